"""GPU snapshot cost (issue #5, H100 targets): runtime overhead with a checkpoint every 10 steps
and all four levels on, and the snapshot's cost against a bare device-to-device copy of the
same shard, measured in the same run.

    python perf/bench_gpu_snapshot.py                 # 100 MB and 1 GB states, 1 and 4 ranks on one GPU
    python perf/bench_gpu_snapshot.py --quick         # 100 MB, 4 ranks
    python perf/bench_gpu_snapshot.py --json out.json

Without a GPU that CuPy can use it says so and exits 0 (its --json then records the skip and
the machine).

The parent launches `mpiexec -n R python perf/bench_gpu_snapshot.py --worker ...` per (state,
ranks). Each worker builds one GPU `Trainer` (MLP on synthetic data, SGD with momentum, float32;
the state is parameters + momentum) and alternates, over --rounds rounds, a segment without
checkpoints ("none") and segments with the real engine for each --modes value of
checkpoint.gpu_snapshot ("device", "pinned"): begin_checkpoint(copy_in_background=True) before
the step, capture() after each weight update (the trainer's CaptureAfterUpdate hook), then
end_checkpoint(). Levels: 4 ranks -> local, partner, erasure (group 4, parity 2), pfs on 4
simulated nodes; 1 rank -> local, pfs. train_step() synchronizes the device at its end, so a
step's time includes all GPU work it waited for.

Metrics (a step's time and a checkpoint's cost are the slowest rank's; medians over checkpoints):
- bare_d2d_ms: copying this rank's shard, piece by piece with the same (strided) views, into
  preallocated device buffers on the compute stream, then synchronizing: what a synchronous
  GPU snapshot costs. flat_d2d_ms: one contiguous device copy of as many bytes.
- host_blocking_ms: what the checkpoint calls held the host (begin + captures + end +
  before_update waits), as in bench_checkpoint.
- gpu_copy_ms: GPU time of the snapshot's copies on the side stream (CUDA events).
- step_delay_ms: the paper's overhead in milliseconds: mean of checkpointed steps and the steps
  right after them minus the mean of the other steps; what the snapshot really costs the
  training stream (compared with bare_d2d_ms for the 1.5x target).
- overhead_pct (paper definition, as a % of the clean step) and wall_overhead_pct (mean step
  time of the segment against the "none" segments).
- durable_s per level; persist_waits: checkpoints whose begin waited for the previous persist.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import alternated, machine, print_machine, run_worker, write_json  # perf/ is on sys.path
from harness import median as _median  # None/NaN: no such level this time
from harness import paper_delay

FEATURES = 1024
MODELS = {"100MB": [2048, 2048, 2048], "1GB": [8192, 8192, 8192]}


def _bare_copies(ckpt, rank, repeats=7):
    """Synchronous device-to-device copies of this rank's pieces (same views as the engine)."""
    import cupy

    from hpcckpt.format.layout import piece_view_slices

    regions = []
    for tl in ckpt.layout.rank_pieces(rank):
        if not tl.piece_nbytes(rank):
            continue
        array = ckpt.arrays.arrays[tl.name].array
        region = array.reshape(tl.logical_shape)[piece_view_slices(tl, rank)]
        regions.append(cupy.moveaxis(region, tl.axis, 0) if tl.axis else region)
    buffers = [cupy.empty(r.shape, r.dtype) for r in regions]
    nbytes = sum(int(b.nbytes) for b in buffers)
    flat_src, flat_dst = cupy.empty(max(1, nbytes), cupy.uint8), cupy.empty(max(1, nbytes), cupy.uint8)
    piecewise, flat = [], []
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        started = time.perf_counter()
        for buffer, region in zip(buffers, regions):
            cupy.copyto(buffer, region)
        cupy.cuda.Device().synchronize()
        piecewise.append(time.perf_counter() - started)
        started = time.perf_counter()
        flat_dst[...] = flat_src
        cupy.cuda.Device().synchronize()
        flat.append(time.perf_counter() - started)
    del buffers, flat_src, flat_dst
    cupy.get_default_memory_pool().free_all_blocks()
    return statistics.median(piecewise), statistics.median(flat), nbytes


