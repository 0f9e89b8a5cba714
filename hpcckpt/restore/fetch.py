"""The restore's fetch and verify steps for a version loaded as it was written (each rank its
own shard): one loop over the level stack, in its order, through the level protocol.

A level that is not collective (L1, L4) delivers this rank's own shard file where its plan
lists it; a collective level (L2, L3) delivers over its peers what the ranks still without a
verified shard need, landing it as their node-local copy (the stack's landing level). Every
delivered file is read and checked per tensor; a mismatch makes that copy missing and the
rank falls through to the next level. A shard read from a level past the landing level is put
back there (from the page cache the verification filled), so the node-local copy is whole
again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcckpt.cluster.collectives import failing_ranks, fold_at_root, quiet_any, quiet_bcast, quiet_gather, quiet_scatter
from hpcckpt.errors import CheckpointError, ChecksumError, HpcckptError
from hpcckpt.format.manifest import Manifest, records_listed
from hpcckpt.format.rank_state import RANK_STATE_PIECE
from hpcckpt.format.shardfile import read_shard_table, read_tensor
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import DeliveryRequest
from hpcckpt.levels.naming import commit_file_name
from hpcckpt.restore.context import warn
from hpcckpt.restore.discover import Holdings
from hpcckpt.run.health import VOUCHING_METRIC, first_non_finite, vouches_finite


def fetch_as_written(ctx, manifest: Manifest, lacking: dict, my_sources: tuple, repair: bool):
    """(all ranks) This rank's pieces of `manifest`'s version from the first level of the stack
    that delivers them verified: (pieces, the level's name), or (None, None)."""
    step = manifest.step
    sizes = manifest.shard_sizes()
    pieces, source, needy = None, None, None
    for level in ctx.levels:
        if level.collective:
            if needy is None:
                needy = failing_ranks(ctx.job.comm, pieces is not None)
            if not needy:
                continue
            request = DeliveryRequest(step, ctx.job.world_size, frozenset(needy), sizes,
                                      open_copy=lambda size, aligned, level=level: _open_copy(ctx, step, size,
                                                                                              aligned, level),
                                      own_shard=lambda: shard_bytes(ctx, step), lacking=lacking.get(level.name,
                                                                                                   frozenset()))
            path = level.deliver(request)
            for message in request.warnings:
                warn(ctx, message)
            if path is not None:
                pieces = attempt(ctx, level, path, manifest)
                if pieces is None:
                    path.unlink(missing_ok=True)  # a bad copy (checksum) counts as missing
                source = level.name if pieces is not None else None
            needy = failing_ranks(ctx.job.comm, pieces is not None)
        else:
            if pieces is None and level.name in my_sources:
                pieces, source = _own_copy(ctx, level, manifest, sizes, repair)
            needy = None  # who still needs a shard is agreed again before the next collective level
    return pieces, source


def _own_copy(ctx, level, manifest: Manifest, sizes: tuple, repair: bool):
    """(this rank) Its own shard file on a level that keeps one: (pieces, level name), or
    (None, None); read past the landing level, it becomes the node-local copy again."""
    step = manifest.step
    path = level.deliver(DeliveryRequest(step, ctx.job.world_size, frozenset({ctx.job.rank}), sizes,
                                         open_copy=lambda size, aligned: None))
    pieces = attempt(ctx, level, path, manifest) if path is not None else None
    if pieces is None:
        return None, None
    landing = ctx.levels.landing
    if repair and landing is not None and level is not landing:
        _land_copy(ctx, landing, level, step, path)
    return pieces, level.name


def attempt(ctx, level, path: Path, manifest: Manifest):
    """Read and verify this rank's pieces from `level`'s copy; None (logged) when they are bad."""
    try:
        return read_pieces(ctx, path, manifest)
    except (HpcckptError, OSError) as exc:
        warn(ctx, f"version {manifest.step} from {level.label} unusable on rank {ctx.job.rank}: {exc}; "
                  "trying the next level")
        return None


def read_pieces(ctx, path: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """This rank's pieces under the current layout, read from its shard file and verified
    (with its per-rank state's piece, where the version has one)."""
    if manifest.world_size != ctx.job.world_size or manifest.layout != ctx.job.layout:
        raise CheckpointError(f"version {manifest.step} was written by {manifest.world_size} ranks with another "
                              "layout; it is loaded over the old job's shards, not as written")
    table = read_shard_table(path)
    manifest.check_shard_table(table, ctx.job.rank, path)
    pieces = {}
    with open(path, "rb") as f:
        for tl in ctx.job.layout.rank_pieces(ctx.job.rank):
            pieces[tl.name] = read_tensor(f, table, tl.name, out=ctx.targets.buffers[tl.name])
        for name in ctx.job.local_array_names:
            pieces[name] = read_tensor(f, table, name, out=ctx.targets.buffers[name])
        if RANK_STATE_PIECE in table.names:
            pieces[RANK_STATE_PIECE] = read_tensor(f, table, RANK_STATE_PIECE)
    refuse_non_finite(ctx, manifest, pieces)
    log_reads(ctx, [path], sum(p.nbytes for p in pieces.values()))
    return pieces


def refuse_non_finite(ctx, manifest: Manifest, pieces: dict[str, np.ndarray]) -> None:
    """A version whose recorded loss was finite restored with NaN or inf in a floating-point
    array: this copy was damaged before its checksum was taken, so it counts as a bad copy
    (run/health.py)."""
    if not (ctx.verify_finite and vouches_finite(manifest.metrics)):
        return
    name = first_non_finite(pieces.items())
    if name is not None:
        raise ChecksumError(f"{name!r} holds NaN or inf, but version {manifest.step} recorded a finite loss "
                            f"({manifest.metrics[VOUCHING_METRIC]:.6g}): this copy was damaged before it was "
                            "checksummed, or what was protected is not the array the application computes on "
                            "(checkpoint.verify_finite = false accepts it, only for arrays that hold NaN or inf on "
                            "purpose)")


def log_reads(ctx, paths, payload_bytes: int) -> None:
    if ctx.log:
        ctx.log.info(f"restore read {payload_bytes} payload bytes from {len(paths)} file(s): "
                     + ", ".join(str(p) for p in paths))


def _land_copy(ctx, landing, level, step: int, path: Path) -> None:
    """This rank's verified shard, read from a level past the landing one, becomes its
    node-local copy again (mapped: from the page cache the verification filled, with no
    shard-sized buffer); a failure only costs that copy."""
    try:
        landing.shard_path(step).unlink(missing_ok=True)
        landing.write_shard_bytes(step, map_readonly(path))
    except (HpcckptError, OSError) as exc:
        warn(ctx, f"version {step}: could not put the {landing.number} copy back from {level.number}: {exc}")


def _open_copy(ctx, step: int, size: int, aligned: bool, level):
    """This rank's node-local copy of a version, opened to take the shard bytes a level
    delivers (a replica, a rebuild) as they arrive; it is read and verified as usual
    afterwards. None when it cannot be stored (said)."""
    landing = ctx.levels.landing
    if landing is None:
        return None
    try:
        return landing.open_shard_copy(step, size, aligned)
    except (HpcckptError, OSError) as exc:
        warn(ctx, f"version {step}: cannot store the shard from {level.label}: {exc}")
        return None


def shard_bytes(ctx, step: int) -> np.ndarray:
    """This rank's verified node-local shard, mapped: what a survivor sends of it (a rebuild's
    segments, a replica protected again) is read from the page cache as it goes."""
    return map_readonly(ctx.levels.landing.shard_path(step))


class LazyShard:
    """This rank's node-local shard, mapped on first use: re-protection after a loss needs it
    only on ranks that send something, and most send nothing."""

    def __init__(self, ctx, step: int):
        self._ctx, self._step, self._data = ctx, step, None

    def __call__(self) -> np.ndarray:
        if self._data is None:
            self._data = shard_bytes(self._ctx, self._step)
        return self._data


def shared_manifest(ctx, step: int, mine: Holdings, whole: bool) -> Manifest | None:
    """(all ranks) The commit record of `step`: read on a level of the stack where possible,
    else sent by a rank that has it (a rank on a replacement node has no copy of its own);
    with the shard records this rank needs (_table_for_this_rank)."""
    manifest = None
    for level in ctx.levels:
        if manifest is None and mine.writing(level.name, step) is not None:
            try:
                manifest = level.manifest(step)
            except (HpcckptError, OSError):
                manifest = None
    view = mine.views.get(step)
    if manifest is None and view is not None and view.commits:
        try:  # another rank's record of the same writing, left on this node
            manifest = Manifest.read(Path(view.directory) / commit_file_name(min(view.commits)))
        except (HpcckptError, OSError):
            manifest = None
    # The first rank that read one shares it (with several pieces of one table, any will do).
    root = fold_at_root(ctx.job.comm, manifest is not None, lambda have: have.index(True) if any(have) else None)
    if root is None:
        return None
    data = quiet_bcast(ctx.job.comm, manifest.to_bytes() if ctx.job.rank == root else None, root=root)
    shared = manifest or Manifest.from_bytes(data, f"commit record of step {step} from rank {root}")
    return _table_for_this_rank(ctx, shared, manifest, whole, view)


def _node_records(ctx, shared: Manifest, view) -> tuple:
    """(the first rank of each node) The shard records of the other commit records of the
    same writing in its node-local version directory: a job on fewer ranks per node than the
    one that wrote the version has no rank of its own to read them."""
    topology = ctx.job.topology
    if view is None or topology.local_index(ctx.job.rank) != 0:
        return ()
    found = []
    for old_rank in sorted(view.commits):
        try:
            record = Manifest.read(Path(view.directory) / commit_file_name(old_rank))
        except (HpcckptError, OSError):
            continue
        if record.identity == shared.identity:
            found.extend(record.shards)
    return tuple(found)


def _table_for_this_rank(ctx, shared: Manifest, mine: Manifest | None, whole: bool, view=None) -> Manifest:
    """(all ranks) The version's record with the shards listed that this rank's restore
    reads: node-local copies list their node's part (Manifest.for_rank), so rank 0 gathers
    what each rank read (O(group) records each) and hands each rank back what its own
    node-local copy lists (its shard, its group's, the replicas it held: O(group)), or, to
    re-partition (`whole`), the table of every shard. Every shard a node-local level can
    deliver is listed by a surviving copy: its own rank's, its replica holder's or its group's;
    the others, a global level's record lists."""
    if not quiet_any(ctx.job.comm, not shared.lists_every_shard):
        return shared
    records = mine.shards if mine is not None and mine.identity == shared.identity else ()
    if whole:
        records = tuple(records) + _node_records(ctx, shared, view)
    gathered = quiet_gather(ctx.job.comm, records, root=0)
    table = None
    if gathered is not None:
        table = shared.with_shards(r for part in gathered for r in part)
        if not table.lists_every_shard:
            # Nodes next to each other lost: no surviving node-local copy lists some shards,
            # which a global level then delivers. Its one record lists them all.
            table = table.with_shards(_global_records(ctx, shared))
    if whole:
        return shared.with_shards(quiet_bcast(ctx.job.comm, table.shards if table is not None else None, root=0))
    parts = None
    if table is not None:
        wanted = records_listed(shared.world_size, shared.partner_of, shared.node_of_rank, shared.groups)
        parts = [table.listed(wanted[rank]) for rank in range(ctx.job.world_size)]
    return shared.with_shards(quiet_scatter(ctx.job.comm, parts, root=0))


def _global_records(ctx, shared: Manifest) -> tuple:
    """(rank 0) The shard records of a global level's commit record of the same writing."""
    for level in ctx.levels.global_levels:
        if shared.step not in level.committed_steps():
            continue
        try:
            record = level.manifest(shared.step)
        except (HpcckptError, OSError) as exc:
            warn(ctx, f"{level.number}'s commit record of version {shared.step} is unreadable: {exc}")
            continue
        if record.identity == shared.identity:
            return record.shards
    return ()
