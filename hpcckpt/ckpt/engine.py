"""The checkpointer: the library API.

    ckpt = Checkpointer(comm, config)        # (all ranks) also catches the scheduler's stop signals
    ckpt.protect("w", w)                     # NumPy/CuPy array (or a PyTorch tensor), filled in place on restart
    ckpt.register_state("loop", get, set)    # small state: nested dicts/lists/tuples, scalars, small arrays
    ckpt.protect_table("emb", table)         # a KeyedTable: rows placed by id hash, saved whole or as deltas
    ckpt.protect_state_dict("train", sd)     # every tensor of a state dict (DTensors too), the rest as state
    start = ckpt.restart() or 0              # (all ranks) newest version every rank can load
    for step in range(start + 1, last + 1):
        loss = work(step)
        if ckpt.observe(step, loss):           # (all ranks) diverged (NaN, a spike): rewound in process
            continue
        if ckpt.due(step, last=step == last):  # (all ranks) the interval, the last step, or a stop agreed
            ckpt.checkpoint(step, metrics)   # returns once the snapshot is taken
        if ckpt.stopping:                    # a stop asked for (signal, allocation end, run.dir/HALT)
            break
    return ckpt.close()                      # (all ranks) newest version made durable on L4; 0, or 75 after a stop

Or, to overlap the snapshot with the step (what the trainer does):

    if ckpt.planned(step): ckpt.begin_checkpoint(step, copy_in_background=True)
    ...  ckpt.before_update(name); update name in place; ckpt.capture(name)  ...
    if ckpt.due(step): ckpt.checkpoint(step, metrics)  # closes the open snapshot; copies finish behind

Where each part of the flow lives: when to checkpoint and when to stop in ckpt/schedule.py
(ckpt/policy.py the interval, ckpt/stopping.py the stop requests), what checkpoints cost the
run in ckpt/tally.py; the protected arrays and their snapshot in ckpt/snapshot.py (arrays of
other frameworks in ckpt/foreign_arrays.py), the snapshot being filled in ckpt/capture.py,
the commit records in ckpt/commit_record.py; the save behind training (levels due, agreement
per stage, commit, retention) in ckpt/pipeline.py; this run's directories and level stack in
ckpt/job_storage.py; the restore in recovery.py, and a version loaded over another job's
shards written again in ckpt/resume.py. Checkpoint traffic uses its own communicator (a
duplicate), never interleaved with the application's collectives. A failure on any rank
becomes the same CheckpointError on every rank (carrying the failures by rank) at the next
call.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from hpcckpt import recovery
from hpcckpt.ckpt.capture import SnapshotCapture
from hpcckpt.ckpt.commit_record import CommitRecords
from hpcckpt.ckpt.divergence import DivergencePolicy, Rewound
from hpcckpt.ckpt.foreign_arrays import protectable
from hpcckpt.ckpt.job_storage import JobStorage, RunClaim
from hpcckpt.ckpt.library_config import LibraryConfig
from hpcckpt.ckpt.memory_forecast import rank_need, warn_if_short
from hpcckpt.ckpt.pipeline import SavePipeline
from hpcckpt.ckpt.resume import protect_again
from hpcckpt.ckpt.rewind import mark_versions_bad, versions_held
from hpcckpt.ckpt.save_types import PersistReport, PipelineSettings, SaveJob, Snapshot
from hpcckpt.ckpt.schedule import CheckpointSchedule
from hpcckpt.ckpt.snapshot import ENGINE_STATE_KEY, ProtectedArrays
from hpcckpt.ckpt.state_dicts import split_state_dict
from hpcckpt.ckpt.stopping import EXIT_HALTED, HALT_FILE_NAME
from hpcckpt.ckpt.table_chain import TableChain
from hpcckpt.ckpt.tally import CheckpointTally
from hpcckpt.cluster.placement import discover_topology
from hpcckpt.errors import CheckpointError, ConfigError, DivergenceError, StorageError
from hpcckpt.exit_record import record_started
from hpcckpt.faults import NO_FAULTS, current_attempt
from hpcckpt.format import pytree
from hpcckpt.format.layout import Layout
from hpcckpt.format.manifest import record_peers
from hpcckpt.restore.context import JobGeometry, RestoreTargets, RunPlace
from hpcckpt.run.health import non_finite_metrics
from hpcckpt.runlog import RunLog, read_heartbeat

__all__ = ["Checkpointer", "PersistReport", "Snapshot", "ENGINE_STATE_KEY", "EXIT_HALTED"]

# Errors that end a run whatever version it loaded (run/ledger.py: they never mark it).
NOT_THE_VERSIONS_DOING = (StorageError, ConfigError)  # a LeaseError is a ConfigError


class Checkpointer:
    def __init__(self, comm, config, *, topology=None, log=None, faults=NO_FAULTS, read_only: bool = False,
                 catch_signals: bool = True):
        """(all ranks) Collective: claims the run (ckpt/lease.py), checks storage on every rank
        and fails together. `config`: a job config (hpcckpt.load_config), a LibraryConfig or
        a job TOML's path. `log`: a runlog.RunLog; by default the checkpointer keeps one of
        its own (<run.dir>/log/rank<R>.log, rank 0's console lines, <run.dir>/metrics.jsonl).
        `catch_signals`: SIGTERM, SIGUSR1 and SIGUSR2 become stop requests (ckpt/stopping.py)
        until close(). `read_only`: for jobs that only read checkpoints (evaluate), which must
        leave a run as it is: no lease (they may run beside the job that writes it), no
        signals caught, no pruning of the spare files this job could not reuse
        (levels/spares.py)."""
        from mpi4py import MPI

        config = self.config = LibraryConfig.of(config)  # also a JobConfig or a job TOML's path
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise ConfigError("MPI is not running: create the Checkpointer once MPI has started (after your framework "
                              "started it, e.g. at its first grid, or after from mpi4py import MPI; MPI.Init_thread()) "
                              "and close it before MPI_Finalize" if not MPI.Is_finalized() else
                              "MPI was finalized already: create and close the Checkpointer before MPI_Finalize")
        self.comm = comm.Dup()  # checkpoint traffic apart from the application's collectives
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.read_only = read_only
        self._own_log = log is None
        self.log = log if log is not None else RunLog(config.run_dir, self.rank, self.world_size)
        log = self.log
        self.topology = topology or discover_topology(comm, config.simulated_nodes, config.failure_domains,
                                                                config.simulated_domains)
        self.node = self.topology.node_of_rank[self.rank]
        self.faults = faults
        self._closed = False
        record_started(self.comm)  # the job script's start-up watchdog: every rank is through MPI_Init
        self._claim = RunClaim(self.comm, config, JobStorage.pfs_dir_for(config), log, read_only)
        self.run = self._claim.identity
        self.schedule = None
        try:
            self.storage = JobStorage(self.comm, config, self.topology, self.run, log, faults)
            shard_extra = {"node": self.node}  # the shard's extra record (the snapshot's layout depends on it)
            self.arrays = ProtectedArrays(self.comm, config.checkpoint.split_threshold_kb * 1024,
                                          config.checkpoint.gpu_snapshot, shard_extra, log)
            self._ordinal = 0
            self.capture_state = SnapshotCapture(self.arrays)
            records = CommitRecords(self.arrays, self.world_size, self.topology.node_of_rank, self.storage.local_dirs,
                                    self.partner_of, self.groups, self.storage.redundancy.parity, self.run.run_id,
                                    config.recorded, *self._domains_recorded())
            job = SaveJob(log, threaded=MPI.Query_thread() >= MPI.THREAD_MULTIPLE, lease=self._claim.lease,
                          record_peers=record_peers(self.rank, self.partner_of, self.topology.node_of_rank, self.groups))
            self.pipeline = SavePipeline(self.comm, self.storage.levels, PipelineSettings.from_config(config), records,
                                         self.arrays, job)
            self.restored_sources: tuple[str, ...] = ()  # level each rank's shard came from at restart
            self.restore_traffic: tuple = ()  # (bytes read, bytes received) by a repartitioning restart
            self.restart_unconfirmed = None  # the restart ledger until the resumed run proves itself
            self.storage.prepare(read_only)
            self.storage.log_placement()
            own_pace = self.pipeline.flush is not None
            level_specs = tuple((level.name, level.survives_nodes, own_pace and not level.node_local)
                                for level in self.storage.levels)
            self.schedule = CheckpointSchedule(comm, config.checkpoint, end_time=config.end_time,
                                               halt_seconds=config.halt_seconds,
                                               halt_file=Path(config.run_dir) / HALT_FILE_NAME, log=log,
                                               catch_signals=catch_signals and not read_only,
                                               resilience=config.resilience, levels=level_specs)
            self._level_times: dict[str, tuple[float, float]] = {}  # newest (until durable, own writing) by level
            self.tally = CheckpointTally(log)
            self._steps_run = 0  # steps done since the start (or restart), for confirm_after_steps
            self._final_step: int | None = None  # the step due() said is the last (a stop, or last=True)
            self._begin_blocked = (0.0, 0.0)  # begin_checkpoint(): (seconds blocked, of them waiting for a persist)
            self._last_checkpoint: int | None = None
            self._previous_durable: float | None = None  # seconds until the previous checkpoint was durable
            self._rewound_to: int | None = None  # the version the last rewind restored
            self.divergence = DivergencePolicy(config.resilience)
            self.table_chain = TableChain(config.checkpoint.table_full_every)
        except BaseException:
            if self.schedule is not None:
                self.schedule.close()
            self._claim.release()
            raise

    # -- what the rest of the package reads --------------------------------------------------
    @property
    def levels(self) -> tuple:
        """The level stack, in data-flow order."""
        return self.storage.levels

    levels_enabled = property(lambda self: tuple(level.name for level in self.levels))
    pfs_dir = property(lambda self: self.storage.pfs_dir)
    local_dir = property(lambda self: self.storage.local_dir)
    def _domains_recorded(self) -> tuple[tuple, tuple]:
        """(domain of each rank, domain names) for the commit records; empty where every node
        is a domain of its own."""
        if not self.topology.has_domains:
            return (), ()
        return self.topology.domain_of_rank, self.topology.domain_names

    partner_of = property(lambda self: self.storage.partner_of)
    groups = property(lambda self: self.storage.groups)
    bytes_stored = property(lambda self: self.pipeline.bytes_stored)
    last_report = property(lambda self: self.pipeline.last_report)

    @property
    def layout(self) -> Layout:
        return self._ensure_layout()

    @property
    def local_array_names(self) -> tuple[str, ...]:
        return self.arrays.local_array_names

    # -- the library API -----------------------------------------------------------------
    def protect(self, name: str, array, replicated: bool = True, *, global_shape: Sequence[int] | None = None,
                offset: Sequence[int] | None = None, allow_gaps: bool = False) -> None:
        """Protect an array, restored in place: a NumPy or CuPy array, or anything writable
        in place that speaks DLPack or the buffer protocol (a PyTorch tensor or parameter on
        the CPU or a GPU: a view of its memory is kept, no copy, and checked to be the
        tensor's own; a DTensor as its local shard placed by its placements,
        ckpt/dtensors.py). Three kinds:

        replicated (the default): the same on every rank, like data-parallel weights; sharded
            across ranks, restored onto any rank count.
        a block of a global array (`global_shape`, this rank's `offset` in it: integers, or
            the slices of the global array the block is): a domain decomposition; blocks may
            differ in size, must not overlap and must cover the global shape unless `allow_gaps`. A restart onto any rank count or decomposition
            fills each rank's block from the old blocks it overlaps (the blocks protected on
            the new ranks say where); a part no old block held keeps what the array holds.
        per-rank (`replicated=False`): stored whole by its own rank; restart must then use
            the same number of ranks.
        Block arrays are checked across ranks at the first checkpoint or restart, replicated
        ones to be the same on every rank at the first checkpoint: one error (exit 2) on
        every rank names what does not fit."""
        self.arrays.protect(name, protectable(name, array), replicated, global_shape, offset, allow_gaps)

    def protect_state_dict(self, name: str, state_dict) -> tuple[str, ...]:
        """Protect a framework's state dict in one call (ckpt/state_dicts.py): each array
        or tensor in it (DTensors as what they are) as protect() takes it, under
        "<name>/<its path>"; the other values beside them as registered state `name`, read
        at each checkpoint and written back into the dict at a restart. Returns the names of
        the arrays protected."""
        parts = split_state_dict(name, state_dict)
        for array_name, leaf in parts.arrays:
            self.protect(array_name, leaf)
        self.register_state(name, parts.get, parts.set)
        return tuple(array_name for array_name, _ in parts.arrays)

    def protect_table(self, name: str, table) -> None:
        """Protect a keyed table (ckpt/keyed_table.py): this rank's rows of a table whose rows
        live on the rank their id hashes to, and which grows as new ids appear. A version
        stores every rank's rows (whole, or those changed since the version before it, with a
        whole version every checkpoint.table_full_every); a restart onto any rank count hands
        each rank the rows whose id hashes to it, from whatever levels survived."""
        self.arrays.protect_table(name, table)

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None]) -> None:
        """Small state (step, iterator position, RNG states) saved with every version: what
        get() returns, a nested "pytree" of dicts, lists and tuples of None, bool, int, float,
        str, bytes, NumPy scalars and small NumPy arrays (format/pytree.py), is given to set()
        at a restart with its types intact; anything else fails the checkpoint naming it."""
        self.arrays.register_state(name, get, set)

    # -- when: the schedule ----------------------------------------------------------------
    def due(self, step: int, last: bool = False, *, step_seconds: float | None = None) -> bool:
        """(all ranks, once per step, after the step's work) Should `step` be checkpointed
        now? True when the interval says so (checkpoint.every_steps: fixed, "auto" under
        checkpoint.max_overhead, Young/Daly with checkpoint.mtbf_hours), at the `last` step,
        and when the ranks agreed to stop (a stop signal, the allocation's end, a halt file:
        then `stopping` says why, and this checkpoint is the run's final one). The ranks
        decide alike without a blocking collective. The step's time is measured from the
        return of the checkpointer's previous call; `step_seconds` reports it instead."""
        if self.schedule.stopping is not None:
            return self.capture_state.is_open_at(step)
        planned = self.schedule.planned(step, last) or self.capture_state.is_open_at(step)
        stop = self.schedule.step_over(step_seconds, observe=not self.capture_state.is_open_at(step),
                                       checkpointing=planned)
        self.tally.step_over()
        self.log.heartbeat(step)
        self._steps_run += 1
        if self._steps_run == self.config.checkpoint.confirm_after_steps:
            self.confirm_restart()
        if stop is not None or last:
            self._final_step = step
        self.schedule.restart_clock(self.pipeline.persisting)
        return planned or stop is not None

    def planned(self, step: int, last: bool = False) -> bool:
        """Whether the interval puts a checkpoint at `step`, asked before the step (to open
        the snapshot with begin_checkpoint() and capture arrays during it); due(step) after
        the step says the same, or True for a stop. No collective."""
        return self.schedule.stopping is None and self.schedule.planned(step, last)

    @property
    def stopping(self) -> str | None:
        """Why the run stops (agreed by all ranks), or None: leave the loop after the step's
        checkpoint; close() then makes that version durable on L4 and returns EXIT_HALTED."""
        return self.schedule.stopping

    def request_stop(self, reason: str) -> None:
        """Ask for a clean stop from this rank (agreed by all ranks at a later due())."""
        self.schedule.stops.request(reason)

    @property
    def exit_code(self) -> int:
        """What the process should exit with: EXIT_HALTED (75) after a stop, which job
        scripts read as "stopped cleanly, submit again"; else 0."""
        return EXIT_HALTED if self.stopping is not None else 0

    # -- the checkpoint --------------------------------------------------------------------
    def checkpoint(self, step: int, metrics: dict | None = None, final: bool | None = None) -> PersistReport | None:
        """(all ranks) Take a snapshot of `step` and persist it in the background.

        Returns once the snapshot is taken. Raises here if the previous checkpoint failed.
        Returns the report of the previous checkpoint (its durability times), if any.
        A snapshot of `step` opened with begin_checkpoint() is closed here. `final`: the
        run's last version, written to every level; by default, when due() said so.
        `metrics` are kept with the version (keep_best, inspect); one that is a number but not
        finite (a loss that turned NaN) makes the step not checkpointed (said in the log), and
        a finite "loss" vouches for finite floating-point arrays at restore (run/health.py).
        """
        previous = None if self.capture_state.is_open_at(step) else self.begin_checkpoint(step)
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
        self.capture_state.refuse_if_open(step)
        opened = time.perf_counter()
        previous = self._persist_over()
        waited = time.perf_counter() - opened
        self.tally.durable(previous, self._l4_copying)
        if previous is not None and previous.durable_s:
            self._previous_durable = max(previous.durable_s.values())
        self._note_level_times(previous)
        self.confirm_restart()
        self._ensure_layout()
        self.arrays.check_before_snapshot()
        self.faults.strike(step, "snapshot")
        self.capture_state.open(step, copy_in_background and self.pipeline.threaded)
        self._begin_blocked = (time.perf_counter() - opened, waited)
        return previous

    def capture(self, name: str) -> None:
        """Copy this rank's piece of protected array `name` into the open snapshot now (or
        queue the copy, see begin_checkpoint); the array may change afterwards (after
        before_update(name) with background copies). No-op when no snapshot is open or it
        was captured."""
        self.capture_state.capture(name)

    def before_update(self, name: str) -> None:
        """Wait until the snapshot's copy of `name` is taken, if it is queued in the
        background; call before changing a protected array in place. Cheap otherwise."""
        self.capture_state.before_update(name)

    def end_checkpoint(self, metrics: dict | None = None, final: bool | None = None) -> PersistReport:
        """(all ranks) Capture whatever is left, freeze the small state and hand the snapshot
        to the background persist. Returns the (still filling) report of this checkpoint.
        With an adaptive interval its costs are agreed across ranks here (and the first
        checkpoint, which measures them, is waited for until durable)."""
        step = self.capture_state.open_step
        refused = non_finite_metrics(metrics)
        if refused and step is not None:
            self.capture_state.abandon()
            self.log.warning(f"step {step} is not checkpointed: its metrics {', '.join(refused)} are not finite (a "
                             "diverged state is never saved); the newest version stays the one before it")
            self.log.metrics({"event": "checkpoint_refused", "step": step, "metrics": refused})
            return PersistReport(step)
        final = (step == self._final_step) if final is None else final
        in_background = self.capture_state.copies is not None
        self._ordinal += 1
        due = self.schedule.levels_due(self._ordinal, final)
        chain = ()
        if self.arrays.tables:
            node_local = {level.name for level in self.levels.node_local}
            going_to = node_local.intersection(self.pipeline.names_due(self._ordinal, final, due))
            chain = self.table_chain.next(step, going_to, final)
        snapshot, report, started = self.capture_state.close(self._ordinal, metrics or {}, final,
                                                            {"schedule": self.schedule.state(),
                                                             "divergence": self.divergence.check.state()}, chain)
        if due is not None:
            snapshot = dataclasses.replace(snapshot, levels=due)
        self.pipeline.submit(snapshot, report, started, self.capture_state.copies, self.arrays.copy_piece)
        self._last_checkpoint = step
        blocked, waited = self._begin_blocked
        blocked += report.snapshot_s + report.captured_early_s
        self._begin_blocked = (0.0, 0.0)
        self.tally.taken(report, blocked, in_background)
        durable = self._previous_durable
        if self.schedule.profiling:
            self.wait()  # the profiling checkpoint: the first interval accounts for the persist's time
            durable = max(report.durable_s.values()) if report.durable_s else 0.0
            self._note_level_times(report)
        said = self.schedule.checkpoint_taken(step, blocked, waited, durable, self._level_times)
        if said and self.schedule.policy.adaptive:
            self.log.info(said, console=True)
        elif said:
            self.log.warning(said)
        self.schedule.restart_clock(self.pipeline.persisting)
        return report

    def _note_level_times(self, report: PersistReport | None) -> None:
        """Each level's newest (seconds until durable, seconds of its own writing), from a
        finished checkpoint's report and from L4's newest copy at its own pace."""
        flush = self.pipeline.flush
        for seen in (report, flush.last_report if flush is not None else None):
            for name, durable in (seen.durable_s.items() if seen is not None else ()):
                self._level_times[name] = (durable, durable - seen.started_s.get(name, 0.0))

    @property
    def persisting(self) -> bool:
        """A checkpoint's copies or persist are running in the background right now."""
        return self.pipeline.persisting

    def wait(self) -> PersistReport | None:
        """(all ranks) Block until the checkpoint in flight is durable, on L4 too when L4 copies
        at its own pace (storage.pfs_async); raise if it failed."""
        report = self._finish_in_flight()
        self.tally.durable(report)
        if self.schedule is not None:
            self.schedule.restart_clock(False)
        return report

    def close(self, confirm: bool | None = None, drain: bool | None = None) -> int:
        """(all ranks) End checkpointing: wait for what is in flight and, after a clean run,
        leave the newest committed version durable on L4 (drain(): the node-local versions
        L4's retention keeps, copied and verified), log what checkpoints cost the run, and
        release the communicator and the run. Returns the exit code for the process: 0, or
        EXIT_HALTED (75) when the run stopped on request (`stopping`).

        Clean means no exception is being handled where close() is called (sys.exc_info);
        a caller inside an `except` block that recovered passes confirm=True, one that knows
        the run went wrong confirm=False (nothing is copied to L4 then, as after an
        exception). A clean close also confirms a restart: a resumed run that had nothing
        left to do, or stopped before its next checkpoint, did not crash on the version it
        loaded, and must not get it marked failed by the next restart. `drain`: False keeps
        the newest version where it is (node-local only, if L4 skipped it); True copies even
        when not clean."""
        if self._closed:
            return self.exit_code
        self._closed = True
        in_flight = sys.exc_info()[1]
        clean = confirm if confirm is not None else in_flight is None
        drain = clean if drain is None else drain
        self.capture_state.abandon()
        if confirm is None and isinstance(in_flight, NOT_THE_VERSIONS_DOING):
            self.confirm_restart()  # storage, settings or another job: the version loaded is not to blame
        try:
            self.tally.durable(self._finish_in_flight())
            if clean:
                self.confirm_restart()
            if drain and not self.read_only:
                self.drain()
            if clean and not self.read_only:
                self.tally.summarise(self.comm, self.bytes_stored, self.levels_enabled, self.pipeline.flush)
            if self.stopping is not None and clean:
                self._report_stop(drained=drain)
        finally:
            self.pipeline.stop()
            self.storage.close()
            self.schedule.close()
            self.arrays.copy_groups.close()
            if self.comm is not None:
                self.comm.Free()
                self.comm = None
            self._claim.release()
            if self._own_log:
                self.log.close()
        return self.exit_code

    def _l4_copying(self, step: int) -> bool:
        flush = self.pipeline.flush
        return flush is not None and flush.flushing == step

    def _report_stop(self, drained: bool) -> None:
        step = self._last_checkpoint
        if step != self._final_step:
            where = (f"no checkpoint was taken at the stop (due() said one was due), so this run resumes from "
                     f"{'version ' + str(step) if step is not None else 'its newest earlier version'}")
        elif self.levels.global_levels and drained:
            where = f"its final checkpoint (step {step}) is durable on the PFS ({self.pfs_dir})"
        else:
            where = (f"its final checkpoint (step {step}) is on node-local storage only (the PFS level is "
                     f"{'not drained' if self.levels.global_levels else 'off'}), so it survives only on these "
                     "nodes")
        self.log.info(f"stopped cleanly after step {self._final_step}: {self.stopping}; {where}; run the job "
                      "again to continue", console=True)
        self.log.metrics({"event": "halted", "step": self._final_step, "reason": self.stopping})
        removed = self.schedule.stops.consume_halt_file()
        if removed:
            self.log.info(f"removed the halt file {removed}: the next job of this run goes on", console=True)

    def confirm_restart(self) -> None:
        """(all ranks) The resumed run works: the version it restarted from is good. Called
        after checkpoint.confirm_after_steps steps (counted by due()), at the next checkpoint
        and at a clean close(). Until then a crash marks that version failed (see run/ledger.py)."""
        ledger, self.restart_unconfirmed = self.restart_unconfirmed, None
        if ledger is not None and self.rank == 0:
            ledger.confirm()

    def drain(self) -> list[int]:
        """(all ranks) Before node-local storage goes away with the allocation: copy to L4 the
        committed node-local versions that L4's retention would keep (the newest keep_pfs, the
        best by keep_best) but that skipped L4 (storage.pfs_every). Returns the steps copied;
        each copy is verified against its checksums before its manifest is written. close()
        calls it after a clean run."""
        self._finish_in_flight()
        landing = self.levels.landing
        if landing is None or not self.levels.global_levels:
            return []
        try:
            return [step for target in self.levels.global_levels for step in self.pipeline.drain(landing, target)]
        except CheckpointError as exc:
            # The node-local versions are intact; they go with the allocation, so this is the
            # job's to retry (exit 3) while they are still there, once the PFS takes writes.
            error = StorageError(f"the end-of-run copy to L4 failed: {exc}; the newest versions are on node-local "
                                 "storage only. Free space on the PFS (or fix it) and run the job again before the "
                                 "allocation ends: it resumes from node-local storage and copies them",
                                 collective=True)
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
        self.arrays.share_block_copies()
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
        return self._load(mode, step, rewinding=False)

    def _load(self, mode: str, step: int | None, rewinding: bool) -> int | None:
        """(all ranks) restart()'s work; a rewind (in process) reports no restart: nothing
        crashed, and the work it costs is counted as a rewind."""
        self._finish_in_flight()
        resuming = step is None and not self.read_only  # evaluating a chosen version confirms nothing
        reached_before = read_heartbeat(self.config.run_dir) if resuming and self.rank == 0 and not rewinding \
            else None
        result = recovery.restore(self._restore_context(), mode, step)
        if result is not None:
            self.arrays.share_block_copies()
            self.restored_sources = result.sources
            self.restore_traffic = result.traffic
            if resuming:
                self.restart_unconfirmed = result.unconfirmed
                if result.protect_again:
                    self._protect_again(result)
        restored = result.step if result is not None else None
        if result is not None:
            self.table_chain.reset()  # a chain never spans a restore: the next version's tables go whole
        if resuming:
            if not rewinding:
                self._report_restart(restored, reached_before)
            said = self.schedule.begin(restored)
            if said:
                self.log.info(said, console=True)
            self.tally.restart_clock()
            self.schedule.restart_clock(self.pipeline.persisting)
        return restored

    def observe(self, step: int, loss: float, finite: bool = True) -> Rewound | None:
        """(all ranks, after the step's work, before due(); `loss` the same on every rank, an
        allreduced value) Whether step `step` diverged: its loss not finite, `finite` false
        (the application's own word, e.g. its gradients), or a spike above
        resilience.divergence_factor times the recent median (ckpt/divergence.py). A healthy
        step returns None. One that diverged is never checkpointed: with
        resilience.rewind_on_divergence the run is rewound in process (rewind()) and a Rewound
        says to which version and which steps' inputs to skip when the replay reaches them;
        otherwise, or past resilience.max_rewinds in resilience.rewind_window_steps, a
        DivergenceError (exit 2)."""
        reason = self.divergence.check.verdict(step, loss, finite)
        if reason is None:
            return None
        self.divergence.admit(step, reason)
        rewound = self.divergence.rewound(step, self.rewind(step, reason), reason)
        self.log.metrics({"event": "diverged", "step": step, "rewound_to": rewound.step,
                          "skipping": rewound.skip_count, "reason": reason})
        return rewound

    def mark_bad(self, step: int, reason: str) -> None:
        """(all ranks) Version `step` is bad (a diverged state, a wrong result): no restart or
        rewind loads it again; `reason` is kept in the restart ledger (<run.dir>/restarts.json)."""
        mark_versions_bad(self.comm, self.config.run_dir, [step], reason)
        self.table_chain.reset()  # no later version's tables may build on it
        self.log.warning(f"version {step} marked bad: {reason}")

    def rewind(self, before: int, reason: str) -> int:
        """(all ranks) Go back in process, without a relaunch: the snapshot open for the step
        that went wrong is dropped (never taken), every version from step `before` on is
        marked bad, and the newest older version is restored by the restart's own path (any
        level that holds it, checked). When the run diverges again from the version the last
        rewind restored, before any newer one was taken, that version is to blame too: it is
        marked bad and the rewind goes further back. Returns the step restored; raises
        DivergenceError (exit 2) when no older version is left."""
        self.capture_state.abandon()
        self._finish_in_flight()
        held = versions_held(self.comm, self.levels)
        bad = [step for step in held if step >= before]
        older = [step for step in held if step < before]
        again = bool(older) and older[-1] == self._rewound_to
        if again:
            bad.append(older.pop())
        if bad:
            mark_versions_bad(self.comm, self.config.run_dir, sorted(bad), f"the run was rewound past it: {reason}")
        if not older:
            raise DivergenceError(f"the run diverged ({reason}) and no version before step {before} is left to "
                                  f"rewind to{' (the run diverged again from version ' + str(bad[-1]) + ')' if again else ''}"
                                  "; look at the data and learning rate, and start again from an earlier run's "
                                  "version (--init-from) or from scratch", collective=True)
        restored = self._load("require", None, rewinding=True)
        self._rewound_to = restored
        self.log.warning(f"rewound from step {before} to version {restored}: {reason}"
                         + (f"; version(s) {sorted(bad)} marked bad" if bad else "")
                         + (f" (the run diverged again from version {bad[-1]} since the last rewind)" if again else ""))
        self.log.metrics({"event": "rewind", "from_step": before, "step": restored, "reason": reason,
                          "marked_bad": sorted(bad)})
        return restored

    def _report_restart(self, restored: int | None, reached_before) -> None:
        """Where each rank's shard came from (each old rank's, when the version was written by
        another rank count) and how much work the failure cost, for metrics.jsonl and
        `hpcckpt report`."""
        record = {"event": "restart", "attempt": current_attempt(), "step": restored or 0,
                  "sources": list(self.restored_sources), "ranks": self.world_size}
        if reached_before is not None:
            reached, _ = reached_before
            record["reached_before"] = reached
            record["lost_steps"] = max(0, reached - (restored or 0))
            if record["lost_steps"] and restored is not None:
                self.log.info(f"the previous run had reached step {reached}: {record['lost_steps']} step(s) are done "
                              "again", console=True)
        self.log.metrics(record)

    def _protect_again(self, result: recovery.RestoreResult) -> None:
        def write(levels: tuple) -> None:
            snapshot = self.arrays.restored_snapshot(result.step, self._ordinal, result.state, result.metrics, levels)
            self.pipeline.persist(snapshot, PersistReport(result.step), time.perf_counter())
        protect_again(result, write, lambda which: recovery.clear_old_geometry(self._restore_context(), which),
                      self.restart_unconfirmed, self.rank, self.log,
                      f"{self.world_size} rank(s) on {self.topology.node_count} node(s)")

    def _apply_restored_state(self, state: dict) -> None:
        for name, (_, setter) in self.arrays.states.items():
            if name in state:
                setter(pytree.decode(state[name]))
        engine = state.get(ENGINE_STATE_KEY, {})
        self._ordinal = int(engine.get("ordinal", 0))
        if "schedule" in engine:  # the interval's profile: a restart does not profile again
            self.schedule.load_state(engine["schedule"])
        self.divergence.check.load_state(engine.get("divergence", {}))

    # -- internals -----------------------------------------------------------------------
    def _ensure_layout(self) -> Layout:
        """(all ranks, the first time) The layout and the snapshot buffers; then whether the
        nodes have the host memory that checkpointing will take (ckpt/memory_forecast.py)."""
        if self.arrays.layout is not None:
            return self.arrays.layout
        layout = self.arrays.ensure_layout()
        need = rank_need(self.arrays.snapshot_bytes, self.levels, self.config.checkpoint.chunk_bytes)
        warn_if_short(self.comm, self.node, need, self.log)
        return layout

    def _restore_context(self) -> recovery.RestoreContext:
        layout = self._ensure_layout()
        self.arrays.check_memory()
        return recovery.RestoreContext(
            job=JobGeometry(self.comm, self.rank, self.world_size, self.node, self.topology, layout,
                            self.local_array_names),
            levels=self.levels,
            targets=RestoreTargets(dict(self.arrays.buffers), {name: p.array for name, p in self.arrays.arrays.items()},
                                   self._apply_restored_state, dict(self.arrays.tables)),
            run=RunPlace(self.run.run_id, self.config.recorded, self.config.run_dir, self.pfs_dir, self.local_dir),
            log=self.log, faults=self.faults, chunk_bytes=self.config.checkpoint.chunk_bytes,
            verify_finite=self.config.checkpoint.verify_finite)

    def _persist_over(self) -> PersistReport | None:
        """The checkpoint in flight over; its tables' rows are safe where some level holds it,
        and count as changed again where none could (or it failed)."""
        try:
            report = self.pipeline.finish_in_flight()
        except BaseException:
            self.table_chain.settle(False)
            self.arrays.settle_tables(False)
            raise
        if report is not None:
            self.table_chain.settle(report.held)
            self.arrays.settle_tables(report.held)
        return report

    def _finish_in_flight(self) -> PersistReport | None:
        """The checkpoint in flight and the copy to L4 running at its own pace, both over."""
        self.capture_state.copies_done()
        report = self._persist_over()
        self.pipeline.wait_for_global_levels()
        return report
