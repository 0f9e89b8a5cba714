"""When to checkpoint: a fixed interval, an overhead bound ("auto"), or Young/Daly from an MTBF.

"auto" (CheckFreq): profile the first steps without checkpoints (step time), take one
checkpoint to measure its cost (blocking time and time until durable on the levels training
waits for; L4 at its own pace reports later), then pick the
shortest interval N whose overhead stays under `checkpoint.max_overhead`:

    N >= durable / step_time                       the next snapshot never waits for a persist
    C  = blocking + interference * durable / step_time            cost of one checkpoint
    N >= C / (max_overhead * step_time)            the checkpoint's share of run time

`interference` is how much longer a step takes while a persist runs in the background than
one without (the persist shares the cores, the disk and the network with training; a copy to
L4 at its own pace counts as a persist here); it is measured while running, so the interval
is retuned after every checkpoint (interference from other jobs raises it too). With `checkpoint.mtbf_hours = H` the interval is Daly's
higher-order optimum (Young's sqrt(2 * C * MTBF), refined where C is not small against the
MTBF: daly_interval), never below the persist bound. With failure rates by class
(resilience.mtbf_crash_hours, mtbf_node_hours, mtbf_two_nodes_hours) the interval and how
often each level takes a version are chosen together from each level's measured cost and the
failures it covers (schedule/level_intervals.py, where the model is written out). There a
version's cost on each level is measured whole once it can be: the seconds every step lost
beside that version's persist and right after it (or beside its copy to L4), summed, shared
over the levels it wrote by their writing time; a mean slowdown times a writing time
undercounts the steps right after a snapshot, which lose most, and those right after a
persist, which lose too.

The policy is pure arithmetic over measurements; it is the same on every rank because the
measurements it is fed are agreed (maxima over ranks) by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpcckpt.schedule.level_intervals import MAX_EVERY, FailureClass, LevelCost, choose_level_intervals

def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """The compute time between checkpoints that loses least to checkpoints and to work redone
    after failures: Daly's higher-order estimate (FGCS 22(3), 2006, eq. 37), for a checkpoint
    costing `cost_s` and failures `mtbf_s` apart. Young's sqrt(2 C M) is its first term; the
    others matter once C is not small against M (C = 5 min: 120 against 117 min at M = 24 h,
    12.2 against 9.1 at M = 15 min); from C = 2 M on, the MTBF itself."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


PROFILE_STEPS = 5
EWMA = 0.5  # weight of the newest measurement


