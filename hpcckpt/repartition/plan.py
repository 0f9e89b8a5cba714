"""Which surviving copy serves each old rank's shard, and who reads it (pure, no MPI, no I/O).

A restart onto another rank count, or onto other nodes, plans over the OLD job's shards. For
each old rank, the cheapest source that survives, in LEVEL_ORDER:

    local     its L1 shard file, in a node-local directory some new rank can read
    partner   its L2 replica, in the directory of the node that held it
    erasure   rebuilt by one new rank (the decoder) from the surviving data segments and
              parity pieces of its L3 group (any k pieces of every stripe: levels/stripes.py)
    pfs       its L4 shard file, which every new rank reads itself (a shared path)

A source found bad when read (a checksum) is `excluded` and the plan is made again without
it. Node-local files are read and verified by one new rank each, the "provider", chosen to
spread the reads over the ranks that can see them; the provider serves the byte ranges
other new ranks need (repartition/exchange.py). Every rank computes the same plan from the
same survey.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from hpcckpt.levels.naming import ERASURE, LEVEL_LABELS, LOCAL, PARTNER, PFS
from hpcckpt.levels.stripes import stripe_plan
from hpcckpt.levels.survey import NodeLocalView, Writing


@dataclass(frozen=True)
class ShardSource:
    old_rank: int
    level: str  # the level whose file it is (levels/naming.py: LOCAL, PARTNER, ERASURE, PFS)
    provider: int | None  # the new rank that reads (or rebuilds) and serves it; None: L4, read by whoever needs it
    path: str | None = None  # the file the provider reads (local, partner)


@dataclass(frozen=True)
class BlockSource:
    """One block of one stripe that a group rebuild reads: a data segment of a member's shard
    (from that shard's provider) or a parity piece (from a rank that sees the parity file)."""

    stripe: int
    block: int
    member: int  # old rank
    provider: int  # new rank that sends it to the decoder
    path: str | None = None  # the parity file a parity piece is read from; None for a data segment


@dataclass(frozen=True)
class GroupRebuild:
    members: tuple[int, ...]  # old ranks, in the group's order
    parity: int
    lost: tuple[int, ...]  # old ranks whose shards the decoder rebuilds
    decoder: int  # new rank
    blocks: tuple[BlockSource, ...]  # k per stripe


@dataclass(frozen=True)
class RepartitionPlan:
    step: int
    old_world_size: int
    sources: tuple[ShardSource | None, ...]  # by old rank; None: no surviving source
    rebuilds: tuple[GroupRebuild, ...] = ()

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r, source in enumerate(self.sources) if source is None)

    @property
    def complete(self) -> bool:
        return not self.missing

    def reads_of(self, new_rank: int) -> tuple[ShardSource, ...]:
        """The node-local shard files (L1, L2) this new rank reads and verifies."""
        return tuple(s for s in self.sources
                     if s is not None and s.provider == new_rank and s.level in (LOCAL, PARTNER))

    def summary(self) -> str:
        counts = Counter(s.level for s in self.sources if s is not None)
        return ", ".join(f"{counts[level]} from {label}" for level, label in LEVEL_LABELS.items() if counts[level])


def plan_repartition(step: int, writing: Writing, views: Sequence[NodeLocalView | None], pfs_holds: bool,
                     excluded: frozenset = frozenset()) -> RepartitionPlan:
    """Sources for every old rank of `writing`'s version `step`. `views[j]`: what new rank j's
    node-local directory holds of that version (None: nothing); `pfs_holds`: L4 has it
    committed; `excluded`: (level, old rank) sources found bad, ("parity", old rank) for a
    bad parity file."""
    views = [v if v is not None and (v.writing is None or v.writing.identity == writing.identity) else None
             for v in views]
    load = Counter()
    sources: list[ShardSource | None] = [None] * writing.world_size

    def least_loaded(candidates: list[tuple[int, str]]) -> tuple[int, str] | None:
        return min(candidates, key=lambda c: (load[c[0]], c[0]), default=None)

    for old_rank in range(writing.world_size):
        for level, holds, path in ((LOCAL, lambda v: old_rank in v.shards, NodeLocalView.path_of_shard),
                                   (PARTNER, lambda v: any(s == old_rank for s, _ in v.replicas),
                                    NodeLocalView.path_of_replica)):
            if (level, old_rank) in excluded:
                continue
            chosen = least_loaded([(j, str(path(v, old_rank))) for j, v in enumerate(views)
                                   if v is not None and holds(v)])
            if chosen is not None:
                sources[old_rank] = ShardSource(old_rank, level, chosen[0], chosen[1])
                load[chosen[0]] += 1
                break
    rebuilds = []
    for members in writing.groups:
        rebuild = _plan_group_rebuild(members, writing.parity, sources, views, excluded, load)
        if rebuild is not None:
            rebuilds.append(rebuild)
            for old_rank in rebuild.lost:
                sources[old_rank] = ShardSource(old_rank, ERASURE, rebuild.decoder)
    for old_rank, source in enumerate(sources):
        if source is None and pfs_holds and (PFS, old_rank) not in excluded:
            sources[old_rank] = ShardSource(old_rank, PFS, None)
    return RepartitionPlan(step, writing.world_size, tuple(sources), tuple(rebuilds))


def _plan_group_rebuild(members: tuple[int, ...], parity: int, sources: list, views, excluded,
                        load: Counter) -> GroupRebuild | None:
    """A rebuild of the group's members that have no shard source, where every stripe still
    has k readable pieces; None when nothing is lost or too much is."""
    lost = tuple(m for m in members if sources[m] is None)
    if not lost or any((ERASURE, m) in excluded for m in lost) or not 1 <= parity < len(members):
        return None
    n, k = len(members), len(members) - parity
    parity_holders = {}
    for index, member in enumerate(members):
        if ("parity", member) in excluded:
            continue
        seen = [(j, str(v.path_of_parity(member))) for j, v in enumerate(views) if v is not None and member in v.parity]
        if seen:
            parity_holders[index] = min(seen, key=lambda c: (load[c[0]], c[0]))
    blocks = []
    for stripe in stripe_plan(n, parity):
        readable = []
        for block in range(n):
            index = stripe.member_of_block(block)
            member = members[index]
            if block < k and sources[member] is not None:
                readable.append(BlockSource(stripe.index, block, member, sources[member].provider))
            elif block >= k and index in parity_holders:
                provider, path = parity_holders[index]
                readable.append(BlockSource(stripe.index, block, member, provider, path))
        if len(readable) < k:
            return None
        blocks.extend(readable[:k])  # data segments first: they need no parity read
    senders = sorted({b.provider for b in blocks})
    decoder = min(senders, key=lambda j: (load[j], j))
    load[decoder] += len(lost)
    return GroupRebuild(tuple(members), parity, lost, decoder, tuple(blocks))
