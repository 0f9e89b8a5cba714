"""perf/bench_goodput.py's runs replayed in the simulator (hpcckpt/simulate/events.py): does the
simulator, fed the costs measured on this machine, give the waste the bench measured?

Each approach's run plan is built from what the same bench run measured, nothing else:
- the work: the failure-free run without checkpoints (its wall time W0, start-up included),
  in the bench's steps (one step = W0 / steps; versions fall between steps);
- each approach's checkpoints: its own failure-free run with checkpoints, how many versions
  each level stored in it (every k steps) and what they cost in all (its wall time - W0,
  charged to the versions evenly); a PFS level is durable once the version has gone through the
  bench's PFS cap (state / PFS rate), a synchronous writer's when its write ends;
- restarts: the median time from a failure to the version loaded, per failure class, over the
  approach's own runs under failures (a class it never met: the median over its other classes);
- the in-job approaches go on from the step held in memory after a crash (a level every step,
  free, that survives only a crash recovered in the job), in the time their in-job recoveries
  took; with spares, while one is left (one is taken per crash, a relaunch starts them all
  again), else relaunched. Not modelled: a crash that strikes a relaunch under the
  fault-tolerant MPI before MPI start-up is through leaves the others there until the job
  script's START_TIMEOUT; charging that to every failure that meets a relaunch over-predicted
  the in-job rows (perf/log/2026-12-06.md), since the plan cannot tell when start-up ends;
- the failures: each seed's schedule, at the same wall times and of the same classes (a crash
  wipes nothing node-local, a node one failure domain, two nodes two), a run cut at the bench's
  timeout counting as no goodput, as the bench counts it.

The simulated waste per seed, 1 - W0 / wall, is set beside the measured one; the comparison is
of the medians over the seeds (tests/test_simulate.py holds a recorded bench run to it).
"""

from __future__ import annotations

import re
import statistics

from hpcckpt.simulate.events import COMPOUND, RunPlan, SimFailure, SimLevel, simulate_run

# failure class -> failure domains it takes (the bench's NODES_LOST)
DOMAINS = {"crash": 0, "node": 1, "two_nodes": 2}
# level -> failure domains a version on it survives (L3: groups of 4, parity 2; None: any)
SURVIVES = {"L1": 0, "L2": 1, "L3": 2, "L4": None}
HELD_STEP = "held step"  # the in-job approaches' state in memory after every step
TIMEOUT_FACTOR = 20  # the bench gives a run up after 20 x W0


def versions_per_level(checkpoints_line: str) -> dict[str, int]:
    """Versions each level stored, from a run's "checkpoints:" line: hpcckpt's names its levels
    ("versions stored: L1 9 (...), L2 3 (...)"), the single-level baselines' only the count
    ("checkpoints: 4 taken"), which is then L4's."""
    stored = dict((level, int(count)) for level, count in re.findall(r"\b(L[1-4]) (\d+) \(", checkpoints_line))
    if stored:
        return stored
    taken = re.search(r"checkpoints: (\d+) taken", checkpoints_line)
    if not taken:
        raise ValueError(f"no checkpoint count in {checkpoints_line!r}")
    return {"L4": int(taken.group(1))}


def plan_for(record: dict, name: str) -> RunPlan:
    """The run plan of approach `name` from a bench's measured record (see record_for_replay)."""
    approach = record["approaches"][name]
    steps, w0 = record["steps"], record["baseline_s"]
    step_s = w0 / steps
    versions = {level: n for level, n in approach["versions"].items() if n > 0}
    if not versions:
        raise ValueError(f"{name}: its failure-free run stored no version")
    taken = max(versions.values())  # every version goes to the most frequent level
    cost = max(0.0, approach["free_wall_s"] - w0) / taken
    pfs_s = record["state_mb"] / record["pfs_mbps"]
    first_every = max(1, round(steps / taken))
    levels = []
    for level in sorted(versions):
        # a rarer level takes every k-th of the versions (schedule/policy.levels_due)
        every = first_every * max(1, round(taken / versions[level]))
        charged = cost if versions[level] == taken and not levels else 0.0
        durable = charged + (pfs_s if level == "L4" and not approach.get("synchronous") else 0.0)
        levels.append(SimLevel(level, SURVIVES[level], charged, durable, every))
    if "L4" not in versions:  # the start, version 0, is on the PFS for a relaunch from scratch
        levels.append(SimLevel("L4", None, 0.0, 0.0, steps + 1))
    failures = tuple(SimFailure(kind, domains, 0.0) for kind, domains in DOMAINS.items())
    relaunched = approach["restart_s"]
    fallback = statistics.median(relaunched.values()) if relaunched else record["restart_fallback_s"]
    relaunch = {(kind, level.name): relaunched.get(kind, fallback) for kind in DOMAINS for level in levels}
    if not approach.get("in_job"):
        return RunPlan(w0, step_s, tuple(levels), failures, relaunch, during_restart=COMPOUND)
    # A crash is survived in the job, from the step the survivors hold, while a spare is left
    # (no spares held: always, on fewer ranks); the runtime ends the job on a node's loss.
    levels.insert(0, SimLevel(HELD_STEP, 0, 0.0, 0.0, 1, in_job_only=True))
    in_the_job = approach.get("in_job_restart_s") or {}
    restart = {(kind, level.name): in_the_job.get("crash", fallback) if kind == "crash" else
               relaunched.get(kind, fallback) for kind in DOMAINS for level in levels}
    relaunch.update({(kind, HELD_STEP): relaunched.get(kind, fallback) for kind in DOMAINS})
    return RunPlan(w0, step_s, tuple(levels), failures, restart, during_restart=COMPOUND,
                   spares=approach.get("spares"), in_job=frozenset({"crash"}),
                   relaunch_s=relaunch if approach.get("spares") is not None else None)


