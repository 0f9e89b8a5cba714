"""Taking one checkpoint, as the facade's calls ask it: the save's side of the application.

    begin(step)   the checkpoint in flight over (its report back), the arrays checked, the
                  snapshot opened
    (capture)     each array copied, or queued, as the application finalises it (capture.py)
    end(metrics)  refused if the metrics are not finite; else numbered, its levels decided
                  (once: schedule/checkpoint_schedule.py), its tables' chain, frozen, handed
                  to the save pipeline behind the step, its cost told to the tally and the
                  schedule; the first checkpoint of an adaptive interval is waited for (it
                  measures what the interval is chosen from)
    write_pending a version no level was due for (every level every n-th version) is held
                  by the snapshot buffers alone until the next snapshot replaces it: stored
                  here (close, wait, drain, a rewind), so no version acknowledged is missing

Every rank calls these alike; the only collectives are the pipeline's and the schedule's.
"""

from __future__ import annotations

import time

from hpcckpt.errors import CheckpointError
from hpcckpt.run.health import non_finite_metrics
from hpcckpt.ckpt.snapshot import frozen_state
from hpcckpt.save.save_types import PersistReport


class CheckpointTaking:
    def __init__(self, job, table_chain, divergence, log, faults, confirm):
        """`job`: the CommJob; `confirm()`: the resumed run proved itself (a checkpoint opens)."""
        self.job = job
        self.table_chain = table_chain
        self.divergence = divergence
        self.log = log
        self.faults = faults
        self.confirm = confirm
        self._overwriting: int | None = None  # the pending version whose buffers the open snapshot fills

    def begin(self, step: int, copy_in_background: bool) -> PersistReport | None:
        """(all ranks) Open the snapshot of `step`; the previous checkpoint's report."""
        job = self.job
        job.capture.refuse_if_open(step)
        # A restored version still being written again is the restart's cost, not this
        # checkpoint's: its wait is kept out of the blocking time the schedule weighs.
        behind = job.pipeline.finish_work_behind()
        if behind is not None and behind[1] >= 0.001:
            self.log.info(f"step {step}'s snapshot waited {behind[1]:.3f} s for {behind[0]} to finish")
        opened = time.perf_counter()
        previous = job.persist_over(self.settle)
        waited = time.perf_counter() - opened
        job.tally.durable(previous, job.l4_copying)
        self.confirm()
        job.arrays.refresh()
        job.ensure_layout()
        job.arrays.check_before_snapshot()
        self.faults.strike(step, "snapshot")
        self._overwriting = job.pipeline.take_pending()
        job.capture.open(step, copy_in_background and job.pipeline.threaded)
        job.tally.opened(previous, time.perf_counter() - opened, waited, job.pipeline.flush)
        return previous.as_of_now() if previous is not None else None

    def end(self, metrics: dict | None, final: bool | None) -> PersistReport:
        """(all ranks) Close the open snapshot and hand it to the pipeline; its report (still filling)."""
        job = self.job
        step = job.capture.open_step
        if step is None:
            raise CheckpointError("end_checkpoint() without begin_checkpoint()")
        refused = non_finite_metrics(metrics)
        if refused:
            return self._refuse(step, refused)
        in_background = job.capture.copies is not None
        ordinal, final, levels = job.schedule.next_checkpoint(step, final)
        self._overwriting = None  # replaced by this version
        chain = ()
        if job.arrays.tables:
            node_local = {level.name for level in job.levels.node_local}
            # A version no level is due for may be written to every level later (write_pending).
            chain = self.table_chain.next(step, node_local.intersection(levels or node_local), final)
        engine_state = {"schedule": job.schedule.state(), "divergence": self.divergence.check.state()}
        snapshot, report, started = job.capture.close(ordinal, metrics or {}, final, levels, engine_state, chain)
        handing = time.perf_counter()
        job.pipeline.submit(snapshot, report, started, job.capture.copies, job.arrays.copy_piece)
        # Where MPI allows no threads the persist runs right here: training stands still for it.
        inline = time.perf_counter() - handing if not job.pipeline.threaded else 0.0
        blocked, waited = job.tally.closed(report, in_background, inline)
        durable = job.tally.previous_durable
        if job.schedule.profiling:
            # The first interval accounts for the persist's time. L4 at its own pace is not
            # waited for: behind a slow PFS that would stall training for a whole copy (and a
            # crash in that stall leaves no version). Its time enters the choice from the next
            # checkpoints, which retune the interval; until then the interval is one level's.
            self._persist_over()
            now = report.as_of_now()  # L4's thread may still add to the report
            durable = max(now.durable_s.values()) if now.durable_s else 0.0
            job.tally.note_level_times(now, job.pipeline.flush)
        said = job.schedule.checkpoint_taken(step, blocked, waited, durable, job.tally.level_times, inline)
        if said and job.schedule.policy.adaptive:
            self.log.info(said, console=True)
        elif said:
            self.log.warning(said)
        job.restart_step_clock()
        return report

    def _refuse(self, step: int, refused: list) -> PersistReport:
        self.drop_open(f"step {step}'s snapshot was refused")
        self.log.warning(f"step {step} is not checkpointed: its metrics {', '.join(refused)} are not finite (a "
                         "diverged state is never saved); the newest version stays the one before it")
        self.log.metrics({"event": "checkpoint_refused", "step": step, "metrics": refused})
        return PersistReport(step)

    def drop_open(self, why: str) -> None:
        """The open snapshot, if any, is dropped (`why`); the version no level was due for
        whose buffers it filled is then lost, and said so."""
        self.job.capture.abandon()
        lost, self._overwriting = self._overwriting, None
        if lost is not None:
            self.log.warning(f"version {lost}, which no level was due for yet, is lost: {why} after taking its place "
                             "in the snapshot buffers; the newest version stored is an older one (resilience.levels "
                             "with a level every version, such as local, avoids this)")
            self.log.metrics({"event": "version_lost", "step": lost, "reason": why})

    def write_pending(self) -> None:
        """(all ranks) After the checkpoint in flight is over: the version no level was due
        for, if any, stored on every level now."""
        report = self.job.pipeline.write_pending()
        if report is not None:
            self.settle(report.held)
            self.job.tally.durable(report)
            self.log.info(f"version {report.step}, the newest taken, which no level was due for, written to every "
                          "level", console=True)

    @property
    def pending_step(self) -> int | None:
        """The version no level was due for and held by the snapshot buffers alone, if any."""
        pending = self.job.pipeline.pending
        return pending.step if pending is not None else None

    def _persist_over(self) -> None:
        """(all ranks) The checkpoint in flight over on the levels it waits for (not L4 at its
        own pace)."""
        job = self.job
        job.capture.copies_done()
        job.tally.durable(job.persist_over(self.settle), job.l4_copying)

    def wait(self) -> PersistReport | None:
        """(all ranks) The checkpoint in flight durable, on L4 too at its own pace; a version
        no level was due for written."""
        report = self.job.finish_in_flight(self.settle)
        self.job.tally.durable(report)
        self.write_pending()
        self.job.schedule.restart_clock(False)
        return report

    def settle(self, held: bool) -> None:
        """The version in flight is over: its tables' rows are safe where some level holds
        it, and count as changed again where none could (or it failed)."""
        self.table_chain.settle(held)
        self.job.arrays.settle_tables(held)

    def finish_in_flight(self) -> PersistReport | None:
        """The checkpoint in flight and L4's copy at its own pace over; its report."""
        return self.job.finish_in_flight(self.settle)

    def all_stored(self) -> None:
        """(all ranks) Before a load fills the snapshot buffers, or a drain: what is in flight
        over, a version no level was due for written."""
        self.finish_in_flight()
        self.write_pending()

    def frozen_state(self) -> dict:
        """The registered state and the engine's now, as a version would hold them."""
        schedule = self.job.schedule
        return frozen_state(self.job.arrays.states, {"ordinal": schedule.ordinal, "schedule": schedule.state(),
                                                     "divergence": self.divergence.check.state()})
