"""The registered state a version gives back, by one rule whatever level it is read from:

- state registered as it is (the default) is the same on every rank (checked at the first
  checkpoint, ckpt/replicas.py), stored once in the commit record, and given to every rank;
- state registered per rank (register_state(..., per_rank=True)) is stored in each rank's own
  shard (format/rank_state.py) and given back to the rank that wrote it on the same rank
  count; onto another rank count, each new rank r gets the states of the old ranks r, r +
  ranks, ... and the registration's reshard(states, rank, size) says what it becomes; without
  a reshard the restart is refused before anything is loaded. One rank's copy is never given
  to another in silence.
"""

from __future__ import annotations

from hpcckpt.ckpt.registry import ENGINE_STATE_KEY
from hpcckpt.errors import ConfigError
from hpcckpt.format import pytree
from hpcckpt.format.rank_state import PER_RANK_NAMES_KEY


def saved_per_rank(saved: dict) -> set[str]:
    """The names a version stored per rank (recorded with the engine's state)."""
    return set(saved.get(ENGINE_STATE_KEY, {}).get(PER_RANK_NAMES_KEY, ()))


def state_problems(states: dict, saved: dict, written_by: int, world_size: int) -> list[str]:
    """Why the registered `states` (name -> RegisteredState) cannot take a version's state
    (`saved`: its commit record's, written by `written_by` ranks) on `world_size` ranks."""
    per_rank_then = saved_per_rank(saved)
    problems = []
    for name, registered in sorted(states.items()):
        was_per_rank = name in per_rank_then
        if name in saved or was_per_rank:
            if was_per_rank != registered.per_rank:
                then, now = ("per rank", "as shared") if was_per_rank else ("as shared", "per rank")
                problems.append(f"state {name!r} was saved {then} and is registered {now} now; register it as it "
                                "was saved (per_rank=...)")
            elif was_per_rank and written_by != world_size and registered.reshard is None:
                problems.append(f"state {name!r} is per rank and was saved by {written_by} ranks, this job has "
                                f"{world_size}: give register_state({name!r}, ..., per_rank=True, reshard=fn), fn(states, "
                                "rank, size) returning this rank's state from the old ranks' states it is handed "
                                f"({{old rank: state}}), or restart on {written_by} ranks")
    return problems


def apply_state(states: dict, saved: dict, rank_states: dict | None, written_by: int, rank: int,
                world_size: int) -> dict:
    """Give each registered state its value from a version: `saved` (shared, the commit
    record's), `rank_states` ({old rank: {name: encoded}}, those handed to this rank; None
    where the version holds none). Returns the engine's own state."""
    for name, registered in states.items():
        if not registered.per_rank:
            if name in saved:
                registered.set(pytree.decode(saved[name]))
            continue
        if rank_states is None or name not in saved_per_rank(saved):
            continue  # a version from before the state was registered
        if written_by == world_size:
            own = rank_states.get(rank, {})
            if name in own:
                registered.set(pytree.decode(own[name]))
            continue
        if registered.reshard is None:  # state_problems refuses this before anything is loaded
            raise ConfigError(f"state {name!r} is per rank and has no reshard for {written_by} -> {world_size} ranks")
        handed = {old: pytree.decode(held[name]) for old, held in sorted(rank_states.items()) if name in held}
        registered.set(registered.reshard(handed, rank, world_size))
    return saved.get(ENGINE_STATE_KEY, {})
