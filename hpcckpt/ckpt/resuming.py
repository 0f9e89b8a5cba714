"""Going back to a version, as the facade's calls ask it: the restore's side of the application.

    load(mode, step)      restart(): the newest version every rank can get (restore/flow.py),
                          set into the application (arrays in place, registered state, blocks
                          several ranks hold), protected again where it was written by another
                          job, told to the schedule, the tally and the run's records
    rewind(before, why)   in process, after a divergence: versions from `before` on marked bad
                          (schedule/rewind.py decides which), the newest older one loaded
    init_from(source)     a new run from another run's arrays

A restart until it proves itself is unconfirmed: a crash before then marks the version it
loaded failed in the restart ledger (run/ledger.py); confirm() clears that.
"""

from __future__ import annotations

import dataclasses
import time

from hpcckpt.ckpt import registered_state
from hpcckpt.config import failures_per_second
from hpcckpt.errors import CheckpointError, DivergenceError
from hpcckpt.faults import current_attempt
from hpcckpt.restore import flow
from hpcckpt.restore.context import JobGeometry, RestoreTargets, RunPlace
from hpcckpt.restore.from_memory import MEMORY
from hpcckpt.restore.protect_again import protect_again
from hpcckpt.runlog import read_heartbeat
from hpcckpt.save.save_types import PersistReport
from hpcckpt.schedule.divergence import Rewound
from hpcckpt.schedule.rewind import mark_versions_bad, plan_rewind, versions_held


