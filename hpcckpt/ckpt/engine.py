"""The checkpointer: the library API.

    ckpt = Checkpointer(comm, config)        # (all ranks)
    ckpt.protect("w", w)                     # NumPy or CuPy array, filled in place on restart
    ckpt.register_state("loop", get, set)    # small JSON-able state
    start = ckpt.restart() or 0              # (all ranks) newest version every rank can load
    ckpt.checkpoint(step, metrics)           # (all ranks) returns once the snapshot is taken
    ckpt.close()                             # (all ranks) drains what is in flight

Or, to overlap the snapshot with the step (what the trainer does):

    ckpt.begin_checkpoint(step, copy_in_background=True)
    ...  ckpt.before_update(name); update name in place; ckpt.capture(name)  ...
    ckpt.end_checkpoint(metrics)             # returns at once; copies finish behind the step

Where each part of the flow lives: the protected arrays and their snapshot in
ckpt/snapshot.py; the save behind training (levels due, agreement per stage, commit,
retention) in ckpt/pipeline.py; this run's directories and level stack in
ckpt/job_storage.py; the restore in recovery.py. Checkpoint traffic uses its own
communicator (a duplicate), never interleaved with the application's collectives. A failure
on any rank becomes the same CheckpointError on every rank (carrying the failures by rank)
at the next call.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from hpcckpt import recovery
from hpcckpt.ckpt.job_storage import JobStorage, RunClaim
from hpcckpt.ckpt.library_config import LibraryConfig
from hpcckpt.ckpt.pipeline import BackgroundCopies, PersistReport, PipelineSettings, SavePipeline, Snapshot
from hpcckpt.ckpt.snapshot import ENGINE_STATE_KEY, ProtectedArrays
from hpcckpt.cluster.placement import discover_topology
from hpcckpt.errors import CheckpointError, StorageError
from hpcckpt.faults import NO_FAULTS
from hpcckpt.format.layout import Layout
from hpcckpt.format.manifest import Manifest, ShardRecord, record_peers

__all__ = ["Checkpointer", "PersistReport", "Snapshot", "ENGINE_STATE_KEY"]


@dataclass
class _PendingSnapshot:
    step: int
    opened: float
    captured: set = field(default_factory=set)
    capture_s: float = 0.0


class Checkpointer:
    def __init__(self, comm, config, *, topology=None, log=None, faults=NO_FAULTS, read_only: bool = False):
        """(all ranks) Collective: claims the run (ckpt/lease.py), checks storage on every rank
        and fails together. `read_only`: for jobs that only read checkpoints (evaluate), which
        must leave a run as it is: no lease (they may run beside the job that writes it) and
        no pruning of the spare files this job could not reuse (levels/spares.py)."""
        from mpi4py import MPI

        config = self.config = LibraryConfig.of(config)  # also a JobConfig or a job TOML's path
        self.comm = comm.Dup()  # checkpoint traffic apart from the application's collectives
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.topology = topology or discover_topology(comm, config.simulated_nodes)
        self.node = self.topology.node_of_rank[self.rank]
        self.log = log
        self.faults = faults
        self._claim = RunClaim(self.comm, config, JobStorage.pfs_dir_for(config), log, read_only)
        self.run = self._claim.identity
        try:
            self.storage = JobStorage(self.comm, config, self.topology, self.run, log)
            shard_extra = {"node": self.node}  # the shard's extra record (the snapshot's layout depends on it)
            self.arrays = ProtectedArrays(self.rank, self.world_size, config.checkpoint.split_threshold_kb * 1024,
                                          config.checkpoint.gpu_snapshot, shard_extra, log)
            self._ordinal = 0
            self._pending: _PendingSnapshot | None = None
            self._copies: BackgroundCopies | None = None
            self.pipeline = SavePipeline(self.comm, self.rank, self.world_size, self.storage.levels,
                                         PipelineSettings.from_config(config), self._manifest, self.arrays, faults, log,
                                         threaded=MPI.Query_thread() >= MPI.THREAD_MULTIPLE, lease=self._claim.lease,
                                         record_peers=record_peers(self.rank, self.partner_of,
                                                                   self.topology.node_of_rank, self.groups))
            self.restored_sources: tuple[str, ...] = ()  # level each rank's shard came from at restart
            self.restore_traffic: tuple = ()  # (bytes read, bytes received) by a repartitioning restart
            self.restart_unconfirmed = None  # the restart ledger until the resumed run proves itself
            self.storage.prepare(read_only)
            self.storage.log_placement()
        except BaseException:
            self._claim.release()
            raise

    # -- what the rest of the package reads --------------------------------------------------
    @property
    def levels(self) -> tuple:
        """The level stack, in data-flow order."""
        return self.storage.levels

    local = property(lambda self: self.levels.local)
    partner = property(lambda self: self.levels.partner)
    erasure = property(lambda self: self.levels.erasure)
    pfs = property(lambda self: self.levels.pfs)
    levels_enabled = property(lambda self: tuple(level.name for level in self.levels))
    pfs_dir = property(lambda self: self.storage.pfs_dir)
    local_dir = property(lambda self: self.storage.local_dir)
    partner_of = property(lambda self: self.storage.partner_of)
    groups = property(lambda self: self.storage.groups)
    bytes_stored = property(lambda self: self.pipeline.bytes_stored)
    last_report = property(lambda self: self.pipeline.last_report)

    @property
    def layout(self) -> Layout:
        return self.arrays.ensure_layout()

    @property
    def local_array_names(self) -> tuple[str, ...]:
        return self.arrays.local_array_names

    # -- the library API -----------------------------------------------------------------
    def protect(self, name: str, array, replicated: bool = True) -> None:
        """Protect a NumPy/CuPy array, restored in place. Replicated arrays (the same on every
        rank, like data-parallel weights) are sharded across ranks; others are stored whole
        by their own rank (restart must then use the same number of ranks)."""
        self.arrays.protect(name, array, replicated)

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None]) -> None:
        """Small JSON-able state (step, iterator position, RNG states) saved with every version."""
        self.arrays.register_state(name, get, set)

    def checkpoint(self, step: int, metrics: dict | None = None, final: bool = False) -> PersistReport | None:
        """(all ranks) Take a snapshot of `step` and persist it in the background.

        Returns once the snapshot is taken. Raises here if the previous checkpoint failed.
        Returns the report of the previous checkpoint (its durability times), if any.
        """
        previous = self.begin_checkpoint(step)
        self.end_checkpoint(metrics, final)
        return previous

    def begin_checkpoint(self, step: int, copy_in_background: bool = False) -> PersistReport | None:
        """(all ranks) Open the snapshot of `step`, to be filled array by array with capture()
        as the application finalises each one (extraction during backprop: a layer's shard is
        copied right after its weight update). Waits for the previous persist, whose buffers
        this snapshot reuses. Returns the previous checkpoint's report.

        copy_in_background: capture() and end_checkpoint() only queue the copies, which the
        copier thread takes once end_checkpoint() returns, while training goes on. The caller
        then promises to call before_update(name) before it next changes a protected array
        in place (until the next begin_checkpoint(), wait() or close()). CuPy arrays are
        copied on a side stream of the GPU as they are captured, ordered after the work
        enqueued before capture(); before_update() then makes the GPU wait for the copy, not
        the host (without copy_in_background, capture() does so at once).
        """
        if self._pending is not None:
            raise CheckpointError(f"begin_checkpoint({step}) while the snapshot of step {self._pending.step} is open")
        previous = self.pipeline.finish_in_flight()
        self.confirm_restart()
        self._ensure_layout()
        self.faults.strike(step, "snapshot")
        self._pending = _PendingSnapshot(step, time.perf_counter())
        self._copies = None
        if copy_in_background and self.pipeline.threaded:
            self._copies = BackgroundCopies(PersistReport(step))
        return previous

    def capture(self, name: str) -> None:
        """Copy this rank's piece of protected array `name` into the open snapshot now (or
        queue the copy, see begin_checkpoint); the array may change afterwards (after
        before_update(name) with background copies). No-op when no snapshot is open or it
        was captured."""
        pending = self._pending
        if pending is None or name in pending.captured:
            return
        if name not in self.arrays.arrays:
            raise CheckpointError(f"capture({name!r}): no protected array has that name; protect() it first")
        started = time.perf_counter()
        self.arrays.take_or_queue(name, self._copies)
        pending.captured.add(name)
        pending.capture_s += time.perf_counter() - started

    def before_update(self, name: str) -> None:
        """Wait until the snapshot's copy of `name` is taken, if it is queued in the
        background; call before changing a protected array in place. Cheap otherwise."""
        copies = self._copies
        if copies is None:
            return
        if self.arrays.device_snapshot is not None and self.arrays.on_gpu(name):
            self.arrays.device_snapshot.guard(name)  # the GPU waits, not the host
            return
        event = copies.taken.get(name)
        if event is None or event.is_set():
            return
        started = time.perf_counter()
        if self._pending is not None:
            # Changed again before end_checkpoint() (e.g. two updates in one step): the copier
            # has not started, so the copy is taken here, with the value it had at capture().
            self.arrays.copy_piece(name)
            event.set()
        else:
            event.wait()
        copies.report.copy_wait_s += time.perf_counter() - started

    def end_checkpoint(self, metrics: dict | None = None, final: bool = False) -> PersistReport:
        """(all ranks) Capture whatever is left, freeze the small state and hand the snapshot
        to the background persist. Returns the (still filling) report of this checkpoint."""
        pending = self._pending
        if pending is None:
            raise CheckpointError("end_checkpoint() without begin_checkpoint()")
        remaining_started = time.perf_counter()
        for name in self.arrays.arrays:
            if name not in pending.captured:
                self.arrays.take_or_queue(name, self._copies)
        self._ordinal += 1
        snapshot = self.arrays.freeze(pending.step, self._ordinal, metrics or {}, final)
        self._pending = None
        copies = self._copies
        report = copies.report if copies is not None else PersistReport(pending.step)
        report.snapshot_s = time.perf_counter() - remaining_started
        report.captured_early_s = pending.capture_s
        self.pipeline.submit(snapshot, report, remaining_started, copies, self.arrays.copy_piece)
        return report

    @property
    def persisting(self) -> bool:
        """A checkpoint's copies or persist are running in the background right now."""
        return self.pipeline.persisting

    def wait(self) -> PersistReport | None:
        """(all ranks) Block until the checkpoint in flight is durable, on L4 too when L4 copies
        at its own pace (storage.pfs_async); raise if it failed."""
        return self._finish_in_flight()

    def close(self, confirm: bool | None = None) -> None:
        """(all ranks) Drain what is in flight and release the communicator. A clean close
        confirms a restart: a resumed run that had nothing left to do, or stopped before its
        next checkpoint, did not crash on the version it loaded, and must not get it marked
        failed by the next restart. `confirm` None: clean means no exception is being handled
        where close() is called (sys.exc_info); a caller inside an `except` block that
        recovered passes True, one that knows the run went wrong passes False."""
        self._pending = None  # a snapshot left open (an exception in the step) is abandoned
        try:
            self._finish_in_flight()
            if confirm if confirm is not None else sys.exc_info()[0] is None:
                self.confirm_restart()
        finally:
            self.pipeline.stop()
            self.storage.close()
            if self.comm is not None:
                self.comm.Free()
                self.comm = None
            self._claim.release()

    def confirm_restart(self) -> None:
        """(all ranks) The resumed run works: the version it restarted from is good. Called at
        the next checkpoint; the trainer calls it earlier, after checkpoint.confirm_after_steps.
        Until then a crash marks that version failed (see ckpt/ledger.py)."""
        ledger, self.restart_unconfirmed = self.restart_unconfirmed, None
        if ledger is not None and self.rank == 0:
            ledger.confirm()

    def drain(self) -> list[int]:
        """(all ranks) Before node-local storage goes away with the allocation: copy to L4 the
        committed node-local versions that L4's retention would keep (the newest keep_pfs, the
        best by keep_best) but that skipped L4 (storage.pfs_every). Returns the steps copied;
        each copy is verified against its checksums before its manifest is written."""
        self._finish_in_flight()
        if self.local is None or self.pfs is None:
            return []
        try:
            return self.pipeline.drain(self.local, self.pfs)
        except CheckpointError as exc:
            # The node-local versions are intact; they go with the allocation, so this is the
            # job's to retry (exit 3) while they are still there, once the PFS takes writes.
            error = StorageError(f"the end-of-run copy to L4 failed: {exc}; the newest versions are on node-local "
                                 "storage only. Free space on the PFS (or fix it) and run the job again before the "
                                 "allocation ends: it resumes from node-local storage and copies them")
            error.collective = True
            raise error from None

    def init_from(self, source: str, select: Callable[[str], bool] | None = None) -> int:
        """(all ranks) Start this new run from another run's state: the protected replicated
        arrays `select(name)` picks (default: all) are loaded from `source` (a run directory,
        its L4 directory, or one L4 version directory), re-partitioned onto this job's ranks
        and verified. The step, data position, RNG and registered state are not taken: the run
        starts at its own step 0, and its versions are its own. Returns the source's step."""
        self._finish_in_flight()
        select = select or (lambda name: True)
        manifest = recovery.init_from(self._restore_context(), source, select)
        if self.log:
            count = sum(1 for t in self.layout.tensors if select(t.name))
            self.log.info(f"initialized {count} array(s) from version {manifest.step} of run "
                          f"{manifest.run_id or '(no run id)'} ({source})")
        return manifest.step

    def restart(self, mode: str = "auto", step: int | None = None) -> int | None:
        """(all ranks) Restore the newest version every rank can load; None when there is none.

        mode: "auto" (resume if a version exists), "require" (fail if none), "never" (start
        fresh; refuses to if versions exist, so nothing is overwritten). `step` restores that
        version instead of the newest.
        """
        self._finish_in_flight()
        result = recovery.restore(self._restore_context(), mode, step)
        if result is None:
            return None
        self.restored_sources = result.sources
        self.restore_traffic = result.traffic
        if step is None:  # a resuming job; evaluating a chosen version confirms nothing
            self.restart_unconfirmed = result.unconfirmed
            if result.protect_again:
                self._protect_again(result)
        return result.step

    def _protect_again(self, result: recovery.RestoreResult) -> None:
        """(all ranks) A version loaded over another job's shards is written again at once to
        this job's levels, under its own geometry, with the state and metrics it was saved
        with: a second node loss right after a shrink is survived. L4 first, where it lacks
        the version: its files cannot collide with the old job's, so the version is durable
        there before the old job's node-local copies of it give way to the new ones (same
        names, never overwritten). Then the old job's older node-local versions go, if its
        rank count or placement was another. A failure here is a warning: the version is
        loaded, and the next checkpoint protects the run."""
        step = result.step
        global_first = tuple(name for name in result.protect_again if name == "pfs")
        node_local = tuple(name for name in result.protect_again if name != "pfs")
        # The version loaded and verified: a crash while writing it is the storage's or a
        # node's, not the version's, and must not get it marked failed (ckpt/ledger.py). The
        # resumed run's first steps are watched again afterwards.
        ledger = self.restart_unconfirmed
        if ledger is not None and self.rank == 0:
            ledger.confirm()
        try:
            if global_first:
                self._write_restored(result, global_first)
            recovery.clear_old_geometry(self._restore_context(), lambda s: s >= step)
            if node_local:
                self._write_restored(result, node_local)
        except CheckpointError as exc:
            if self.log:
                self.log.warning(f"version {step} is restored but could not be written again under this job's "
                                 f"levels: {exc}; the next checkpoint protects the run")
        else:
            if self.log:
                self.log.info(f"version {step} protected again on {', '.join(result.protect_again)} for "
                              f"{self.world_size} rank(s) on {self.topology.node_count} node(s)",
                              console=self.rank == 0)
            if result.geometry_changed:
                recovery.clear_old_geometry(self._restore_context(), lambda s: s < step)
        finally:
            if ledger is not None and self.rank == 0:
                ledger.begin(step)

    def _write_restored(self, result: recovery.RestoreResult, levels: tuple) -> None:
        snapshot = self.arrays.restored_snapshot(result.step, self._ordinal, result.state, result.metrics, levels)
        self.pipeline.persist(snapshot, PersistReport(result.step), time.perf_counter())

    def _apply_restored_state(self, state: dict) -> None:
        for name, (_, setter) in self.arrays.states.items():
            if name in state:
                setter(state[name])
        self._ordinal = int(state.get(ENGINE_STATE_KEY, {}).get("ordinal", 0))

    # -- internals -----------------------------------------------------------------------
    def _ensure_layout(self) -> Layout:
        return self.arrays.ensure_layout()

    def _restore_context(self) -> recovery.RestoreContext:
        layout = self._ensure_layout()
        return recovery.RestoreContext(
            comm=self.comm, rank=self.rank, world_size=self.world_size, node=self.node, topology=self.topology,
            levels=self.levels, partner_of=self.partner_of, groups=self.groups,
            parity=self.storage.redundancy.parity, layout=layout, local_array_names=self.local_array_names,
            buffers=dict(self.arrays.buffers), targets={name: p.array for name, p in self.arrays.arrays.items()},
            run_id=self.run.run_id, settings=self.config.recorded, run_dir=self.config.run_dir,
            pfs_dir=self.pfs_dir, local_dir=self.local_dir, log=self.log, faults=self.faults,
            apply_state=self._apply_restored_state)

    def _finish_in_flight(self) -> PersistReport | None:
        """The checkpoint in flight and the copy to L4 running at its own pace, both over."""
        self._copies = None
        report = self.pipeline.finish_in_flight()
        self.pipeline.wait_for_global_levels()
        return report

    def _manifest(self, snapshot: Snapshot, shard_infos, levels) -> Manifest:
        return Manifest(
            step=snapshot.step,
            world_size=self.world_size,
            layout=self.arrays.layout,
            shards=tuple(ShardRecord(r, size, checksums) for r, (size, checksums) in sorted(shard_infos.records.items())),
            state=snapshot.state,
            metrics=snapshot.metrics,
            node_of_rank=self.topology.node_of_rank,
            local_dirs=self.storage.local_dirs,
            local_arrays=self.local_array_names,
            levels=tuple(levels),
            created=time.time(),
            run_id=self.run.run_id,
            settings=self.config.recorded,
            partner_of=self.partner_of,
            groups=self.groups,
            parity=self.storage.redundancy.parity if self.groups else 0,
            version_id=shard_infos.version_id,
        )
