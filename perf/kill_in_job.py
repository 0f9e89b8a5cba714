"""Kills from outside at random moments of the README's main job under the ULFM launcher: does
every run recover in the job, fast, and end where a relaunch would?

    python perf/kill_in_job.py                     # 20 runs, one rank each
    python perf/kill_in_job.py --runs 5 --seed 3 --json /tmp/kills.json

Each run: `python -m hpcckpt.cluster.ulfm_mpiexec -n 4 hpcckpt train -c jobs/local.toml` (the
README's job, a step logged each step), one random rank SIGKILLed from outside as soon as a
random step (10-390) shows in metrics.jsonl. Checked per run:
- the launcher exits 0 (its ranks' exit record says 0: Open MPI's own code does not tell),
  the job ending on 3 ranks;
- recovery time: from the kill to the first step the survivors finish after it (one host,
  one clock; metrics.jsonl's times), against 1 s;
- the final weights equal those of a relaunch onto 3 ranks from the step the survivors went
  on from: the job run on 4 ranks to that step (its final version there), then resumed on
  3 ranks (the mpich wheel, as the job scripts relaunch).
A run that hangs (no exit in --timeout) is stopped and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, compile_checkout, machine, median, mpiexec_command, pin_threads, print_machine, \
    tagged_ranks, worker_env, write_json

RANKS = 4
STEPS = 400  # the README job's (--steps: another)
JOB = REPO / "jobs" / "local.toml"
LOGGED = ["--set", "run.log_every=1"]
TAG_VARIABLE = "KILL_IN_JOB_TAG"  # how this script finds a run's ranks (not HPCCKPT_*: no config key)


def train_command(ranks: int, run_dir: Path, ulfm: bool, extra: list[str]) -> tuple[list[str], dict]:
    args = ["-m", "hpcckpt", "train", "-c", str(JOB), "--set", f"run.dir={run_dir}", *extra]
    if ulfm:
        return [sys.executable, "-m", "hpcckpt.cluster.ulfm_mpiexec", "-n", str(ranks), sys.executable, *args], {}
    prefix, _ = mpiexec_command(ranks)
    return [*prefix, sys.executable, *args], {}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def newest_step(run_dir: Path) -> int:
    try:
        return int((run_dir / "heartbeat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def relaunched_digest(step: int, work: Path) -> str | None:
    """The final weights of a relaunch onto 3 ranks from a version of `step` written by 4
    ranks (the mpich wheel, as the job scripts relaunch): the job run on 4 ranks to `step`
    (its final version), then resumed on 3."""
    run_dir = work / f"relaunch-{step}"
    shutil.rmtree(run_dir, ignore_errors=True)
    for ranks, steps in ((RANKS, step), (RANKS - 1, STEPS)):
        command, _ = train_command(ranks, run_dir, False, ["--set", f"run.steps={steps}",
                                                           "--set", f"cluster.simulated_nodes={ranks}"])
        proc = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            print(f"  the relaunch from step {step} failed ({proc.returncode}): {proc.stdout[-800:]}{proc.stderr[-800:]}")
            return None
    metrics = records(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    restarts = [r for r in metrics if r.get("event") == "restart"]
    finals = [r for r in metrics if r.get("final")]
    if not restarts or restarts[-1].get("step") != step or not finals:
        print(f"  the relaunch did not resume from step {step}: {restarts[-1:]}")
        return None
    return finals[-1]["weights_digest"]


def one_run(number: int, rng: random.Random, work: Path, timeout: float, at: int | None = None,
            dump_after: float | None = None) -> dict:
    run_dir = work / f"run-{number}"
    shutil.rmtree(run_dir, ignore_errors=True)
    target, victim = rng.randrange(10, STEPS - 10), rng.randrange(RANKS)
    target = at if at is not None else target
    tag = f"kill-{os.getpid()}-{number}"
    command, _ = train_command(RANKS, run_dir, True, LOGGED)
    exit_file = work / f".exit-{number}"
    exit_file.unlink(missing_ok=True)
    env = {**worker_env(), TAG_VARIABLE: tag, "HPCCKPT_EXIT_FILE": str(exit_file)}
    output = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    killed_at = None
    started = time.monotonic()
    while process.poll() is None and time.monotonic() - started < timeout:
        if newest_step(run_dir) >= target:
            pid = tagged_ranks(TAG_VARIABLE, tag).get(victim)
            if pid is not None:
                killed_at = time.time()
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    dumps = ""
    if dump_after and killed_at is not None:
        try:
            process.wait(timeout=dump_after)
        except subprocess.TimeoutExpired:  # a recovery that takes this long: where is every rank?
            for rank, pid in sorted(tagged_ranks(TAG_VARIABLE, tag).items()):
                spy = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--native", "--pid",
                                      str(pid)], capture_output=True, text=True)
                dumps += f"\n=== rank {rank} (pid {pid}), {time.time() - killed_at:.1f} s after the kill\n" \
                    f"{spy.stdout}{spy.stderr}"
    try:
        process.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        hung = True
    output.seek(0)
    out = output.read()
    output.close()
    recorded = exit_file.read_text() if exit_file.exists() else ""
    exit_code = 0 if process.returncode == 0 and "exit_code=0" in recorded.splitlines() else (process.returncode or 1)
    metrics = records(run_dir)
    failures = [r for r in metrics if r.get("event") == "process_failure"]
    restarts = [r for r in metrics if r.get("event") == "restart" and r.get("attempt", 1) > 1]
    after = [r for r in metrics if "loss" in r and "step" in r and killed_at is not None and r.get("time", 0) > killed_at
             and restarts and r["step"] > restarts[0]["step"]]
    recovery = (after[0]["time"] - killed_at) if after else None
    finals = [r for r in metrics if r.get("final")]
    result = {"run": number, "victim": victim, "kill_step": target, "killed": killed_at is not None, "hung": hung,
              "exit": exit_code, "ranks_left": failures[-1]["ranks_left"] if failures else None,
              "shrink_s": failures[-1]["shrink_s"] if failures else None,
              "went_on_from": restarts[0]["step"] if restarts else None,
              "sources": sorted(set(restarts[0]["sources"])) if restarts else None,
              "recovery_s": round(recovery, 4) if recovery is not None else None,
              "digest": finals[-1]["weights_digest"] if finals else None,
              "shrink_never_returned": "did not finish in" in out}
    if result["went_on_from"] is not None and result["digest"] is not None:
        expected = relaunched_digest(result["went_on_from"], work)
        result["relaunch_digest"] = expected
        result["equal_to_relaunch"] = expected is not None and expected == result["digest"]
    if hung or exit_code != 0:
        result["output"] = out[-3000:]
        (work / f"run-{number}.out").write_text(out + dumps)  # kept, whole, for a run that went wrong
    return result


def main() -> int:
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a run counts as hung")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hpcckpt-kill-in-job")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--dump-after", type=float, help="where a run has not ended this many seconds after the "
                        "kill, each rank's stacks (py-spy) go into its kept output")
    parser.add_argument("--steps", type=int, default=400, help="run.steps (the README job: 400)")
    parser.add_argument("--eval-every", type=int, help="eval.every_steps (the README job: 50)")
    parser.add_argument("--at", type=int, action="append", default=[],
                        help="kill at this step (repeatable, taken in turn) instead of a random one")
    args = parser.parse_args()
    STEPS = args.steps
    LOGGED.extend(["--set", f"run.steps={args.steps}"] + (["--set", f"eval.every_steps={args.eval_every}"]
                                                           if args.eval_every else []))
    pin_threads()
    compile_checkout()
    where = machine()
    print_machine(where)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    rng = random.Random(args.seed)
    results = []
    for number in range(1, args.runs + 1):
        at = args.at[(number - 1) % len(args.at)] if args.at else None
        result = one_run(number, rng, args.dir, args.timeout, at, args.dump_after)
        results.append(result)
        print(f"run {number}: rank {result['victim']} killed at step {result['kill_step']} -> exit {result['exit']}"
              f"{' HUNG' if result['hung'] else ''}, {result['ranks_left']} rank(s) left, went on from step "
              f"{result['went_on_from']} ({result['sources']}), recovered in {result['recovery_s']} s, shrink "
              f"{result['shrink_s']} s, weights {'= relaunch' if result.get('equal_to_relaunch') else '!= relaunch'}",
              flush=True)
        if "output" in result:
            print("  " + result["output"][-1500:].replace("\n", "\n  "))
        if result["exit"] == 0 and result.get("equal_to_relaunch"):  # else kept, to look at
            shutil.rmtree(args.dir / f"run-{number}", ignore_errors=True)
    times = [r["recovery_s"] for r in results if r["recovery_s"] is not None]
    summary = {"runs": len(results), "exit_0": sum(r["exit"] == 0 for r in results),
               "hung": sum(r["hung"] for r in results), "on_3_ranks": sum(r["ranks_left"] == 3 for r in results),
               "recovered_under_1s": sum(t < 1.0 for t in times), "recovery_median_s": median(times),
               "recovery_max_s": max(times) if times else None,
               "equal_to_relaunch": sum(bool(r.get("equal_to_relaunch")) for r in results),
               "from_memory": sum(r["sources"] == ["memory"] for r in results if r["sources"]),
               "shrink_never_returned": sum(r["shrink_never_returned"] for r in results)}
    print("summary: " + json.dumps(summary))
    if args.json:
        write_json(args.json, {"summary": summary, "runs": results, "seed": args.seed}, where)
    ok = summary["exit_0"] == summary["on_3_ranks"] == summary["equal_to_relaunch"] == len(results)
    return 0 if ok and summary["recovered_under_1s"] == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
