"""The end-of-run drain: before node-local storage goes away with the allocation, the
committed node-local versions that a global level's retention would keep but that skipped it
(storage.pfs_every) are copied there, each verified against its checksums before its commit
record is written (SCR_Finalize's guarantee)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from hpcckpt.save.retention import steps_to_delete
from hpcckpt.cluster.collectives import fold_at_root, quiet_bcast, quiet_gather
from hpcckpt.errors import CheckpointError
from hpcckpt.format.shardfile import verify_shard
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import VersionImage


def drain(comm, source, target, records, pruner, stage: Callable, skip: set, log, stored: Callable) -> list[int]:
    """(all ranks) Copy to the global level `target` the versions `source` (the landing
    level, L1) committed that `target`'s retention would keep; `skip`: versions made room
    for on `target` by dropping them (not copied back). `stage(step, label, action)`
    runs one agreed stage; `stored(level, nbytes)` counts each copy.
    Returns the steps copied."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    # Versions every rank holds with a readable record (a damaged one is not copied from).
    readable = {step: m for step in source.committed_steps() if (m := records.manifest(source, step))}
    common = fold_at_root(comm, list(readable), lambda held: set.intersection(*map(set, held)))
    # The target's intact versions and their metrics, read once by rank 0 (damaged ones set aside).
    on_target_metrics = comm.bcast(
        {step: m.metrics for step in target.committed_steps() if (m := records.manifest(target, step))}
        if rank == 0 else None, root=0)
    on_target = set(on_target_metrics)
    manifests = {step: readable[step] for step in sorted(common - on_target - skip)
                 if readable[step].world_size == world_size}
    metrics = {step: m.metrics for step, m in manifests.items()}
    keep, keep_best = pruner.keep["global"], pruner.keep_best
    if keep_best:
        metrics.update(on_target_metrics)
    dropped = set(steps_to_delete(sorted(set(manifests) | on_target), keep, metrics, keep_best))
    kept = [step for step in sorted(manifests) if step not in dropped]
    # A version's keyed tables need their chain on the target too (format/keyed_rows.py):
    # decided by rank 0, so every rank copies the same versions.
    copied, incomplete = comm.bcast(with_chains(kept, {step: manifests[step].table_chain for step in kept},
                                                on_target, set(manifests)) if rank == 0 else None, root=0)
    if incomplete and log:
        log.warning(f"version(s) {incomplete} not copied to {target.number}: their tables need version(s) that "
                    f"neither node-local storage nor {target.number} holds")
    for step in copied:
        copy_version(comm, source, target, manifests[step], stage, log, stored)
    if copied and target.prunes_here:
        for step in pruner.deletable(target, keep, max(copied)):
            target.remove(step)
    return copied


def with_chains(kept: list[int], chains: dict, on_target: set, available: set) -> tuple[list[int], list[int]]:
    """(the versions to copy, the kept versions left out): each kept version with the versions
    of its chain the target lacks, or left out when one of them is on neither side."""
    copied, incomplete = set(), []
    for step in kept:
        members = set(chains.get(step, ())[:-1]) - on_target
        if members - available:
            incomplete.append(step)
        else:
            copied |= {step} | members
    return sorted(copied), incomplete


def copy_version(comm, source, target, manifest, stage: Callable, log, stored: Callable) -> None:
    """(all ranks) One version: every rank's shard copied and verified, then the commit."""
    step = manifest.step
    # A copy of this version that a killed job began and never committed would make every
    # shard "already exist" (files are never overwritten) and fail this copy in every attempt.
    if quiet_bcast(comm, step in target.uncommitted_steps() if comm.Get_rank() == 0 else None, root=0):
        stage(step, f"{target.number}: the uncommitted copy left by an earlier job", lambda: target.remove(step))
    # The target's one record lists every shard; each rank's node-local copy lists its node's part.
    # Sleeping, nonblocking (cluster/mpi_gate.py): this runs on L4's thread beside the agreement.
    gathered = quiet_gather(comm, manifest.shard(comm.Get_rank()), root=0)
    if gathered is not None:
        manifest = manifest.with_shards(gathered)

    def copy_shard():
        data = map_readonly(source.shard_path(step))  # from the page cache, not a shard-sized buffer
        target.store(VersionImage(step, comm.Get_size(), (), lambda: data))
        problems = verify_shard(target.shard_path(step))
        if problems:
            raise CheckpointError(f"{target.number} copy of {source.shard_path(step)}: {problems[0]}")
        stored(target.name, data.nbytes)
    stage(step, f"drain to {target.number}", copy_shard)
    manifest = dataclasses.replace(manifest, levels=manifest.levels + (target.name,))
    stage(step, f"{target.number} commit", lambda: target.commit(manifest))
    if log:
        log.info(f"drained version {step} from node-local storage to {target.number}", console=True)