class Resuming:
    def __init__(self, job, table_chain, divergence, config, log, faults, read_only: bool, finish, commits):
        """`finish()`: the checkpoint in flight and L4's copy over, a version no level was due
        for stored (the facade's: a load fills the snapshot buffers); `commits`:
        the steps this process holds (ckpt/step_commits.py), forgotten by any load."""
        self.job = job
        self.table_chain = table_chain
        self.divergence = divergence
        self.config = config
        self.log = log
        self.faults = faults
        self.read_only = read_only
        self.finish = finish
        self.commits = commits
        self.restored_sources: tuple[str, ...] = ()  # level each rank's shard came from at restart
        self.restore_traffic: tuple = ()  # (bytes read, bytes received) by a repartitioning restart
        self.unconfirmed = None  # the restart ledger until the resumed run proves itself

    def confirm(self) -> None:
        """(all ranks) The resumed run works: the version it restarted from is good."""
        ledger, self.unconfirmed = self.unconfirmed, None
        if ledger is not None and self.job.rank == 0:
            ledger.confirm()

    def context(self) -> flow.RestoreContext:
        job = self.job
        layout = job.ensure_layout()
        job.arrays.check_memory()
        arrays = job.arrays
        return flow.RestoreContext(
            job=JobGeometry(job.comm, job.rank, job.world_size, job.node, job.topology, layout,
                            arrays.local_array_names),
            levels=job.levels,
            targets=RestoreTargets(dict(arrays.buffers), {name: p.array for name, p in arrays.arrays.items()},
                                   self.apply_state, dict(arrays.tables), self.state_problems,
                                   pieces_inherited=arrays.pieces_inherited),
            run=RunPlace(job.run.run_id, self.config.recorded, self.config.run_dir, job.storage.pfs_dir,
                         job.storage.local_dir, tuple(map(str, job.storage.places.roots))),
            log=self.log, faults=self.faults, chunk_bytes=self.config.checkpoint.chunk_bytes,
            verify_finite=self.config.checkpoint.verify_finite,
            failures_per_second=failures_per_second(self.config.checkpoint, self.config.resilience),
            unrecoverable=self._when_unrecoverable())

    def _when_unrecoverable(self) -> str:
        """restore/context.py's `unrecoverable`: a start over happens in new processes where
        this one went on in the job after ranks died (its arrays hold the lost run's state)."""
        from hpcckpt.run.in_job_state import recoveries_in_job

        chosen = self.config.resilience.unrecoverable
        return "relaunch" if chosen == "start_over" and recoveries_in_job() else chosen

    def load(self, mode: str, step: int | None, rewinding: bool = False) -> int | None:
        """(all ranks) restart()'s work; a rewind (in process) reports no restart: nothing
        crashed, and the work it costs is counted as a rewind."""
        self.finish()
        self.commits.forget()
        self.job.arrays.refresh()  # arrays protected by reference: restored into the current ones
        resuming = step is None and not self.read_only  # evaluating a chosen version confirms nothing
        reached_before = read_heartbeat(self.config.run_dir) if resuming and self.job.rank == 0 and not rewinding \
            else None
        memory = self._from_memory() if resuming and not rewinding and mode != "never" else None
        result = flow.restore(self.context(), mode, step) if memory is None else None
        self.job.arrays.pieces_inherited = False  # of use to the first restore only: it fills the buffers
        restored = memory.step if memory is not None else result.step if result is not None else None
        self.job.tally.last_checkpoint = None  # none taken since what was loaded
        if memory is not None:
            self.apply_state(memory.state, memory.rank_states, memory.world_size)
            self.restored_sources, self.restore_traffic = (MEMORY,) * self.job.world_size, (0, 0)
        if result is not None:
            self.job.arrays.share_block_copies()
            self.restored_sources, self.restore_traffic = result.sources, result.traffic
            if resuming:
                self.unconfirmed = result.unconfirmed
                if result.protect_again:
                    self._protect_again(result)
            self.table_chain.reset()  # a chain never spans a restore: the next version's tables go whole
        if resuming:
            if not rewinding:
                self._report_restart(restored, reached_before, memory)
            # From memory the interval goes on counting from the last version: none was loaded.
            said = self.job.schedule.begin(restored if memory is None else None)
            if said:
                self.log.info(said, console=True)
            self.job.tally.restart_clock()
            self.job.restart_step_clock()
        return restored

    def rewind(self, before: int, reason: str) -> int:
        """(all ranks) Checkpointer.rewind's work (see there)."""
        job = self.job
        job.capture.abandon()
        self.finish()
        plan = plan_rewind(versions_held(job.comm, job.levels), before, self.divergence.rewound_to)
        if plan.bad:
            mark_versions_bad(job.comm, self.config.run_dir, list(plan.bad), f"the run was rewound past it: {reason}")
        if plan.newest_older is None:
            again = f" (the run diverged again from version {plan.again})" if plan.again is not None else ""
            raise DivergenceError(f"the run diverged ({reason}) and no version before step {before} is left to "
                                  f"rewind to{again}; look at the data and learning rate, and start again from an "
                                  "earlier run's version (--init-from) or from scratch", collective=True)
        restored = self.load("require", None, rewinding=True)
        self.divergence.rewound_to = restored
        bad = list(plan.bad)
        self.log.warning(f"rewound from step {before} to version {restored}: {reason}"
                         + (f"; version(s) {bad} marked bad" if bad else "")
                         + (f" (the run diverged again from version {plan.again} since the last rewind)"
                            if plan.again is not None else ""))
        self.log.metrics({"event": "rewind", "from_step": before, "step": restored, "reason": reason,
                          "marked_bad": bad})
        return restored

    def observe(self, step: int, loss: float, finite: bool, rewind) -> Rewound | None:
        """(all ranks) Checkpointer.observe's work: `rewind(step, reason)` the facade's."""
        reason = self.divergence.check.verdict(step, loss, finite)
        if reason is None:
            return None
        self.divergence.admit(step, reason)
        rewound = self.divergence.rewound(step, rewind(step, reason), reason)
        self.log.metrics({"event": "diverged", "step": step, "rewound_to": rewound.step,
                          "skipping": rewound.skip_count, "reason": reason})
        return rewound

    def mark_bad(self, step: int, reason: str) -> None:
        """(all ranks) Checkpointer.mark_bad's work; its collective waits for what the pipeline
        runs on the same communicator."""
        self.finish()
        mark_versions_bad(self.job.comm, self.config.run_dir, [step], reason)
        self.table_chain.reset()  # no later version's tables may build on it
        self.log.warning(f"version {step} marked bad: {reason}")

    def init_from(self, source: str, select) -> int:
        self.finish()
        self.job.arrays.refresh()
        manifest = flow.init_from(self.context(), source, select)
        self.job.arrays.share_block_copies()
        count = sum(1 for t in self.job.arrays.layout.tensors if select(t.name))
        self.log.info(f"initialized {count} array(s) from version {manifest.step} of run "
                      f"{manifest.run_id or '(no run id)'} ({source})")
        return manifest.step

    def _from_memory(self):
        """(all ranks) After ranks died in this job: the survivors' finished step from memory
        (restore/from_memory.py), or None to read a version."""
        from hpcckpt.restore.from_memory import go_on_from_memory
        from hpcckpt.restore.tidy import clear_for_a_place_taken
        from hpcckpt.run.in_job_state import FILLING, NOT_OFFERED, take_held

        held = take_held(self.config.run_dir)  # alike on every survivor: offered or not
        if held is NOT_OFFERED or not self.config.resilience.in_job_from_memory:
            return None
        # Until the next commit_step, a death offers `held` again (step_commits.py): the
        # survivors' arrays are still that step, and a spare that was being handed it is still
        # owed it. Not once a version is to be read: the read overwrites the arrays.
        self.commits.restarting_from = held
        job = self.job
        job.ensure_layout()
        job.arrays.check_memory()
        memory = go_on_from_memory(job.comm, held, job.arrays.registry, self.log,
                                   lambda step: self.faults.strike(step, "handover"))
        if memory is None:
            self.commits.restarting_from = None
        else:
            if held is FILLING and not self.read_only:
                clear_for_a_place_taken(job.levels, memory.step, self.log)
            spares = f" and handed to {memory.handed_to} spare(s) in dead ranks' places" if memory.handed_to else ""
            self.log.info(f"went on from step {memory.step}, held in memory by the {job.world_size - memory.handed_to} "
                          f"survivor(s){spares}: no version read ({memory.seconds:.3f} s)", console=True)
        return memory

    def state_problems(self, saved: dict, written_by: int) -> list[str]:
        """Why a version's registered state cannot go to this job's (ckpt/registered_state.py)."""
        return registered_state.state_problems(self.job.arrays.states, saved, written_by, self.job.world_size)

    def apply_state(self, state: dict, rank_states: dict | None = None, written_by: int | None = None) -> None:
        """A loaded version's registered state into the application (shared, and the per-rank
        states of the old ranks handed to this rank), its own into the engine."""
        job = self.job
        engine = registered_state.apply_state(job.arrays.states, state, rank_states,
                                              job.world_size if written_by is None else written_by, job.rank,
                                              job.world_size)
        job.schedule.ordinal = int(engine.get("ordinal", 0))
        if "schedule" in engine:  # the interval's profile: a restart does not profile again
            job.schedule.load_state(engine["schedule"])
        self.divergence.check.load_state(engine.get("divergence", {}))

    def _report_restart(self, restored: int | None, reached_before, memory=None) -> None:
        """Where each rank's shard came from (each old rank's, when the version was written by
        another rank count) and how much work the failure cost, for metrics.jsonl and
        `hpcckpt report`."""
        record = {"event": "restart", "attempt": current_attempt(), "step": restored or 0,
                  "sources": list(self.restored_sources), "ranks": self.job.world_size}
        if memory is not None:
            record["from_memory_s"] = round(memory.seconds, 6)
        if reached_before is not None:
            reached, _ = reached_before
            record["reached_before"] = reached
            record["lost_steps"] = max(0, reached - (restored or 0))
            if record["lost_steps"] and restored is not None:
                self.log.info(f"the previous run had reached step {reached}: {record['lost_steps']} step(s) are done "
                              "again", console=True)
        self.log.metrics(record)

    def _protect_again(self, result) -> None:
        """Write the restored version again under this job's geometry, behind the resumed run's
        first steps where MPI allows threads: the write copies nothing the application
        changes (the snapshot buffers the restore filled, the state encoded here), and the
        next checkpoint, wait(), restart and close() wait for it. The version stays watched
        meanwhile: a crash during the write counts as any crash in the first steps (one
        proves nothing, run/ledger.py); without threads the write is done before the first
        step and a crash in it is not charged."""
        job = self.job
        snapshot = job.arrays.restored_snapshot(result.step, job.schedule.ordinal, result.state, result.metrics, ())
        # Without the restore's targets: the application's arrays are not the write's, and a
        # reference to them behind training would hide an array the application let go.
        ctx = dataclasses.replace(self.context(), targets=None)

        def write(levels: tuple) -> None:
            report = PersistReport(result.step)
            job.pipeline.persist(dataclasses.replace(snapshot, levels=tuple(levels)), report, time.perf_counter())
            # A level that could not take it degrades there, as for any checkpoint; here that
            # must not read as written again: the older versions stay the fallback. The
            # report's outcomes are agreed, so every rank raises alike.
            if report.failed or not report.held:
                why = "; ".join(f"{level}: {error}" for level, error in report.failed.items()) or "no level took it"
                raise CheckpointError(why, collective=True)
        ledger = None if job.pipeline.threaded else self.unconfirmed
        where = f"{job.world_size} rank(s) on {job.topology.node_count} node(s)"
        job.pipeline.run_behind(
            lambda: protect_again(result, write, lambda which: flow.clear_old_geometry(ctx, which), ledger, job.rank,
                                  self.log, where),
            f"writing restored version {result.step} again under this job's levels")
