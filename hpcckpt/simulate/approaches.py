"""Four ways to checkpoint the same job on the same machine, as run plans, and their goodput.

- "hpcckpt": the library's stack (L1 host memory, L2 partner, L3 Reed-Solomon, L4 PFS at its own
  pace); the interval and each level's share of the versions are the library's own choice,
  schedule/level_intervals.choose_level_intervals, fed the modelled costs (what the library
  would measure) and the job's failure rates by class. A rank crash is recovered in the job,
  a switch's loss by a relaunch; a node's loss in the job with a spare in its place where the
  spares pay for their idle time (the library's expected waste with and without them, the
  spares' share of the nodes added to the first), else by a relaunch.
- "hpcckpt-l4": the same library with L4 alone: a version every daly_interval (never sooner
  than the previous one is durable: one in flight), recovered as above from the PFS, with the
  spares "hpcckpt" holds on the same machine.
- "async-pfs" (torch DCP's async_save, CheckFreq): the snapshot blocks, the PFS write runs
  behind; daly_interval; every failure relaunches the job and reads the PFS.
- "sync-pfs" (h5py, a file per rank): the whole write blocks; daly_interval; relaunch.

Goodput is per node held: the work over the wall time, times nodes / (nodes + spares). The
waste is split the same way: checkpoints, work redone, detection and recovery (fractions of
the wall time, times the same ratio) and the idle spares (spares / (nodes + spares)); the five
add up to 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcckpt.schedule.level_intervals import FailureClass, LevelCost, choose_level_intervals
from hpcckpt.schedule.policy import daly_interval
from hpcckpt.simulate.events import COMPOUND, RunPlan, SimFailure, SimLevel, simulate_run
from hpcckpt.simulate.machine import Machine

APPROACHES = ("hpcckpt", "hpcckpt-l4", "async-pfs", "sync-pfs")
CLASSES = (("rank crash", 0), ("node", 1), ("switch", 1))  # failure domains each takes (domains: leaf switches)


@dataclass(frozen=True)
class Scenario:
    approach: str
    plan: RunPlan
    spares: int
    reason: str  # how the interval and the levels were chosen


@dataclass(frozen=True)
class Projection:
    approach: str
    nodes: int
    goodput: float
    checkpoints: float
    redone: float
    recovery: float
    idle_spares: float
    interval_s: float
    every: dict
    spares: int
    failures: float  # per run, mean over the seeds
    truncated: int  # runs cut at max_wall_s
    reason: str


def scenario(approach: str, machine: Machine, work_s: float) -> Scenario:
    """The run plan `approach` would follow on `machine` for `work_s` seconds of training."""
    if approach not in APPROACHES:
        raise ValueError(f"unknown approach {approach!r}: one of {', '.join(APPROACHES)}")
    rates = machine.job_rates()
    failures = tuple(SimFailure(name, domains, rates[name]) for name, domains in CLASSES)
    if approach == "hpcckpt":
        return _hpcckpt(machine, work_s, failures)
    spares = _hpcckpt(machine, work_s, failures).spares if approach == "hpcckpt-l4" else 0
    in_job = ("rank crash", "node") if spares else ("rank crash",) if approach == "hpcckpt-l4" else ()
    blocking = machine.snapshot_s + machine.pfs_write_s if approach == "sync-pfs" else \
        machine.snapshot_s + machine.interference * machine.partner_s
    durable = machine.snapshot_s + machine.pfs_write_s
    interval = max(daly_interval(blocking, machine.job_mtbf_s), durable - blocking, machine.step_s)
    level = SimLevel("L4", None, blocking, durable)
    restart = {(f.name, "L4"): _restart_s(machine, f.name, "L4", f.name in in_job) for f in failures}
    plan = RunPlan(work_s, interval, (level,), failures, restart, during_restart=COMPOUND)
    reason = (f"daly_interval({blocking:.3g} s, job MTBF {machine.job_mtbf_s / 3600:.3g} h) = "
              f"{daly_interval(blocking, machine.job_mtbf_s):.3g} s, at least the {durable:.3g} s until durable")
    return Scenario(approach, plan, spares, reason)


def _hpcckpt(machine: Machine, work_s: float, failures: tuple[SimFailure, ...]) -> Scenario:
    with_spares = _hpcckpt_choice(machine, failures, ("rank crash", "node"))
    without = _hpcckpt_choice(machine, failures, ("rank crash",))
    spares = machine.spares()
    held = machine.nodes / (machine.nodes + spares)
    if (1 - with_spares[1].waste) * held >= 1 - without[1].waste:
        (levels, chosen, in_job), kept = with_spares, spares
        why = f"{spares} spares held (expected goodput {100 * (1 - chosen.waste) * held:.2f} % with them, " \
              f"{100 * (1 - without[1].waste):.2f} % relaunching after a node's loss)"
    else:
        (levels, chosen, in_job), kept = without, 0
        why = f"no spares (expected goodput {100 * (1 - chosen.waste):.2f} % relaunching after a node's loss, " \
              f"{100 * (1 - with_spares[1].waste) * held:.2f} % holding {spares} spares)"
    restart = {(f.name, level.name): _restart_s(machine, f.name, level.name, f.name in in_job)
               for f in failures for level in levels}
    plan = RunPlan(work_s, chosen.interval_s, levels, failures, restart, during_restart=COMPOUND)
    return Scenario("hpcckpt", plan, kept, f"{why}; {chosen.reason}")


def _hpcckpt_choice(machine: Machine, failures: tuple[SimFailure, ...], in_job: tuple[str, ...]):
    """(levels, the library's choice, classes recovered in the job) for the full stack."""
    m = machine
    snapshot = m.snapshot_s
    modelled = [  # (name, survives, cost, durable, own pace)
        ("L1", 0, snapshot, snapshot, False),
        ("L2", 1, m.interference * m.partner_s, snapshot + m.partner_s, False),
        ("L3", m.rs_parity, m.interference * m.erasure_s, snapshot + m.erasure_s, False),
        ("L4", None, m.interference * m.partner_s, snapshot + m.pfs_write_s, True),
    ]
    # What the library would measure restarting from each level: the mean over the failures
    # it recovers, weighted by their rates (L1 a rank crash; L2 and L3 a node's or a switch's
    # loss, one domain; L4 only what the others cannot: a relaunch, as after a switch).
    def measured_restart(name: str) -> float:
        if name == "L4":
            return _restart_s(m, "switch", name, False)
        recovered = [f for f in failures if f.domains_lost == (0 if name == "L1" else 1)]
        total = sum(f.per_second for f in recovered)
        if total == 0:
            return _restart_s(m, "node", name, "node" in in_job)
        return sum(f.per_second * _restart_s(m, f.name, name, f.name in in_job) for f in recovered) / total

    costs = [LevelCost(name, survives, cost, durable, measured_restart(name), own_pace)
             for name, survives, cost, durable, own_pace in modelled]
    by_domains: dict[int, float] = {}
    for f in failures:
        by_domains[f.domains_lost] = by_domains.get(f.domains_lost, 0.0) + f.per_second
    classes = [FailureClass(domains, rate) for domains, rate in sorted(by_domains.items())]
    floor = max([m.step_s] + [durable for _, _, _, durable, own_pace in modelled if not own_pace])
    chosen = choose_level_intervals(costs, classes, floor)
    levels = tuple(SimLevel(name, survives, cost, durable, chosen.every[name])
                   for name, survives, cost, durable, _ in modelled)
    return levels, chosen, in_job


def _restart_s(machine: Machine, failure: str, level: str, in_job: bool) -> float:
    """Detection, the in-job recovery (`in_job`) or a relaunch, and the read from `level`. A
    switch's loss is always relaunched: a whole leaf of nodes is more than spares are held for."""
    start = machine.in_job_s if in_job and failure != "switch" else machine.relaunch_s
    return machine.detection_s + start + machine.read_s(level)


def project(approach: str, machine: Machine, work_s: float, seeds: int = 3,
            max_wall_factor: float = 20.0) -> Projection:
    """Goodput and its split for `approach`, summed over `seeds` runs (ratios of sums). A run
    taking longer than `max_wall_factor` times the work is cut there (counted in `truncated`)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    chosen = scenario(approach, machine, work_s)
    runs = [simulate_run(chosen.plan, np.random.default_rng([seed, machine.nodes]), max_wall_factor * work_s)
            for seed in range(seeds)]
    wall = sum(r.wall_s for r in runs)
    held = machine.nodes / (machine.nodes + chosen.spares)
    return Projection(
        approach, machine.nodes,
        goodput=sum(r.work_s for r in runs) / wall * held,
        checkpoints=sum(r.checkpoint_s for r in runs) / wall * held,
        redone=sum(r.redone_s for r in runs) / wall * held,
        recovery=sum(r.recovery_s for r in runs) / wall * held,
        idle_spares=1 - held,
        interval_s=chosen.plan.interval_s,
        every={level.name: level.every for level in chosen.plan.levels},
        spares=chosen.spares,
        failures=sum(r.failures for r in runs) / seeds,
        truncated=sum(r.truncated for r in runs),
        reason=chosen.reason,
    )
