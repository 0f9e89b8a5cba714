"""What checkpoints cost under the fault-tolerant MPI (the ULFM launch, with in-job recovery
on) against the mpich wheel, measured in pairs run one after the other in the same run.

    python perf/bench_ulfm_pipeline.py                       # 3 pairs of each case
    python perf/bench_ulfm_pipeline.py --pairs 5 --serialized --json /tmp/ulfm_pipeline.json

Two cases:
- the README's main job (`hpcckpt train -c jobs/local.toml`, 4 ranks, all four levels, a
  version every 50 steps): its summary line's blocking median and estimated overhead, under
  `mpiexec` (the mpich wheel) and under `python -m hpcckpt.cluster.ulfm_mpiexec`;
- perf/bench_checkpoint.py's 100 MB case (`--quick --approaches hpcckpt`): blocking median
  and the papers' overhead, with `--mpiexec` left out and with `--mpiexec ulfm`; on 4 ranks
  and on 2 (`--checkpoint-ranks`). On a 2-core machine 4 ranks share each core, and the
  blocking time is then mostly how long the application's thread waits for its core back
  after waking the copier thread, which Open MPI's ranks wait longer for than MPICH's; 2
  ranks give each rank a core, as a cluster does.
The `ulfm` variant asks for MPI_THREAD_MULTIPLE, the launch's default (the save pipeline's
threads behind the application, kept out of MPI while commit_step's agreement is in it:
cluster/mpi_gate.py). --serialized adds a third variant of each: serialized MPI, every
level's transfers on the application's thread.
Reported: medians over the pairs, and the ULFM/mpich ratios (target: within 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import REPO, compile_checkout, machine, median, mpiexec_command, pin_threads, print_machine, \
    worker_env, write_json

SUMMARY = re.compile(r"checkpoints: (\d+) taken.*blocking median ([\d.]+) ms, max [\d.]+ ms, estimated overhead "
                     r"([\d.]+) %")


def readme_job(variant: str, run_dir: Path) -> dict:
    args = ["-m", "hpcckpt", "train", "-c", str(REPO / "jobs" / "local.toml"), "--set", f"run.dir={run_dir}"]
    env = worker_env()
    if variant == "mpich":
        prefix, _ = mpiexec_command(4)
        command = [*prefix, sys.executable, *args]
    else:
        command = [sys.executable, "-m", "hpcckpt.cluster.ulfm_mpiexec", "-n", "4", sys.executable, *args]
        env["MPI4PY_RC_THREAD_LEVEL"] = "serialized" if variant == "ulfm_serialized" else "multiple"
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    found = SUMMARY.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"the README job under {variant} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    result = {"checkpoints": int(found.group(1)), "blocking_ms": float(found.group(2)),
              "overhead_pct": float(found.group(3))}
    if result["checkpoints"] != 8 or "died" in proc.stderr:  # 400 steps, a version every 50: not this run
        result["output"] = (proc.stdout + proc.stderr)[-4000:]
        print(f"  {variant}: {result['checkpoints']} checkpoints in the summary, not 8; its output:\n"
              + result["output"].replace("\n", "\n    "), flush=True)
    return result


def checkpoint_bench(variant: str, directory: Path, ranks: int) -> dict:
    out = directory / f"bench_checkpoint_{variant}_{ranks}.json"
    command = [sys.executable, str(REPO / "perf" / "bench_checkpoint.py"), "--quick", "--ranks", str(ranks),
               "--approaches", "hpcckpt", "--freq", "", "--json", str(out)]
    env = worker_env()
    if variant != "mpich":
        command += ["--mpiexec", "ulfm"]
        env["MPI4PY_RC_THREAD_LEVEL"] = "serialized" if variant == "ulfm_serialized" else "multiple"
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"bench_checkpoint under {variant} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    run = json.loads(out.read_text())["runs"][f"r{ranks}_100MB"]["approaches"]["hpcckpt"]
    return {"blocking_ms": run["blocking_ms"], "overhead_pct": run["overhead_pct"],
            "wall_overhead_pct": run.get("wall_overhead_pct")}


def summarise(name: str, by_variant: dict) -> dict:
    out = {}
    for variant, runs in by_variant.items():
        out[variant] = {key: median([r[key] for r in runs]) for key in ("blocking_ms", "overhead_pct")}
        out[variant]["runs"] = runs
    for variant in by_variant:
        if variant != "mpich":
            for key in ("blocking_ms", "overhead_pct"):
                base = out["mpich"][key]
                out[variant][f"{key}_vs_mpich"] = out[variant][key] / base if base else None
    print(f"\n{name}:")
    for variant, figures in out.items():
        ratios = "" if variant == "mpich" else (f"  ({figures['blocking_ms_vs_mpich']:.2f}x and "
                                                f"{figures['overhead_pct_vs_mpich']:.2f}x mpich's)")
        print(f"  {variant:16s} blocking median {figures['blocking_ms']:.2f} ms, overhead "
              f"{figures['overhead_pct']:.2f} %{ratios}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--serialized", action="store_true", help="also the ULFM launch with serialized MPI")
    parser.add_argument("--skip-checkpoint-bench", action="store_true", help="the README job only")
    parser.add_argument("--checkpoint-ranks", default="4,2",
                        help="rank counts of the 100 MB case (default 4,2: 4 shares two cores per rank on a 2-core "
                             "machine, 2 gives each rank a core)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    pin_threads()
    compile_checkout()
    where = machine()
    print_machine(where)
    variants = ["mpich", "ulfm"] + (["ulfm_serialized"] if args.serialized else [])
    directory = Path(tempfile.mkdtemp(prefix="bench_ulfm_pipeline_"))
    readme = {variant: [] for variant in variants}
    checkpoint_ranks = [int(n) for n in args.checkpoint_ranks.split(",") if n]
    bench = {ranks: {variant: [] for variant in variants} for ranks in checkpoint_ranks}
    try:
        for pair in range(args.pairs):
            order = variants if pair % 2 == 0 else list(reversed(variants))  # who goes first alternates
            for variant in order:
                run_dir = directory / f"readme-{variant}-{pair}"
                readme[variant].append(readme_job(variant, run_dir))
                shutil.rmtree(run_dir, ignore_errors=True)
                print(f"pair {pair + 1}, README job, {variant}: {readme[variant][-1]}", flush=True)
            for ranks in checkpoint_ranks if not args.skip_checkpoint_bench else ():
                for variant in order:
                    os.sync()
                    bench[ranks][variant].append(checkpoint_bench(variant, directory, ranks))
                    print(f"pair {pair + 1}, bench_checkpoint 100 MB, {ranks} ranks, {variant}: "
                          f"{bench[ranks][variant][-1]}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result = {"readme_job": summarise("the README's main job (4 ranks, 400 steps, a version every 50)", readme),
              "pairs": args.pairs}
    for ranks in checkpoint_ranks if not args.skip_checkpoint_bench else ():
        key = "bench_checkpoint_100MB" if ranks == 4 else f"bench_checkpoint_100MB_{ranks}ranks"
        result[key] = summarise(f"bench_checkpoint --quick, 100 MB, {ranks} ranks", bench[ranks])
    if args.json:
        write_json(args.json, result, where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
