"""The save pipeline: one snapshot's way into the levels, behind training.

    layout -> agree on every rank's shard size -> the node-local levels due (L1 on the writer
    thread while L2 sends and L3 encodes the same bytes) -> their commit -> the global levels
    due (L4), each written then committed: at their own pace from L1's file (ckpt/flush.py),
    or here -> retention

A loop over the ordered level stack (levels/base.py's Level), with no branch on what a level
is: a level says whether it is node-local (its files share L1's version directory and commit
record) and whether it is collective. Each stage ends with an agreement (cluster/
collectives.py), so a failure anywhere stops the version everywhere before its commit.
When that failure was the storage's (full, read-only, I/O error, gone), the version is kept
by the levels that work instead (ckpt/level_health.py): a rank whose node-local directory
failed keeps nothing of the version there, and the version stands on the other nodes while
L2/L3 supply that rank's shard from them (Level.supplies; L4, when due, then takes it from
the snapshot); else the node-local levels hand the whole version to L4. A level out of
space first drops versions another level holds and tries once more (ckpt/room.py). Any
other failure is raised.

Threads: background copies on a copier thread, the first node-local write on a writer
thread, the rest on a persist thread, L4's copies on a thread of their own; all live as long
as the pipeline. At most one checkpoint is in flight: the next snapshot first waits for this
one (its buffers are reused), not for L4's copy.
A failure on any rank is kept and raised on the main thread at the next call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hpcckpt.ckpt.flush import AsyncFlush
from hpcckpt.ckpt.level_health import LevelHealth
from hpcckpt.ckpt.policy import levels_due
from hpcckpt.run.records import RecordReader
from hpcckpt.ckpt.retention import newest_redundant_versions, steps_to_delete, versions_to_delete
from hpcckpt.ckpt.room import RoomMaker, bytes_to_write, out_of_space
from hpcckpt.ckpt.worker import Worker
from hpcckpt.cluster.collectives import (
    StorageFailure,
    agree,
    agree_per_rank,
    exchange_objects,
    fold_at_root,
    is_storage_failure,
    quiet_bcast,
    quiet_gather,
    raise_if_any_failed,
)
from hpcckpt.errors import CheckpointError, HpcckptError
from hpcckpt.format.manifest import Manifest, shard_digest, version_id_of
from hpcckpt.format.shardfile import plan_shard, verify_shard
from hpcckpt.io import direct_io
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import VersionImage
from hpcckpt.levels.pfs import COORDINATOR


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of this rank's shard of one step, handed to the pipeline."""

    step: int
    ordinal: int  # 1-based count of checkpoints of this job, for every-Nth levels
    pieces: tuple[tuple[str, np.ndarray], ...]
    state: dict
    metrics: dict
    final: bool
    levels: tuple | None = None  # the levels to write it to; None: those due (policy.levels_due)


@dataclass
class PersistReport:
    """Timings of one checkpoint, for logs, the interval policy and benchmarks.

    snapshot_s: what end_checkpoint() blocked for; captured_early_s: time spent in capture()
    during the step (the copies themselves, or only queueing them with copy_in_background);
    copy_wait_s: what before_update() blocked for until a background copy was taken;
    background_copy_s: the copies made behind the step by the worker thread;
    device_to_host_s: the persist thread's wait for the GPU snapshot to reach host memory;
    device_copy_s: GPU time of the snapshot's copies on the side stream (CuPy arrays);
    durable_s: seconds from end_checkpoint() until each level was durable;
    started_s: seconds from end_checkpoint() until this rank began writing each level (a
    level's own time is durable_s - started_s; L4 starts after the L1-L3 commit);
    cpu_s: CPU seconds this rank spent on the checkpoint outside the training loop's own
    work, by thread ("copy", "persist", "l1_write"; "persist" is the calling thread when the
    engine runs unthreaded): what it takes from training on saturated cores.
    """

    step: int
    snapshot_s: float = 0.0
    captured_early_s: float = 0.0
    copy_wait_s: float = 0.0
    background_copy_s: float = 0.0
    device_to_host_s: float = 0.0
    device_copy_s: float = 0.0
    durable_s: dict = field(default_factory=dict)
    started_s: dict = field(default_factory=dict)
    cpu_s: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)  # level -> why it could not take this version (others hold it)


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline needs of the job's configuration."""

    every: dict  # level -> every how many checkpoints it is due (policy.levels_due)
    keep: dict  # node_local / global -> versions retention keeps (checkpoint.keep_local, keep_pfs)
    keep_best: str = ""
    one_write_at_a_time: bool = False  # storage.local_bandwidth_mb is set: L1 before L2/L3
    background_policy: str = "batch"
    persist_nice: int = 0
    direct_io: bool = False
    max_unprotected: int = 3  # resilience.max_unprotected_checkpoints
    pfs_async: bool = True  # storage.pfs_async: L4 copies from L1 at its own pace (ckpt/flush.py)

    @classmethod
    def from_config(cls, config) -> "PipelineSettings":
        resilience, storage, checkpoint = config.resilience, config.storage, config.checkpoint
        return cls(
            every={"partner": resilience.partner_every, "erasure": resilience.erasure_every, "pfs": storage.pfs_every},
            keep={"node_local": checkpoint.keep_local, "global": checkpoint.keep_pfs},
            keep_best=checkpoint.keep_best, one_write_at_a_time=bool(storage.local_bandwidth_mb),
            background_policy=checkpoint.background_policy, persist_nice=checkpoint.persist_nice,
            direct_io=storage.direct_io, max_unprotected=resilience.max_unprotected_checkpoints,
            pfs_async=storage.pfs_async)