def worker(args):
    from mpi4py import MPI

    from hpcckpt.ckpt.engine import Checkpointer
    from hpcckpt.cluster.backend import select_backend
    from hpcckpt.config import load_config
    from hpcckpt.runlog import RunLog
    from hpcckpt.train.loop import CaptureAfterUpdate
    from hpcckpt.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    root = Path(args.run_root)
    overrides = [f"model.hidden={json.dumps(MODELS[args.model])}", "data.source=synthetic",
                 f"data.features={FEATURES}", "data.samples=4096", "data.batch_size=256", "optimizer.kind=sgd",
                 "run.device=gpu", "storage.pfs_every=1", f"run.dir={root / 'train'}"]
    config = load_config(None, overrides, environ={})
    log = RunLog(root / "train", rank, size, console=False)
    trainer = Trainer(config, comm, select_backend("gpu", local_rank=rank), log)
    state_bytes = sum(int(a.nbytes) for _, a in trainer.protected_arrays())
    levels = ["local", "partner", "erasure", "pfs"] if size >= 4 else ["local", "pfs"]
    for _ in range(3):
        trainer.train_step()

    def gather_max(values):
        rows = comm.gather(values, root=0)
        return [max(col) for col in zip(*rows)] if rank == 0 else None

    steps = args.every * args.nckpt + 2
    raw = {name: [] for name in ["none", *args.modes]}
    bare = None
    for round_index in range(args.rounds):
        for name in alternated(["none", *args.modes], round_index):
            ckpt = hook = None
            if name != "none":
                directory = root / name
                if rank == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                comm.Barrier()
                cfg = load_config(None, overrides + [
                    f"run.dir={directory}", f"cluster.simulated_nodes={size}",
                    f"resilience.levels={json.dumps(levels)}", "resilience.group_size=4", "resilience.parity=2",
                    f'checkpoint.gpu_snapshot="{name}"'], environ={})
                ckpt = Checkpointer(comm, cfg, log=log)
                for array_name, array in trainer.protected_arrays():
                    ckpt.protect(array_name, array)
                ckpt.register_state("trainer", trainer.training_state, trainer.load_training_state)
                hook = CaptureAfterUpdate(ckpt, trainer)
                trainer.step_hooks = (hook,)
                if bare is None:
                    bare = _bare_copies(ckpt, rank)
                ckpt.begin_checkpoint(trainer.step + 1, copy_in_background=True)  # untimed warm-up
                trainer.train_step()
                ckpt.end_checkpoint({})
                ckpt.wait()
            comm.Barrier()
            times, flags, records = [], [], []
            for i in range(1, steps + 1):
                due = ckpt is not None and i % args.every == 0
                started = time.perf_counter()
                begin_s = end_s = 0.0
                if due:
                    t = time.perf_counter()
                    ckpt.begin_checkpoint(trainer.step + 1, copy_in_background=True)
                    begin_s = time.perf_counter() - t
                trainer.train_step()
                if due:
                    t = time.perf_counter()
                    report = ckpt.end_checkpoint({})
                    end_s = time.perf_counter() - t
                    records.append({"report": report, "begin": begin_s, "end": end_s})
                times.append(time.perf_counter() - started)
                flags.append(due)
            rows = []
            if ckpt is not None:
                ckpt.wait()
                for record in records:
                    r = record["report"]
                    rows.append([record["begin"] + r.captured_early_s + record["end"] + r.copy_wait_s,
                                 r.device_copy_s, r.device_to_host_s, record["begin"],
                                 *[r.durable_s.get(lv, float("nan")) for lv in levels]])
                trainer.step_hooks = ()
                ckpt.close()
                if rank == 0:
                    shutil.rmtree(root / name, ignore_errors=True)
            times = gather_max(times)
            rows = comm.gather(rows, root=0)
            if rank == 0:
                raw[name].append({"times": times, "flags": flags,
                                  "rows": [[max(col) for col in zip(*per_ckpt)] for per_ckpt in zip(*rows)]})
            print(f"[rank {rank}] {args.model} x{size} {name}: round {round_index}", file=sys.stderr, flush=True)
    bare_rows = comm.gather(bare, root=0)
    if rank != 0:
        return
    base_means = [statistics.fmean(seg["times"]) for seg in raw["none"]]
    base = statistics.fmean(base_means)
    out = {"ranks": size, "model": args.model, "state_bytes": state_bytes, "levels": levels, "every": args.every,
           "nckpt": args.nckpt, "rounds": args.rounds, "step_ms": 1e3 * statistics.median(
               [t for seg in raw["none"] for t in seg["times"]]),
           "bare_d2d_ms": 1e3 * max(b[0] for b in bare_rows), "flat_d2d_ms": 1e3 * max(b[1] for b in bare_rows),
           "shard_bytes": max(b[2] for b in bare_rows), "modes": {}}
    for name in args.modes:
        delays, paper, wall = [], [], []
        rows = [row for seg in raw[name] for row in seg["rows"]]
        for seg in raw[name]:
            delay, clean = paper_delay(seg["times"], seg["flags"])
            delays.append(delay)
            paper.append(100 * delay / clean)
            wall.append(100 * (statistics.fmean(seg["times"]) - base) / base)
        out["modes"][name] = {
            "host_blocking_ms": 1e3 * _median([r[0] for r in rows]),
            "gpu_copy_ms": 1e3 * _median([r[1] for r in rows]),
            "device_to_host_ms": 1e3 * _median([r[2] for r in rows]),
            "begin_wait_ms": 1e3 * _median([r[3] for r in rows]),
            "step_delay_ms": 1e3 * statistics.median(delays),
            "overhead_pct": statistics.median(paper),
            "wall_overhead_pct": statistics.median(wall),
            "durable_s": {lv: _median([r[4 + i] for r in rows]) for i, lv in enumerate(levels)},
        }
    write_json(args.out, out)


