"""Exhaustive recovery check of the L3 scheme (stripe placement + codec), SCR redset style,
in one process: for every set of lost members' files (data, parity or both) up to parity + 1,
recovery succeeds exactly when every stripe keeps k pieces, and rebuilt bytes equal the
originals."""

import itertools

import numpy as np
import pytest

from hpcckpt.codec import CodecError, ErasureCode
from hpcckpt.levels.stripes import recovery_sources, segment_length, stripe_plan

SCHEMES = [(2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (8, 2)]


@pytest.mark.parametrize("n,p", SCHEMES)
def test_placement_spreads_parity_and_uses_every_segment_once(n, p):
    stripes = stripe_plan(n, p)
    k = n - p
    held = [0] * n
    used = {(j, seg) for s in stripes for j, seg in zip(s.contributors, s.segments)}
    assert used == {(j, seg) for j in range(n) for seg in range(k)}
    for s in stripes:
        assert len(set(s.contributors) | set(s.holders)) == n  # one piece of every stripe per member
        for h in s.holders:
            held[h] += 1
    assert held == [p] * n  # no parity node: p pieces each, overhead p / k


def _encode_group(shards, n, p):
    k = n - p
    code = ErasureCode(k, p)
    seg = segment_length([len(s) for s in shards], n, p)
    padded = [np.frombuffer(s + bytes(k * seg - len(s)), np.uint8) for s in shards]
    blocks = {}
    for stripe in stripe_plan(n, p):
        data = [padded[j][g * seg:(g + 1) * seg] for j, g in zip(stripe.contributors, stripe.segments)]
        parity = code.encode(data)
        for b in range(n):
            blocks[(stripe.index, b)] = data[b] if b < k else parity[b - k]
    return blocks, seg


def _recover(blocks, shards, n, p, lost_data, lost_parity, seg):
    """Rebuild every lost piece from survivors; returns rebuilt shards or raises."""
    k = n - p
    code = ErasureCode(k, p)
    rebuilt = {m: np.zeros(k * seg, np.uint8) for m in lost_data}
    for stripe in stripe_plan(n, p):
        gone = {b for b in range(n) if (b < k and stripe.member_of_block(b) in lost_data)
                or (b >= k and stripe.member_of_block(b) in lost_parity)}
        available = {b: blocks[(stripe.index, b)] for b in range(n) if b not in gone}
        if len(available) < k:
            raise CodecError("too few")
        for b, data in code.rebuild(available, sorted(gone)).items():
            assert np.array_equal(data, blocks[(stripe.index, b)])
            if b < k:
                member, g = stripe.contributors[b], stripe.segments[b]
                rebuilt[member][g * seg:(g + 1) * seg] = data
    return {m: rebuilt[m].tobytes()[:len(shards[m])] for m in lost_data}


@pytest.mark.parametrize("n,p", SCHEMES)
@pytest.mark.parametrize("kind", ["data", "parity", "both"])
def test_every_loss_up_to_parity_plus_one(n, p, kind):
    rng = np.random.default_rng(n * 10 + p)
    shards = [rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes() for _ in range(n)]
    blocks, seg = _encode_group(shards, n, p)
    k = n - p
    for size in range(1, p + 2):
        for lost in itertools.combinations(range(n), size):
            lost_data = set(lost) if kind in ("data", "both") else set()
            lost_parity = set(lost) if kind in ("parity", "both") else set()
            tolerable = all(
                sum(1 for b in range(n) if (b < k and s.member_of_block(b) in lost_data)
                    or (b >= k and s.member_of_block(b) in lost_parity)) <= p
                for s in stripe_plan(n, p))
            if kind == "both":
                assert tolerable == (size <= p)  # whole members: exactly the parity count
            if tolerable:
                rebuilt = _recover(blocks, shards, n, p, lost_data, lost_parity, seg)
                for m in lost_data:
                    assert rebuilt[m] == shards[m]
            else:
                with pytest.raises(CodecError):
                    _recover(blocks, shards, n, p, lost_data, lost_parity, seg)


def test_recovery_sources_are_survivors_data_first():
    stripe = stripe_plan(4, 2)[1]
    sources = recovery_sources(stripe, frozenset({stripe.contributors[0]}), 2)
    assert all(stripe.member_of_block(b) != stripe.contributors[0] for b in sources)
    assert sources[0] < sources[1]
    with pytest.raises(ValueError):
        recovery_sources(stripe, frozenset({0, 1, 2}), 2)
