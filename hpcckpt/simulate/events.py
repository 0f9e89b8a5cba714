"""One checkpointed run, simulated from failure to failure (pure Python + NumPy, no MPI).

The run computes `work_s` seconds in intervals of `interval_s`; after each interval a version
is taken (ordinal n = 1, 2, ...: version n holds the progress n * interval_s). Version n goes
to every level l with n % every_l == 0 (the library's rule, schedule/policy.levels_due) or,
`exclusive`, to the last of them in the stack only (SCR's model: a level-c checkpoint is
written to level c alone and serves every failure a lower level would). The run stands still
for the sum of the costs of the levels a version goes to; a version is on level l once
`durable_s` has passed since its checkpoint began. Version 0 (the start) is on every level.

Failures of each class come as a Poisson process; their sum is drawn one arrival at a time,
and the run jumps from the end of one restart to the next failure in O(1) arithmetic over the
versions' pattern (it repeats every lcm(every) versions), so the cost of a run grows with the
number of failures, not of versions. A failure that takes `nodes_lost` failure domains wipes
every level that survives fewer (survives < nodes_lost) and every version not yet durable; the
run rolls back to the newest version on a level that survives it, read from the first such
level in the stack, and stands still for `restart_s[(failure, level)]` (detection, a relaunch or
the in-job recovery, and the read). The progress since that version is computed again.

A failure during a restart, two semantics:
- "compound" (the library's model, schedule/level_intervals.py): the domains it takes add to
  those of the failure being recovered (the restored version is protected again only once the
  restart is done); a rank crash adds none and the restart begins again.
- "scr" (LLNL's SCR model, Moody et al. SC10, modelSCR_core.py's X state): a failure a lower
  level would recover, or any failure while restarting from the top level, begins the restart
  from the same version again; one of the class the restoring level covers last escalates to
  the next class (that level is wiped); a higher class is handled as itself.
With `reprotect` (the library) the restored version is on every level once the restart is
done; without (SCR) it stays on the level it came from.

The run ends when the version at the last interval (work rounded up to whole intervals) has
been written. Every second of wall time is one of: work kept, checkpoints (including those a
failure cut short), work redone (computed, then lost to a rollback), detection and recovery.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

COMPOUND, SCR = "compound", "scr"
_PHASE_TABLE_LIMIT = 1024  # patterns up to this many versions get a per-phase lookup table


@dataclass(frozen=True)
class SimLevel:
    name: str
    survives: int | None  # failure domains lost at once that a version on it survives; None: any
    cost_s: float  # seconds of run one version on it costs (blocking, plus what its background work slows)
    durable_s: float  # seconds from the checkpoint's start until a version is on it
    every: int = 1  # it takes every `every`-th version
    in_job_only: bool = False  # held in the processes' memory: lost to a relaunch

    def covers(self, domains_lost: int, in_job: bool = True) -> bool:
        return (in_job or not self.in_job_only) and (self.survives is None or domains_lost <= self.survives)


@dataclass(frozen=True)
class SimFailure:
    name: str
    domains_lost: int  # 0: a rank crash (every node-local file survives); 1: one domain; ...
    per_second: float


@dataclass(frozen=True)
class RunPlan:
    work_s: float
    interval_s: float
    levels: tuple[SimLevel, ...]
    failures: tuple[SimFailure, ...]
    restart_s: Mapping[tuple[str, str], float]  # (failure name, level name) -> seconds stood still
    exclusive: bool = False
    reprotect: bool = True
    during_restart: str = COMPOUND
    # Spare ranks: a failure of an `in_job` class is recovered in the job (restart_s) while a
    # spare is left, each such recovery using one; with none left it is relaunched
    # (relaunch_s), which starts the spares again. None: no spares counted (restart_s always).
    spares: int | None = None
    in_job: frozenset = frozenset()
    relaunch_s: Mapping[tuple[str, str], float] | None = None

    def __post_init__(self):
        if not self.work_s > 0 or not self.interval_s > 0:
            raise ValueError(f"work_s ({self.work_s}) and interval_s ({self.interval_s}) must be > 0")
        if not self.levels:
            raise ValueError("a run needs at least one level")
        if not any(level.survives is None for level in self.levels):
            raise ValueError("no level survives every failure (survives=None): a run could not start over")
        for level in self.levels:
            if level.every < 1 or level.cost_s < 0 or level.durable_s < 0:
                raise ValueError(f"level {level.name}: every >= 1, cost_s >= 0 and durable_s >= 0 required")
        for failure in self.failures:
            if failure.per_second < 0 or failure.domains_lost < 0:
                raise ValueError(f"failure {failure.name}: per_second and domains_lost must be >= 0")
            for level in self.levels:
                if (failure.name, level.name) not in self.restart_s:
                    raise ValueError(f"restart_s has no entry for failure {failure.name!r} from level {level.name!r}")
        if self.spares is not None:
            if self.spares < 0 or self.relaunch_s is None:
                raise ValueError("spares must be >= 0 and come with relaunch_s (the restart once none is left)")
            missing = [(f, level.name) for f in self.in_job for level in self.levels
                       if (f, level.name) not in self.relaunch_s]
            if missing:
                raise ValueError(f"relaunch_s has no entry for {missing[0]}")
        if self.during_restart not in (COMPOUND, SCR):
            raise ValueError(f"during_restart must be {COMPOUND!r} or {SCR!r}, not {self.during_restart!r}")


@dataclass(frozen=True)
class RunResult:
    wall_s: float
    work_s: float  # kept (the work rounded up to whole intervals)
    checkpoint_s: float
    redone_s: float
    recovery_s: float  # detection and restarts, those cut short included
    failures: int
    restored_from: dict = field(default_factory=dict)  # level name -> restarts read from it
    truncated: bool = False  # cut at max_wall_s: work_s is the progress kept by then

    @property
    def goodput(self) -> float:
        return self.work_s / self.wall_s


class _Pattern:
    """What versions cost and where they go, as functions of the ordinal (period lcm(every))."""

    def __init__(self, plan: RunPlan):
        self.tau = plan.interval_s
        self.period = math.lcm(*(level.every for level in plan.levels))
        self.levels = plan.levels
        self.exclusive = plan.exclusive
        self.cost = [sum(level.cost_s for level in self._written(phase)) for phase in range(self.period)]
        self.held_phases = [[phase for phase in range(self.period) if self.holds(i, phase)]
                            for i in range(len(self.levels))]
        self.prefix = [0.0]
        for cost in self.cost:
            self.prefix.append(self.prefix[-1] + cost)
        self.period_s = self.period * self.tau + self.prefix[-1]
        # starts[phase][r - 1]: start(n0, r) for a segment whose restored version n0 has this phase
        self.starts = None
        if self.period <= _PHASE_TABLE_LIMIT:
            self.starts = [[self.start(n0, r) for r in range(1, self.period + 1)] for n0 in range(self.period)]

    def _written(self, ordinal: int) -> list[SimLevel]:
        due = [level for level in self.levels if ordinal % level.every == 0]
        return due[-1:] if self.exclusive else due

    def newest_held(self, level_index: int, ordinal: int) -> int:
        """The newest version up to `ordinal` that goes to the level (-1: none)."""
        phases = self.held_phases[level_index]
        if not phases or ordinal < 0:
            return -1
        whole, phase = divmod(ordinal, self.period)
        at = bisect.bisect_right(phases, phase)
        return whole * self.period + phases[at - 1] if at else (whole - 1) * self.period + phases[-1]

    def holds(self, level_index: int, ordinal: int) -> bool:
        level = self.levels[level_index]
        if ordinal % level.every:
            return False
        if not self.exclusive:
            return True
        return not any(ordinal % later.every == 0 for later in self.levels[level_index + 1:])

    def cost_sum(self, first: int, last: int) -> float:
        """Seconds the checkpoints of versions first..last cost (0 when last < first)."""
        return self._prefix(last + 1) - self._prefix(first) if last >= first else 0.0

    def _prefix(self, ordinal: int) -> float:
        whole, phase = divmod(ordinal, self.period)
        return whole * self.prefix[-1] + self.prefix[phase]

    def start(self, n0: int, r: int) -> float:
        """Seconds from a segment's start (after version n0) until version n0 + r's checkpoint begins."""
        return r * self.tau + self.cost_sum(n0 + 1, n0 + r - 1)

    def begun_by(self, n0: int, elapsed: float) -> int:
        """How many checkpoints of a segment after version n0 have begun `elapsed` seconds in."""
        whole = int(elapsed // self.period_s)
        rest = elapsed - whole * self.period_s
        if self.starts is not None:
            return whole * self.period + bisect.bisect_right(self.starts[n0 % self.period], rest)
        low, high = 0, self.period  # start(n0, 0) <= rest < start(n0, period + 1)
        while low < high:
            mid = (low + high + 1) // 2
            if self.start(n0, mid) <= rest:
                low = mid
            else:
                high = mid - 1
        return whole * self.period + low


class _Arrivals:
    """Exponential gaps and uniform draws from a seeded NumPy generator, fetched in blocks."""

    def __init__(self, rng: np.random.Generator, block: int = 8192):
        self.rng, self.block = rng, block
        self.gaps, self.uniforms, self.index = [], [], 0

    def next(self) -> tuple[float, float]:
        if self.index == len(self.gaps):
            self.gaps = self.rng.standard_exponential(self.block).tolist()
            self.uniforms = self.rng.random(self.block).tolist()
            self.index = 0
        self.index += 1
        return self.gaps[self.index - 1], self.uniforms[self.index - 1]


class _Poisson:
    """The next failure of the plan's classes as Poisson processes (memoryless: a failure drawn
    but not reached before a restart ended is drawn again afresh)."""

    def __init__(self, plan: RunPlan, rng: np.random.Generator):
        self.failing = [f for f in plan.failures if f.per_second > 0]
        self.rate = sum(f.per_second for f in self.failing)
        self.cumulative = list(np.cumsum([f.per_second / self.rate for f in self.failing])) if self.failing else []
        self.arrivals = _Arrivals(rng)

    def next(self, now: float) -> tuple[float, SimFailure | None]:
        if not self.failing:
            return math.inf, None
        gap, pick = self.arrivals.next()
        return now + gap / self.rate, self.failing[min(bisect.bisect_right(self.cumulative, pick),
                                                       len(self.failing) - 1)]

    def unread(self) -> None:
        pass


class _Trace:
    """Failures at given wall times (seconds since the run's start), by class name, in order:
    a replay of a schedule a real run met. One not yet reached is given again."""

    def __init__(self, plan: RunPlan, trace):
        by_name = {f.name: f for f in plan.failures}
        unknown = sorted({name for _, name in trace} - set(by_name))
        if unknown:
            raise ValueError(f"trace failures {unknown} are not among the plan's classes {sorted(by_name)}")
        self.items = sorted((float(at), by_name[name]) for at, name in trace)
        self.index = 0
        self.given = False  # the last next() gave an item (not the end's "never")

    def next(self, now: float) -> tuple[float, SimFailure | None]:
        self.given = self.index < len(self.items)
        if not self.given:
            return math.inf, None
        at, failure = self.items[self.index]
        self.index += 1
        return max(at, now), failure

    def unread(self) -> None:
        if self.given:
            self.index -= 1
            self.given = False


def simulate_run(plan: RunPlan, seed: int | np.random.Generator = 0, max_wall_s: float = math.inf,
                 trace=None) -> RunResult:
    """Wall time and its split for one run of `plan` (seeded: the same seed, the same run).
    A run that fails so often it would take longer than `max_wall_s` is cut at the first
    restart that ends past it: its work kept is then the progress restored there. `trace`:
    (seconds since the start, failure class name) pairs met instead of the plan's rates."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    pattern = _Pattern(plan)
    levels = plan.levels
    arriving = _Poisson(plan, rng) if trace is None else _Trace(plan, trace)
    next_failure = arriving.next
    last = max(1, math.ceil(plan.work_s / plan.interval_s - 1e-9))

    # Version 0, the start, is where a version of ordinal 0 would be (every level; exclusive: the last)
    held = [0 if pattern.holds(i, 0) else -1 for i in range(len(levels))]  # newest version per level (-1: none)
    spares_left = plan.spares
    now, n0 = 0.0, 0
    checkpoint_s = computed_s = recovery_s = 0.0
    failures = 0
    restored_from: dict = {}
    truncated = False
    while n0 < last:  # a restore of the last version itself (durable before its checkpoint ends) ends the run
        if now >= max_wall_s:
            truncated = True
            break
        failed_at, failure = next_failure(now)
        elapsed = failed_at - now
        finish = pattern.start(n0, last - n0) + pattern.cost_sum(last, last)
        if finish <= elapsed:
            checkpoint_s += pattern.cost_sum(n0 + 1, last)
            computed_s += finish - pattern.cost_sum(n0 + 1, last)
            now += finish
            break
        begun = pattern.begun_by(n0, elapsed)
        in_checkpoints = pattern.cost_sum(n0 + 1, n0 + begun - 1)
        if begun:
            in_checkpoints += min(pattern.cost_sum(n0 + begun, n0 + begun), elapsed - pattern.start(n0, begun))
        checkpoint_s += in_checkpoints
        computed_s += elapsed - in_checkpoints
        written = [_newest_durable(pattern, i, n0, begun, elapsed) for i in range(len(levels))]
        now = failed_at
        failures += 1
        lost = failure.domains_lost
        while True:  # restart, begun again while failures meet it
            # With spares counted: a spare taken (in the job, memory kept) or a relaunch
            spare_taken = plan.spares is not None and failure.name in plan.in_job and spares_left > 0
            memory_kept = plan.spares is None or spare_taken
            for i, level in enumerate(levels):
                held[i] = max(held[i], written[i]) if level.covers(lost, memory_kept) else -1
            written = [-1] * len(levels)
            restored = max(held[i] for i, level in enumerate(levels) if level.covers(lost, memory_kept))
            source = next(i for i, level in enumerate(levels)
                          if level.covers(lost, memory_kept) and held[i] == restored)
            out_of_spares = plan.spares is not None and failure.name in plan.in_job and not spare_taken
            seconds = (plan.relaunch_s if out_of_spares else plan.restart_s)[(failure.name, levels[source].name)]
            if spare_taken:
                spares_left -= 1  # taken as the recovery begins: another death meanwhile needs another
            failed_at, later = next_failure(now)
            if failed_at - now >= seconds:
                arriving.unread()
                if plan.spares is not None and not spare_taken:
                    spares_left = plan.spares  # a relaunch starts every spare again
                now += seconds
                recovery_s += seconds
                n0 = restored
                restored_from[levels[source].name] = restored_from.get(levels[source].name, 0) + 1
                if plan.reprotect:
                    held = [restored] * len(levels)
                break
            recovery_s += failed_at - now
            now = failed_at
            failures += 1
            if now >= max_wall_s:  # restarts that never end between failures: cut here, not never
                n0 = restored
                break
            failure = later
            lost = _lost_after(plan.during_restart, lost, later.domains_lost, levels[source])
    kept = (n0 if truncated else last) * plan.interval_s
    return RunResult(now, kept, checkpoint_s, computed_s - kept, recovery_s, failures, restored_from, truncated)


def _newest_durable(pattern: _Pattern, index: int, n0: int, begun: int, elapsed: float) -> int:
    """The newest version of a segment after version n0 on level `index` by `elapsed` seconds
    in, `begun` checkpoints having begun (-1: none)."""
    durable_s = pattern.levels[index].durable_s
    ordinal = pattern.newest_held(index, n0 + begun)
    while ordinal > n0:
        if pattern.start(n0, ordinal - n0) + durable_s <= elapsed:
            return ordinal
        ordinal = pattern.newest_held(index, ordinal - 1)
    return -1


def _lost_after(semantics: str, lost: int, more: int, restoring: SimLevel) -> int:
    """Domains a restart from `restoring` must survive once a failure taking `more` meets it."""
    if semantics == COMPOUND:
        return lost + more
    if restoring.survives is None or more < restoring.survives:
        return lost  # the restart begins again from the same version
    return max(more, restoring.survives + 1)
