"""Say it before it fails: what checkpointing will take of each node's host
memory, against what the node has, said in one line at the first checkpoint or restart
instead of an OOM kill in the middle of a run.

Per rank: the snapshot (one buffer laid out as the shard file, the only one the size of the
shard) and the chunk buffers of the levels (L2: 2 chunks; L3: group size + parity chunks of
a stripe's segment, or the 2 k chunks of a rebuild's rounds at a restart where that is more;
see checkpoint.chunk_mib), plus the bounce buffers of the threads that write with O_DIRECT. Per node: the sum over its ranks, against the smallest MemAvailable its
ranks read. The buffers are allocated but not yet touched when this runs, so MemAvailable
still holds the room they will take.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcckpt.cluster.collectives import fold_at_root
from hpcckpt.io.direct_io import BOUNCE_BYTES
from hpcckpt.levels.stripes import segment_length

MEMINFO = Path("/proc/meminfo")
WRITING_THREADS = 2  # the persist thread and L4's own (save/flush.py)
GIB = 1 << 30


@dataclass(frozen=True)
class RankNeed:
    snapshot: int
    chunks: int

    @property
    def total(self) -> int:
        return self.snapshot + self.chunks


def rank_need(snapshot_bytes: int, levels, chunk_bytes: int) -> RankNeed:
    """What this rank's checkpoints will hold in host memory, from its snapshot size and the
    level stack (levels/partner.py and levels/erasure.py keep their chunks)."""
    chunks = BOUNCE_BYTES * WRITING_THREADS
    partner, erasure = levels.partner, levels.erasure
    if partner is not None:
        chunks += 2 * min(chunk_bytes, snapshot_bytes)
    if erasure is not None:
        segment = segment_length([snapshot_bytes], erasure.n, erasure.p)
        chunks += max(erasure.n + erasure.p, 2 * erasure.k) * min(chunk_bytes, segment)
    return RankNeed(int(snapshot_bytes), int(chunks))


def mem_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def short_nodes(everyone: list[tuple[int, RankNeed, int | None]]) -> list[tuple[int, int, int, int, RankNeed]]:
    """(rank 0) (node, ranks, bytes needed, bytes available, the largest rank's need) of each
    node whose ranks need more than it has available, most short first."""
    by_node: dict[int, list] = {}
    for node, need, available in everyone:
        by_node.setdefault(node, []).append((need, available))
    short = []
    for node, entries in by_node.items():
        needed = sum(need.total for need, _ in entries)
        known = [available for _, available in entries if available is not None]
        if known and needed > min(known):
            largest = max((need for need, _ in entries), key=lambda n: n.total)
            short.append((node, len(entries), needed, min(known), largest))
    return sorted(short, key=lambda s: s[3] - s[2])


def describe(short: list) -> str:
    node, ranks, needed, available, largest = short[0]
    others = f" (and {len(short) - 1} more node(s))" if len(short) > 1 else ""
    return (f"checkpointing will need {needed / GIB:.2f} GiB of host memory on node {node}{others}: {ranks} rank(s), "
            f"each up to {largest.snapshot / GIB:.2f} GiB of snapshot and {largest.chunks / GIB:.3f} GiB of chunk "
            f"buffers, but the node has {available / GIB:.2f} GiB available; the first checkpoint may be killed for "
            "lack of memory. Free host memory, run fewer ranks per node, take fewer levels (resilience.levels) or "
            "smaller chunks (checkpoint.chunk_mib)")


def warn_if_short(comm, node: int, need: RankNeed, log) -> list:
    """(all ranks) Rank 0 says, in one line, which nodes lack the memory checkpointing needs."""
    short = fold_at_root(comm, (node, need, mem_available()), short_nodes)
    if short and log is not None and comm.Get_rank() == 0:
        log.warning(describe(short))
    return short
