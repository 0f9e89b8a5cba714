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
from functools import partial
from typing import Callable, Sequence

from hpcckpt.ckpt.closing import close_run
from hpcckpt.ckpt.job import CommJob, require_running_mpi
from hpcckpt.ckpt.library_config import LibraryConfig
from hpcckpt.ckpt.registry import ENGINE_STATE_KEY, ArrayRegistry
from hpcckpt.ckpt.resuming import Resuming
from hpcckpt.ckpt.state_dicts import split_state_dict
from hpcckpt.ckpt.step_commits import StepCommits
from hpcckpt.ckpt.taking import CheckpointTaking
from hpcckpt.cluster.mpi_gate import fault_tolerant_agree
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
        and fails together; MPI must be running (exit 2 otherwise). `config`: a job config, a
        LibraryConfig or a job TOML's path. `log`: a runlog.RunLog (default: one of its own
        under <run.dir>). `catch_signals`: SIGTERM, SIGUSR1, SIGUSR2 become stop requests.
        `read_only`: a job that only reads versions (evaluate): no lease, no signals, no pruning."""
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
        self.taking = CheckpointTaking(self.job, self.table_chain, self.divergence, self.log, faults,
                                       self.confirm_restart)
        self.resuming = Resuming(self.job, self.table_chain, self.divergence, config, self.log, faults, read_only,
                                 self.taking.all_stored, self.commits)
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
        """Protect an array, restored in place: NumPy, CuPy, anything writable that speaks
        DLPack or the buffer protocol (a PyTorch tensor: a view of its memory), a DTensor or a
        Heat DNDarray (its local part at the place its split gives), or a getter of any of
        them (lambda: W: read at each capture and restore, for code that rebinds the name).
        replicated (default): the same on every rank (checked), restored onto any rank count;
        a block (`global_shape`, this rank's `offset`: integers or slices): restored onto any
        rank count or decomposition; per-rank (`replicated=False`): the same rank count.
        What does not fit is one error on every rank (exit 2); an array protected by value
        that the application no longer holds fails the next checkpoint (docs/library.md)."""
        self.registry.protect(name, array, replicated, global_shape, offset, allow_gaps)

    def protect_state_dict(self, name: str, state_dict) -> tuple[str, ...]:
        """Protect a framework's state dict in one call (ckpt/state_dicts.py): each tensor
        as protect() takes it, as "<name>/<its path>", the other values as registered state
        `name`, written back into the dict at a restart. Returns the arrays' names."""
        parts = split_state_dict(name, state_dict)
        for array_name, leaf in parts.arrays:
            self.protect(array_name, leaf)
        self.register_state(name, parts.get, parts.set)
        return tuple(array_name for array_name, _ in parts.arrays)

    def protect_table(self, name: str, table) -> None:
        """Protect a keyed table (ckpt/keyed_table.py): this rank's rows, those whose id
        hashes to it; saved whole or as the rows changed, restored onto any rank count."""
        self.job.arrays.protect_table(name, table)

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None], *,
                       per_rank: bool = False, reshard: Callable | None = None) -> None:
        """Small state saved with every version: what get() returns (a pytree of dicts,
        lists, tuples, scalars, str, bytes, small arrays: format/pytree.py) goes to set() at a
        restart, types intact. By default the same on every rank (checked at the first
        checkpoint), stored once; `per_rank`: each rank's own, in its shard, given back to
        its rank; onto another rank count `reshard(states, rank, size)` makes this rank's from
        the old ranks' handed to it, else refused (ckpt/registered_state.py)."""
        self.registry.register_state(name, get, set, per_rank, reshard)

    # -- when: the schedule ----------------------------------------------------------------
    def commit_step(self, step: int) -> None:
        """(all ranks, once per step, after its last collective, before it changes a protected
        array) With in-job recovery on (ULFM), a fault-tolerant agreement: after a death every
        survivor holds the step it last called due() for, and goes on from it with no version
        read where all is replicated (ckpt/step_commits.py). The promise: protected arrays
        change only between commit_step(step) and due(step). A no-op without ULFM."""
        if not self._survives_rank_loss:
            return
        said = "commit_step({}): MPI's agreement returned {}, which no rank gave; taken for a failure"
        self.commits.commit(step, partial(fault_tolerant_agree, self.job.schedule.comm),
                            lambda outcome: self.log.warning(said.format(step, outcome)))

    @property
    def survives_rank_loss(self) -> bool:
        """This process's ranks go on in the job when one dies (run/in_job.py, ULFM)."""
        return self._survives_rank_loss

    def due(self, step: int, last: bool = False, *, step_seconds: float | None = None) -> bool:
        """(all ranks, once per step, after its work) Checkpoint `step` now? When the interval
        says so (fixed, "auto", Young/Daly, per level), at the `last` step, and when the ranks
        agreed to stop (`stopping` says why; the run's final version). No blocking collective.
        The step's time runs from the checkpointer's previous call (`step_seconds`: given)."""
        schedule, capture = self.job.schedule, self.job.capture
        self.commits.step_done(step, self.registry, self.taking.frozen_state, self.job.rank, self.job.world_size)
        if schedule.stopping is not None:
            return capture.is_open_at(step)
        planned = schedule.planned(step, last) or capture.is_open_at(step)
        stop = schedule.step_over(step_seconds, observe=not capture.is_open_at(step), checkpointing=planned)
        self.job.tally.step_over()
        self.log.heartbeat(step)
        if schedule.step_done(step, stop, last):
            self.confirm_restart()
        self.job.restart_step_clock()
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
        """(all ranks) Snapshot `step` and persist it in the background; returns once the
        snapshot is taken, with the previous checkpoint's report, or raises its failure.
        `final`: written to every level (default: when due() said it is the last). `metrics`
        are kept with it; a number not finite among them refuses the step (said in the log)."""
        previous = None if self.job.capture.is_open_at(step) else self.begin_checkpoint(step)
        self.end_checkpoint(metrics, final)
        return previous

    def begin_checkpoint(self, step: int, copy_in_background: bool = False) -> PersistReport | None:
        """(all ranks) Open the snapshot of `step`, filled with capture() as each array is final
        (after the previous persist, whose buffers it reuses: its report is returned).
        copy_in_background: copies are queued and taken behind the step; the caller then calls
        before_update(name) before changing a protected array in place (docs/library.md)."""
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
        """(all ranks) Copy to L4, verified, the node-local versions its retention keeps but
        that skipped it (a version no level was due for written first). Returns the steps
        copied; close() calls it after a clean run."""
        self.taking.all_stored()
        return self.job.drain()

    def close(self, confirm: bool | None = None, drain: bool | None = None) -> int:
        """(all ranks) End checkpointing (ckpt/closing.py): after a clean run (no exception
        being handled, or confirm=True) the newest version durable on L4 and the costs logged.
        Returns 0, or EXIT_HALTED (75) after a stop. `drain`: False keeps versions where they are."""
        if self._closed:
            return self.exit_code
        from hpcckpt.run.in_job import close_waits_for_the_verdict

        in_flight = sys.exc_info()[1]
        if confirm is not True and close_waits_for_the_verdict(in_flight):
            return self.exit_code  # a dead rank's recovery abandons it; else run_surviving closes it
        self._closed = True
        clean = confirm if confirm is not None else in_flight is None
        try:
            close_run(self, clean, clean if drain is None else drain,
                      not_to_blame=confirm is None and isinstance(in_flight, NOT_THE_VERSIONS_DOING))
        finally:
            self.job.close()
            in_job_state.closed(self)  # only now: a close a process failure cut short is abandoned
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
        failures = getattr(self, "_abandon_failures", [])
        for failure in failures:
            self.log.warning(f"ranks died and this checkpointer was set aside for the survivors' new one; "
                             f"{failure} (the survivors go on)")
        if not failures:
            self.log.info("ranks died: this checkpointer was set aside for the survivors' new one (its version in "
                          "flight, if any, dropped: it never completed)")
        if self._own_log:
            self.log.close()

    # -- going back: restart, rewind, another run's arrays ----------------------------------
    def restart(self, mode: str = "auto", step: int | None = None) -> int | None:
        """(all ranks) Restore the newest version every rank can load (or version `step`);
        None when there is none. mode: "auto" (resume if a version exists), "require" (fail if
        none), "never" (start fresh; refuses to if versions exist: nothing is overwritten)."""
        return self.resuming.load(mode, step)

    def init_from(self, source: str, select: Callable[[str], bool] | None = None) -> int:
        """(all ranks) Start this new run from another run's replicated arrays that
        `select(name)` picks, from `source` (a run, its L4 directory or one version), onto
        this job's ranks; not its step or state. Returns the source's step."""
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
        return self.resuming.observe(step, loss, finite, self.rewind)

    def mark_bad(self, step: int, reason: str) -> None:
        """(all ranks) Version `step` is bad (a diverged state, a wrong result): no restart or
        rewind loads it again; `reason` is kept in the restart ledger (<run.dir>/restarts.json)."""
        self.resuming.mark_bad(step, reason)

    def rewind(self, before: int, reason: str) -> int:
        """(all ranks) Go back in process: the open snapshot dropped, every version from step
        `before` on marked bad (and the one the last rewind restored, if the run diverged
        again from it), the newest older version restored by the restart's path. Returns its
        step; DivergenceError (exit 2) when none is left."""
        self.taking.drop_open(f"the run was rewound from step {before}")
        return self.resuming.rewind(before, reason)
