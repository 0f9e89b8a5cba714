"""The global stage of a save: each global level (L4) due stores the version and commits it,
agreed; from the snapshot, or from the landing level's files (a version committed on the
node-local levels, copied at its own pace or at the end). A level out of space first drops
versions another level holds and tries once more (save/room.py); a storage failure then
degrades (the version stays on the levels that took it) and is told to the level's health.
A global level holds a version's keyed tables only with their chain (format/keyed_rows.py):
the versions before it in the chain that the level lacks are copied there first, from the
landing level's files, which retention keeps while a kept version names them."""

from __future__ import annotations

import dataclasses
import functools
import time

from hpcckpt.save.room import bytes_to_write
from hpcckpt.save.stages import StageRunner, once_more_after_making_room
from hpcckpt.save.drain import copy_version
from hpcckpt.cluster.collectives import describe_failure, is_storage_failure, on_root, raise_if_any_failed
from hpcckpt.errors import CheckpointError, HpcckptError, StorageError
from hpcckpt.format.manifest import Manifest
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import VersionImage


class GlobalStage:
    """(all ranks) `room` makes room on a level (RoomMaker.on_global), `health` hears each
    level's outcome, `pruner` applies the global levels' retention after a copy; `lease`
    (optional) says whether another job took the run over, which then owns the global levels."""

    def __init__(self, runner: StageRunner, levels, room, health, pruner, lease=None):
        self.runner = runner
        self.landing = levels.landing
        self.node_local = levels.node_local
        self.global_levels = levels.global_levels
        self.room = room
        self.health = health
        self.pruner = pruner
        self.lease = lease

    def store(self, level, version: VersionImage, manifest: Manifest, report, started: float, held_by: tuple,
              comm) -> bool:
        """One global level's store and commit of a version, agreed on `comm`. True when the
        level took it; a storage failure degrades, any other failure is raised."""
        step = version.step
        report.started_s[level.name] = time.perf_counter() - started

        def store_and_commit() -> int:
            try:
                self._chain_first(level, manifest, comm)
                stored = self.runner.run(step, level.stage_label, lambda: level.store(version), comm=comm)
                self.runner.run(step, f"{level.number} commit", lambda: level.commit(manifest), comm=comm)
                return stored
            except CheckpointError:
                self.runner.drop_partial(level, step)
                raise
        try:
            stored = once_more_after_making_room(store_and_commit, lambda: self.room.on_global(level, version, comm))
        except CheckpointError as exc:
            if not is_storage_failure(exc):
                raise
            report.failed[level.name] = str(exc)
            self.health.failed(level.label, step, exc, held_by)
            return False
        self.runner.mark(report, step, level.name, started, stored)
        self.health.succeeded(level.label, step)
        return True

    def _chain_first(self, level, manifest: Manifest, comm) -> None:
        """(all ranks of comm) The versions before `manifest`'s in its tables' chain that
        `level` lacks, each copied there whole from the landing level's files and committed."""
        chain = manifest.table_chain[:-1]
        if not chain:
            return
        try:  # the coordinator lists the shared directory; a failure there degrades the level on every rank
            missing = on_root(comm, f"listing {level.number}'s versions",
                              lambda: sorted(set(chain) - set(level.committed_steps())))
        except HpcckptError as exc:  # the same on every rank (on_root): a storage failure of this level
            raise CheckpointError(str(exc), {0: describe_failure(StorageError(str(exc)))}, collective=True) from None
        for step in missing:
            record = self.pruner.records.manifest(self.landing, step) if self.landing is not None else None
            failure = None
            if record is None or not self.landing.shard_path(step).is_file():
                failure = describe_failure(StorageError(
                    f"{level.number} cannot take version {manifest.step}: its tables need version {step}, which "
                    "this rank's node-local storage no longer holds"))
            raise_if_any_failed(comm, f"{level.number} chain of version {manifest.step}", failure, step=step)
            copy_version(comm, self.landing, level, record,
                         lambda at, label, action: self.runner.run(at, label, action, comm=comm), None,
                         self.runner.note_stored)
            if self.pruner.log:
                self.pruner.log.info(f"version {step} copied to {level.number} before version {manifest.step}, "
                                     "whose tables build on it")

    def copy_from_files(self, step: int, manifest: Manifest, report, started: float, comm) -> bool:
        """(all ranks; L4's thread, or the persist thread for the final version) Copy a
        version committed on the node-local levels to the global ones from this rank's file
        on the landing level, then their retention. True when some global level took it."""
        # A job that took the run over owns the global levels now (only rank 0 holds the lease: agreed).
        lost = self.lease is not None and self.lease.lost_to is not None
        raise_if_any_failed(comm, "copy to L4", str(self.lease.lost_error()) if lost else None, step=step)
        sizes = manifest.shard_sizes()
        # Mapped, not read: the file's pages come from the page cache (L1 just wrote them)
        # without a second shard-sized buffer beside the snapshot's.
        # The coordinator's record lists every shard: it is the rank that measures L4's room.
        version = VersionImage(step, comm.Get_size(), sizes, functools.cache(
            lambda: map_readonly(self.landing.shard_path(step))), version_bytes=bytes_to_write(sizes))
        held_by = tuple(level.label for level in self.node_local if level.name in manifest.levels)
        took = False
        for level in self.global_levels:
            on_level = dataclasses.replace(manifest, levels=tuple(dict.fromkeys((*manifest.levels, level.name))))
            took |= self.store(level, version, on_level, report, started, held_by, comm)
        if took:
            self.pruner.prune_global(step)
        return took
