"""Registered state that is per rank by nature (a framework's RNG stream, a rank's data
position): stored in each rank's own shard file as one piece of JSON bytes, so it travels with
that shard through every level (L1, a partner's replica, an erasure rebuild, L4) under the
shard's checksums, and comes back to the rank that wrote it. The state every rank holds alike
stays in the commit record.

A version records the names of its per-rank states under the engine's state
(PER_RANK_NAMES_KEY), so a restart tells a state saved per rank from one saved replicated.
"""

from __future__ import annotations

import json

import numpy as np

RANK_STATE_PIECE = "_hpcckpt/rank_state"
PER_RANK_NAMES_KEY = "per_rank_state"


def rank_state_piece(encoded: dict) -> np.ndarray:
    """This rank's per-rank states (name -> pytree-encoded value) as the piece's bytes."""
    return np.frombuffer(json.dumps(encoded, sort_keys=True).encode(), dtype=np.uint8)


def read_rank_state_piece(data) -> dict:
    """The per-rank states a piece holds (name -> pytree-encoded value)."""
    return json.loads(bytes(np.asarray(data, dtype=np.uint8)).decode())


def split_state(state: dict, per_rank: set) -> tuple[dict, dict]:
    """(the state every rank holds alike, this rank's own) of a frozen state dict."""
    shared = {name: value for name, value in state.items() if name not in per_rank}
    own = {name: value for name, value in state.items() if name in per_rank}
    return shared, own
