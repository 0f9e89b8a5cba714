"""When an application checkpoints and when it stops: the schedule behind Checkpointer.due().

The interval comes from schedule/policy.py (fixed, "auto" under checkpoint.max_overhead, or
Young/Daly from checkpoint.mtbf_hours); stop requests from schedule/stopping.py. This module
feeds them what they measure and keeps every rank deciding alike:

- step times: the wall time between two calls of step_over() (once per step, after the
  step's work), less nothing: the checkpointer restarts the clock when its own blocking calls
  return, so a step's time is the application's. An application that knows better (the
  trainer times its step alone, without logging and evaluation) reports it.
- costs of each checkpoint: what it blocked, and how long its persist took to be durable.
  With an adaptive interval they are agreed as maxima over ranks (the slowest rank's costs)
  in one sleeping allreduce after each checkpoint, so the interval is the same everywhere; with
  failure rates set (resilience.mtbf_*_hours) so are each level's times, what the steps
  beside (or right after) the previous version's persist and a copy to L4 at its own pace
  lost (each step's time less the clean step time, summed; clean steps are those beside no
  such work and not right after it, and not a process's first), and the levels each
  checkpoint goes to.
- stops: the per-step OR-reduce of schedule/stopping.py.

Collectives (all ranks, main thread, on a communicator of the schedule's own): one posted
Iallreduce of an int per step (the stop flags); with an adaptive interval one sleeping
Iallreduce of four doubles (with failure rates: four more, and two per level) per checkpoint.
"""

from __future__ import annotations

import time

import numpy as np

from hpcckpt.schedule.policy import IntervalPolicy
from hpcckpt.schedule.stopping import StopRequests
from hpcckpt.cluster.collectives import wait_all


# The steps right after a persist or a copy ended still pay for it (caches refilled, memory
# the copy held given back, a thread finishing its bookkeeping): they are counted in that
# work's loss and not taken for clean steps, whose time the losses are measured against.
SETTLING_STEPS = 2


