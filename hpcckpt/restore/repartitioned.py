"""A version loaded over the old job's shards: another rank count, layout or placement wrote
it, so each rank builds its new pieces from the old shards they overlap, wherever those
survived (repartition/: planned over the node-local survey, exchanged between ranks)."""

from __future__ import annotations

import numpy as np

from hpcckpt.cluster.collectives import allgather_compact, failing_ranks, fold_at_root
from hpcckpt.errors import ChecksumError
from hpcckpt.format.layout import Layout, place_from_piece, read_requests
from hpcckpt.format.manifest import Manifest
from hpcckpt.levels.naming import LOCAL
from hpcckpt.repartition.exchange import OldPieceReader, RepartitionJob
from hpcckpt.repartition.plan import RepartitionPlan
from hpcckpt.restore.context import RestoreResult, warn
from hpcckpt.restore.fetch import log_reads, refuse_non_finite
from hpcckpt.restore.from_memory import MEMORY, counted_by_source
from hpcckpt.restore.load import keep_what_gaps_leave, load
from hpcckpt.restore.rank_states import gather_rank_states, holds_rank_states
from hpcckpt.runlog import bytes_text


def try_repartition(ctx, manifest: Manifest, candidate, repair: bool) -> RestoreResult | None:
    """(all ranks) Load a version over the old job's shards, wherever they survived: each from
    its cheapest surviving level, lost ones rebuilt from parity, the global level only for
    what no node-local level holds. A resuming job then writes the version again under this
    job's geometry (RestoreResult.protect_again), so a second loss is survived once that is
    written."""
    step = manifest.step
    whole = ctx.levels.level(candidate.whole_on) if candidate.whole_on else None
    gaps_kept = keep_what_gaps_leave(ctx, manifest.layout, ctx.job.layout)
    job = RepartitionJob(ctx.job.comm, manifest, ctx.job.layout, ctx.targets.buffers, ctx.job.local_array_names, candidate.views,
                         (lambda old_rank: whole.shard_path(step, old_rank)) if whole is not None else None,
                         lambda message: warn(ctx, message), scratch_dir=ctx.run.node_dir, chunk_bytes=ctx.chunk_bytes,
                         pieces_inherited=ctx.targets.pieces_inherited and not gaps_kept)
    outcome = job.run(candidate.writing, whole is not None)
    if isinstance(outcome, RepartitionPlan):
        if ctx.job.rank == 0:
            warn(ctx, f"version {step} cannot be assembled: old rank(s) {list(outcome.missing)} have no usable "
                      "copy left; trying an older one")
        return None
    damaged = failing_ranks(ctx.job.comm, not _non_finite(ctx, manifest, outcome.pieces))
    if damaged:
        if ctx.job.rank == 0:
            warn(ctx, f"version {step} cannot be assembled: rank(s) {sorted(damaged)} got NaN or inf from old shards "
                      "though the version recorded a finite loss (damaged before they were checksummed); trying an "
                      "older one")
        return None
    rank_states = None
    if holds_rank_states(manifest):
        rank_states = gather_rank_states(ctx, manifest, candidate)
        if rank_states is None:
            return None
    load(ctx, manifest, outcome.pieces, rank_states)
    sources = _sources(ctx, manifest, outcome)
    _log_moved(ctx, manifest, outcome, sources)
    again = tuple(level for level in ctx.levels if level.node_local or whole is None) if repair else ()
    changed = manifest.world_size != ctx.job.world_size or tuple(manifest.node_of_rank) != ctx.job.topology.node_of_rank
    return RestoreResult(step, sources, manifest.state,
                           protect_again=tuple(level.name for level in again),
                           protect_globally=tuple(level.name for level in again if not level.node_local),
                           metrics=manifest.metrics, geometry_changed=changed,
                           traffic=(outcome.bytes_read, outcome.bytes_received))