@dataclass
class IntervalPolicy:
    every_steps: int | str  # int > 0 fixed, "auto"; 0 = off
    max_overhead: float = 0.035
    mtbf_hours: float = 0.0
    step_time: float = 0.0  # seconds, smoothed, steps with no persist in flight
    busy_step_time: float = 0.0  # seconds, smoothed, steps run while a persist is in flight
    blocking: float = 0.0  # seconds per checkpoint, smoothed
    durable: float = 0.0  # seconds until the last level is durable, smoothed
    interval: int = 0  # chosen interval; 0 while profiling
    last_checkpoint: int = 0
    reason: str = ""
    history: list = field(default_factory=list)
    # Per-level intervals: the failure classes with their rates, the levels in the stack's
    # order as (name, node losses survived or None, copies at its own pace), each level's
    # measured seconds until durable and of its own writing (smoothed), and the choice.
    failures: tuple = ()
    levels: tuple = ()
    level_durable: dict = field(default_factory=dict)
    level_busy: dict = field(default_factory=dict)
    # Training seconds one version on each level cost, measured whole (smoothed).
    level_loss: dict = field(default_factory=dict)
    # The persist runs on the training's thread (MPI allows no threads): training stands still
    # for all of a level's writing, which is then its cost until a version's loss is measured.
    persist_inline: bool = False
    every: dict = field(default_factory=dict)
    # Without per-level intervals, each level every fixed_every[name]-th checkpoint
    # (resilience.partner_every, erasure_every, storage.pfs_every; L1 every time).
    fixed_every: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg, resilience=None) -> "IntervalPolicy":
        """`cfg`: the checkpoint section; `resilience`: its section, whose failure rates (if
        any) choose an interval per level."""
        every = cfg.every_steps
        adaptive = every == "auto" or cfg.mtbf_hours > 0
        policy = cls("auto" if adaptive else every, cfg.max_overhead, cfg.mtbf_hours)
        if resilience is not None:
            hours = (resilience.mtbf_crash_hours, resilience.mtbf_node_hours, resilience.mtbf_two_nodes_hours)
            policy.failures = tuple(FailureClass(nodes, 1 / (3600 * h)) for nodes, h in enumerate(hours) if h > 0)
        if not adaptive:
            policy.interval = int(every)
            policy.reason = f"checkpoint.every_steps = {every}"
        return policy

    @property
    def per_level(self) -> bool:
        """Each level's share of the versions is chosen here (failure rates and levels known)."""
        return self.adaptive and bool(self.failures) and bool(self.levels)

    def levels_due(self, ordinal: int, final: bool) -> tuple[str, ...]:
        """The levels the checkpoint with 1-based `ordinal` goes to: every level on the final
        one; else each every n-th, n chosen from the failure rates (per_level) or fixed."""
        every = self.every if self.per_level else self.fixed_every
        return levels_due(tuple(name for name, _, _ in self.levels), ordinal, final, every)

    def observe_levels(self, durable: dict, busy: dict) -> None:
        """Each level's newest measured seconds until durable and of its own writing."""
        for name, seconds in durable.items():
            self.level_durable[name] = _smooth(self.level_durable.get(name, 0.0), seconds)
        for name, seconds in busy.items():
            self.level_busy[name] = _smooth(self.level_busy.get(name, 0.0), seconds)

    def observe_persist_loss(self, written: tuple[str, ...], persist_loss: float | None,
                             own_pace_loss: float | None) -> None:
        """What one version cost the steps beside its work: `persist_loss` seconds beside its
        persist to the levels in `written` and right after it (None: it ran beside no step),
        `own_pace_loss` beside a whole copy to the levels at their own pace (None: no copy
        ended). Each part is shared over its levels by their writing time (smoothed per
        level)."""
        own_pace = {name for name, _, at_own_pace in self.levels if at_own_pace}
        parts = ((tuple(name for name in written if name not in own_pace), persist_loss),
                 (tuple(name for name, _, at_own_pace in self.levels if at_own_pace), own_pace_loss))
        for names, loss in parts:
            if loss is None or not names:
                continue
            writing = {name: max(self.level_busy.get(name, 0.0), 1e-9) for name in names}
            total = sum(writing.values())
            for name, seconds in writing.items():
                share = max(0.0, loss) * seconds / total
                self.level_loss[name] = share if name not in self.level_loss else \
                    (1 - EWMA) * self.level_loss[name] + EWMA * share

    @property
    def enabled(self) -> bool:
        return self.every_steps == "auto" or int(self.every_steps) > 0

    @property
    def adaptive(self) -> bool:
        return self.every_steps == "auto"

    def due(self, step: int, last_step: int) -> bool:
        """Checkpoint after `step`? The last step of a run is always checkpointed."""
        if not self.enabled:
            return False
        if step == last_step:
            return True
        if self.adaptive and self.interval == 0:
            # Profile PROFILE_STEPS steps without checkpoints, then take one to measure its cost.
            return step >= self.last_checkpoint + PROFILE_STEPS + 1 and self.step_time > 0
        return step - self.last_checkpoint >= self.interval

    def observe_step(self, seconds: float, persisting: bool = False) -> None:
        """One step's time; `persisting`: a checkpoint was being persisted while it ran."""
        if persisting:
            self.busy_step_time = _smooth(self.busy_step_time, seconds)
        else:
            self.step_time = _smooth(self.step_time, seconds)

    @property
    def interference(self) -> float:
        """Seconds a step loses while a persist runs behind it (0 until both are measured)."""
        if not self.busy_step_time or not self.step_time:
            return 0.0
        return max(0.0, self.busy_step_time - self.step_time)

    @property
    def cost(self) -> float:
        """Seconds of training one checkpoint costs: what it blocks, and what the steps run
        during its persist lose (the interval is never shorter than the persist)."""
        return self.blocking + self.interference * self.durable / max(self.step_time, 1e-9)

    def observe_checkpoint(self, step: int, blocking: float, durable: float | None) -> str | None:
        """Feed one checkpoint's cost; returns a log line when the interval changes."""
        self.last_checkpoint = step
        if not self.adaptive:
            return None
        self.blocking = _smooth(self.blocking, blocking)
        if durable is not None:
            self.durable = _smooth(self.durable, durable)
        if self.step_time <= 0:
            return None  # no step timed yet: any interval would divide by nothing; keep profiling
        every_before = dict(self.every)
        chosen, reason = self._choose()
        if chosen != self.interval or self.every != every_before:
            self.interval, self.reason = chosen, reason
            self.history.append((step, chosen))
            return f"checkpoint interval now {chosen} steps: {reason}"
        return None

    def _choose(self) -> tuple[int, str]:
        # The levels written with the checkpoint are timed by it; a level copying at its own
        # pace reports later. Waiting for it would leave the first choice to whatever interval
        # the profile gave, possibly beyond the end of a short run.
        timed = [name in self.level_durable for name, _, own_pace in self.levels if not own_pace]
        if self.per_level and timed and all(timed):
            return self._choose_per_level()
        step_time = max(self.step_time, 1e-9)
        persist_bound = max(1, math.ceil(self.durable / step_time))
        measured = (f"step {1000 * self.step_time:.2f} ms, snapshot blocks {1000 * self.blocking:.2f} ms, "
                    f"durable after {1000 * self.durable:.1f} ms, "
                    f"steps {1000 * self.interference:.2f} ms slower while it persists")
        if self.mtbf_hours > 0:
            young_daly = daly_interval(self.cost, self.mtbf_hours * 3600) / step_time
            interval = max(persist_bound, math.ceil(young_daly))
            return interval, (f"Young/Daly: Daly's optimum for C = {1000 * self.cost:.2f} ms and MTBF "
                              f"{self.mtbf_hours} h is {young_daly:.1f} steps; {measured}")
        overhead_bound = max(1, math.ceil(self.cost / (self.max_overhead * step_time)))
        interval = max(overhead_bound, persist_bound)
        binding = "overhead bound" if overhead_bound >= persist_bound else "persist must finish first"
        return interval, (f"shortest interval with overhead <= {100 * self.max_overhead:.1f} % ({binding}); "
                          f"{measured}")

    def _choose_per_level(self) -> tuple[int, str]:
        """The base interval and each level's every-k-th from level_intervals.py: a version on
        a level costs the training what the steps beside its writing lost, as measured whole,
        or until measured the share of its writing that steps lose while a persist runs (all
        of it where the persist runs inline; the first level also the snapshot's blocking);
        restoring from it is taken to take as long as writing it did."""
        step_time = max(self.step_time, 1e-9)
        slowdown = self.interference / step_time
        costs, untimed = [], []
        for index, (name, survives, own_pace) in enumerate(self.levels):
            if name not in self.level_durable:
                untimed.append(name)  # at its own pace, its first copy still running
                continue
            busy = self.level_busy.get(name, self.level_durable[name])
            loss = self.level_loss.get(name, busy if self.persist_inline else slowdown * busy)
            costs.append(LevelCost(name, survives, (self.blocking if index == 0 else 0.0) + loss,
                                   self.level_durable[name], busy, own_pace))
        floor = max([self.level_durable[name] for name, _, own_pace in self.levels if not own_pace], default=0.0)
        chosen = choose_level_intervals(costs, list(self.failures), floor)
        # An untimed level takes the final version (and every MAX_EVERY-th) until its cost is
        # known; the interval stays short meanwhile, so that the choice with it comes soon.
        self.every = {**dict(chosen.every), **{name: MAX_EVERY for name in untimed}}
        persist_bound = max(1, math.ceil(floor / step_time))
        pending = f"; {', '.join(untimed)} not timed yet, rechosen within {PROFILE_STEPS + 1} steps" if untimed else ""
        if not math.isfinite(chosen.interval_s):
            # No level covers any failure set: the overhead bound, as without failure rates.
            overhead_bound = max(1, math.ceil(self.cost / (self.max_overhead * step_time)))
            interval = max(persist_bound, overhead_bound)
            reason = f"no level covers a failure class set; {chosen.reason}{pending}"
        else:
            interval = max(persist_bound, math.ceil(chosen.interval_s / step_time))
            takes = ", ".join(f"{name} every {k}" for name, k in self.every.items() if k > 1)
            reason = (f"{takes or 'every level every version'}; {chosen.reason}; step {1000 * step_time:.2f} ms, "
                      f"steps {100 * slowdown:.1f} % slower while a persist runs{pending}")
        if untimed:
            interval = min(interval, max(persist_bound, PROFILE_STEPS + 1))
        return interval, reason

    def state(self) -> dict:
        return {"step_time": self.step_time, "busy_step_time": self.busy_step_time,
                "blocking": self.blocking, "durable": self.durable,
                "interval": self.interval, "last_checkpoint": self.last_checkpoint, "reason": self.reason,
                "level_durable": dict(self.level_durable), "level_busy": dict(self.level_busy),
                "level_loss": dict(self.level_loss), "every": dict(self.every)}

    def load_state(self, state: dict) -> None:
        """A restart keeps the profile: no second profiling phase."""
        self.step_time = float(state.get("step_time", 0.0))
        self.busy_step_time = float(state.get("busy_step_time", 0.0))
        self.blocking = float(state.get("blocking", 0.0))
        self.durable = float(state.get("durable", 0.0))
        self.last_checkpoint = int(state.get("last_checkpoint", 0))
        self.level_durable = {str(k): float(v) for k, v in state.get("level_durable", {}).items()}
        self.level_busy = {str(k): float(v) for k, v in state.get("level_busy", {}).items()}
        self.level_loss = {str(k): float(v) for k, v in state.get("level_loss", {}).items()}
        if self.adaptive:
            self.interval = int(state.get("interval", 0))
            self.reason = str(state.get("reason", ""))
            self.every = {str(k): int(v) for k, v in state.get("every", {}).items()}


def checkpoints_enabled(cfg) -> bool:
    """checkpoint.every_steps > 0, "auto", or an MTBF to derive the interval from."""
    return IntervalPolicy.from_config(cfg).enabled


def _smooth(previous: float, value: float) -> float:
    return value if previous == 0 else (1 - EWMA) * previous + EWMA * value


def levels_due(enabled: tuple[str, ...], ordinal: int, final: bool, every: dict[str, int]) -> tuple[str, ...]:
    """Which enabled levels take the checkpoint with 1-based `ordinal`: each level every
    `every[level]`-th checkpoint (resilience.partner_every, erasure_every, storage.pfs_every;
    a level without an interval, L1, every time), and every level on the final one."""
    return tuple(level for level in enabled if final or ordinal % max(1, every.get(level, 1)) == 0)