class BackgroundCopies:
    """Copies of one snapshot queued by capture() and taken by the copier thread while
    training goes on (CheckFreq's snapshot overlapping the next step). Each array has an
    event, set once its copy is taken, which before_update() waits for."""

    def __init__(self, report: PersistReport):
        self.taken: dict[str, threading.Event] = {}
        self.report = report
        self.error: str | None = None

    def release_all(self) -> None:
        for event in self.taken.values():
            event.set()


class _BackgroundWrite:
    """One level's store on the writer thread (L1's file), while the other node-local levels
    send and encode the same bytes: durable on L1-L3 after the disk's time for the files
    rather than after the disk's time plus the transfers and the encoding."""

    def __init__(self):
        self.done = threading.Event()
        self.error = None
        self.stored = 0
        self.finished_at = 0.0
        self.cpu_s = 0.0


TAG_RECORDS = 401  # and 402: shard records to the ranks whose node-local record lists them


@dataclass(frozen=True)
class ShardInfos:
    """What this rank's commit records need of the version's shards: (size, checksums) by rank
    of the shards they list (its node-local part, or all of them on L4's coordinator), the
    version id (a hash of every rank's shard_digest) and the bytes all ranks' files take."""

    records: dict
    version_id: str
    version_bytes: int

    @property
    def sizes(self) -> dict[int, int]:
        """The shard sizes of the ranks listed: this rank's, its L3 group's and the replica
        sources it holds, which are the ones its levels need."""
        return {rank: size for rank, (size, _) in self.records.items()}


class _RoomOnce:
    """Making room for one version (ckpt/room.py), at most once: later calls answer as the
    first did."""

    def __init__(self, make_room: Callable[[], bool]):
        self._make_room = make_room
        self.result: bool | None = None

    @property
    def tried(self) -> bool:
        return self.result is not None

    def __call__(self) -> bool:
        if self.result is None:
            self.result = bool(self._make_room())
        return self.result


def _note_failures(lacking: dict, failed: dict, where: str) -> None:
    """A stage's storage failures by rank, the first one of each rank kept, saying where."""
    for rank, why in failed.items():
        lacking.setdefault(rank, StorageFailure(f"{where}: {why}"))


