"""The restore flow: discover -> agree -> fetch -> verify -> load (all ranks, collectively).

discover: every rank lists the versions committed on the levels it can reach.
agree:    one allgather; the newest version for which every rank has a source wins.
fetch:    each rank reads only its own shard, from the cheapest level that holds it (own L1,
          then L4); on a different number of ranks, the byte ranges of the old shards that
          its new pieces need, from L4.
verify:   checksums per tensor; a mismatch makes that source missing and the rank falls
          through to the next level; if a rank has no good source left, the whole job drops
          that version and agrees on the next older one.
load:     pieces are exchanged with allgather so every rank holds the full replicated
          tensors, written in place into the protected arrays; small state is set last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from hpcckpt.ckpt.layout import Layout, place_read, read_requests
from hpcckpt.ckpt.manifest import Manifest
from hpcckpt.ckpt.shardfile import read_shard_table, read_tensor
from hpcckpt.errors import (
    CheckpointError,
    ConfigError,
    HpcckptError,
    IncompatibleCheckpointError,
    UnrecoverableError,
)

RESTART_MODES = ("auto", "require", "never")


@dataclass(frozen=True)
class Holdings:
    """What one rank can reach: committed steps per level, with the world size that wrote them."""

    local: dict  # step -> world size
    pfs: dict  # step -> world size


def _discover(ckpt) -> Holdings:
    local, pfs = {}, {}
    if ckpt.local is not None:
        for step in ckpt.local.committed_steps():
            try:
                local[step] = ckpt.local.manifest(step).world_size
            except HpcckptError as exc:
                _warn(ckpt, f"ignoring L1 version {step}: {exc}")
    if ckpt.pfs is not None:
        for step in ckpt.pfs.committed_steps():
            try:
                pfs[step] = ckpt.pfs.manifest(step).world_size
            except HpcckptError as exc:
                _warn(ckpt, f"ignoring L4 version {step}: {exc}")
    return Holdings(local, pfs)


def _sources(holdings: Holdings, step: int, world_size: int) -> list[str]:
    """Levels from which a rank can load `step`, cheapest first."""
    sources = []
    if holdings.local.get(step) == world_size:
        sources.append("local")
    if step in holdings.pfs:
        sources.append("pfs")
    return sources


def _candidates(all_holdings: list[Holdings], world_size: int, wanted: int | None) -> list[int]:
    steps = set()
    for h in all_holdings:
        steps.update(h.local)
        steps.update(h.pfs)
    if wanted is not None:
        steps &= {wanted}
    return [s for s in sorted(steps, reverse=True)
            if all(_sources(h, s, world_size) for h in all_holdings)]


def restore(ckpt, mode: str = "auto", wanted: int | None = None) -> int | None:
    if mode not in RESTART_MODES:
        raise ConfigError(f"--restart {mode!r}: use one of {', '.join(RESTART_MODES)}")
    comm = ckpt.comm
    world_size = ckpt.world_size
    mine = _discover(ckpt)
    everyone = comm.allgather(mine)
    newest_anywhere = max([s for h in everyone for s in (*h.local, *h.pfs)], default=None)
    if mode == "never":
        if newest_anywhere is not None:
            raise _collective(ConfigError(
                f"--restart never, but the storage already holds checkpoint versions (newest: step "
                f"{newest_anywhere}); resume with --restart auto, or give the run a new run.dir"))
        return None
    candidates = _candidates(everyone, world_size, wanted)
    if not candidates:
        if wanted is not None:
            raise _collective(UnrecoverableError(_missing_message(everyone, wanted, world_size, ckpt)))
        if newest_anywhere is not None:
            raise _collective(UnrecoverableError(_missing_message(everyone, newest_anywhere, world_size, ckpt)))
        if mode == "require":
            raise _collective(CheckpointError(
                "--restart require, but no checkpoint version exists under "
                f"{ckpt.pfs_dir!r} or the node-local directories; run with --restart auto to start fresh"))
        return None
    for step in candidates:
        restored = _try_restore(ckpt, step, mine)
        if restored:
            if wanted is None:  # a resuming job; evaluating an older version must leave newer ones be
                _clear_newer(ckpt, step, mine)
            return step
    raise _collective(UnrecoverableError(
        f"no checkpoint version could be loaded: every candidate ({candidates}) failed verification; "
        "see the rank logs for the pieces that were bad"))


def _try_restore(ckpt, step: int, mine: Holdings) -> bool:
    """(all ranks) Fetch and verify this rank's part of `step`; load it if every rank succeeded."""
    comm = ckpt.comm
    error, source, manifest, pieces = None, None, None, None
    for level_name in _sources(mine, step, ckpt.world_size):
        level = ckpt.local if level_name == "local" else ckpt.pfs
        try:
            manifest = level.manifest(step)
            _check_compatible(ckpt, manifest)
            pieces = _fetch(ckpt, level, manifest)
            source = level_name
            error = None
            break
        except IncompatibleCheckpointError as exc:
            error = str(exc)
            break  # the same on every level: no point falling through
        except (HpcckptError, OSError) as exc:
            error = f"{level.label}: {exc}"
            _warn(ckpt, f"version {step} from {level.label} unusable on rank {ckpt.rank}: {exc}; trying the next level")
    if source is None and error is None:
        error = "no level holds this rank's shard"
    outcomes = comm.allgather((error, source))
    failures = {r: e for r, (e, _) in enumerate(outcomes) if e}
    if failures:
        incompatible = [e for e in failures.values() if "does not match" in e or "incompatible" in e.lower()]
        if incompatible:
            raise _collective(IncompatibleCheckpointError(incompatible[0], failures))
        if ckpt.rank == 0:
            _warn(ckpt, f"version {step} cannot be loaded on rank(s) {sorted(failures)}; trying an older one")
        return False
    _load(ckpt, manifest, pieces)
    if ckpt.log:
        label = ckpt.local.label if source == "local" else ckpt.pfs.label
        ckpt.log.info(f"restored version {step} from {label} (rank {ckpt.rank}, node {ckpt.node})")
        counts = {}
        for _, s in outcomes:
            counts[s] = counts.get(s, 0) + 1
        summary = ", ".join(f"{n} rank(s) from {'L1 local' if s == 'local' else 'L4 pfs'}" for s, n in counts.items())
        ckpt.log.info(f"restored version {step}: {summary}", console=True)
    return True