class CheckpointSchedule:
    def __init__(self, comm, checkpoint_config, *, end_time: float = 0.0, halt_seconds: float = 0.0,
                 halt_file=None, log=None, catch_signals: bool = True, resilience=None, levels: tuple = (),
                 fixed_every: dict | None = None, confirm_after_steps: int = 0):
        """(all ranks) Collective: duplicates `comm`. `resilience`: the section whose failure
        rates choose an interval per level; `levels`: the stack's levels as (name, node losses
        a version there survives or None, copies at its own pace); `fixed_every`: each level
        every n-th checkpoint where no rates choose; `confirm_after_steps`: steps after which
        a resumed run is confirmed (confirm_due)."""
        self.comm = comm.Dup()  # main thread only: the stop exchange and the cost agreement
        self.log = log
        self.policy = IntervalPolicy.from_config(checkpoint_config, resilience)
        self.policy.levels = tuple(levels)
        self.policy.fixed_every = dict(fixed_every or {})
        self.every_steps = checkpoint_config.every_steps
        self.confirm_after_steps = confirm_after_steps
        self.ordinal = 0  # checkpoints taken by the run so far (saved with each version)
        self.steps_run = 0  # steps done since the start or restart
        self.final_step: int | None = None  # the step due() said is the last (a stop, or last=True)
        self.stops = StopRequests(self.comm, end_time, halt_seconds, halt_file, dup=False)
        if catch_signals:
            self.stops.install(log)
        self._clock_started: float | None = None
        self._persisting_at_start = False
        self._copying_at_start: int | None = None
        self._unmeasured_at_start = False
        self._warmed_up = False
        # Steps since the last one beside a persist or a copy, and what that one was beside
        # (persisting, copying): the profile's steps count as settled.
        self._since_work = SETTLING_STEPS
        self._work_before: tuple[bool, int | None] = (False, None)
        self._warned_short_interval = False
        self.losses = StepLosses()
        self._newest_levels: tuple[str, ...] | None = None  # the levels of the checkpoint taken last
        self._persisted_levels: tuple[str, ...] | None = None  # ... of the one before: its persist ran since

    # -- the step ---------------------------------------------------------------------------
    def restart_clock(self, persisting: bool, copying_at_own_pace: int | None = None,
                      beside_other_work: bool = False) -> None:
        """The application's step begins now (after a checkpointer call that blocked), beside
        a persist (`persisting`) or a copy of version `copying_at_own_pace` to the levels at
        their own pace, or neither. `beside_other_work`: work that is no checkpoint's runs
        beside it (a restored version written again): its time then says nothing of a step's
        or a checkpoint's cost, and is not timed."""
        self._clock_started = time.perf_counter()
        self._persisting_at_start = persisting
        self._copying_at_start = copying_at_own_pace
        self._unmeasured_at_start = beside_other_work

    def begin(self, restored_step: int | None) -> str | None:
        """(all ranks) After the restart: the interval counts from the version loaded, the
        stop exchange of the first step is posted (a stop asked for while loading is agreed
        after the first step). Returns a log line when a saved profile sets the interval."""
        if restored_step is not None:
            self.policy.last_checkpoint = restored_step
        self.stops.post_if_idle()
        if restored_step is not None and self.policy.adaptive and self.policy.interval:
            return (f"checkpoint interval {self.policy.interval} steps, kept from the checkpoint's profile: "
                    f"{self.policy.reason}")
        return None

    def planned(self, step: int, last: bool = False) -> bool:
        """Whether the interval puts a checkpoint at `step` (the last step always has one;
        with checkpoint.every_steps = 0 only the last has); pure, the same on every rank.
        Stops are not considered."""
        return last or self.policy.due(step, -1)

    def step_over(self, seconds: float | None, observe: bool, checkpointing: bool = False) -> str | None:
        """(all ranks, once per step, after its work) Time the step (unless `observe` is
        false: a snapshot was open during it) and complete the stop agreement (`checkpointing`:
        this step is checkpointed, a moment to look for the halt file). Returns the agreed
        reason to stop, if any."""
        now = time.perf_counter()
        if seconds is None and self._clock_started is not None:
            seconds = now - self._clock_started
        if observe and not self._unmeasured_at_start and seconds is not None and seconds > 0:
            if self._warmed_up:
                self._time_step(seconds)
            # A process's first step pays once for what it sets up (imports finished, memory
            # touched first, connections made): neither a clean step nor a checkpoint's loss.
            self._warmed_up = True
        return self.stops.step_over(look_now=checkpointing)

    def _time_step(self, seconds: float) -> None:
        persisting, copying = self._persisting_at_start, self._copying_at_start
        beside_work = persisting or copying is not None
        if beside_work:
            self._since_work, self._work_before = 0, (persisting, copying)
        else:
            self._since_work += 1
        settling = not beside_work and self._since_work <= SETTLING_STEPS
        if (beside_work or settling) and self.policy.step_time > 0:
            self.losses.add(seconds - self.policy.step_time, *self._work_before)
        if not settling:
            self.policy.observe_step(seconds, persisting=beside_work)

    @property
    def stopping(self) -> str | None:
        return self.stops.reason

    def step_done(self, step: int, stop: str | None, last: bool) -> bool:
        """A step counted (after step_over); True when the resumed run is now confirmed
        (checkpoint.confirm_after_steps steps done)."""
        self.steps_run += 1
        if stop is not None or last:
            self.final_step = step
        return self.steps_run == self.confirm_after_steps

    # -- the checkpoint ---------------------------------------------------------------------
    def next_checkpoint(self, step: int, final: bool | None) -> tuple[int, bool, tuple[str, ...]]:
        """The checkpoint of `step` is taken: (its ordinal, whether it is the run's final one
        (`final`, or by default the step due() said is the last), the levels it goes to).
        The one place that decides which levels take a version."""
        self.ordinal += 1
        final = (step == self.final_step) if final is None else final
        levels = self.policy.levels_due(self.ordinal, final)
        self._newest_levels = levels
        return self.ordinal, final, levels

    def checkpoint_taken(self, step: int, blocked: float, waited: float, durable: float | None,
                         level_times: dict | None = None, inline: float = 0.0) -> str | None:
        """(all ranks) One checkpoint's costs: `blocked` in all (`waited` of it for the
        previous persist, `inline` of it its persist on the caller's thread, where MPI allows
        no threads: the whole persist stalls training), `durable` seconds until the last level
        of the previous (or this profiling) checkpoint was durable, `level_times` level ->
        (seconds until durable, of its own writing) as newest measured on this rank.
        Returns a line to log (interval changed, or a fixed interval shorter than a persist)
        or None."""
        policy = self.policy
        if inline > 0:
            policy.persist_inline = True
        if policy.per_level:
            blocked -= inline  # a version's loss, whole, settled with the next window (below)
        if not policy.adaptive:
            policy.observe_checkpoint(step, blocked, None)
            if waited > 0.5 * blocked > 0.01 and not self._warned_short_interval:
                # At most one checkpoint is in flight: a fixed interval shorter than a persist
                # turns the persist's duration into blocking time.
                self._warned_short_interval = True
                return (f"step {step} waited {waited:.3f} s for the previous checkpoint to persist: checkpoints come "
                        "faster than they persist, and the wait is blocking time; checkpoint where due() says (now "
                        f"every {self.every_steps} steps), with a larger checkpoint.every_steps, or every_steps = "
                        "\"auto\"")
            return None
        names = [name for name, _, _ in policy.levels] if policy.per_level else []
        times = level_times or {}
        per_level = [value for name in names for value in times.get(name, (-1.0, -1.0))]
        losses = self.losses.values(self._copying_at_start) if policy.per_level else []
        agreed = self._agreed_max([policy.step_time, policy.busy_step_time, blocked, durable or 0.0,
                                   *losses, *per_level])
        step_time, busy_step_time, blocking, agreed_durable = agreed[:4]
        policy.step_time, policy.busy_step_time = step_time, busy_step_time
        after_losses = agreed[4 + len(losses):]
        pairs = dict(zip(names, zip(after_losses[0::2], after_losses[1::2])))
        policy.observe_levels({name: d for name, (d, _) in pairs.items() if d >= 0},
                              {name: b for name, (_, b) in pairs.items() if b >= 0})
        if losses:
            persist_loss, own_pace_loss = self.losses.settle(agreed[4:4 + len(losses)], self._copying_at_start)
            if self._persisted_levels is not None:
                policy.observe_persist_loss(self._persisted_levels, persist_loss, own_pace_loss)
            # A persist run here is this version's loss, whole: settled with the next window.
            self.losses.add_inline(inline)
        self._persisted_levels = self._newest_levels
        return policy.observe_checkpoint(step, blocking, agreed_durable or None)

    @property
    def profiling(self) -> bool:
        """The next checkpoint measures the costs the first interval is chosen from: it is
        waited for until durable (not on L4 at its own pace)."""
        return self.policy.adaptive and self.policy.interval == 0

    def _agreed_max(self, values: list[float]) -> list[float]:
        """The policy must decide the same everywhere: feed it the slowest rank's costs."""
        from mpi4py import MPI

        local = np.asarray(values, dtype=np.float64)
        agreed = np.empty_like(local)
        wait_all([self.comm.Iallreduce(local, agreed, op=MPI.MAX)])
        return agreed.tolist()

    # -- saved with every version -----------------------------------------------------------
    def state(self) -> dict:
        return self.policy.state()

    def load_state(self, state: dict) -> None:
        self.policy.load_state(state)

    def close(self) -> None:
        self.stops.close()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class StepLosses:
    """What the steps beside checkpoint work lost (seconds over the clean step time, summed)
    since the last checkpoint: beside (or right after) the persist of the version before it,
    and beside (or right after) each copy to the levels at their own pace, by version (a copy
    may span several checkpoints: its loss adds up until it is over); a step beside both
    shares its loss half and half."""

    def __init__(self):
        self.persist = 0.0
        self.persist_counted = 0
        self.by_copy: dict[int, float] = {}

    def add(self, excess: float, persisting: bool, copying: int | None) -> None:
        share = excess / 2 if persisting and copying is not None else excess
        if persisting:
            self.persist += share
            self.persist_counted += 1
        if copying is not None:
            self.by_copy[copying] = self.by_copy.get(copying, 0.0) + share

    def add_inline(self, seconds: float) -> None:
        """A persist that ran on the caller's thread: training stood still for all of it."""
        if seconds > 0:
            self.persist += seconds
            self.persist_counted += 1

    def values(self, copying_now: int | None) -> list[float]:
        """This rank's part of the agreement (maxima over ranks): the persist's loss and its
        steps, the losses of the copies over (summed) and how many."""
        over = [loss for version, loss in self.by_copy.items() if version != copying_now]
        return [self.persist, float(self.persist_counted), sum(over), float(len(over))]

    def settle(self, agreed: list[float], copying_now: int | None) -> tuple[float | None, float | None]:
        """From the agreed values: (the persist's loss, None where no step ran beside it; one
        copy's loss at its own pace, the mean of those over, None where none ended), and start
        counting again (`copying_now` as given to values())."""
        persist, persist_counted, copies_loss, copies = agreed
        self.persist, self.persist_counted = 0.0, 0
        self.by_copy = {version: loss for version, loss in self.by_copy.items() if version == copying_now}
        return (persist if persist_counted else None), (copies_loss / copies if copies else None)
