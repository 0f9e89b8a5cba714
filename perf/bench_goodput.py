"""Goodput under failures: the machine time that failures waste, for hpcckpt's levels against
single-level checkpointing, under one seeded failure schedule replayed for every approach.

    python perf/bench_goodput.py                 # 5 seeds of >= 3 failures, 6 approaches, 32 steps, MTBF 15 s
    python perf/bench_goodput.py --approaches hpcckpt_in_job,hpcckpt_spare   # the shrinking row too
    python perf/bench_goodput.py --seeds 1 --approaches hpcckpt,dcp --json out.json

The workload is the trainer (`hpcckpt train`'s model, data order and steps), 4 ranks on 4
simulated nodes, a state of about --state-mb MB (parameters and SGD momentum). Every attempt is
launched by the job scripts' restart loop (`bash jobs/slurm.sbatch` over mpiexec, outside
Slurm), which relaunches it after each failure until the run reaches its last step, with
START_TIMEOUT set as a site would for this job's start-up (START_TIMEOUT_S). The checkout is
compiled to bytecode first, as an installed package is: no attempt compiles it again.

Failures come from this script, from outside the job, as a cluster's do: at exponential
intervals (mean --mtbf-s seconds of wall time), each a rank crash (SIGKILL of one rank), the
loss of one node (its ranks stopped, its node-local directory deleted, its ranks killed) or,
rarer, of two nodes at once (--mix). The schedule (times, classes, victims) is drawn from the
seed alone, so every approach meets the same failures at the same times after its start. A
failure that comes while no attempt runs (between attempts) still deletes the node's
directory; a crash then hits nothing. Seeds whose schedule strikes fewer than --min-failures
times within the failure-free run's time are passed over: every seed tells the approaches
apart, and the table gives each approach's spread over the seeds beside its median.

The PFS is shared and slower than node-local storage, as on a cluster: its write bandwidth
for the job is --pfs-fraction of the node-local disk's (measured here at the start), the same
cap for every approach (storage.pfs_bandwidth_mb per rank for hpcckpt's L4, an equal share
per writing rank for DCP, the whole cap for h5py's single writer), and so is its read rate at
a restart (storage.pfs_read_bandwidth_mb; DCP's and h5py's readers alike).

Approaches:
- hpcckpt: L1-L4 (L3 groups of 4, parity 2), the interval and each level's share of the
  versions chosen by the library from the failure rates (resilience.mtbf_*_hours, set to this
  schedule's rates) and the costs it measures (schedule/level_intervals.py), the node-local
  versions in memory first (storage.memory_dir under --memory-root, /dev/shm: a lost node's
  part is deleted with its node-local directory);
- hpcckpt_disk: the same with the node-local versions on the disk (what memory saves);
- hpcckpt_in_job (only where --approaches names it: the others end on the failure-free
  weights, which every row of the default must): hpcckpt's levels and intervals, the job
  launched on the fault-tolerant MPI
  (`LAUNCHER=ulfm`, Open MPI's ULFM): a crashed rank costs no relaunch, the others go on in
  the job from the step they hold in memory (the trainer commits each step) and finish on
  fewer ranks, so its weights are not the failure-free run's (sums over fewer ranks). A crash
  aimed at a rank already gone strikes a live one. A lost node ends the whole job, as Open
  MPI's runtime does on a cluster when it loses the node's daemon (here: every rank killed
  after the node's directory is deleted), and the loop relaunches it on 4 ranks;
- hpcckpt_spare: the same in the job with one spare rank more (resilience.spares = 1, on a
  simulated node of its own): a crashed rank's place goes to the spare, so the job goes on at
  its size and ends on the failure-free weights; a crash with no spare left ends the job for a
  relaunch at its size (resilience.out_of_spares = "relaunch"), which starts the spare again.
  Its waste is given over the working ranks' time and with the spare's time charged too;
- hpcckpt_l4: L4 only, at its Young/Daly interval (checkpoint.mtbf_hours: all failures);
- dcp: torch.distributed.checkpoint.async_save, and
- h5py: rank 0 writes one HDF5 file; both at their Young/Daly interval from their measured cost
  (perf/goodput_app.py), restarting from their own files.
Where failures leave no version to restore (more nodes lost at once than the levels cover,
before L4 held one), every approach starts over from step 0: DCP's and h5py's apps find no
file, and hpcckpt's rows run with resilience.unrecoverable = "start_over".

Before the seeds, hpcckpt runs without failures, --prediction-steps long (--prediction-repeats
times, each between two runs without checkpoints, shared with its neighbours: the machine
drifts between runs by as much as the waste measured; medians): the checkpoint waste its
per-level choice predicted ("checkpoints X %" of the choice in force, averaged over the steps
it governed, from its first choice that timed every level) beside the waste realized over
those same steps against the mean of the runs without checkpoints before and after it; then,
for the run as a whole, the waste over
all its steps (the profile included) and over the whole run (the start and the final
version's copy to the PFS included, per second of the failure-free run's training).

Each approach also runs once without failures (--no-replay: not), and the simulator
(hpcckpt/simulate/) replays the seeds' failures fed the costs this run measured
(perf/goodput_replay.py): its waste per approach is printed beside the measured one, and
--replay-out writes what the replay needs (tests/measured/ holds one, which
tests/test_simulate.py holds the simulator to).

Reported per approach (medians over seeds): wall time; goodput = failure-free compute time /
wall time, the failure-free time being the same job run without checkpoints or failures, and
0 for a run that gave up (it delivered nothing: the job must run again); waste = 1 - goodput; steps redone; restart time by failure class (from the failure until the
relaunched job has loaded its version); the checkpoints of the last attempt. Every run must end
on the weights of the failure-free run (the same data order): proof that each restart
restored what it should.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import (REPO, compile_checkout, find_mpiexec, machine, print_machine, tagged_ranks, worker_env,
                     write_durably, write_json)
from goodput_replay import print_replay, record_for_replay  # noqa: E402  (needs the path harness sets)

APPROACHES = ("hpcckpt", "hpcckpt_disk", "hpcckpt_in_job", "hpcckpt_spare", "hpcckpt_l4", "dcp", "h5py")
# The job scripts' START_TIMEOUT as a site sets it for its scale (a cold start-up plus a
# margin; this small job starts in seconds): under ULFM a rank killed before the others are
# through MPI_Init leaves them there, and the loop's default of 300 s would hold a job that met
# it in its first attempt.
START_TIMEOUT_S = 30
MULTI_LEVEL = ("hpcckpt", "hpcckpt_disk", "hpcckpt_in_job", "hpcckpt_spare")
IN_JOB = "hpcckpt_in_job"
SPARE = "hpcckpt_spare"  # in the job with one spare rank on a node of its own
IN_JOB_APPROACHES = (IN_JOB, SPARE)
# The default leaves out the in-job run that shrinks: it finishes on fewer ranks, so its weights
# cannot be the failure-free run's, the proof every other row gives that its restarts restored
# what they should; the spare row keeps the job's size instead.
DEFAULT_APPROACHES = tuple(name for name in APPROACHES if name != IN_JOB)
SPARES = {SPARE: 1}
CLASSES = ("crash", "node", "two_nodes")
NODES_LOST = {"crash": 0, "node": 1, "two_nodes": 2}
FEATURES = 1024


@dataclass(frozen=True)
class Failure:
    at_s: float  # seconds after the job's start
    kind: str  # crash, node, two_nodes
    victims: tuple[int, ...]  # the rank (crash) or the nodes lost


def failure_schedule(seed: int, mtbf_s: float, mix: dict, ranks: int, nodes: int, horizon_s: float) -> list[Failure]:
    rng = random.Random(seed)
    kinds, weights = zip(*mix.items())
    events, now = [], 0.0
    while True:
        now += rng.expovariate(1.0 / mtbf_s)
        if now > horizon_s:
            return events
        kind = rng.choices(kinds, weights)[0]
        if kind == "crash":
            victims = (rng.randrange(ranks),)
        else:
            victims = tuple(sorted(rng.sample(range(nodes), NODES_LOST[kind])))
        events.append(Failure(round(now, 3), kind, victims))


def predicted_against_realized(root: Path, args, hidden, rates_h, pfs_mbps, ranks, nodes, memory_root) -> dict:
    """hpcckpt without failures, --prediction-repeats times, each between two runs without
    checkpoints (one before, one after, shared with the neighbouring pairs), all
    --prediction-steps long: the checkpoint waste the per-level choice predicted against the
    waste it realized against the mean of the two, medians over the pairs. Single runs on a
    shared machine differ by more than the effect, and drift: one run without checkpoints
    beside each run with them took the drift between the two for the checkpoints' doing.

    The choice's waste is per second of steady training under it, so the comparison is made
    over the steps it governed: from its first choice that timed every level to the last step
    (the profile before it and the final version's copy after it are the run's, not the
    choice's; both are reported apart). The prediction is the mean over those steps of the
    share the choice in force at each said."""
    root = root / "prediction"
    root.mkdir(parents=True, exist_ok=True)
    env, run_dir = approach_setup("nockpt", root, args.prediction_steps, hidden, rates_h, args.mtbf_s, pfs_mbps,
                                  ranks)
    plain = Job("nockpt", env, run_dir, "failure-free-nockpt", ranks, nodes, args.restart_delay)
    env, run_dir = approach_setup("hpcckpt", root, args.prediction_steps, hidden, rates_h, args.mtbf_s, pfs_mbps,
                                  ranks, memory_root)
    job = Job("hpcckpt", env, run_dir, "failure-free-hpcckpt", ranks, nodes, args.restart_delay,
              memory_dir_of(memory_root, "hpcckpt"))
    pairs = []
    baselines = [plain.run([], 3600)]
    for repeat in range(args.prediction_repeats):
        outcome = job.run([], 20 * baselines[-1].wall_s)
        baselines.append(plain.run([], 3600))
        around = baselines[-2:]
        baseline_wall = statistics.fmean(b.wall_s for b in around)
        step_s = statistics.fmean(b.step_s or 0.0 for b in around)
        training_s = args.prediction_steps * step_s or baseline_wall
        # The span of the step lines leaves out the start and the end (the final version's
        # copy to the PFS), which the choice's waste per second of training has no term for.
        spans = [b.steps_span_s for b in around]
        while_training = ((outcome.steps_span_s - statistics.fmean(spans)) / statistics.fmean(spans)
                          if outcome.steps_span_s and all(spans) else None)
        governed = under_the_choice(outcome, around)
        pairs.append({"wall_s": outcome.wall_s, "baseline_wall_s": baseline_wall,
                      "baselines_wall_s": [b.wall_s for b in around],
                      "predicted": governed["predicted"] if governed else None,
                      "realized_under_choice": governed["realized"] if governed else None,
                      "steps_under_choice": governed["steps"] if governed else 0,
                      "last_choice_predicted": predicted_checkpoint_waste(outcome.intervals),
                      "realized": (outcome.wall_s - baseline_wall) / training_s,
                      "realized_while_training": while_training,
                      "finished": outcome.finished and all(b.finished for b in around),
                      "weights_equal": all(outcome.digest == b.digest for b in around), "intervals": outcome.intervals})

    def median_of(key):
        values = [pair[key] for pair in pairs if pair[key] is not None]
        return statistics.median(values) if values else None

    def percent(value):
        return f"{100 * value:.1f} %" if value is not None else "n/a"
    predicted, under_choice = median_of("predicted"), median_of("realized_under_choice")
    off = f" ({100 * (under_choice / predicted - 1):+.0f} %)" if predicted and under_choice is not None else ""
    print(f"hpcckpt without failures, {args.prediction_steps} steps (medians of {len(pairs)} run(s), each against "
          f"the mean of the runs without checkpoints before and after it): "
          f"{median_of('wall_s'):.1f} s against {median_of('baseline_wall_s'):.1f} s; under the per-level choice "
          f"({median_of('steps_under_choice'):.0f} steps) checkpoint waste predicted {percent(predicted)}, realized "
          f"{percent(under_choice)}{off}; over all steps {percent(median_of('realized_while_training'))}, over the "
          f"whole run {percent(median_of('realized'))}"
          f"{'' if all(pair['finished'] for pair in pairs) else ', A RUN DID NOT FINISH'}"
          f"{'' if all(pair['weights_equal'] for pair in pairs) else ', WEIGHTS DIFFER'}", flush=True)
    for number, pair in enumerate(pairs, 1):
        before, after = pair["baselines_wall_s"]
        print(f"  run {number}: {pair['wall_s']:.1f} s against {before:.1f} s before and {after:.1f} s after; predicted "
              f"{percent(pair['predicted'])}, realized {percent(pair['realized_under_choice'])} over "
              f"{pair['steps_under_choice']} steps; all steps {percent(pair['realized_while_training'])}, whole run "
              f"{percent(pair['realized'])}", flush=True)
    return {"predicted": predicted, "realized_under_choice": under_choice,
            "realized_while_training": median_of("realized_while_training"), "realized": median_of("realized"),
            "pairs": pairs}


def under_the_choice(outcome: "Outcome", baselines: "list[Outcome]") -> dict | None:
    """The steps after the per-level choice first timed every level, to the last: their span
    against the same steps' mean span in `baselines`, runs without checkpoints (realized), and
    the mean over them of the checkpoint share the choice in force said (predicted). None when
    no such choice was made or fewer than two steps followed it."""
    choices = [(at, share) for at, line in outcome.interval_times
               if "not timed yet" not in line and (share := predicted_checkpoint_waste([line])) is not None]
    ours = first_line_of_each_step(outcome.step_times)
    theirs = [first_line_of_each_step(baseline.step_times) for baseline in baselines]
    if not choices:
        return None
    governed = sorted(step for step, at in ours.items() if at > choices[0][0] and all(step in t for t in theirs))
    if len(governed) < 2:
        return None
    first, last = governed[0], governed[-1]
    in_force = [next(share for at, share in reversed(choices) if at < ours[step]) for step in governed[1:]]
    realized = (ours[last] - ours[first]) / statistics.fmean(t[last] - t[first] for t in theirs) - 1
    return {"predicted": statistics.fmean(in_force), "realized": realized, "steps": last - first}


def predicted_checkpoint_waste(interval_lines: list[str]) -> float | None:
    """What the last per-level choice said its checkpoints cost, as a fraction."""
    for line in reversed(interval_lines):
        if m := re.search(r"\(checkpoints ([0-9.]+) %", line):
            return float(m.group(1)) / 100
    return None


def first_line_of_each_step(step_times: list) -> dict:
    """step -> seconds of its first line (a step's evaluation line repeats its number)."""
    first = {}
    for at, step in step_times:
        first.setdefault(step, at)
    return first


def seeds_with_failures(first: int, count: int, min_failures: int, within_s: float, mtbf_s: float, mix: dict,
                        ranks: int, nodes: int) -> list[int]:
    """The first `count` seeds from `first` whose schedule strikes at least `min_failures`
    times within `within_s` (the failure-free run's time: every approach runs at least that
    long, so each meets them), so that every seed tells the approaches apart."""
    seeds, seed = [], first
    while len(seeds) < count:
        schedule = failure_schedule(seed, mtbf_s, mix, ranks, nodes, horizon_s=within_s)
        if len(schedule) >= min_failures:
            seeds.append(seed)
        seed += 1
        if seed > first + 1000 * count:
            raise SystemExit(f"no {count} seeds with {min_failures} failures in {within_s:.0f} s at MTBF "
                             f"{mtbf_s} s: lower --min-failures or --mtbf-s")
    return seeds


# -- the job -----------------------------------------------------------------------------------
def hidden_for(state_mb: float) -> tuple[int, int]:
    """Two equal hidden layers whose parameters and momentum make about `state_mb` MB."""
    # params ~ FEATURES*h + h*h + 10*h; state = 2 * 4 bytes * params
    target = state_mb * 1e6 / 8
    h = int((-(FEATURES + 10) + ((FEATURES + 10) ** 2 + 4 * target) ** 0.5) / 2)
    return h, h


def job_toml(path: Path, run_dir: Path, steps: int, hidden: tuple, extra: dict) -> Path:
    sections = {
        "run": {"dir": str(run_dir), "steps": steps, "log_every": 1, "device": "cpu", "seed": 7},
        "model": {"kind": "mlp", "hidden": list(hidden)},
        "data": {"source": "synthetic", "features": FEATURES, "samples": 4096, "batch_size": 64},
        "optimizer": {"kind": "sgd", "lr": 0.05},
        "eval": {"every_steps": 10 * steps},
        "cluster": {"simulated_nodes": 4},
    }
    for section, values in extra.items():
        sections.setdefault(section, {}).update(values)
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def memory_dir_of(memory_root: Path | None, name: str) -> Path | None:
    """Where an approach keeps node-local versions in memory (None: on the disk only)."""
    return memory_root / name if memory_root is not None and name in ("hpcckpt", *IN_JOB_APPROACHES) else None


def approach_setup(name: str, root: Path, steps: int, hidden: tuple, rates_h: dict, mtbf_s: float,
                   pfs_mbps: float, ranks: int, memory_root: Path | None = None) -> tuple[dict, Path]:
    """(environment for the job script, the run directory) of one approach."""
    run_dir = root / name
    per_rank_pfs = pfs_mbps / ranks
    if name in (*MULTI_LEVEL, "hpcckpt_l4", "nockpt"):
        extra = {"storage": {"pfs_bandwidth_mb": round(per_rank_pfs, 3),
                             "pfs_read_bandwidth_mb": round(per_rank_pfs, 3)}}
        # One version kept on the PFS, as h5py's file and DCP's newest directory: the end-of-run
        # drain then copies no older version there (keep_pfs would keep three).
        extra["checkpoint"] = {"keep_pfs": 1}
        # As DCP's and h5py's apps do when they find no file: no version left, start over.
        extra["resilience"] = {"unrecoverable": "start_over"}
        if name in MULTI_LEVEL:
            extra["checkpoint"]["every_steps"] = "auto"
            memory = memory_dir_of(memory_root, name)
            if memory is not None:
                extra["storage"]["memory_dir"] = str(memory / "node{node}")
            extra["resilience"].update(levels=["local", "partner", "erasure", "pfs"], group_size=4, parity=2,
                                       mtbf_crash_hours=rates_h["crash"], mtbf_node_hours=rates_h["node"],
                                       mtbf_two_nodes_hours=rates_h["two_nodes"])
            if SPARES.get(name):
                # never smaller: a death no spare is left for relaunches the job at its size
                extra["resilience"].update(spares=SPARES[name], out_of_spares="relaunch")
        elif name == "hpcckpt_l4":
            extra["checkpoint"].update(every_steps="auto", mtbf_hours=mtbf_s / 3600)
            extra["resilience"]["levels"] = ["pfs"]
        else:
            extra["checkpoint"]["every_steps"] = 0
        config = job_toml(root / f"{name}.toml", run_dir, steps, hidden, extra)
        if name in IN_JOB_APPROACHES:
            return {"CONFIG": str(config), "LAUNCHER": "ulfm", "NRANKS": str(ranks + SPARES.get(name, 0)),
                    "MPIEXEC": f"{sys.executable} -m hpcckpt.cluster.ulfm_mpiexec"}, run_dir
        return {"CONFIG": str(config)}, run_dir
    config = job_toml(root / f"{name}.toml", run_dir, steps, hidden, {})
    app = (f"{sys.executable} {REPO / 'perf' / 'goodput_app.py'} --approach {name} --config {config} "
           f"--dir {run_dir / 'pfs'} --mtbf-s {mtbf_s} --pfs-mbps {pfs_mbps}")
    return {"APP": app}, run_dir


@dataclass
class Attempt:
    started_s: float
    start_step: int | None = None
    reached: int = 0
    loaded_at_s: float | None = None
    restored_from: str = ""
    in_job: bool = False  # the survivors going on in the job, not a relaunch


@dataclass
class Outcome:
    approach: str
    seed: int
    wall_s: float
    finished: bool
    digest: str
    attempts: list = field(default_factory=list)
    failures: list = field(default_factory=list)  # (at_s, kind, applied, restart_s)
    checkpoints: str = ""
    intervals: list = field(default_factory=list)
    step_s: float | None = None  # seconds per step from the step lines (of a failure-free run: the compute alone)
    lost_steps: int | None = None  # hpcckpt's runs: the steps its restart records say were done again
    steps_span_s: float | None = None  # from the first step line to the last (training, without start and end)
    step_times: list = field(default_factory=list)  # (seconds since the start, step) of each step line
    interval_times: list = field(default_factory=list)  # (seconds since the start, line) of each interval change

    @property
    def steps_run(self) -> int:
        """Steps done in all, the last attempt's included: from hpcckpt's restart records where
        the run has them (the console's step lines of Open MPI's ranks do not all reach the
        job's output), else from the step lines."""
        if self.lost_steps is not None:
            return max(a.reached for a in self.attempts) + self.lost_steps if self.attempts else 0
        return sum(max(0, a.reached - (a.start_step or 0)) for a in self.attempts)


class Job:
    """One run of the job script under the failure schedule."""

    def __init__(self, name: str, env: dict, run_dir: Path, tag: str, ranks: int, nodes: int,
                 restart_delay: float = 0.0, memory_dir: Path | None = None):
        self.name, self.run_dir, self.tag, self.ranks, self.nodes = name, run_dir, tag, ranks, nodes
        self.memory_dir = memory_dir  # the nodes' versions in memory (a node's loss takes its part)
        self.in_job = env.get("LAUNCHER") == "ulfm"
        self.env = dict(worker_env(), NRANKS=str(ranks), MPIEXEC=find_mpiexec(), MAX_RESTARTS="1000",
                        EXIT_DIR=str(run_dir), GOODPUT_JOB_TAG=tag, HPCCKPT=f"{sys.executable} -m hpcckpt",
                        RESTART_DELAY=str(restart_delay), START_TIMEOUT=str(START_TIMEOUT_S))
        self.env.update(env)
        self.lines: list[tuple[float, str]] = []

    def run(self, schedule: list[Failure], timeout_s: float) -> Outcome:
        self.lines = []  # a Job run again (the prediction check's pairs) reads only this run's output
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        if self.memory_dir is not None:
            shutil.rmtree(self.memory_dir, ignore_errors=True)
        # What the runs before wrote (the PFS copies, a whole run directory) is written back to
        # the disk now, not by the kernel during this run: no run pays for another's writes.
        os.sync()
        started = time.monotonic()
        proc = subprocess.Popen(["bash", str(REPO / "jobs" / "slurm.sbatch")], cwd=self.run_dir, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        reader = threading.Thread(target=self._read, args=(proc, started), daemon=True)
        reader.start()
        applied = []
        for failure in schedule:
            if not _sleep_until(proc, started + failure.at_s):
                break
            applied.append((failure, self._strike(failure)))
        try:
            proc.wait(timeout=max(1.0, started + timeout_s - time.monotonic()))
            finished = proc.returncode == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            finished = False
        wall = time.monotonic() - started
        reader.join(timeout=10)
        if self.memory_dir is not None:
            shutil.rmtree(self.memory_dir, ignore_errors=True)  # RAM: not left to the next run
        log = self.run_dir.parent / f"{self.tag}.log"
        log.write_text("".join(f"{at:8.2f} {line}\n" for at, line in self.lines)
                       + "".join(f"failure {f.kind} {f.victims} at {f.at_s:.2f} s: {'hit' if hit else 'missed'}\n"
                                 for f, hit in applied))
        return self._outcome(wall, finished, applied)

    def _read(self, proc, started: float) -> None:
        for line in proc.stdout:
            self.lines.append((time.monotonic() - started, line.rstrip("\n")))

    # -- failures -------------------------------------------------------------------------------
    def _strike(self, failure: Failure) -> bool:
        from hpcckpt.cluster.topology import simulated_node_of_rank

        ranks = tagged_ranks("GOODPUT_JOB_TAG", self.tag, name_contains="python")
        if failure.kind == "crash":
            victim = failure.victims[0]
            if self.in_job and victim not in ranks and ranks:
                victim = sorted(ranks)[victim % len(ranks)]  # its rank died in the job before: another's crash
            pid = ranks.get(victim)
            if pid is None:
                return False
            _signal(pid, signal.SIGKILL)
            return True
        node_of = simulated_node_of_rank(self.ranks, self.nodes)
        # A spare rank (past the working ranks) sits on a node of its own, which no failure here takes
        victims = [pid for rank, pid in ranks.items() if rank < len(node_of) and node_of[rank] in failure.victims]
        for pid in victims:  # stopped first, so none writes into its directory again
            _signal(pid, signal.SIGSTOP)
        for node in failure.victims:
            shutil.rmtree(self.run_dir / "local" / f"node{node}", ignore_errors=True)
            if self.memory_dir is not None:
                shutil.rmtree(self.memory_dir / f"node{node}", ignore_errors=True)
        if self.in_job:
            # Open MPI's runtime ends the job when it loses a node's daemon: every rank goes.
            hit = bool(ranks)
            victims = list(ranks.values())
        else:
            hit = bool(victims)
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        return hit

    # -- what the job said ------------------------------------------------------------------------
    def _outcome(self, wall: float, finished: bool, applied: list) -> Outcome:
        attempts: list[Attempt] = []
        outcome = Outcome(self.name, 0, wall, finished, "")
        for at, line in self.lines:
            if re.match(r"hpcckpt-job: attempt \d+ \(at most", line) or "going on in the job" in line:
                attempts.append(Attempt(at, in_job="going on in the job" in line))  # or a relaunch
            elif not attempts:
                continue
            elif m := re.match(r"went on from step (\d+), held in memory", line):
                attempts[-1].start_step, attempts[-1].loaded_at_s = int(m.group(1)), at
                attempts[-1].restored_from, attempts[-1].reached = "memory", int(m.group(1))
            elif m := re.match(r"restored version (\d+)(.*)", line):
                attempts[-1].start_step, attempts[-1].loaded_at_s = int(m.group(1)), at
                attempts[-1].restored_from = m.group(2).strip(" :")
                attempts[-1].reached = int(m.group(1))
            elif line.startswith("starting from scratch"):
                attempts[-1].start_step, attempts[-1].loaded_at_s, attempts[-1].reached = 0, at, 0
            elif m := re.match(r"step\s+(\d+)\s", line):
                attempts[-1].reached = max(attempts[-1].reached, int(m.group(1)))
            elif m := re.match(r"done: (\d+) steps .*weights ([0-9a-f]+)", line):
                attempts[-1].reached = max(attempts[-1].reached, int(m.group(1)))
                outcome.digest = m.group(2)
            elif line.startswith("checkpoints: "):
                outcome.checkpoints = line
            elif "interval now" in line or "per-level intervals" in line:
                outcome.intervals.append(line)
                outcome.interval_times.append((at, line))
        outcome.attempts = attempts
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file():
            restarts = [json.loads(line) for line in metrics.read_text(errors="replace").splitlines()
                        if '"event": "restart"' in line]
            outcome.lost_steps = sum(int(r.get("lost_steps", 0)) for r in restarts)
        steps = [(at, int(m.group(1))) for at, line in self.lines if (m := re.match(r"step\s+(\d+)\s", line))]
        outcome.step_times = steps
        if len(steps) > 10:
            (t0, s0), (t1, s1) = steps[len(steps) // 5], steps[-1]
            outcome.step_s = (t1 - t0) / max(1, s1 - s0)
        if len(steps) > 1:
            outcome.steps_span_s = steps[-1][0] - steps[0][0]
        hits = [failure.at_s for failure, hit in applied if hit]
        for failure, hit in applied:
            loaded = [a.loaded_at_s for a in attempts if a.loaded_at_s is not None and a.loaded_at_s > failure.at_s]
            restart = (min(loaded) - failure.at_s) if hit and loaded else None
            # A failure that strikes the restart another one began cuts it short: its restart
            # is counted once, from the later failure (None: not a whole restart of its own).
            if restart is not None and any(failure.at_s < at < failure.at_s + restart for at in hits):
                restart = None
            outcome.failures.append((failure.at_s, failure.kind, hit, restart))
        return outcome


def _sleep_until(proc, deadline: float) -> bool:
    """Sleep until `deadline` (monotonic); False if the job ended first."""
    while True:
        left = deadline - time.monotonic()
        if proc.poll() is not None:
            return False
        if left <= 0:
            return True
        time.sleep(min(left, 0.05))


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def disk_rate_mbps(directory: Path, nbytes: int = 256 << 20) -> float:
    """The node-local disk's write rate: one file, written and fsynced (median of 3)."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 << 20)
    rates = []
    for i in range(3):
        path = directory / f"disk-{i}.bin"
        started = time.perf_counter()
        write_durably(path, [block] * (nbytes // len(block)), sync_dir=False)
        rates.append(nbytes / (time.perf_counter() - started) / 1e6)
        path.unlink()
    return statistics.median(rates)


# -- the report --------------------------------------------------------------------------------
def where_the_waste_went(outcome: Outcome, baseline_s: float, step_s: float, steps: int) -> dict:
    """The wall time beyond the failure-free run, split: restarts (each failure until the
    relaunched job has loaded its version), the steps done again, and the rest (checkpoints'
    cost to training and the steps a failure cut short)."""
    waste = outcome.wall_s - baseline_s
    restarts = sum(restart for _, _, hit, restart in outcome.failures if hit and restart is not None)
    # ...and the restarts cut short by the next failure, up to it
    hits = sorted(at for at, _, hit, _ in outcome.failures if hit)
    restarts += sum(later - at for at, later, (_, _, _, restart) in
                    zip(hits, hits[1:], [f for f in outcome.failures if f[2]]) if restart is None)
    redone = max(0, outcome.steps_run - steps) * step_s
    return {"waste_s": waste, "restarts_s": restarts, "redone_s": redone, "rest_s": waste - restarts - redone}


def goodput(outcome: Outcome, baseline_s: float) -> float:
    """The failure-free time over the wall time; nothing for a run that did not finish, whose
    wall time would otherwise read as little waste."""
    return baseline_s / outcome.wall_s if outcome.finished else 0.0


def summarise(outcomes: list[Outcome], baseline_s: dict, reference: dict, steps: int, step_s: dict,
              ranks: int = 4) -> dict:
    table = {}
    for name in dict.fromkeys(o.approach for o in outcomes):
        runs = [o for o in outcomes if o.approach == name]
        goodputs = [goodput(o, baseline_s[o.seed]) for o in runs]
        split = [where_the_waste_went(o, baseline_s[o.seed], step_s[o.seed], steps) for o in runs]
        restarts: dict[str, list] = {}
        for o in runs:
            for _, kind, hit, restart in o.failures:
                if hit and restart is not None:
                    restarts.setdefault(kind, []).append(restart)
        table[name] = {
            "wall_s": statistics.median(o.wall_s for o in runs),
            "goodput": statistics.median(goodputs),
            "waste": 1 - statistics.median(goodputs),
            "waste_range": (1 - max(goodputs), 1 - min(goodputs)),
            "waste_by_seed": {o.seed: 1 - goodput(o, baseline_s[o.seed]) for o in runs},
            "failures_hit_range": (min(sum(1 for f in o.failures if f[2]) for o in runs),
                                   max(sum(1 for f in o.failures if f[2]) for o in runs)),
            "steps_redone": statistics.median(o.steps_run - steps for o in runs),
            "failures_hit": statistics.median(sum(1 for f in o.failures if f[2]) for o in runs),
            "restart_s": {kind: statistics.median(values) for kind, values in restarts.items()},
            "waste_split_s": {key: statistics.median(part[key] for part in split) for key in split[0]},
            "finished": all(o.finished for o in runs),
            # The spares' machine time charged too: the job held ranks + spares for its wall time.
            "spares": SPARES.get(name, 0),
            "waste_charged": 1 - statistics.median(goodputs) * ranks / (ranks + SPARES.get(name, 0)),
            # Going on with fewer ranks sums gradients in another order: other weights.
            "weights_equal": None if name == IN_JOB else all(o.digest == reference[o.seed] for o in runs),
            "checkpoints": [o.checkpoints for o in runs],
            "last_interval": [o.intervals[-1] if o.intervals else "" for o in runs],
        }
    return table


def weights_said(equal: bool | None) -> str:
    return "n/a" if equal is None else "equal" if equal else "DIFFER"


def print_table(table: dict) -> None:
    print(f"{'approach':<14} {'wall s':>8} {'goodput':>8} {'waste':>7} {'waste min-max':>14} {'redone':>7} "
          f"{'failures':>9} {'restart s (crash/node/two)':>28} {'finished':>8} {'weights':>8}")
    for name, row in table.items():
        restarts = "/".join(f"{row['restart_s'][k]:.1f}" if k in row["restart_s"] else "-" for k in CLASSES)
        low, high = row["waste_range"]
        spread = f"{100 * low:.1f}-{100 * high:.1f}%"
        fewest, most = row["failures_hit_range"]
        failures = f"{row['failures_hit']:.0f} ({fewest}-{most})"
        print(f"{name:<14} {row['wall_s']:8.1f} {100 * row['goodput']:7.1f}% {100 * row['waste']:6.1f}% "
              f"{spread:>14} {row['steps_redone']:7.0f} {failures:>9} {restarts:>28} "
              f"{str(row['finished']):>8} {weights_said(row['weights_equal']):>8}")
    names = list(table)
    seeds = sorted(next(iter(table.values()))["waste_by_seed"]) if table else []
    print("\nwaste by seed: " + "; ".join(
        f"seed {seed}: " + ", ".join(f"{name} {100 * table[name]['waste_by_seed'].get(seed, float('nan')):.1f}%"
                                     for name in names) for seed in seeds))
    if "hpcckpt" in table:
        for other in ("hpcckpt_l4", "dcp", "h5py", *IN_JOB_APPROACHES):
            if other in table and table[other]["waste"] > 0:
                print(f"hpcckpt's waste / {other}'s: {table['hpcckpt']['waste'] / table[other]['waste']:.2f}")
    print("\nwhere the waste went (median seconds beyond the failure-free run): restarts (failure until the "
          "version is loaded), steps redone, the rest (checkpoint cost, steps cut short)")
    for name, row in table.items():
        if row.get("spares"):
            print(f"{name}: waste {100 * row['waste']:.1f} % over the working ranks' time, "
                  f"{100 * row['waste_charged']:.1f} % with its {row['spares']} spare rank(s)' time charged too")
    for name, row in table.items():
        split = row["waste_split_s"]
        print(f"  {name:<12} waste {split['waste_s']:6.1f} s = restarts {split['restarts_s']:5.1f} + redone "
              f"{split['redone_s']:5.1f} + rest {split['rest_s']:5.1f}")
    for name, row in table.items():
        for line in row["checkpoints"][:1] + [x for x in row["last_interval"][:1] if x]:
            print(f"  {name}: {line[:300]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="how many seeds to run")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--min-failures", type=int, default=3,
                        help="seeds whose schedule has fewer failures within the failure-free run's time are "
                             "passed over (0: every seed from --first-seed)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--state-mb", type=float, default=100.0)
    parser.add_argument("--mtbf-s", type=float, default=15.0, help="mean wall time between failures, all classes")
    parser.add_argument("--mix", default="crash=0.5,node=0.35,two_nodes=0.15", help="share of each failure class")
    parser.add_argument("--pfs-fraction", type=float, default=0.1, help="PFS bandwidth / node-local disk bandwidth")
    parser.add_argument("--approaches", default=",".join(DEFAULT_APPROACHES),
                        help=f"comma-separated, of {', '.join(APPROACHES)} (default: all but hpcckpt_in_job)")
    parser.add_argument("--restart-delay", type=float, default=0.0,
                        help="the restart loop's pause between attempts (RESTART_DELAY), the same for all")
    parser.add_argument("--root", default="/tmp/hpcckpt-goodput", help="run directories and each job's output")
    parser.add_argument("--prediction-repeats", type=int, default=3,
                        help="failure-free hpcckpt runs (each between two runs without checkpoints) the "
                             "prediction check takes medians of")
    parser.add_argument("--prediction-steps", type=int, default=128,
                        help="steps of the prediction check's runs: long enough that the per-level choice, not "
                             "the profile before it, governs most of them")
    parser.add_argument("--no-prediction-check", dest="prediction_check", action="store_false",
                        help="skip hpcckpt's failure-free run (its predicted checkpoint waste against the realized)")
    parser.add_argument("--memory-root", default="/dev/shm/hpcckpt-goodput",
                        help="hpcckpt's node-local versions in memory first here (storage.memory_dir); "
                             "'' keeps them on the node-local disk")
    parser.add_argument("--json", help="write every run and the table here")
    parser.add_argument("--no-replay", dest="replay", action="store_false",
                        help="skip each approach's failure-free run and the simulator's replay of the seeds "
                             "(perf/goodput_replay.py) fed the costs they measure")
    parser.add_argument("--replay-out", help="write what the replay needs (tests/measured/ holds one) here")
    args = parser.parse_args(argv)
    approaches = [a for a in args.approaches.split(",") if a]
    unknown = [a for a in approaches if a not in APPROACHES]
    if unknown or not approaches:
        print(f"bench_goodput: --approaches {args.approaches!r}: unknown {unknown or 'empty'}; name some of "
              f"{', '.join(APPROACHES)}", file=sys.stderr)
        raise SystemExit(2)

    ranks = nodes = 4
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    host = machine(directory=root)
    print_machine(host)
    compile_checkout()
    mix = {k: float(v) for k, v in (item.split("=") for item in args.mix.split(","))}
    if set(mix) - set(CLASSES):
        raise SystemExit(f"--mix: classes are {', '.join(CLASSES)}")
    total = sum(mix.values())
    rates_h = {kind: (args.mtbf_s * total / mix[kind]) / 3600 if mix.get(kind) else 0.0 for kind in CLASSES}
    disk = disk_rate_mbps(root / "disk")
    pfs_mbps = args.pfs_fraction * disk
    hidden = hidden_for(args.state_mb)
    print(f"bench_goodput: {ranks} ranks on {nodes} simulated nodes, model hidden {hidden} (~{args.state_mb:.0f} MB "
          f"state), {args.steps} steps; node-local disk {disk:.0f} MB/s, PFS capped at {pfs_mbps:.0f} MB/s for the "
          f"job ({args.pfs_fraction:g}); failures every {args.mtbf_s:g} s on average: "
          + ", ".join(f"{k} {mix.get(k, 0) / total:.0%} (MTBF {3600 * h:.0f} s)" for k, h in rates_h.items() if h),
          flush=True)
    outcomes, baseline_s, reference, step_s = [], {}, {}, {}
    # The seed draws only the failures: one failure-free run serves every seed.
    memory_root = Path(args.memory_root) if args.memory_root else None
    env, run_dir = approach_setup("nockpt", root, args.steps, hidden, rates_h, args.mtbf_s, pfs_mbps, ranks)
    plain = Job("nockpt", env, run_dir, "nockpt", ranks, nodes, args.restart_delay)
    clean = plain.run([], 3600)
    if not clean.finished:
        raise SystemExit("the failure-free run failed:\n" + "\n".join(line for _, line in plain.lines[-60:]))
    seeds = seeds_with_failures(args.first_seed, args.seeds, args.min_failures, clean.wall_s, args.mtbf_s, mix,
                                ranks, nodes)
    free = {}
    if args.replay:  # each approach's costs, for the simulator's replay of the seeds
        for name in approaches:
            env, run_dir = approach_setup(name, root, args.steps, hidden, rates_h, args.mtbf_s, pfs_mbps, ranks,
                                          memory_root)
            job = Job(name, env, run_dir, f"free-{name}", ranks, nodes, args.restart_delay,
                      memory_dir_of(memory_root, name))
            free[name] = job.run([], timeout_s=20 * clean.wall_s)
            print(f"  {name} without failures: {free[name].wall_s:.1f} s ({free[name].checkpoints.strip()})",
                  flush=True)
    prediction = None
    if "hpcckpt" in args.approaches.split(",") and args.prediction_check:
        prediction = predicted_against_realized(root, args, hidden, rates_h, pfs_mbps, ranks, nodes, memory_root)
    print(f"seeds {seeds}: the first {args.seeds} from {args.first_seed} whose schedule has at least "
          f"{args.min_failures} failure(s) within the failure-free run's {clean.wall_s:.1f} s", flush=True)
    schedules = {}
    for seed in seeds:
        baseline_s[seed], reference[seed], step_s[seed] = clean.wall_s, clean.digest, clean.step_s or 0.0
        schedule = failure_schedule(seed, args.mtbf_s, mix, ranks, nodes, horizon_s=20 * clean.wall_s)
        schedules[seed] = schedule
        print(f"seed {seed}: failure-free {clean.wall_s:.1f} s ({1000 * step_s[seed]:.0f} ms/step, weights "
              f"{clean.digest}); schedule: "
              + ", ".join(f"{f.kind}@{f.at_s:.0f}s" for f in schedule if f.at_s < 4 * clean.wall_s), flush=True)
        order = approaches if seed % 2 else approaches[::-1]
        for name in order:
            env, run_dir = approach_setup(name, root, args.steps, hidden, rates_h, args.mtbf_s, pfs_mbps, ranks,
                                          memory_root)
            job = Job(name, env, run_dir, f"seed{seed}-{name}", ranks, nodes, args.restart_delay,
                      memory_dir_of(memory_root, name))
            outcome = job.run(schedule, timeout_s=20 * clean.wall_s)
            outcome.seed = seed
            outcomes.append(outcome)
            hits = sum(1 for f in outcome.failures if f[2])
            print(f"  {name}: {outcome.wall_s:.1f} s, goodput {100 * goodput(outcome, clean.wall_s):.1f} %, "
                  f"{len(outcome.attempts)} attempt(s), {hits} failure(s) hit, {outcome.steps_run - args.steps} "
                  f"step(s) redone, weights "
                  f"{weights_said(None if name == IN_JOB else outcome.digest == clean.digest)}"
                  f"{'' if outcome.finished else ', DID NOT FINISH'}", flush=True)
            if not outcome.finished or (name != IN_JOB and outcome.digest != clean.digest):
                sys.stderr.write("\n".join(line for _, line in job.lines[-60:]) + "\n")
    table = summarise(outcomes, baseline_s, reference, args.steps, step_s, ranks)
    print()
    print_table(table)
    replay = None
    if free:
        replay = record_for_replay(args, clean.wall_s, {name: asdict(o) for name, o in free.items()}, table,
                                   [asdict(o) for o in outcomes], schedules, pfs_mbps, IN_JOB_APPROACHES, ("h5py",),
                                   SPARES)
        print_replay(replay)
        if args.replay_out:
            write_json(args.replay_out, replay, host)
    if args.json:
        write_json(args.json, {"args": vars(args), "disk_mbps": disk, "pfs_mbps": pfs_mbps, "hidden": hidden,
                               "prediction": prediction, "replay": replay,
                               "free": {name: asdict(o) for name, o in free.items()},
                               "rates_h": rates_h, "baseline_s": baseline_s, "step_s": step_s, "table": table,
                               "runs": [asdict(o) for o in outcomes]}, host)
    ok = all(row["finished"] and row["weights_equal"] is not False for row in table.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
