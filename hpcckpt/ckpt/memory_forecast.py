"""Say it before it fails: what checkpointing will take of each node's host
memory, against what the node has, said in one line at the first checkpoint or restart
instead of an OOM kill in the middle of a run.

Per rank: the snapshot (one buffer laid out as the shard file, the only one the size of the
shard) and the chunk buffers of the levels (L2: 2 chunks; L3: group size + parity chunks of
a stripe's segment, or the 2 k chunks of a rebuild's rounds at a restart where that is more;
see checkpoint.chunk_mib), plus the bounce buffers of the threads that write with O_DIRECT. Per node: the sum over its ranks, against the smallest MemAvailable its
ranks read. The buffers are allocated but not yet touched when this runs, so MemAvailable
still holds the room they will take.

Where the node-local versions are kept in memory first (storage.memory_dir on a RAM file
system), their files take the node's memory too, and MemAvailable does not count them as free
once written: the node also needs what its versions will take there (the versions kept,
checkpoint.keep_local, and the one being written, each its L1 shards, the L2 replicas it holds
and its share of L3's parity), at most the budget (storage.memory_budget_mb), less what the
versions there take already.
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
    in_memory: int = 0  # the node-local versions' files in memory, this rank's part (before the budget caps it)

    @property
    def total(self) -> int:
        """The buffers: what this rank holds whatever the node's memory directory holds."""
        return self.snapshot + self.chunks


@dataclass(frozen=True)
class MemoryTier:
    """A node's memory directory, as one of its ranks sees it."""

    budget: int  # bytes its versions may take (storage.memory_budget_mb)
    used: int  # bytes its versions take now (already out of MemAvailable)


def rank_need(snapshot_bytes: int, levels, chunk_bytes: int, versions_in_memory: int = 0) -> RankNeed:
    """What this rank's checkpoints will hold in host memory, from its snapshot size and the
    level stack (levels/partner.py and levels/erasure.py keep their chunks); with
    `versions_in_memory` > 0, that many node-local versions' files in a RAM file system."""
    chunks = BOUNCE_BYTES * WRITING_THREADS
    partner, erasure = levels.partner, levels.erasure
    version = snapshot_bytes  # L1's shard file
    if partner is not None:
        chunks += 2 * min(chunk_bytes, snapshot_bytes)
        version += snapshot_bytes  # the replica of its partner's shard this rank holds
    if erasure is not None:
        segment = segment_length([snapshot_bytes], erasure.n, erasure.p)
        chunks += max(erasure.n + erasure.p, 2 * erasure.k) * min(chunk_bytes, segment)
        version += -(-snapshot_bytes * erasure.p // erasure.k)  # its share of the group's parity
    return RankNeed(int(snapshot_bytes), int(chunks), int(versions_in_memory * version))


def mem_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def short_nodes(everyone: list[tuple[int, RankNeed, int | None, MemoryTier | None]]
                ) -> list[tuple[int, int, int, int, RankNeed, int]]:
    """(rank 0) (node, ranks, bytes needed, bytes available, the largest rank's need, of the
    bytes needed those of versions in memory) of each node whose ranks need more than it has
    available, most short first."""
    by_node: dict[int, list] = {}
    for node, need, available, tier in everyone:
        by_node.setdefault(node, []).append((need, available, tier))
    short = []
    for node, entries in by_node.items():
        tiers = [tier for _, _, tier in entries if tier is not None]
        in_memory = 0
        if tiers:  # the node's ranks share its memory directory and see one budget
            wanted = sum(need.in_memory for need, _, _ in entries)
            in_memory = max(0, min(wanted, min(t.budget for t in tiers)) - max(t.used for t in tiers))
        needed = sum(need.total for need, _, _ in entries) + in_memory
        known = [available for _, available, _ in entries if available is not None]
        if known and needed > min(known):
            largest = max((need for need, _, _ in entries), key=lambda n: n.total)
            short.append((node, len(entries), needed, min(known), largest, in_memory))
    return sorted(short, key=lambda s: s[3] - s[2])


def describe(short: list) -> str:
    node, ranks, needed, available, largest, in_memory = short[0]
    others = f" (and {len(short) - 1} more node(s))" if len(short) > 1 else ""
    versions = (f", and {in_memory / GIB:.2f} GiB of node-local versions in memory (storage.memory_dir)"
                if in_memory else "")
    advice = (", or keep fewer versions in memory (storage.memory_budget_mb, checkpoint.keep_local)"
              if in_memory else "")
    return (f"checkpointing will need {needed / GIB:.2f} GiB of host memory on node {node}{others}: {ranks} rank(s), "
            f"each up to {largest.snapshot / GIB:.2f} GiB of snapshot and {largest.chunks / GIB:.3f} GiB of chunk "
            f"buffers{versions}, but the node has {available / GIB:.2f} GiB available; the first checkpoint may be "
            "killed for lack of memory. Free host memory, run fewer ranks per node, take fewer levels "
            f"(resilience.levels) or smaller chunks (checkpoint.chunk_mib){advice}")


def warn_if_short(comm, node: int, need: RankNeed, log, tier: MemoryTier | None = None) -> list:
    """(all ranks) Rank 0 says, in one line, which nodes lack the memory checkpointing needs;
    `tier`: this rank's memory directory where it is in RAM."""
    short = fold_at_root(comm, (node, need, mem_available(), tier), short_nodes)
    if short and log is not None and comm.Get_rank() == 0:
        log.warning(describe(short))
    return short