def replayed(record: dict) -> dict:
    """approach -> {"measured": median waste over the seeds, "simulated": the same replayed,
    "by_seed": {seed: (measured, simulated)}}."""
    w0 = record["baseline_s"]
    out = {}
    for name, approach in record["approaches"].items():
        plan = plan_for(record, name)
        by_seed = {}
        for seed, schedule in record["schedules"].items():
            result = simulate_run(plan, max_wall_s=TIMEOUT_FACTOR * w0,
                                  trace=[(at, kind) for at, kind in schedule if at < TIMEOUT_FACTOR * w0])
            simulated = 1.0 if result.truncated else 1 - w0 / result.wall_s
            by_seed[seed] = (approach["waste_by_seed"][seed], simulated)
        out[name] = {"measured": statistics.median(m for m, _ in by_seed.values()),
                     "simulated": statistics.median(s for _, s in by_seed.values()), "by_seed": by_seed}
    return out


def restarts_by_recovery(run: dict) -> list[tuple[str, bool, float]]:
    """(failure class, recovered in the job, seconds until the version or step was loaded) of
    each failure of one bench run (an Outcome as a dict) that had a whole restart of its own."""
    attempts = [a for a in run["attempts"] if a.get("loaded_at_s") is not None]
    out = []
    for at_s, kind, hit, restart in run["failures"]:
        if not hit or restart is None:
            continue
        loaded = min((a for a in attempts if a["loaded_at_s"] > at_s), key=lambda a: a["loaded_at_s"], default=None)
        if loaded is not None:  # records from before the flag: the survivors went on from memory
            out.append((kind, loaded.get("in_job", loaded["restored_from"] == "memory"), restart))
    return out


def record_for_replay(args, baseline_s: float, free: dict, table: dict, runs: list, schedules: dict,
                      pfs_mbps: float, in_job: tuple, synchronous: tuple, spares: dict) -> dict:
    """What the replay needs from one bench run, JSON-ready: the work, each approach's
    failure-free run with checkpoints (`free`: name -> Outcome as a dict), its restarts by class
    and by how they were recovered (`runs`: every Outcome as a dict), its measured waste per
    seed (`table`), and the seeds' schedules (seed -> [Failure])."""
    def medians(name: str, in_the_job: bool) -> dict:
        by_kind: dict = {}
        for run in runs:
            if run["approach"] == name:
                for kind, recovered_in_job, seconds in restarts_by_recovery(run):
                    if recovered_in_job == in_the_job:
                        by_kind.setdefault(kind, []).append(seconds)
        return {kind: statistics.median(values) for kind, values in by_kind.items()}

    restarts = [s for row in table.values() for s in row["restart_s"].values()]
    return {
        "steps": args.steps, "state_mb": args.state_mb, "pfs_mbps": pfs_mbps, "baseline_s": baseline_s,
        "mtbf_s": args.mtbf_s, "mix": args.mix,
        "restart_fallback_s": statistics.median(restarts) if restarts else 0.0,
        "schedules": {str(seed): [[f.at_s, f.kind] for f in schedule] for seed, schedule in schedules.items()},
        "approaches": {
            name: {"free_wall_s": free[name]["wall_s"], "versions": versions_per_level(free[name]["checkpoints"]),
                   "restart_s": medians(name, False), "in_job_restart_s": medians(name, True),
                   "in_job": name in in_job, "synchronous": name in synchronous, "spares": spares.get(name),
                   "waste": row["waste"], "waste_by_seed": {str(s): w for s, w in row["waste_by_seed"].items()}}
            for name, row in table.items() if name in free and free[name]["finished"] and free[name]["checkpoints"]},
    }


def print_replay(record: dict) -> None:
    print("\nthe simulator fed this run's measured costs, the seeds' failures replayed (median waste over the seeds):")
    for name, row in replayed(record).items():
        ratio = row["simulated"] / row["measured"] if row["measured"] else float("nan")
        seeds = ", ".join(f"{seed} {100 * m:.0f}/{100 * s:.0f}" for seed, (m, s) in row["by_seed"].items())
        print(f"  {name:<14} measured {100 * row['measured']:5.1f} %, simulated {100 * row['simulated']:5.1f} % "
              f"({ratio:.2f}x; by seed measured/simulated: {seeds})")