def _check_compatible(ckpt, manifest: Manifest) -> None:
    problems = manifest.layout.same_tensors(ckpt.layout, "checkpoint", "current model")
    local_now = set(ckpt.local_array_names)
    if set(manifest.local_arrays) != local_now:
        problems.append(f"per-rank arrays differ: checkpoint {sorted(manifest.local_arrays)}, now {sorted(local_now)}")
    if manifest.local_arrays and manifest.world_size != ckpt.world_size:
        problems.append(f"per-rank arrays {list(manifest.local_arrays)} were saved by {manifest.world_size} ranks "
                        f"and cannot be re-partitioned onto {ckpt.world_size}")
    if problems:
        raise IncompatibleCheckpointError(
            f"checkpoint version {manifest.step} is incompatible with this job (it does not match): "
            + "; ".join(problems))


def _fetch(ckpt, level, manifest: Manifest) -> dict[str, np.ndarray]:
    """This rank's pieces under the CURRENT layout, read and verified."""
    rank = ckpt.rank
    layout = ckpt.layout
    pieces = {}
    if manifest.world_size == ckpt.world_size and manifest.layout == layout:
        path = level.shard_path(manifest.step, rank)
        table = read_shard_table(path)
        _check_table(table, manifest, rank, path)
        with open(path, "rb") as f:
            for tl in layout.rank_pieces(rank):
                pieces[tl.name] = read_tensor(f, table, tl.name, out=ckpt._buffers[tl.name])
            for name in ckpt.local_array_names:
                pieces[name] = read_tensor(f, table, name, out=ckpt._buffers[name])
        _log_reads(ckpt, [path], sum(p.nbytes for p in pieces.values()))
        return pieces
    if level.name != "pfs":
        raise CheckpointError(f"version {manifest.step} was written by {manifest.world_size} ranks with another "
                              "layout; re-partitioning reads from L4 only")
    return _fetch_repartitioned(ckpt, level, manifest, layout)


def _fetch_repartitioned(ckpt, level, manifest: Manifest, layout: Layout) -> dict[str, np.ndarray]:
    """Read only the byte ranges of the old shards that this rank's new pieces cover."""
    rank = ckpt.rank
    pieces = {tl.name: ckpt._buffers[tl.name] for tl in layout.rank_pieces(rank)}
    tables, files = {}, {}
    try:
        for request in read_requests(manifest.layout, layout, rank):
            if request.old_rank not in tables:
                path = level.shard_path(manifest.step, request.old_rank)
                tables[request.old_rank] = read_shard_table(path)
                _check_table(tables[request.old_rank], manifest, request.old_rank, path)
                files[request.old_rank] = open(path, "rb")
            table = tables[request.old_rank]
            verify_whole = request.byte_offset_in_piece == 0 and request.nbytes == table.entry(request.name).nbytes
            data = read_tensor(files[request.old_rank], table, request.name,
                               byte_range=None if verify_whole else (request.byte_offset_in_piece, request.nbytes))
            place_read(pieces[request.name], request, data, manifest.layout, layout, rank)
        _log_reads(ckpt, [level.shard_path(manifest.step, r) for r in sorted(files)],
                   sum(r.nbytes for r in read_requests(manifest.layout, layout, rank)))
    finally:
        for f in files.values():
            f.close()
    return pieces


