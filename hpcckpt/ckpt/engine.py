"""The checkpointer: the library API.

    ckpt = Checkpointer(comm, config)        # (all ranks) also catches the scheduler's stop signals
    ckpt.protect("w", w)                     # NumPy/CuPy array (or a PyTorch tensor), filled in place on restart
    ckpt.register_state("loop", get, set)    # small state, the same on every rank (per_rank=True: each rank's own)
    ckpt.protect_table("emb", table)         # a KeyedTable: rows placed by id hash, saved whole or as deltas
    ckpt.protect_state_dict("train", sd)     # every tensor of a state dict (DTensors too), the rest as state
    start = ckpt.restart() or 0              # (all ranks) newest version every rank can load
    for step in range(start + 1, last + 1):
        loss = work(step)                    # its collectives, then (optional, see commit_step)
        ckpt.commit_step(step)               # before the protected arrays change in place
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

The facade stands on two things. What the application handed over outlives any communicator:
the registry of arrays, tables and state (ckpt/registry.py), the divergence history
(schedule/divergence.py) and the tables' chain (save/table_chain.py). What is built from a
communicator is one CommJob (ckpt/job.py: topology, the level stack, the layout and snapshot
buffers, the save pipeline, the schedule and its agreement, the tally), which another
communicator can build again. A checkpoint is taken by ckpt/taking.py (into save/), a
version loaded by ckpt/resuming.py (from restore/). Checkpoint traffic uses its own
communicator, never interleaved with the application's collectives. A failure on any rank
becomes the same CheckpointError on every rank (carrying the failures by rank) at the next call.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from hpcckpt.ckpt.job import CommJob, require_running_mpi
from hpcckpt.ckpt.library_config import LibraryConfig
from hpcckpt.ckpt.registry import ENGINE_STATE_KEY, ArrayRegistry
from hpcckpt.ckpt.resuming import Resuming
from hpcckpt.ckpt.snapshot import frozen_state
from hpcckpt.ckpt.state_dicts import split_state_dict
from hpcckpt.ckpt.step_commits import StepCommits
from hpcckpt.ckpt.taking import CheckpointTaking
from hpcckpt.errors import ConfigError, StorageError
from hpcckpt.faults import NO_FAULTS
from hpcckpt.format.layout import Layout
from hpcckpt.run import in_job_state
from hpcckpt.runlog import RunLog
from hpcckpt.save.save_types import PersistReport, Snapshot
from hpcckpt.save.table_chain import TableChain
from hpcckpt.schedule.divergence import DivergencePolicy, Rewound
from hpcckpt.schedule.stopping import EXIT_HALTED

__all__ = ["Checkpointer", "PersistReport", "Snapshot", "ENGINE_STATE_KEY", "EXIT_HALTED"]

# Errors that end a run whatever version it loaded (run/ledger.py: they never mark it).
NOT_THE_VERSIONS_DOING = (StorageError, ConfigError)  # a LeaseError is a ConfigError

class Checkpointer:
    def __init__(self, comm, config, *, topology=None, log=None, faults=NO_FAULTS, read_only: bool = False,
                 catch_signals: bool = True):
        """(all ranks) Collective: claims the run (run/lease.py), checks storage on every rank
        and fails together. `config`: a job config (hpcckpt.load_config), a LibraryConfig or
        a job TOML's path. `log`: a runlog.RunLog; by default the checkpointer keeps one of
        its own (<run.dir>/log/rank<R>.log, rank 0's console lines, <run.dir>/metrics.jsonl).
        `catch_signals`: SIGTERM, SIGUSR1 and SIGUSR2 become stop requests (schedule/stopping.py)
        until close(). `read_only`: for jobs that only read checkpoints (evaluate), which must
        leave a run as it is: no lease (they may run beside the job that writes it), no
        signals caught, no pruning of the spare files this job could not reuse
        (levels/spares.py). MPI must be running (exit 2 otherwise)."""
        config = self.config = LibraryConfig.of(config)  # also a JobConfig or a job TOML's path
        require_running_mpi()
        self.read_only = read_only
        self._own_log = log is None
        from hpcckpt.cluster.fault_tolerance import in_job_recovery_unavailable

        self._survives_rank_loss = in_job_recovery_unavailable() is None
        self.log = log if log is not None else RunLog(config.run_dir, comm.Get_rank(), comm.Get_size())
        self.faults = faults
        self._closed = False
        self.registry = ArrayRegistry()
        self.divergence = DivergencePolicy(config.resilience)
        self.table_chain = TableChain(config.checkpoint.table_full_every)
        self.commits = StepCommits()
        self.job = CommJob(comm, config, self.registry, self.log, faults, topology=topology, read_only=read_only,
                           catch_signals=catch_signals)
        self.job.arrays.held_elsewhere = self.commits.held_arrays
        self.taking = CheckpointTaking(self.job, self.table_chain, self.divergence, self.log, faults, self._settle,
                                       self.confirm_restart)
        self.resuming = Resuming(self.job, self.table_chain, self.divergence, config, self.log, faults, read_only,
                                 self._all_stored, self.commits)
        in_job_state.opened(self)
        for record in in_job_state.take_unrecorded():  # the process failures this one follows
            self.log.metrics(record)

    # -- what the rest of the package reads --------------------------------------------------
    run = property(lambda self: self.job.run, doc="The run's identity (run/run_identity.py).")
    levels = property(lambda self: self.job.levels, doc="The level stack, in data-flow order.")
    local_dir = property(lambda self: self.job.storage.local_dir)
    arrays = property(lambda self: self.job.arrays, doc="The layout and snapshot buffers (ckpt/snapshot.py).")
    schedule = property(lambda self: self.job.schedule)
    restored_sources = property(lambda self: self.resuming.restored_sources,
                                doc="The level each rank's shard came from at the restart.")
    restore_traffic = property(lambda self: self.resuming.restore_traffic,
                               doc="(bytes read, bytes received) by a repartitioning restart.")
    persisting = property(lambda self: self.job.pipeline.persisting,
                          doc="A checkpoint's copies or persist are running in the background right now.")

    @property
    def layout(self) -> Layout:
        return self.job.ensure_layout()

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
            differ in size, must not overlap and must cover the global shape unless
            `allow_gaps`. A restart onto any rank count or decomposition fills each rank's
            block from the old blocks it overlaps; a part no old block held keeps its values.
        per-rank (`replicated=False`): stored whole by its own rank; restart must then use
            the same number of ranks.
        Block arrays are checked across ranks at the first checkpoint or restart, replicated
        ones to be the same on every rank at the first checkpoint: one error (exit 2) on
        every rank names what does not fit.
        By reference: `array` may be a getter (lambda: W), called at each capture and restore,
        so code that rebinds the name (W = W * s) is followed; a Heat DNDarray is followed
        itself (its local tensor at the offset its split gives). An array protected by value
        that the application no longer holds (its name rebound) fails the next checkpoint."""
        self.registry.protect(name, array, replicated, global_shape, offset, allow_gaps)

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
        self.job.arrays.protect_table(name, table)

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None], *,
                       per_rank: bool = False, reshard: Callable | None = None) -> None:
        """Small state (step, iterator position, RNG states) saved with every version: what
        get() returns, a nested "pytree" of dicts, lists and tuples of None, bool, int, float,
        str, bytes, NumPy scalars and small NumPy arrays (format/pytree.py), is given to set()
        at a restart with its types intact; anything else fails the checkpoint naming it.
        By default it is the same on every rank (checked at the first checkpoint: an error
        names the state and the ranks), stored once and given to every rank. `per_rank`: each
        rank's own (an RNG stream, a rank's data position), stored in its shard on every level
        and given back to the rank that wrote it; onto another rank count `reshard(states,
        rank, size)` returns this rank's state from the old ranks' handed to it ({old rank:
        state}, old rank r to new rank r % size), and without it such a restart is refused
        (ckpt/registered_state.py)."""
        self.registry.register_state(name, get, set, per_rank, reshard)

    # -- when: the schedule ----------------------------------------------------------------
    def commit_step(self, step: int) -> None:
        """(all ranks, once per step: after the step's last collective, before it changes a
        protected array in place) With in-job recovery on (ULFM), a fault-tolerant agreement
        that every rank got here: after a rank's death either every survivor passed it for
        `step` or none did, so each survivor holds the arrays of the step it last called
        due() for, and where everything protected is replicated the survivors go on from that
        step with no version read (restore/from_memory.py; the next restart() does it). The
        promise it makes: the protected arrays change only between commit_step(step) and
        due(step). Returns at once without in-job recovery; optional (without it a recovery
        reads the newest version)."""
        if not self._survives_rank_loss:
            return
        comm = self.job.schedule.comm
        self.commits.commit(step, lambda: comm.Agree(1))

    @property
    def survives_rank_loss(self) -> bool:
        """This process's ranks go on in the job when one dies (run/in_job.py, ULFM)."""
        return self._survives_rank_loss

    def due(self, step: int, last: bool = False, *, step_seconds: float | None = None) -> bool:
        """(all ranks, once per step, after the step's work) Should `step` be checkpointed
        now? True when the interval says so (checkpoint.every_steps: fixed, "auto" under
        checkpoint.max_overhead, Young/Daly with checkpoint.mtbf_hours), at the `last` step,
        and when the ranks agreed to stop (a stop signal, the allocation's end, a halt file:
        then `stopping` says why, and this checkpoint is the run's final one). The ranks
        decide alike without a blocking collective. The step's time is measured from the
        return of the checkpointer's previous call; `step_seconds` reports it instead."""
        schedule, capture = self.job.schedule, self.job.capture
        self.commits.step_done(step, self.registry, self._frozen_state, self.job.rank, self.job.world_size)
        if schedule.stopping is not None:
            return capture.is_open_at(step)
        planned = schedule.planned(step, last) or capture.is_open_at(step)
        stop = schedule.step_over(step_seconds, observe=not capture.is_open_at(step), checkpointing=planned)
        self.job.tally.step_over()
        self.log.heartbeat(step)
        if schedule.step_done(step, stop, last):
            self.confirm_restart()
        schedule.restart_clock(self.job.pipeline.persisting, self.job.pipeline.copying_at_own_pace)
        return planned or stop is not None

    def planned(self, step: int, last: bool = False) -> bool:
        """Whether the interval puts a checkpoint at `step`, asked before the step (to open
        the snapshot with begin_checkpoint() and capture arrays during it); due(step) after
        the step says the same, or True for a stop. No collective."""
        return self.stopping is None and self.job.schedule.planned(step, last)

    @property
    def stopping(self) -> str | None:
        """Why the run stops (agreed by all ranks), or None: leave the loop after the step's
        checkpoint; close() then makes that version durable on L4 and returns EXIT_HALTED."""
        return self.job.schedule.stopping

    def request_stop(self, reason: str) -> None:
        """Ask for a clean stop from this rank (agreed by all ranks at a later due())."""
        self.job.schedule.stops.request(reason)

    @property
    def exit_code(self) -> int:
        """What the process should exit with: EXIT_HALTED (75) after a stop, which job
        scripts read as "stopped cleanly, submit again"; else 0."""
        return EXIT_HALTED if self.stopping is not None else 0

    # -- the checkpoint --------------------------------------------------------------------
    def checkpoint(self, step: int, metrics: dict | None = None, final: bool | None = None) -> PersistReport | None:
        """(all ranks) Take a snapshot of `step` and persist it in the background; returns
        once the snapshot is taken, with the previous checkpoint's report (its durability
        times), if any; raises here if the previous checkpoint failed. A snapshot of `step`
        opened with begin_checkpoint() is closed here. `final`: the run's last version,
        written to every level; by default, when due() said so. `metrics` are kept with the
        version (keep_best, inspect); one that is a number but not finite (a loss that turned
        NaN) makes the step not checkpointed (said in the log), and a finite "loss" vouches
        for finite floating-point arrays at restore (run/health.py)."""
        previous = None if self.job.capture.is_open_at(step) else self.begin_checkpoint(step)
        self.end_checkpoint(metrics, final)
        return previous

    def begin_checkpoint(self, step: int, copy_in_background: bool = False) -> PersistReport | None:
        """(all ranks) Open the snapshot of `step`, to be filled array by array with capture()
        as the application finalises each one (extraction during backprop). Waits for the
        previous persist, whose buffers this snapshot reuses; returns its report.
        copy_in_background: capture() and end_checkpoint() only queue the copies, which the
        copier thread takes once end_checkpoint() returns, while training goes on; the caller
        then calls before_update(name) before it next changes a protected array in place
        (until the next begin_checkpoint(), wait() or close()). CuPy arrays are copied on a
        side stream as they are captured; before_update() then makes the GPU wait, not the host."""
        return self.taking.begin(step, copy_in_background)

    def capture(self, name: str) -> None:
        """Copy this rank's piece of protected array `name` into the open snapshot now (or
        queue the copy, see begin_checkpoint); no-op when no snapshot is open or it was captured."""
        self.job.capture.capture(name)

    def before_update(self, name: str) -> None:
        """Wait until the snapshot's copy of `name` is taken, if it is queued in the
        background; call before changing a protected array in place. Cheap otherwise."""
        self.job.capture.before_update(name)

    def end_checkpoint(self, metrics: dict | None = None, final: bool | None = None) -> PersistReport:
        """(all ranks) Capture whatever is left, freeze the small state and hand the snapshot
        to the background persist (ckpt/taking.py). Returns its (still filling) report."""
        return self.taking.end(metrics, final)

    def wait(self) -> PersistReport | None:
        """(all ranks) Block until the checkpoint in flight is durable, on L4 too when L4 copies
        at its own pace (storage.pfs_async); raise if it failed."""
        return self.taking.wait()

    def drain(self) -> list[int]:
        """(all ranks) Before node-local storage goes away with the allocation: copy to L4 the
        committed node-local versions that L4's retention would keep (the newest keep_pfs, the
        best by keep_best) but that skipped L4 (storage.pfs_every). Returns the steps copied;
        each copy is verified against its checksums before its manifest is written. close()
        calls it after a clean run."""
        self._finish_in_flight()
        self.taking.write_pending()
        return self.job.drain()

    def close(self, confirm: bool | None = None, drain: bool | None = None) -> int:
        """(all ranks) End checkpointing: what is in flight finished, after a clean run the
        newest version made durable on L4 (drain()) and what checkpoints cost logged; the run
        released. Returns 0, or EXIT_HALTED (75) after a stop. Clean: no exception is being
        handled here; an `except` block that recovered passes confirm=True, one that knows the
        run went wrong confirm=False. `drain`: False keeps the newest version where it is."""
        if self._closed:
            return self.exit_code
        from hpcckpt.run.in_job import close_waits_for_the_verdict

        in_flight = sys.exc_info()[1]
        if confirm is not True and close_waits_for_the_verdict(in_flight):
            return self.exit_code  # a dead rank's recovery abandons it; else run_surviving closes it
        self._closed = True
        clean = confirm if confirm is not None else in_flight is None
        drain = clean if drain is None else drain
        job = self.job
        self.taking.drop_open("the checkpointer was closed with a snapshot open")
        if confirm is None and isinstance(in_flight, NOT_THE_VERSIONS_DOING):
            self.confirm_restart()  # storage, settings or another job: the version loaded is not to blame
        try:
            job.tally.durable(self._finish_in_flight())
            if clean:
                self.confirm_restart()
            if drain and not self.read_only:
                self.drain()
                job.require_newest_on_global_levels(self.job.tally.last_checkpoint)
            elif self.taking.pending_step is not None:
                self.log.warning(f"version {self.taking.pending_step}, the newest taken, is not stored: no level was "
                                 "due for it and the run did not end cleanly")
            if clean and not self.read_only:
                pipeline = job.pipeline
                job.tally.summarise(job.comm, (pipeline.versions_stored, pipeline.bytes_stored),
                                    tuple(level.name for level in job.levels), pipeline.flush, pipeline.pending_replaced)
            if self.stopping is not None and clean:
                job.report_stop(drained=drain)
            elif clean and drain and not self.read_only:
                job.release_memory()  # finished: a stopped run's next job may read them
        finally:
            job.close()
            # Only now: a close that a process failure cut short leaves it to be abandoned.
            in_job_state.closed(self)
            if self._own_log:
                self.log.close()
        return self.exit_code

    def abandon(self) -> None:
        """(this rank alone) Ranks of the job died and the survivors go on without this
        checkpointer: its communicators are revoked (run/in_job.py), its threads stopped;
        nothing collective, nothing saved. A new Checkpointer over the survivors' communicator
        takes the run on. What failed on the way is logged by abandoned()."""
        if not in_job_state.is_open(self):
            return
        self._closed = True
        in_job_state.closed(self)
        self.job.capture.abandon()
        self._abandon_failures = self.job.abandon()

    def abandoned(self) -> None:
        """After abandon() and the shrink: what failed while abandoning goes to the log, which
        is then closed."""
        for failure in getattr(self, "_abandon_failures", []):
            self.log.warning(f"abandoning the checkpointer after a process failure: {failure}")
        if self._own_log:
            self.log.close()

    # -- going back: restart, rewind, another run's arrays ----------------------------------
    def restart(self, mode: str = "auto", step: int | None = None) -> int | None:
        """(all ranks) Restore the newest version every rank can load (or version `step`);
        None when there is none. mode: "auto" (resume if a version exists), "require" (fail if
        none), "never" (start fresh; refuses to if versions exist: nothing is overwritten)."""
        return self.resuming.load(mode, step)

    def init_from(self, source: str, select: Callable[[str], bool] | None = None) -> int:
        """(all ranks) Start this new run from another run's state: the protected replicated
        arrays `select(name)` picks (default: all) are loaded from `source` (a run directory,
        its L4 directory, or one L4 version directory), re-partitioned onto this job's ranks
        and verified. The step, data position, RNG and registered state are not taken: the run
        starts at its own step 0, and its versions are its own. Returns the source's step."""
        return self.resuming.init_from(source, select or (lambda name: True))

    def confirm_restart(self) -> None:
        """(all ranks) The resumed run works: the version it restarted from is good. Called
        after checkpoint.confirm_after_steps steps (counted by due()), at the next checkpoint
        and at a clean close(). Until then a crash marks that version failed (run/ledger.py)."""
        self.resuming.confirm()

    def observe(self, step: int, loss: float, finite: bool = True) -> Rewound | None:
        """(all ranks, after the step's work, before due(); `loss` the same on every rank)
        None for a healthy step. One that diverged (a loss not finite, `finite` false, a
        spike: schedule/divergence.py) is never checkpointed: with
        resilience.rewind_on_divergence it is rewound in process (rewind()), and a Rewound
        says to which version and which steps' inputs to skip; otherwise, or past
        resilience.max_rewinds, a DivergenceError (exit 2)."""
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
        from hpcckpt.schedule.rewind import mark_versions_bad

        mark_versions_bad(self.job.comm, self.config.run_dir, [step], reason)
        self.table_chain.reset()  # no later version's tables may build on it
        self.log.warning(f"version {step} marked bad: {reason}")

    def rewind(self, before: int, reason: str) -> int:
        """(all ranks) Go back in process: the open snapshot dropped, every version from step
        `before` on marked bad (and the one the last rewind restored, if the run diverged
        again from it), the newest older version restored by the restart's path. Returns its
        step; DivergenceError (exit 2) when none is left."""
        self.taking.drop_open(f"the run was rewound from step {before}")
        return self.resuming.rewind(before, reason)

    # -- internals -----------------------------------------------------------------------
    def _frozen_state(self) -> dict:
        """The registered state and the engine's now, as a version would hold them."""
        schedule = self.job.schedule
        return frozen_state(self.registry.states, {"ordinal": schedule.ordinal, "schedule": schedule.state(),
                                                   "divergence": self.divergence.check.state()})

    def _settle(self, held: bool) -> None:
        """The version in flight is over: its tables' rows are safe where some level holds
        it, and count as changed again where none could (or it failed)."""
        self.table_chain.settle(held)
        self.job.arrays.settle_tables(held)

    def _finish_in_flight(self) -> PersistReport | None:
        return self.job.finish_in_flight(self._settle)

    def _all_stored(self) -> None:
        """Before a load fills the snapshot buffers: what is in flight over, a version no
        level was due for written."""
        self._finish_in_flight()
        self.taking.write_pending()
