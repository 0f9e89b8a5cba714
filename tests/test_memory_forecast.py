"""The host-memory forecast (ckpt/memory_forecast.py): what checkpointing will need per node."""


def test_the_memory_forecast_counts_the_snapshot_and_every_levels_chunks():
    from types import SimpleNamespace

    from hpcckpt.ckpt.memory_forecast import BOUNCE_BYTES, WRITING_THREADS, RankNeed, describe, rank_need, short_nodes

    erasure = SimpleNamespace(n=4, p=2, k=2)
    mib = 1 << 20
    levels = SimpleNamespace(partner=object(), erasure=erasure)
    need = rank_need(256 * mib, levels, 8 * mib)
    # L2: 2 chunks; L3: group size + parity chunks; the writing threads' bounce buffers
    assert need == RankNeed(256 * mib, 2 * 8 * mib + 6 * 8 * mib + WRITING_THREADS * BOUNCE_BYTES)
    small = rank_need(3 * mib, levels, 8 * mib)  # chunks no larger than what travels
    assert small.chunks == 2 * 3 * mib + 6 * (3 * mib // 2) + WRITING_THREADS * BOUNCE_BYTES
    # Group 8, parity 2: a restart's rebuild holds 2 k = 12 chunks, more than a checkpoint's 10.
    wide = rank_need(256 * mib, SimpleNamespace(partner=None, erasure=SimpleNamespace(n=8, p=2, k=6)), 8 * mib)
    assert wide.chunks == 12 * 8 * mib + WRITING_THREADS * BOUNCE_BYTES
    local_only = rank_need(256 * mib, SimpleNamespace(partner=None, erasure=None), 8 * mib)
    assert local_only.chunks == WRITING_THREADS * BOUNCE_BYTES
    everyone = [(0, need, 1 << 40), (1, need, 350 * mib), (1, small, 500 * mib), (2, need, None)]  # None: unknown
    [(node, ranks, needed, available, largest)] = short_nodes(everyone)
    assert (node, ranks, needed, available, largest) == (1, 2, need.total + small.total, 350 * mib, need)
    assert describe(short_nodes(everyone)).startswith(
        f"checkpointing will need {(need.total + small.total) / (1 << 30):.2f} GiB of host memory on node 1: "
        "2 rank(s), each up to 0.25 GiB of snapshot and 0.078 GiB of chunk buffers, but the node has 0.34 GiB")