def _log_reads(ckpt, paths, payload_bytes: int) -> None:
    if ckpt.log:
        ckpt.log.info(f"restore read {payload_bytes} payload bytes from {len(paths)} file(s): "
                      + ", ".join(str(p) for p in paths))


def _check_table(table, manifest: Manifest, rank: int, path) -> None:
    if table.step != manifest.step or table.rank != rank or table.world_size != manifest.world_size:
        raise CheckpointError(f"{path}: shard header says step {table.step}, rank {table.rank} of "
                              f"{table.world_size}; the commit record expects step {manifest.step}, rank {rank}")
    expected = manifest.shards[rank].checksums
    for entry in table.entries:
        if expected.get(entry.name) != entry.checksum:
            raise CheckpointError(f"{path}: tensor {entry.name!r} checksum differs from the commit record")


def _load(ckpt, manifest: Manifest, pieces: dict[str, np.ndarray]) -> None:
    """(all ranks) Reassemble every replicated tensor everywhere; write all arrays in place."""
    from mpi4py import MPI

    layout = ckpt.layout
    for tl in layout.tensors:
        counts = [tl.piece_nbytes(r) for r in range(ckpt.world_size)]
        displacements = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        gathered = np.empty(sum(counts), dtype=np.uint8)
        mine = pieces.get(tl.name)
        send = mine.reshape(-1).view(np.uint8) if mine is not None and mine.size else np.empty(0, np.uint8)
        ckpt.comm.Allgatherv(send, [gathered, counts, displacements, MPI.BYTE])
        shape = tl.logical_shape
        axis_major = (shape[tl.axis],) + shape[:tl.axis] + shape[tl.axis + 1:]
        full = np.moveaxis(gathered.view(tl.spec.dtype).reshape(axis_major), 0, tl.axis).reshape(tl.spec.shape)
        _write_in_place(ckpt._protected[tl.name].array, full)
    for name in ckpt.local_array_names:
        _write_in_place(ckpt._protected[name].array, pieces[name])
    for name, (_, setter) in ckpt._states.items():
        if name in manifest.state:
            setter(manifest.state[name])
    ckpt._ordinal = int(manifest.state.get("_hpcckpt", {}).get("ordinal", 0))


def _write_in_place(target, host: np.ndarray) -> None:
    if isinstance(target, np.ndarray):
        np.copyto(target, host.reshape(target.shape))
    else:
        target.set(np.ascontiguousarray(host.reshape(target.shape)))


def _clear_newer(ckpt, restored: int, mine: Holdings) -> None:
    """Versions newer than the restored one can never be loaded (not complete on every rank,
    or failed verification); the resumed run will write those steps again, and shard files are
    never overwritten, so move them out of the way: uncommitted ones are deleted, committed
    L4 ones are renamed for inspection."""
    if ckpt.local is not None:
        for step in set(ckpt.local.committed_steps()) | set(ckpt.local.uncommitted_steps()):
            if step > restored:
                ckpt.local.remove(step)
    if ckpt.pfs is not None and ckpt.rank == 0:
        for step in ckpt.pfs.uncommitted_steps():
            if step > restored:
                ckpt.pfs.remove(step)
        for step in ckpt.pfs.committed_steps():
            if step > restored:
                directory = ckpt.pfs.version_dir(step)
                os.replace(directory, directory.with_name(directory.name + ".unusable"))
                _warn(ckpt, f"L4 version {step} could not be loaded; kept aside as {directory.name}.unusable")
    from hpcckpt.ckpt.engine import quiet_barrier

    quiet_barrier(ckpt.comm)


def _missing_message(everyone: list[Holdings], step: int, world_size: int, ckpt) -> str:
    missing = [r for r, h in enumerate(everyone) if not _sources(h, step, world_size)]
    nodes = sorted({ckpt.topology.node_of_rank[r] for r in missing})
    return (f"checkpoint version {step} cannot be recovered: the shards of rank(s) {missing} on node(s) {nodes} "
            "are on no surviving level (lost node-local storage and no L4 copy); restart from an older version "
            "or enable the pfs level")


def _collective(exc: HpcckptError) -> HpcckptError:
    exc.collective = True
    return exc


def _warn(ckpt, message: str) -> None:
    if ckpt.log:
        ckpt.log.warning(message) if ckpt.rank == 0 else ckpt.log.info("warning: " + message)