def _non_finite(ctx, manifest: Manifest, pieces: dict) -> bool:
    """This rank's new pieces hold NaN or inf though the version vouched for them (said)."""
    try:
        refuse_non_finite(ctx, manifest, pieces)
    except ChecksumError as exc:
        warn(ctx, f"version {manifest.step} on rank {ctx.job.rank}: {exc}")
        return True
    return False


def _sources(ctx, manifest: Manifest, outcome) -> tuple:
    """(all ranks) Where each old rank's shard came from: the plan's level, or memory where
    the rank found its own old shard in its snapshot buffers (on as many ranks, old rank r is
    new rank r)."""
    planned = tuple(s.level for s in outcome.plan.sources)
    if manifest.world_size != ctx.job.world_size:
        return planned
    in_buffers = allgather_compact(ctx.job.comm, outcome.in_buffers)
    return tuple(MEMORY if held else level for level, held in zip(planned, in_buffers))


def _log_moved(ctx, manifest: Manifest, outcome, sources: tuple) -> None:
    step, plan = manifest.step, outcome.plan
    most_read, most_received = fold_at_root(ctx.job.comm, (outcome.bytes_read, outcome.bytes_received),
                                            lambda moved: tuple(map(max, zip(*moved))))
    if ctx.log:
        own = "; its own old shard checked in its snapshot buffers, not read" if outcome.in_buffers else ""
        ctx.log.info(f"restored version {step}, written by {manifest.world_size} rank(s), onto {ctx.job.world_size}: "
                     f"old shards {counted_by_source(sources)}; this rank read {outcome.bytes_read} and received "
                     f"{outcome.bytes_received} bytes{own}", console=False)
        if ctx.job.rank == 0:
            ctx.log.info(f"restored version {step} (written by {manifest.world_size} ranks) onto {ctx.job.world_size} "
                         f"rank(s): old shards {counted_by_source(sources)}; at most {bytes_text(most_read)} read and "
                         f"{bytes_text(most_received)} received by one rank{_domains_lost(manifest, plan)}",
                         console=True)


def _domains_lost(manifest: Manifest, plan: RepartitionPlan) -> str:
    """The failure domains (as the version's record names them) none of whose old ranks' L1
    shards survived: whole switches or racks lost, recovered from the other levels."""
    if not manifest.domain_of_rank:
        return ""
    gone = {rank for rank, source in enumerate(plan.sources) if source is None or source.level != LOCAL}
    ranks_of: dict[int, set[int]] = {}
    for rank, domain in enumerate(manifest.domain_of_rank):
        ranks_of.setdefault(domain, set()).add(rank)
    lost = [manifest.domain_names[d] if d < len(manifest.domain_names) else str(d)
            for d, ranks in sorted(ranks_of.items()) if ranks <= gone]
    return f"; failure domain(s) lost whole: {', '.join(lost)}" if lost else ""


def read_repartitioned(ctx, shard_path_of, manifest: Manifest, layout: Layout) -> dict[str, np.ndarray]:
    """This rank's new pieces under `layout`, from the old pieces they overlap, each old piece
    read whole from `shard_path_of(old rank)` and verified (repartition/exchange.py's
    OldPieceReader). Where old and new pieces do not line up, a rank reads more than it keeps:
    2x from 2 to 4 ranks, 1.5x from 4 to 3, 3x from 2 to 3 at worst."""
    rank = ctx.job.rank
    pieces = {tl.name: ctx.targets.buffers[tl.name] for tl in layout.rank_pieces(rank)}
    keep_what_gaps_leave(ctx, manifest.layout, layout)
    reader = OldPieceReader(manifest, shard_path_of)
    try:
        for request in read_requests(manifest.layout, layout, rank):
            place_from_piece(pieces[request.name], request, reader.piece(request.old_rank, request.name),
                             manifest.layout, layout, rank)
        log_reads(ctx, reader.paths, reader.bytes_read)
    finally:
        reader.close()
    return pieces