def parent(args):
    from hpcckpt.cluster.backend import gpu_available

    host = machine(args.mpiexec, args.tmp)
    print_machine(host)
    if not gpu_available():
        reason = "no GPU that CuPy can use: nothing to measure"
        print(f"bench_gpu_snapshot: skipped ({reason})")
        if args.json:
            write_json(args.json, {"skipped": reason, "jobs": []}, host)
        return
    jobs = [("100MB", 4)] if args.quick else [(m, r) for m in args.models for r in args.ranks]
    results = []
    for model, ranks in jobs:
        run_root = tempfile.mkdtemp(prefix=f"bench_gpu_{model}_r{ranks}_", dir=args.tmp)
        worker_args = ["--run-root", run_root, "--model", model, "--every", str(args.every),
                       "--nckpt", str(args.nckpt), "--rounds", str(args.rounds), "--modes", ",".join(args.modes)]
        try:
            result, elapsed = run_worker(__file__, ranks, worker_args, f"{model} job on {ranks} ranks",
                                         mpiexec=args.mpiexec, capture="none")
        finally:
            shutil.rmtree(run_root, ignore_errors=True)
        result["elapsed_s"] = elapsed
        results.append(result)
        print(f"\n{model} state ({result['state_bytes'] / 1e6:.0f} MB), {ranks} rank(s), levels {result['levels']}, "
              f"every {result['every']} steps; clean step {result['step_ms']:.1f} ms; shard "
              f"{result['shard_bytes'] / 1e6:.1f} MB/rank: bare D2D {result['bare_d2d_ms']:.2f} ms "
              f"(flat {result['flat_d2d_ms']:.2f} ms)")
        for name, m in result["modes"].items():
            ratio = m["step_delay_ms"] / result["bare_d2d_ms"] if result["bare_d2d_ms"] else float("nan")
            print(f"  {name:7s} host blocking {m['host_blocking_ms']:.2f} ms, GPU copies {m['gpu_copy_ms']:.2f} ms, "
                  f"step delay {m['step_delay_ms']:.2f} ms ({ratio:.2f}x bare D2D), overhead "
                  f"{m['overhead_pct']:.2f} % (wall {m['wall_overhead_pct']:.2f} %), begin waited "
                  f"{m['begin_wait_ms']:.1f} ms, durable " +
                  ", ".join(f"{lv} {v:.2f} s" for lv, v in m["durable_s"].items() if v is not None))
    if args.json:
        write_json(args.json, {"jobs": results}, host)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--nckpt", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=["device", "pinned"])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[1, 4])
    parser.add_argument("--tmp", default=None, help="directory for run files (default: the system's temp)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-root", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
