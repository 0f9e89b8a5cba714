"""The save pipeline: one snapshot's way into the levels, behind training.

    layout -> agree on every rank's shard size -> plan (save/save_plan.py: the levels due,
    node-local and global) -> the node-local stage (save/node_local_stage.py: L1 on the
    writer thread while L2 sends and L3 encodes the same bytes, then their commit) -> route
    the global levels (at their own pace from L1's files: save/flush.py; or here:
    save/global_stage.py) -> retention (save/pruning.py)

A loop over the ordered level stack (levels/base.py's Level), with no branch on what a level
is: a level says whether it is node-local (its files share L1's version directory and commit
record) and whether it is collective. Each stage ends with an agreement (save/stages.py), so
a failure anywhere stops the version everywhere before its commit. What a failure leads to
is decided apart (save_plan.decide): a storage failure (full, read-only, I/O error, gone)
keeps the version on the levels that work instead (save/level_health.py): a rank whose
node-local directory failed keeps nothing of the version there and the version stands on the
other nodes while L2/L3 supply that rank's shard from them; else the node-local levels hand
the whole version to L4. A level out of space first drops versions another level holds and
tries once more (save/room.py). Any other failure is raised.

Threads (save/threads.py): background copies on a copier thread, the first node-local write
on a writer thread, the rest on a persist thread, L4's copies on a thread of their own; all
live as long as the pipeline. At most one checkpoint is in flight: the next snapshot first
waits for this one (its buffers are reused), not for L4's copy. A failure on any rank is kept
and raised on the main thread at the next call; the end-of-run drain is save/drain.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Callable

from hpcckpt.save.drain import drain
from hpcckpt.save.flush import AsyncFlush
from hpcckpt.save.global_stage import GlobalStage
from hpcckpt.save.level_health import LevelHealth
from hpcckpt.save.memory_placement import MemoryPlacement
from hpcckpt.save.node_local_stage import NodeLocalStage
from hpcckpt.save.pruning import Pruner
from hpcckpt.save.room import RoomMaker, bytes_to_write, out_of_space
from hpcckpt.save.save_plan import (
    DEGRADE,
    HERE,
    NODE_LOCAL_FAILED,
    NODE_LOCAL_OK,
    NODE_LOCAL_PARTIAL,
    NOW_FROM_FILES,
    decide,
    plan_save,
    route_global,
)
from hpcckpt.save.save_types import (
    BackgroundCopies,
    PersistReport,
    PipelineSettings,
    ShardInfos,
    Snapshot,
    VersionInFlight,
)
from hpcckpt.save.stages import RoomOnce, StageRunner, once_more_after_making_room
from hpcckpt.save.threads import ThreadSetup, Worker
from hpcckpt.cluster.collectives import exchange_objects, is_storage_failure, quiet_bcast, quiet_gather, \
    raise_if_any_failed
from hpcckpt.errors import CheckpointError
from hpcckpt.format.manifest import shard_digest, version_id_of
from hpcckpt.format.shardfile import plan_shard
from hpcckpt.levels.base import VersionImage
from hpcckpt.levels.pfs import COORDINATOR
from hpcckpt.run.records import RecordReader

__all__ = ["BackgroundCopies", "PersistReport", "PipelineSettings", "SavePipeline", "Snapshot"]

TAG_RECORDS = 401  # and 402: shard records to the ranks whose node-local record lists them


class SavePipeline:
    """(all ranks) Runs snapshots through the level stack (levels/base.py's LevelStack).
    `make_manifest(snapshot, shard_infos, levels)` builds the commit record (ShardInfos: what
    this rank's records list); `record_peers` are format/manifest.py's for this rank; `arrays` are the
    protected arrays (ckpt/snapshot.py), whose buffers the snapshot's pieces live in: its
    shard-shaped host buffer, its GPU copies and the shard's extra record."""

    def __init__(self, comm, levels, settings: PipelineSettings, make_manifest: Callable, arrays, job):
        """`job`: log, threaded, lease (or None) and record_peers (ranks whose
        node-local record lists this rank's shard, ranks whose shards its lists)."""
        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.levels = levels
        self.settings = settings
        self.make_manifest = make_manifest
        self.arrays = arrays
        self.log, self.threaded, self.lease = job.log, job.threaded, job.lease
        self.record_peers = job.record_peers
        self.last_report: PersistReport | None = None
        # A version no level was due for (every level every n-th version): held only by the
        # snapshot buffers until a newer version replaces it or write_pending() stores it.
        self.pending: Snapshot | None = None
        self.pending_replaced = 0  # such versions replaced by a newer one before any level took them
        self.worker_error: BaseException | None = None
        self.in_flight: threading.Event | None = None
        self.behind: str | None = None  # what run_behind()'s work in flight is; None: none is
        # Copies run at normal priority (training may wait for them in before_update()), the
        # persist at checkpoint.persist_nice; a done event per checkpoint marks it finished.
        threads = ThreadSetup(settings, self.log)
        self._copier = Worker("hpcckpt-copy", on_start=threads.background)
        self._persister = Worker("hpcckpt-persist", on_start=threads.writing)
        self.runner = StageRunner(comm, self.log, Worker("hpcckpt-l1-write", on_start=threads.writing))
        self.records = RecordReader(self.rank, self.log)
        # L4 at its own pace needs threads and the landing level's files to copy from;
        # otherwise each version due waits for L4 in the persist.
        self.flush: AsyncFlush | None = None
        self.pruner = Pruner(levels, settings, self.records, self.log,
                             pinned=lambda: {self.flush.flushing} if self.flush else set(),
                             chains_matter=lambda: bool(self.arrays.tables))
        self.room = RoomMaker(self.rank, levels.node_local, levels.global_levels, settings.keep_best, self.log,
                              remove_node_local=self.pruner.remove_node_local, prune=self.pruner.prune)
        self.health = LevelHealth(settings.max_unprotected, self.log)
        self.memory = MemoryPlacement(levels.node_local[0].places if levels.node_local else None,
                                      job.node_sharers, self.log)
        self.node_local_stage = NodeLocalStage(self.runner, levels.node_local, make_manifest, self.pruner,
                                               settings.one_write_at_a_time)
        self.global_stage = GlobalStage(self.runner, levels, self.room, self.health, self.pruner, self.lease)
        if (self.threaded and settings.pfs_async and levels.global_levels and levels.node_local
                and levels.landing is levels.node_local[0]):
            self.flush = AsyncFlush(comm, self.global_stage.copy_from_files, self.log, on_start=threads.writing)

    bytes_stored = property(lambda self: self.runner.bytes_stored)  # level -> bytes this rank stored, this run
    versions_stored = property(lambda self: self.runner.versions_stored)  # level -> versions this rank stored
    node_local_label = property(lambda self: self.node_local_stage.label)

    # -- hand-over from the snapshot ---------------------------------------------------------
    def submit(self, snapshot: Snapshot, report: PersistReport, started: float,
               copies: BackgroundCopies | None, copy_piece: Callable[[str], None]) -> None:
        """Persist `snapshot` behind training (after its background `copies`, if any), or
        here and now where MPI allows no threads."""
        if copies is not None:
            self.in_flight = threading.Event()
            self._copier.submit(self._take_copies, copies, copy_piece, snapshot, started, self.in_flight)
        elif self.threaded:
            self.in_flight = threading.Event()
            self._persister.submit(self._persist_guarded, snapshot, report, started, self.in_flight)
        else:
            self._persist_guarded(snapshot, report, started)

    def run_behind(self, work: Callable[[], None], what: str) -> None:
        """(all ranks) `work`, collective over the pipeline's communicator and writing through
        persist(), behind training as a checkpoint in flight is: the next snapshot, wait(),
        a restart and close() wait for it, and its failure is raised at the next of those
        calls. Here and now where MPI allows no threads."""
        if self.in_flight is not None:
            raise RuntimeError(f"{what}: another checkpoint or work is still in flight (finish_in_flight() first)")
        if not self.threaded:
            work()
            return
        self.in_flight, self.behind = threading.Event(), what
        self._persister.submit(self._run_guarded, work, what, self.in_flight)

    def finish_work_behind(self) -> tuple[str, float] | None:
        """Wait for run_behind()'s work if it is in flight (its failure raised here): what it
        was and the seconds waited; None if it was not."""
        what = self.behind
        if what is None:
            return None
        started = time.perf_counter()
        self.finish_in_flight()
        return what, time.perf_counter() - started

    def _run_guarded(self, work: Callable[[], None], what: str, done: threading.Event) -> None:
        try:
            work()
        except BaseException as exc:
            self.worker_error = exc
            if self.log:
                self.log.error(f"{what} failed: {exc}")
        finally:
            done.set()

    @property
    def persisting(self) -> bool:
        """A checkpoint's persist is running (not run_behind()'s work)."""
        return self.behind is None and self._running

    @property
    def working_behind(self) -> bool:
        """run_behind()'s work is running."""
        return self.behind is not None and self._running

    _running = property(lambda self: self.in_flight is not None and not self.in_flight.is_set())

    @property
    def copying_at_own_pace(self) -> int | None:
        """The version a copy to the global levels at their own pace is taking on this rank
        right now (None: no copy runs)."""
        return self.flush.flushing if self.flush is not None else None

    def finish_in_flight(self) -> PersistReport | None:
        """Wait for the checkpoint in flight; raise its failure here, on the main thread."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None
        self.behind = None
        if self.worker_error is not None:
            error, self.worker_error = self.worker_error, None
            raise error
        report, self.last_report = self.last_report, None
        return report

    def wait_for_global_levels(self) -> None:
        """Until the copy to L4 in flight is over on this rank; its unexpected failure here."""
        if self.flush is not None:
            self.flush.wait()

    def stop(self) -> None:
        self._copier.stop()  # after the copies queued for an abandoned snapshot
        self._persister.stop()
        self.runner.writer.stop()
        if self.flush is not None:
            self.flush.stop()

    def _take_copies(self, copies: BackgroundCopies, copy_piece, snapshot: Snapshot, ended_at: float,
                     done: threading.Event) -> None:
        """(copier thread) The snapshot's copies in capture order (the order the next step
        updates them in), then on to the persist; after a failed copy the rest are skipped.
        They start once the step is over: copies woken during the step competed with it for
        the cores and the GIL, which on busy cores cost more than they overlapped."""
        try:
            started, cpu_started = time.perf_counter(), time.thread_time()
            for name, taken in list(copies.taken.items()):
                if copies.error is None and not taken.is_set():
                    try:
                        copy_piece(name)
                    except Exception as exc:  # agreed by every rank before the persist
                        copies.error = f"copying {name!r} into the snapshot: {type(exc).__name__}: {exc}"
                taken.set()
            copies.report.background_copy_s += time.perf_counter() - started
            copies.report.cpu_s["copy"] = time.thread_time() - cpu_started
        finally:
            copies.release_all()
        self._persister.submit(self._persist_guarded, snapshot, copies.report, ended_at, done, copies)

    # -- the persist ----------------------------------------------------------------------
    def _persist_guarded(self, snapshot: Snapshot, report: PersistReport, started: float,
                         done: threading.Event | None = None, copies: BackgroundCopies | None = None) -> None:
        """Persist; a failure surfaces on the next call on the main thread. Every rank first
        agrees that its snapshot is whole (background copies, the GPU's copies to the host),
        so no rank persists a torn one. `done` marks the checkpoint finished either way."""
        cpu_started = time.thread_time()
        try:
            error = copies.error if copies is not None else None
            if error is None and self.lease is not None and self.lease.lost_to is not None:
                error = str(self.lease.lost_error())
            device_snapshot = self.arrays.device_snapshot
            if error is None and device_snapshot is not None:
                device_started = time.perf_counter()
                try:
                    report.device_copy_s = device_snapshot.to_host()
                except Exception as exc:  # a CUDA error of an asynchronous copy lands here
                    error = f"copying GPU arrays into the snapshot: {type(exc).__name__}: {exc}"
                report.device_to_host_s = time.perf_counter() - device_started
            raise_if_any_failed(self.comm, "snapshot", error, step=report.step)
            self.persist(snapshot, report, started)
            self.last_report = report
        except BaseException as exc:
            self.worker_error = exc
            if self.log:
                self.log.error(f"checkpoint of step {report.step} failed: {exc}")
        finally:
            report.cpu_s["persist"] = time.thread_time() - cpu_started
            if done is not None:
                done.set()

    def take_pending(self) -> int | None:
        """The step of the version no level was due for, whose buffers the next snapshot is
        about to fill (it is then replaced, or lost if that snapshot is dropped); None."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        self.pending_replaced += 1
        return pending.step

    def write_pending(self) -> PersistReport | None:
        """(all ranks, main thread, nothing in flight) The version no level was due for, if
        any, written now to every level of the stack, as a final version is: its report."""
        if self.pending is None:
            return None
        snapshot = dataclasses.replace(self.pending, levels=tuple(level.name for level in self.levels))
        self.pending = None
        report = PersistReport(snapshot.step)
        self.persist(snapshot, report, time.perf_counter())
        return report

    def levels_due(self, snapshot: Snapshot) -> tuple:
        """The levels the snapshot goes to, as the schedule decided, in the stack's order."""
        return tuple(level for level in self.levels if level.name in snapshot.levels)

    def persist(self, snapshot: Snapshot, report: PersistReport, started: float) -> None:
        """(all ranks) Plan the version's stages, run the node-local one, route the global
        levels by its outcome, then retention."""
        step = snapshot.step
        plan = plan_save(self.levels_due(snapshot))
        self.pending = None  # a restored version written again
        if plan.empty:
            report.held = False  # no level was due: a table's rows changed since are not stored yet
            self.pending = snapshot
            return
        version, shard_infos = self._version(snapshot, (plan.node_local or plan.global_levels)[0],
                                             len(plan.node_local))
        if plan.node_local:
            self.memory.place(step, shard_infos.in_memory)
        v = VersionInFlight(snapshot, version, shard_infos, report, started)
        outcome, manifest, lacking, failure = NODE_LOCAL_OK, None, {}, None
        if plan.node_local:
            outcome, manifest, lacking, failure = self._node_local(v, plan)
        stored_on = plan.node_local if outcome != NODE_LOCAL_FAILED else ()
        held_by = [self.node_local_stage.held_despite(stored_on, lacking)] if lacking else \
            [level.label for level in stored_on]
        route = route_global(plan, outcome, self.levels.global_levels, self.flush is not None,
                             self.flush is not None and self.flush.owed, snapshot.final)
        if route.wait_first:
            self.flush.wait()  # L4 takes this version here, not beside a copy of its own
        if route.how == HERE:
            self._global_here(v, stored_on, route.levels, held_by)
        elif route.how == NOW_FROM_FILES:
            self.flush.copy_now(step, manifest, report, started)
        else:
            self.flush.offer(self.comm, step, manifest, report, started, due=bool(route.levels))
        self._tell_node_local_health(step, failure, lacking, stored_on, held_by, report)
        report.held = bool(held_by)
        self.health.version_held(step, bool(held_by))
        self.pruner.apply(step, global_too=self.flush is None)  # else L4's thread prunes after each copy

    def _version(self, snapshot: Snapshot, first, node_local_levels: int) -> tuple[VersionImage, ShardInfos]:
        """(all ranks) This rank's shard planned, and what every rank's records need of it
        (with whether every node has room for the version in memory)."""
        step = snapshot.step
        image = self.runner.run(step, "shard layout", lambda: plan_shard(
            step, self.rank, self.world_size, snapshot.pieces, self.arrays.shard_extra,
            str(first.shard_path(step))))
        shard_infos = self._share_shard_infos(image.size, image.checksums, step,
                                              self.memory.room_for(image.size, node_local_levels))
        version = VersionImage(step, self.world_size, shard_infos.sizes,
                               functools.cache(lambda: image.copy_into(self.arrays.file_buffer(image.size))), image,
                               version_bytes=shard_infos.version_bytes)
        return version, shard_infos

    def _node_local(self, v: VersionInFlight, plan):
        """(all ranks) The node-local stage, once more after making room where it ran out of
        space. Returns (outcome, commit record, {rank: why} lacking, the failure degraded)."""
        room = RoomOnce(lambda: self.room.on_node_local(self.comm, v.version, self.node_local_label,
                                                         self.flush.flushing if self.flush else None))
        names = tuple(level.name for level in (*plan.node_local, *plan.global_levels))
        try:
            manifest, lacking = once_more_after_making_room(
                lambda: self.node_local_stage.run(v, plan.node_local, names, room), room)
        except CheckpointError as exc:
            if decide(is_storage_failure(exc), out_of_space(exc), room_untried=False) != DEGRADE:
                raise  # memory, a codec, a file in the way: not for degrading
            # Degrade, do not stop: the version goes to the global levels instead (all of
            # them, due or not: nothing else holds it), from the snapshot, as L1's file is gone.
            v.report.failed["node-local"] = str(exc)
            return NODE_LOCAL_FAILED, None, {}, exc
        return (NODE_LOCAL_PARTIAL if lacking else NODE_LOCAL_OK), manifest, lacking, None

    def _global_here(self, v: VersionInFlight, node_local: tuple, levels: tuple, held_by: list) -> None:
        """(all ranks) The global levels take the version now, from the snapshot; `held_by`
        grows by the levels that took it."""
        if not levels:
            return
        names_now = tuple(dict.fromkeys((*(level.name for level in node_local), *(level.name for level in levels))))
        manifest = self.make_manifest(v.snapshot, v.shard_infos, names_now)
        took = False
        for level in levels:
            if self.global_stage.store(level, v.version, manifest, v.report, v.started, tuple(held_by), self.comm):
                held_by.append(level.label)
                took = True
        if self.flush is not None:
            self.flush.owed = not took
            self.pruner.prune_global(v.step)

    def _tell_node_local_health(self, step: int, failure, lacking: dict, node_local: tuple, held_by: list,
                                report: PersistReport) -> None:
        """The node-local levels' health after this version: failed everywhere, failed on
        some ranks (`lacking`), or fine."""
        if failure is not None:
            self.health.failed(self.node_local_label, step, failure, tuple(held_by))
        elif lacking:
            report.failed["node-local"] = self.node_local_stage.partial_failure(step, lacking)
            self.health.failed(self.node_local_label, step, report.failed["node-local"], tuple(held_by),
                               ranks=sorted(lacking))
        elif self.levels.node_local and node_local:
            self.health.succeeded(self.node_local_label, step)

    def _share_shard_infos(self, size: int, checksums: dict, step: int, room_in_memory: bool) -> ShardInfos:
        """(all ranks) What the commit records need of every rank's shard, each rank told only
        what it writes, so no rank receives O(ranks): the checksums of the shards its node-local
        record lists, point to point from those O(group) ranks; all of them at L4's coordinator,
        which writes the record listing every shard and hands every rank the version id and
        total size."""
        send_to, receive_from = self.record_peers
        records = exchange_objects(self.comm, (size, checksums), send_to, receive_from, TAG_RECORDS)
        records[self.rank] = (size, checksums)
        mine = (size, checksums, shard_digest(size, checksums), room_in_memory)
        everyone = quiet_gather(self.comm, mine, root=COORDINATOR)
        summary = None
        if everyone is not None:
            records = {rank: (size, checksums) for rank, (size, checksums, _, _) in enumerate(everyone)}
            summary = (version_id_of(step, self.world_size, [digest for _, _, digest, _ in everyone]),
                       bytes_to_write(size for size, _, _, _ in everyone), all(room for *_, room in everyone))
        version_id, version_bytes, in_memory = quiet_bcast(self.comm, summary, root=COORDINATOR)
        return ShardInfos(records, version_id, version_bytes, in_memory)

    def drain(self, source, target) -> list[int]:
        """(all ranks) The end-of-run drain of `source`'s versions to `target` (save/drain.py)."""
        return drain(self.comm, source, target, self.records, self.pruner, self.runner.run,
                     self.room.dropped.get(target.name, set()), self.log, self.runner.note_stored)
