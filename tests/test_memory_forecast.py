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
    everyone = [(0, need, 1 << 40, None), (1, need, 350 * mib, None), (1, small, 500 * mib, None),
                (2, need, None, None)]  # None: unknown
    [(node, ranks, needed, available, largest, in_memory)] = short_nodes(everyone)
    assert (node, ranks, needed, available, largest, in_memory) == (1, 2, need.total + small.total, 350 * mib, need, 0)
    assert describe(short_nodes(everyone)).startswith(
        f"checkpointing will need {(need.total + small.total) / (1 << 30):.2f} GiB of host memory on node 1: "
        "2 rank(s), each up to 0.25 GiB of snapshot and 0.078 GiB of chunk buffers, but the node has 0.34 GiB")


def test_versions_kept_in_memory_count_against_the_node_up_to_the_budget_less_what_is_there():
    from types import SimpleNamespace

    from hpcckpt.ckpt.memory_forecast import MemoryTier, describe, rank_need, short_nodes

    mib = 1 << 20
    levels = SimpleNamespace(partner=object(), erasure=SimpleNamespace(n=4, p=2, k=2))
    # 3 versions (2 kept, 1 being written) of L1 + the replica held + parity p/k of the shard
    need = rank_need(100 * mib, levels, 8 * mib, versions_in_memory=3)
    assert need.in_memory == 3 * (100 + 100 + 100) * mib
    assert rank_need(100 * mib, levels, 8 * mib).in_memory == 0
    roomy = MemoryTier(budget=10_000 * mib, used=0)
    [(_, _, needed, _, _, in_memory)] = short_nodes([(0, need, 1000 * mib, roomy), (0, need, 1000 * mib, roomy)])
    assert in_memory == 1800 * mib and needed == 2 * need.total + 1800 * mib
    assert "1.76 GiB of node-local versions in memory (storage.memory_dir)" in describe(
        short_nodes([(0, need, 1000 * mib, roomy), (0, need, 1000 * mib, roomy)]))
    # The budget caps them (more spill to the disk), and those already there are out of MemAvailable.
    capped = MemoryTier(budget=600 * mib, used=200 * mib)
    [(_, _, needed, _, _, in_memory)] = short_nodes([(0, need, 500 * mib, capped), (0, need, 500 * mib, capped)])
    assert in_memory == 400 * mib
    assert short_nodes([(0, need, 2000 * mib, capped), (0, need, 2000 * mib, capped)]) == []
