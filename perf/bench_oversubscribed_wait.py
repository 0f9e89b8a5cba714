"""How MPICH waits where a node has more ranks than cores: the library's sleeping wait
(cluster/oversubscription.py sets MPIR_CVAR_ENABLE_HEAVY_YIELD=1 there) against MPICH's
spinning default, the same job in the same run.

    python perf/bench_oversubscribed_wait.py                  # 4 ranks, 2000 steps, 5 repeats
    python perf/bench_oversubscribed_wait.py --ranks 4 --steps 400 --repeats 3 --json out.json

The job: `hpcckpt train` with the Slurm tests' settings (an MLP on the digits, a version
every 50 steps on all four levels, 4 simulated nodes) over the mpich wheel's mpiexec. Variants,
alternated repeat by repeat: `spinning` (MPIR_CVAR_ENABLE_HEAVY_YIELD=0, the user's choice,
which the library leaves alone) and `library` (the variable unset: the library decides). Per
run: wall time, the job's CPU time (user + system of the launcher and its ranks) and the
final weights' digest, which must be the same in every run. Reported: medians and the
library's ratio to spinning. Meaningful only where the ranks outnumber the cores; on a
machine with a core per rank both variants spin and the script says so.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import alternated, machine, median, mpiexec_command, print_machine, worker_env, write_json

VARIANTS = {"spinning": {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"}, "library": {}}


def job_config(run_dir: Path, steps: int) -> str:
    return f"""
[run]
dir = "{run_dir}"
steps = {steps}
log_every = {steps}
seed = 5
device = "cpu"
[model]
kind = "mlp"
hidden = [32, 16]
[data]
source = "digits"
batch_size = 32
[eval]
every_steps = 0
[checkpoint]
every_steps = 50
keep_local = 2
keep_pfs = 2
split_threshold_kb = 4
[storage]
pfs_every = 4
[resilience]
levels = ["local", "partner", "erasure", "pfs"]
group_size = 4
parity = 1
[cluster]
simulated_nodes = 4
"""


def one_run(variant: str, ranks: int, steps: int, scratch: Path) -> dict:
    run_dir = scratch / f"run-{variant}-{time.monotonic_ns()}"
    config = scratch / f"{run_dir.name}.toml"
    config.write_text(job_config(run_dir, steps))
    env = worker_env()
    env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)
    env.update(VARIANTS[variant])
    prefix, _ = mpiexec_command(ranks)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([*prefix, sys.executable, "-m", "hpcckpt", "train", "-c", str(config)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: the job failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    done = [line for line in proc.stdout.splitlines() if line.startswith("done:")]
    digest = done[-1].split("weights ")[1].split()[0] if done else None
    return {"variant": variant, "wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime)
            + (after.ru_stime - before.ru_stime), "system_s": after.ru_stime - before.ru_stime, "digest": digest}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the runs and medians here")
    args = parser.parse_args(argv)
    found = machine()
    print_machine(found)
    cores = os.cpu_count() or 1
    if args.ranks <= cores:
        print(f"note: {args.ranks} ranks on {cores} cores: the library leaves MPICH spinning, so both variants "
              "are the same here")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_oversubscribed_") as scratch:
        for repeat in range(args.repeats):
            for variant in alternated(list(VARIANTS), repeat):
                run = one_run(variant, args.ranks, args.steps, Path(scratch))
                run["repeat"] = repeat
                runs.append(run)
                print(f"  repeat {repeat} {variant:9s} wall {run['wall_s']:6.2f} s  cpu {run['cpu_s']:6.2f} s  "
                      f"(system {run['system_s']:5.2f} s)  weights {run['digest']}", flush=True)
    digests = {run["digest"] for run in runs}
    if len(digests) != 1:
        raise SystemExit(f"the runs ended on different weights: {sorted(map(str, digests))}")
    medians = {variant: {key: median([r[key] for r in runs if r["variant"] == variant])
                         for key in ("wall_s", "cpu_s", "system_s")} for variant in VARIANTS}
    print(f"\n{args.ranks} ranks on {cores} cores, {args.steps} steps, medians of {args.repeats}:")
    for variant, values in medians.items():
        print(f"  {variant:9s} wall {values['wall_s']:6.2f} s  cpu {values['cpu_s']:6.2f} s  "
              f"system {values['system_s']:5.2f} s")
    print(f"  library / spinning: wall {medians['library']['wall_s'] / medians['spinning']['wall_s']:.2f}, "
          f"cpu {medians['library']['cpu_s'] / medians['spinning']['cpu_s']:.2f}; weights {digests.pop()} in every run")
    if args.json:
        write_json(args.json, {"ranks": args.ranks, "steps": args.steps, "runs": runs, "medians": medians}, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