class SavePipeline:
    """(all ranks) Runs snapshots through the level stack (levels/base.py's LevelStack).
    `make_manifest(snapshot, shard_infos, levels)` builds the commit record (ShardInfos: what
    this rank's records list); `record_peers` are format/manifest.py's for this rank; `arrays` are the
    protected arrays (ckpt/snapshot.py), whose buffers the snapshot's pieces live in: its
    shard-shaped host buffer, its GPU copies and the shard's extra record; `faults` injects
    failures by stage."""

    def __init__(self, comm, rank: int, world_size: int, levels, settings: PipelineSettings,
                 make_manifest: Callable, arrays, faults, log, threaded: bool, lease=None,
                 record_peers: tuple = ((), ())):
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        self.levels = levels
        self.node_local = levels.node_local
        self.global_levels = levels.global_levels
        self.settings = settings
        self.make_manifest = make_manifest
        self.faults = faults
        self.log = log
        self.threaded = threaded
        self.lease = lease
        self.arrays = arrays
        # (ranks whose node-local record lists this rank's shard, ranks whose shards its lists)
        self.record_peers = record_peers
        self.bytes_stored: dict[str, int] = {}  # level -> bytes this rank stored on it, this run
        self.last_report: PersistReport | None = None
        self.worker_error: BaseException | None = None
        self.in_flight: threading.Event | None = None
        # Copies run at normal priority (training may wait for them in before_update()), the
        # persist at checkpoint.persist_nice; a done event per checkpoint marks it finished.
        self._copier = Worker("hpcckpt-copy", on_start=self._background_scheduling)
        self._persister = Worker("hpcckpt-persist", on_start=self._start_writing_thread)
        self._writer = Worker("hpcckpt-l1-write", on_start=self._start_writing_thread)
        self._warned: set[str] = set()
        self.room = RoomMaker(self.rank, self.node_local, self.global_levels, settings.keep_best, log,
                              remove_node_local=self._remove_node_local, prune=self._prune)
        self.health = LevelHealth(settings.max_unprotected, log)
        self.records = RecordReader(rank, log)
        # Versions the node-local levels committed while this rank's node could not take its
        # part: they count toward its node-local retention as on the other ranks, or it would
        # keep an older version there that no other rank keeps.
        self.committed_without_me: set[int] = set()
        # L4 at its own pace needs threads and L1's files to copy from; otherwise each version
        # due waits for L4 in the persist.
        self.flush: AsyncFlush | None = None
        if (threaded and settings.pfs_async and self.global_levels and self.node_local
                and self.node_local[0].name == "local"):
            self.flush = AsyncFlush(comm, self._copy_to_global, log, on_start=self._start_writing_thread)

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

    @property
    def persisting(self) -> bool:
        return self.in_flight is not None and not self.in_flight.is_set()

    def finish_in_flight(self) -> PersistReport | None:
        """Wait for the checkpoint in flight; raise its failure here, on the main thread."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None
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
        self._writer.stop()
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

    # -- thread set-up -------------------------------------------------------------------
    def _background_scheduling(self) -> None:
        """(worker thread) SCHED_BATCH: the scheduler does not let this thread's wake-ups (a
        copy job arriving, the persist's polls of MPI requests) preempt training; it keeps its
        fair share of the CPU, so it cannot hold the GIL or MPICH's lock for long while
        preempted, as a niced thread did (Linux schedules threads separately)."""
        if self.settings.background_policy != "batch":
            return
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
        except (AttributeError, OSError) as exc:
            self._say_once("policy", f"cannot use SCHED_BATCH for background threads here ({exc}); they run as normal")

    def _start_writing_thread(self) -> None:
        """(persist and writer threads) Priority first, then the O_DIRECT bounce buffer."""
        self._background_scheduling()
        nice = self.settings.persist_nice
        if nice and threading.current_thread() is not threading.main_thread():
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except (AttributeError, OSError) as exc:
                self._say_once("nice", f"cannot lower the persist thread's priority here ({exc}); it runs at "
                                       "normal priority")
        if self.settings.direct_io and direct_io.O_DIRECT:
            direct_io.reserve_bounce()

    def _say_once(self, key: str, message: str) -> None:
        if self.log and key not in self._warned:
            self.log.info(message)
            self._warned.add(key)

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

    def levels_due(self, snapshot: Snapshot) -> tuple:
        if snapshot.levels is not None:
            return tuple(level for level in self.levels if level.name in snapshot.levels)
        names = levels_due(tuple(level.name for level in self.levels), snapshot.ordinal, snapshot.final,
                           self.settings.every)
        return tuple(level for level in self.levels if level.name in names)

    def persist(self, snapshot: Snapshot, report: PersistReport, started: float) -> None:
        """(all ranks) The levels due, in data-flow order, each agreed; then retention."""
        step = snapshot.step
        due = self.levels_due(snapshot)
        if not due:
            return
        where = due[0]
        image = self._stage(step, "shard layout", lambda: plan_shard(
            step, self.rank, self.world_size, snapshot.pieces, self.arrays.shard_extra,
            str(where.shard_path(step))), phase="layout")
        shard_infos = self._share_shard_infos(image.size, image.checksums, step)
        version = VersionImage(step, self.world_size, shard_infos.sizes,
                               functools.cache(lambda: image.copy_into(self.arrays.shard_bytes)), image,
                               version_bytes=shard_infos.version_bytes)
        names = tuple(level.name for level in due)
        node_local = [level for level in due if level.node_local]
        global_due = [level for level in due if not level.node_local]
        node_local_failure, lacking = None, {}
        if node_local:
            room = _RoomOnce(lambda: self.room.on_node_local(self.comm, version, self.node_local_label,
                                                            self.flush.flushing if self.flush else None))
            try:
                manifest, lacking = self._once_more_after_making_room(
                    lambda: self._persist_node_local(snapshot, version, node_local, shard_infos, names, report,
                                                     started, room), room)
            except CheckpointError as exc:
                if not is_storage_failure(exc):
                    raise  # memory, a codec, a file in the way: not for degrading
                # Degrade, do not stop: the version goes to the global levels instead (all of
                # them, due or not: nothing else holds it), from the snapshot, as L1's file is gone.
                node_local_failure = exc
                report.failed["node-local"] = str(exc)
                if self.flush is not None:
                    self.flush.wait()  # L4 takes this version here, not beside a copy of its own
                global_due, node_local = list(self.global_levels), []
        held_by = [self._held_despite(node_local, lacking)] if lacking else [level.label for level in node_local]
        if self.flush is not None and node_local and not lacking:
            if snapshot.final:
                self.flush.copy_now(step, manifest, report, started)
            else:
                self.flush.offer(self.comm, step, manifest, report, started, due=bool(global_due))
        else:
            self._persist_global_here(snapshot, version, shard_infos, node_local, global_due, bool(lacking), held_by,
                                      report, started)
        self._tell_node_local_health(step, node_local_failure, lacking, node_local, held_by, report)
        self.health.version_held(step, bool(held_by))
        self.apply_retention(step)

    def _persist_global_here(self, snapshot: Snapshot, version: VersionImage, shard_infos: ShardInfos,
                             node_local: list, global_due: list, lacking: bool, held_by: list,
                             report: PersistReport, started: float) -> None:
        """(all ranks) The global levels take the version now, from the snapshot, rather than
        at their own pace from L1's files: there is no copy at its own pace, or the node-local
        levels failed on some ranks, which then have no L1 file to copy from. `held_by` grows
        by the levels that took it."""
        step = snapshot.step
        if lacking and self.flush is not None and (global_due or self.flush.owed):
            # L4 takes this version here, from the snapshot, after the copy in flight.
            self.flush.wait()
            global_due = list(self.global_levels)
        names_now = tuple(dict.fromkeys((*(level.name for level in node_local),
                                         *(level.name for level in global_due))))
        manifest = self.make_manifest(snapshot, shard_infos, names_now) if global_due else None
        took = False
        for level in global_due:
            if self._store_global(level, version, manifest, report, started, tuple(held_by), self.comm):
                held_by.append(level.label)
                took = True
        if global_due and self.flush is not None:
            self.flush.owed = not took
            self._prune_global(step)

    def _tell_node_local_health(self, step: int, failure, lacking: dict, node_local: list, held_by: list,
                                report: PersistReport) -> None:
        """The node-local levels' health after this version: failed everywhere, failed on
        some ranks (`lacking`), or fine."""
        if failure is not None:
            self.health.failed(self.node_local_label, step, failure, tuple(held_by))
        elif lacking:
            report.failed["node-local"] = self._partial_failure(step, lacking)
            self.health.failed(self.node_local_label, step, report.failed["node-local"], tuple(held_by),
                               ranks=sorted(lacking))
        elif self.node_local and node_local:
            self.health.succeeded(self.node_local_label, step)

    def _share_shard_infos(self, size: int, checksums: dict, step: int) -> ShardInfos:
        """(all ranks) What the commit records need of every rank's shard, each rank told only
        what it writes, so no rank receives O(ranks): the checksums of the shards its node-local
        record lists, point to point from those O(group) ranks; all of them at L4's coordinator,
        which writes the record listing every shard and hands every rank the version id and
        total size."""
        send_to, receive_from = self.record_peers
        records = exchange_objects(self.comm, (size, checksums), send_to, receive_from, TAG_RECORDS)
        records[self.rank] = (size, checksums)
        mine = (size, checksums, shard_digest(size, checksums))
        everyone = quiet_gather(self.comm, mine, root=COORDINATOR)
        summary = None
        if everyone is not None:
            records = {rank: (size, checksums) for rank, (size, checksums, _) in enumerate(everyone)}
            summary = (version_id_of(step, self.world_size, [digest for _, _, digest in everyone]),
                       bytes_to_write(size for size, _, _ in everyone))
        version_id, version_bytes = quiet_bcast(self.comm, summary, root=COORDINATOR)
        return ShardInfos(records, version_id, version_bytes)

    @property
    def node_local_label(self) -> str:
        """The node-local levels fail and recover together: one version directory, one commit
        record per rank."""
        return "node-local " + " ".join(level.number for level in self.node_local)

    def _persist_node_local(self, snapshot: Snapshot, version: VersionImage, levels: list, shard_infos,
                            names: tuple, report: PersistReport, started: float, room: "_RoomOnce"):
        """(all ranks) The node-local levels due store the version and commit it together.
        Returns (the commit record, {rank: why} of the ranks whose node could not take its
        part, the same on every rank). A rank whose node failed keeps nothing of the version
        there and commits nothing; the version stands while the others' redundancy (L2, L3)
        still supplies those ranks' shards, else none keeps it (agreed: withdrawn everywhere)."""
        step = version.step
        try:
            lacking = self._store_node_local(version, levels, report, started)
            self._raise_unless_supplied(step, levels, lacking, room)
            manifest = self.make_manifest(snapshot, shard_infos, names)
            self.faults.strike(step, "commit")

            def commit():
                if self.rank not in lacking:
                    self.faults.storage_fault(step, "node-local commit")
                    for level in levels:
                        level.commit(manifest)
            _, failed = agree_per_rank(self.comm, "L1-L3 commit", commit, step=step)
            _note_failures(lacking, failed, "commit record")
            self._raise_unless_supplied(step, levels, lacking, room)
        except CheckpointError as exc:
            self._withdraw(step, levels)
            if is_storage_failure(exc):
                # What the ranks wrote of it goes now, not at the next retention: a full disk
                # is when writes fail. (After any other failure a file may be in the way that
                # no level wrote: it stays for the operator to see.)
                self._prune("node-local", lambda: self._remove_node_local(step))
            raise
        if self.rank in lacking:
            self._withdraw(step, levels)
            self._prune("node-local", lambda: self._remove_node_local(step))
            self.committed_without_me.add(step)
        return manifest, lacking

    def _raise_unless_supplied(self, step: int, levels: list, lacking: dict, room: "_RoomOnce") -> None:
        """(all ranks) The version stands with some ranks' node-local parts missing while the
        redundancy levels due supply those ranks' shards from the others' files, and no level
        that ran out of space can make room to take it whole; else the node-local store fails,
        agreed (a storage failure, which degrades, or makes room and tries once more)."""
        if not lacking:
            return
        lost = frozenset(lacking)
        supplied = frozenset().union(*(level.supplies(lost) for level in levels))
        failure = CheckpointError(self._partial_failure(step, lacking), lacking, collective=True)
        if lost <= supplied and not (out_of_space(failure) and not room.tried and room()):
            return
        raise failure

    def _partial_failure(self, step: int, lacking: dict) -> str:
        first = lacking[min(lacking)]
        who = f"rank(s) {sorted(lacking)}" if len(lacking) < self.world_size else f"all {self.world_size} ranks"
        return f"{self.node_local_label} write of step {step} failed on {who}: {first}"

    def _held_despite(self, levels: list, lacking: dict) -> str:
        """Where a version stands that some ranks' nodes could not take (for the warning)."""
        lost = frozenset(lacking)
        supplying = [level.label for level in levels if level.supplies(lost)]
        return (f"{self.node_local_label} (the shard of rank(s) {sorted(lost)} by {' and '.join(supplying)} "
                "from other nodes)")

    @staticmethod
    def _once_more_after_making_room(attempt: Callable, make_room: Callable[[], bool]):
        """(all ranks) `attempt()`, and once more if it ran out of space on some rank and
        `make_room()` dropped versions (ckpt/room.py); its last error otherwise."""
        try:
            return attempt()
        except CheckpointError as exc:
            if not (is_storage_failure(exc) and out_of_space(exc) and make_room()):
                raise
        return attempt()

    def _remove_node_local(self, step: int) -> None:
        """This rank's files of a version on every node-local level, and what other levels left
        there of it."""
        for level in self.node_local:
            level.remove(step)
        self.node_local[0].remove_strays(step)

    def _store_global(self, level, version: VersionImage, manifest: Manifest, report: PersistReport,
                      started: float, held_by: tuple, comm) -> bool:
        """(all ranks) One global level's store and commit of a version, agreed on `comm`. A
        failure degrades, it does not stop: the version stays on the levels that took it."""
        step = version.step
        report.started_s[level.name] = time.perf_counter() - started

        def store_and_commit() -> int:
            try:
                stored = self._stage(step, level.stage_label, lambda: level.store(version), phase=level.name,
                                     comm=comm)
                self.faults.strike(step, "commit")
                self._stage(step, f"{level.number} commit", lambda: level.commit(manifest),
                            phase="commit", comm=comm)
                return stored
            except CheckpointError:
                self._drop_partial(level, step)
                raise
        try:
            stored = self._once_more_after_making_room(store_and_commit,
                                                       lambda: self.room.on_global(level, version, comm))
        except CheckpointError as exc:
            if not is_storage_failure(exc):
                raise
            report.failed[level.name] = str(exc)
            self.health.failed(level.label, step, exc, held_by)
            return False
        self._mark(report, step, level.name, started, stored)
        self.health.succeeded(level.label, step)
        return True

    def _copy_to_global(self, step: int, manifest: Manifest, report: PersistReport, started: float, comm) -> bool:
        """(all ranks; L4's thread, or the persist thread for the final version) Copy a version
        committed on the node-local levels to the global ones from this rank's L1 file, then
        their retention. True when some global level took it."""
        # A job that took the run over owns its L4 now (only rank 0 holds the lease: agreed).
        lost = self.lease is not None and self.lease.lost_to is not None
        raise_if_any_failed(comm, "copy to L4", str(self.lease.lost_error()) if lost else None, step=step)
        source = self.node_local[0]
        sizes = manifest.shard_sizes()
        # Mapped, not read: the file's pages come from the page cache (L1 just wrote them)
        # without a second shard-sized buffer beside the snapshot's.
        # The coordinator's record lists every shard: it is the rank that measures L4's room.
        version = VersionImage(step, self.world_size, sizes, functools.cache(
            lambda: map_readonly(source.shard_path(step))),
            version_bytes=bytes_to_write(sizes))
        held_by = tuple(level.label for level in self.node_local if level.name in manifest.levels)
        took = False
        for level in self.global_levels:
            on_level = dataclasses.replace(manifest, levels=tuple(dict.fromkeys((*manifest.levels, level.name))))
            took |= self._store_global(level, version, on_level, report, started, held_by, comm)
        if took:
            self._prune_global(step)
        return took

    def _drop_partial(self, level, step: int) -> None:
        """(all ranks) What a failed global level wrote of a version goes (its coordinator
        deletes the directory once every rank's attempt is over: the failure was agreed)."""
        try:
            level.remove(step)
        except OSError as exc:
            if self.log:
                self.log.warning(f"cannot remove the partial {level.label} copy of step {step}: "
                                 f"{exc.strerror or exc}; it has no commit record, so no restart loads it")

    def _store_node_local(self, version: VersionImage, levels: list, report: PersistReport,
                          started: float) -> dict:
        """(all ranks) The first node-local level (L1's file) stores on the writer thread while
        the others send and encode the same bytes; with one write at a time it finishes first.
        Returns {rank: why} of the ranks whose node's storage failed in some level (each rank
        goes on with the others' transfers: they need its bytes); any other failure raises."""
        step = version.step
        lacking: dict = {}
        first, rest = levels[0], levels[1:]
        report.started_s[first.name] = time.perf_counter() - started
        writing = self._start_background_store(first, version)
        try:
            if self.settings.one_write_at_a_time:
                self._finish_background_store(first, step, writing, report, started, lacking)
            for level in rest:
                report.started_s[level.name] = time.perf_counter() - started
                stored, failed = self._store_per_rank(step, level, version)
                _note_failures(lacking, failed, level.stage_label)
                if self.rank not in failed:
                    self._mark(report, step, level.name, started, stored)
            if not self.settings.one_write_at_a_time:
                self._finish_background_store(first, step, writing, report, started, lacking)
        finally:
            writing.done.wait()  # never leave while the writer still reads the snapshot
        return lacking

    def _store_per_rank(self, step: int, level, version: VersionImage) -> tuple[int | None, dict]:
        """(all ranks) One node-local level's store, its storage failures by rank. An injected
        fault of a collective level strikes after its transfers, where it writes its file,
        as a full or read-only directory would: its peers never wait for it."""
        self.faults.strike(step, level.name)

        def store():
            if not level.collective:
                self.faults.storage_fault(step, level.name)
            stored = level.store(version)
            if level.collective:
                self.faults.storage_fault(step, level.name)
            return stored
        return agree_per_rank(self.comm, level.stage_label, store, step=step)

    def _start_background_store(self, level, version: VersionImage) -> _BackgroundWrite:
        self.faults.strike(version.step, level.name)
        writing = _BackgroundWrite()

        def write():
            cpu_started = time.thread_time()
            try:
                self.faults.storage_fault(version.step, level.name)
                writing.stored = level.store(version)
            except Exception as exc:  # agreed by every rank like any stage's error, never lost
                writing.error = exc
            finally:
                writing.finished_at = time.perf_counter()
                writing.cpu_s = time.thread_time() - cpu_started
                writing.done.set()

        self._writer.submit(write)
        return writing

    def _finish_background_store(self, level, step: int, writing: _BackgroundWrite, report: PersistReport,
                                 started: float, lacking: dict) -> None:
        """(all ranks) Wait for the writer thread's store and agree on it."""
        writing.done.wait()
        report.cpu_s["l1_write"] = writing.cpu_s

        def outcome():
            if writing.error is not None:
                raise writing.error
        _, failed = agree_per_rank(self.comm, level.stage_label, outcome, step=step)
        _note_failures(lacking, failed, level.stage_label)
        if self.rank not in failed:
            self._mark(report, step, level.name, started, writing.stored, finished=writing.finished_at)

    def _stage(self, step: int, label: str, action, phase: str, comm=None):
        """(all ranks) One stage of the persist; a failure on any rank fails it on all."""
        if phase != "commit":
            self.faults.strike(step, phase)

        def act():
            self.faults.storage_fault(step, phase)
            return action()
        return agree(self.comm if comm is None else comm, label, act, step=step)

    def _withdraw(self, step: int, levels: list) -> None:
        """A version some rank could not commit is committed nowhere: the ranks that did drop
        their record, or their retention would count it and delete an older complete one."""
        for level in levels:
            try:
                level.withdraw(step)
            except OSError as exc:
                if self.log:
                    self.log.warning(f"step {step}: cannot withdraw this rank's commit record of the failed "
                                     f"version: {exc.strerror or exc}; a restart will not use it, as other ranks "
                                     "lack theirs")
                return

    def _mark(self, report: PersistReport, step: int, level: str, started: float, nbytes: int,
              finished: float | None = None) -> None:
        report.durable_s[level] = (finished or time.perf_counter()) - started
        self.bytes_stored[level] = self.bytes_stored.get(level, 0) + int(nbytes)
        if self.log:
            self.log.info(f"step {step}: {level} done after {report.durable_s[level]:.3f} s "
                          f"({nbytes} bytes stored by this rank)")

    # -- retention ------------------------------------------------------------------------
    def apply_retention(self, newest: int) -> None:
        """Delete old whole versions; uncommitted leftovers older than `newest` go too. The
        node-local levels share version directories, so they keep and drop versions together,
        decided by the first (L1's commit records); each deletes its own files."""
        if self.node_local:
            first = self.node_local[0]

            def prune_node_local():
                # Every node-local level's uncommitted files, and those of levels this job does
                # not run, in one scan of the directory.
                steps = self._deletable(first, self.settings.keep["node_local"], newest, set(first.stray_steps()),
                                        pin_redundant=True, pinned={self.flush.flushing} if self.flush else (),
                                        also_committed=self.committed_without_me)
                for step in steps:
                    self._remove_node_local(step)
                    self.committed_without_me.discard(step)
            self._prune("node-local", prune_node_local)
        if self.flush is None:  # else L4's thread prunes after each copy: it alone writes there
            self._prune_global(newest)

    def _prune_global(self, newest: int) -> None:
        for level in self.global_levels:
            if level.prunes_here:
                self._prune(level.label, lambda level=level: [level.remove(step) for step in self._deletable(
                    level, self.settings.keep["global"], newest)])

    def _prune(self, where: str, prune) -> None:
        """Retention on one rank's part of the storage. Its failure (a directory gone, an I/O
        error) loses nothing and stops nothing, and on one rank alone it must not fail a
        collective path: logged, and retention runs again at the next checkpoint."""
        try:
            prune()
        except (OSError, HpcckptError) as exc:
            if self.log:
                self.log.warning(f"retention on {where} storage failed: {exc}; older versions stay until the next "
                                 "checkpoint's retention")

    def _deletable(self, level, keep: int, newest: int, leftovers: set[int] | None = None,
                   pin_redundant: bool = False, pinned=(), also_committed=()) -> list[int]:
        committed = sorted(set(level.committed_steps()) | set(also_committed))
        manifests: dict[int, Manifest | None] = {}

        def manifest(step: int) -> Manifest | None:  # each commit record read once per retention
            if step not in manifests:  # None: none here (committed_without_me), or damaged
                manifests[step] = self.records.manifest(level, step)
            return manifests[step]

        if not level.node_local:  # its one record per version: a damaged one sets the version aside
            committed = [s for s in committed if manifest(s) is not None or (level.name, s) not in self.records.aside]

        metrics = {}
        if self.settings.keep_best:
            metrics = {s: manifest(s).metrics for s in committed if manifest(s) is not None}
        pinned = {step for step in pinned if step is not None}
        redundant = {lv.name for lv in self.node_local[1:]}
        if pin_redundant and redundant:
            levels_by_step: dict[int, tuple] = {}
            for step in sorted(committed, reverse=True):  # newest first, read until each is found
                levels_by_step[step] = manifest(step).levels if manifest(step) is not None else ()
                if redundant <= {name for names in levels_by_step.values() for name in names}:
                    break
            pinned |= newest_redundant_versions(levels_by_step, redundant)
        if leftovers is None:
            leftovers = set(level.uncommitted_steps())
        return versions_to_delete(committed, sorted(leftovers), newest, keep, metrics, self.settings.keep_best, pinned)

    # -- drain ----------------------------------------------------------------------------
    def drain(self, source, target) -> list[int]:
        """(all ranks) Copy to the global level `target` the committed versions of `source`
        (L1) that its retention would keep but that skipped it; each copy is verified against
        its checksums before its commit record is written. Returns the steps copied."""
        # Versions every rank holds with a readable record (a damaged one is not copied from).
        readable = {step: m for step in source.committed_steps() if (m := self.records.manifest(source, step))}
        common = fold_at_root(self.comm, list(readable), lambda held: set.intersection(*map(set, held)))
        # L4's intact versions and their metrics, read once by rank 0 (damaged ones set aside).
        on_target_metrics = self.comm.bcast(
            {step: m.metrics for step in target.committed_steps() if (m := self.records.manifest(target, step))}
            if self.rank == 0 else None, root=0)
        on_target = set(on_target_metrics)
        manifests = {}
        for step in sorted(common - on_target - self.room.dropped.get(target.name, set())):
            if readable[step].world_size == self.world_size:
                manifests[step] = readable[step]
        metrics = {step: m.metrics for step, m in manifests.items()}
        keep, keep_best = self.settings.keep["global"], self.settings.keep_best
        if keep_best:
            metrics.update(on_target_metrics)
        dropped = set(steps_to_delete(sorted(set(manifests) | on_target), keep, metrics, keep_best))
        copied = [step for step in sorted(manifests) if step not in dropped]
        for step in copied:
            # L4's one record lists every shard; each rank's node-local copy lists its node's part.
            gathered = self.comm.gather(manifests[step].shard(self.rank), root=0)
            if self.rank == 0:
                manifests[step] = manifests[step].with_shards(gathered)

            def copy_shard(step=step):
                data = map_readonly(source.shard_path(step))  # from the page cache, not a shard-sized buffer
                target.store(VersionImage(step, self.world_size, (), lambda: data))
                problems = verify_shard(target.shard_path(step))
                if problems:
                    raise CheckpointError(f"{target.number} copy of {source.shard_path(step)}: "
                                          f"{problems[0]}")
            self._stage(step, f"drain to {target.number}", copy_shard, phase=target.name)
            manifest = dataclasses.replace(manifests[step], levels=manifests[step].levels + (target.name,))
            self._stage(step, f"{target.number} commit", lambda: target.commit(manifest), phase="commit")
            if self.log:
                self.log.info(f"drained version {step} from node-local storage to {target.number}",
                              console=True)
        if copied and target.prunes_here:
            for step in self._deletable(target, keep, max(copied)):
                target.remove(step)
        return copied
