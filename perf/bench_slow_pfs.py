"""A slow L4 against node-local checkpoints (#21, item 3): the same training job, checkpoints
every --every steps on all four levels with L4 due at every version, run with the PFS at its
own speed (the baseline, measured in the same run) and with every L4 store slowed by
--slow seconds (--inject slow-level, as a contended Lustre is), once with L4 at its own pace
(storage.pfs_async = true, the default) and once with every version waiting for L4 (false,
as before #21). Per variant, medians over --repeats runs in rotating order:

  interval_s    wall time between consecutive node-local checkpoints (snapshot to snapshot)
  blocking_ms   what the training loop blocked for per checkpoint (median and max)
  train_s       the training loop's wall time as the job reports it ("done: N steps in X s")
  l4_versions   versions L4 holds at the end (keep_pfs is large: none retired)

    PYTHONPATH=. python perf/bench_slow_pfs.py                     # 4 ranks, --slow 2, 3 repeats, ~2 min
    PYTHONPATH=. python perf/bench_slow_pfs.py --slow 1 --repeats 5 --json slow_pfs.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from harness import machine, median, print_machine, rotated, run_mpi, write_json  # perf/ is on sys.path

JOB = """
[run]
dir = "{run}"
steps = {steps}
log_every = {steps}
seed = 11
device = "cpu"
[model]
kind = "mlp"
hidden = [256, 128]
[data]
source = "digits"
batch_size = 64
[eval]
every_steps = 0
[checkpoint]
every_steps = {every}
keep_local = 2
keep_pfs = 1000
[storage]
pfs_every = 1
pfs_async = {pfs_async}
[resilience]
levels = ["local", "partner", "erasure", "pfs"]
group_size = 4
parity = 1
[cluster]
simulated_nodes = {ranks}
"""


def run_variant(root: Path, args, slow: float | None, pfs_async: bool) -> dict:
    run = root / "run"
    shutil.rmtree(run, ignore_errors=True)
    config = root / "job.toml"
    config.write_text(JOB.format(run=run, steps=args.steps, every=args.every, ranks=args.ranks,
                                 pfs_async=str(pfs_async).lower()))
    inject = ["--inject", f"slow-level:level=pfs:seconds={slow}"] if slow else []
    proc = run_mpi(args.ranks, [sys.executable, "-m", "hpcckpt", "train", "-c", str(config), *inject],
                   cwd=root, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    snapshots = sorted((r["step"], r["time"]) for r in records if "checkpoint_blocking_s" in r)
    blocking = [r["checkpoint_blocking_s"] for r in records if "checkpoint_blocking_s" in r]
    intervals = [b[1] - a[1] for a, b in zip(snapshots, snapshots[1:])]
    done = re.search(r"done: \d+ steps in ([\d.]+) s", proc.stdout)
    return {
        "interval_s": median(intervals), "interval_max_s": max(intervals, default=None),
        "blocking_median_s": median(blocking), "blocking_max_s": max(blocking, default=None),
        "train_s": float(done.group(1)) if done else None,
        "l4_versions": len(list((run / "pfs").glob("v*"))), "checkpoints": len(snapshots),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--every", type=int, default=100, help="checkpoint every N steps")
    parser.add_argument("--slow", type=float, default=2.0, help="seconds added to each L4 store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    variants = {"baseline": (None, True), f"L4 +{args.slow:g} s, own pace": (args.slow, True),
                f"L4 +{args.slow:g} s, waited": (args.slow, False)}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="bench-slow-pfs-") as tmp:
        host = machine(directory=tmp)
        print_machine(host)
        for repeat in range(args.repeats):
            for name in rotated(variants, repeat):
                results[name].append(run_variant(Path(tmp), args, *variants[name]))
    keys = ("interval_s", "interval_max_s", "blocking_median_s", "blocking_max_s", "train_s", "l4_versions",
            "checkpoints")
    summary = {name: {key: median([r[key] for r in runs]) for key in keys} for name, runs in results.items()}
    print(f"{args.ranks} ranks, checkpoint every {args.every} steps of {args.steps}, all levels, L4 every version; "
          f"medians of {args.repeats}")
    print(f"{'variant':<24} {'interval s':>10} {'max':>7} {'blocking ms':>11} {'max':>8} {'train s':>8} "
          f"{'L4 versions':>12}")
    for name, row in summary.items():
        print(f"{name:<24} {row['interval_s']:>10.3f} {row['interval_max_s']:>7.3f} "
              f"{1000 * row['blocking_median_s']:>11.1f} {1000 * row['blocking_max_s']:>8.1f} {row['train_s']:>8.2f} "
              f"{row['l4_versions']:>8.0f} of "
              f"{row['checkpoints']:.0f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "summary": summary, "runs": results}, host)


if __name__ == "__main__":
    main()
