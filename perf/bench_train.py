"""Training throughput of the hpcckpt trainer (issue #2): samples/s, ms/step and where a step goes.

One command runs everything: this script (the parent) launches itself as
`mpiexec -n N python perf/bench_train.py --worker ...` for each rank count and device, each
worker job benchmarks both models and rank 0 writes one JSON file that the parent reads.

    python perf/bench_train.py                 # full run: 1, 2, 4 ranks, MLP and conv1d, CPU (+ GPU if any)
    python perf/bench_train.py --quick         # under a minute on 2 cores
    python perf/bench_train.py --ranks 1,2 --steps 100 --json out.json

What is measured, per (device, model, ranks):

- Throughput: the unmodified `Trainer.train_step()`. A step's time is the
  slowest rank's `StepResult.seconds` for that step; ms/step is the median over the timed steps
  of one repeat (after warm-up steps), and the reported value is the median over repeats.
  samples/s (global) = global batch / that ms/step.
- Breakdown: further repeats of the same steps with timing probes attached to the trainer's
  objects (instance attributes only, nothing in hpcckpt is changed): forward + loss + backward
  compute (model.forward, the loss kernel, each advance of the model.backward generator),
  allreduce staging (GradientAllreduce.add: copy into the bucket, start Iallreduce, Testall),
  allreduce wait (each advance of GradientAllreduce.reduced, i.e. Wait), optimizer update
  (optimizer.update) and the rest (batch selection, host->device copy, Python). Shares are
  sums over the timed steps divided by the summed step time, averaged over ranks. On a GPU the
  probes synchronise the device before reading the clock (so kernels are charged to the phase
  that launched them); that removes some overlap, so compare the instrumented ms/step.
- Matrix products: NumPy's `@` cannot be timed in place without slowing every array operation,
  so one forward + backward of a twin model (same config, this rank's local batch) is traced
  with an ndarray subclass that records the operands of every matmul (shapes and strides
  exactly as the model produces them). Those matmuls are then replayed back to back on the
  recorded operands (CPU: perf_counter; GPU: the same shapes/strides on device buffers, timed
  with CUDA events) on all ranks at once, and the median replay time is compared with the
  step time. It is an estimate: replayed operands are cache-warm and no other phase runs
  between them.

Children run with OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1 (the trainer's
default, needed for bit-identical CPU runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ForeignLoad, machine, median, print_machine, run_worker, write_json  # perf/ is on sys.path

MODELS = {
    # The default job (jobs/local.toml): MLP 64-128-64-10 on the 8x8 digits.
    "mlp": [],
    # NT3-style conv net on synthetic data: 8192 samples x 128 features.
    "conv1d": [
        "model.kind=conv1d",
        "data.source=synthetic",
        "data.samples=8192",
        "data.features=128",
        "model.conv_channels=[16, 32]",
        "model.hidden=[64]",
    ],
}
PHASES = ("compute", "allreduce_stage", "allreduce_wait", "optimizer", "other")


# ------------------------------------------------------------------------------------------
# worker side (runs under mpiexec)


def _median_or_nan(values):
    return median(values, empty=float("nan"))


class _Probes:
    """Timing wrappers set as instance attributes on one Trainer's objects."""

    def __init__(self, trainer, sync):
        import hpcckpt.train.trainer as trainer_module

        self.trainer = trainer
        self.sync = sync
        self.totals = dict.fromkeys(PHASES[:-1], 0.0)
        self._module = trainer_module
        self._orig_loss = trainer_module.softmax_cross_entropy
        clock = time.perf_counter
        totals = self.totals
        model, allreduce, optimizer = trainer.model, trainer.allreduce, trainer.optimizer
        orig_forward, orig_backward = model.forward, model.backward
        orig_add, orig_reduced, orig_update = allreduce.add, allreduce.reduced, optimizer.update
        orig_loss = self._orig_loss

        def timed(key, function):
            def wrapper(*args, **kwargs):
                started = clock()
                result = function(*args, **kwargs)
                sync()
                totals[key] += clock() - started
                return result
            return wrapper

        def timed_generator(key, function):
            def wrapper(*args, **kwargs):
                generator = function(*args, **kwargs)
                while True:
                    started = clock()
                    try:
                        item = next(generator)
                    except StopIteration:
                        totals[key] += clock() - started
                        return
                    sync()
                    totals[key] += clock() - started
                    yield item
            return wrapper

        model.forward = timed("compute", orig_forward)
        model.backward = timed_generator("compute", orig_backward)
        allreduce.add = timed("allreduce_stage", orig_add)
        allreduce.reduced = timed_generator("allreduce_wait", orig_reduced)
        optimizer.update = timed("optimizer", orig_update)
        trainer_module.softmax_cross_entropy = timed("compute", orig_loss)

    def reset(self):
        for key in self.totals:
            self.totals[key] = 0.0

    def remove(self):
        for obj, names in ((self.trainer.model, ("forward", "backward")),
                           (self.trainer.allreduce, ("add", "reduced")),
                           (self.trainer.optimizer, ("update",))):
            for name in names:
                del obj.__dict__[name]
        self._module.softmax_cross_entropy = self._orig_loss


def _trace_matmuls(config, dataset, local_batch):
    """Operands (as plain ndarrays) of every matmul in one forward+backward of a NumPy twin."""
    import numpy as np

    from hpcckpt.train.kernels import softmax_cross_entropy
    from hpcckpt.train.models import build_model

    recorded = []

    def wrap(value):
        if type(value) is np.ndarray:
            return value.view(_Traced)
        if isinstance(value, tuple):
            return tuple(wrap(v) for v in value)
        return value

    def plain(value):
        return value.view(np.ndarray) if isinstance(value, _Traced) else value

    class _Traced(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            inputs = tuple(plain(i) for i in inputs)
            if "out" in kwargs:
                kwargs["out"] = tuple(plain(o) for o in kwargs["out"])
            if ufunc is np.matmul and method == "__call__":
                recorded.append((inputs[0], inputs[1]))
            return wrap(getattr(ufunc, method)(*inputs, **kwargs))

        def __array_function__(self, func, types, args, kwargs):
            return wrap(super().__array_function__(func, types, args, kwargs))

    rng = np.random.default_rng([config.run.seed, 0x1417])
    model = build_model(config.model, dataset.input_shape, dataset.n_classes, np, rng)
    for layer in model.layers:
        if hasattr(layer, "weight"):
            layer.weight = layer.weight.view(_Traced)
    inputs, labels = dataset.train.rows(np.arange(local_batch))
    logits = plain(model.forward(inputs, train=True))
    _, grad = softmax_cross_entropy(logits, labels)
    for _ in model.backward(grad):
        pass
    return recorded


def _time_matmuls(recorded, backend, passes):
    """Median seconds of one back-to-back replay of the recorded matmuls."""
    import numpy as np

    if not backend.is_gpu:
        for a, b in recorded:  # warm-up
            np.matmul(a, b)
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            for a, b in recorded:
                np.matmul(a, b)
            times.append(time.perf_counter() - started)
        return _median_or_nan(times)
    import cupy

    def device_like(array):
        extent = sum((n - 1) * s for n, s in zip(array.shape, array.strides)) + array.itemsize
        buffer = cupy.random.standard_normal(extent // array.itemsize + 1).astype(array.dtype)
        return cupy.lib.stride_tricks.as_strided(buffer, array.shape, array.strides)

    operands = [(device_like(a), device_like(b)) for a, b in recorded]
    for a, b in operands:
        cupy.matmul(a, b)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(passes):
        start.record()
        for a, b in operands:
            cupy.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1000.0)
    return _median_or_nan(times)


def _step_times(trainer, comm, steps):
    """Per-step time of the slowest rank (on rank 0; None elsewhere) and this rank's own times."""
    comm.Barrier()
    mine = [trainer.train_step().seconds for _ in range(steps)]
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None, mine
    return [max(column) for column in zip(*everyone)], mine


def _bench_model(model_name, args, comm, run_dir):
    from hpcckpt.cluster.backend import select_backend
    from hpcckpt.config import load_config
    from hpcckpt.runlog import RunLog
    from hpcckpt.train.data import rank_slice
    from hpcckpt.train.trainer import Trainer

    rank, world = comm.Get_rank(), comm.Get_size()
    overrides = MODELS[model_name] + [f"run.device={args.device}", f"run.dir={run_dir}",
                                      f"data.batch_size={args.batch_size}"]
    config = load_config(None, overrides, environ={})
    backend = select_backend(args.device, local_rank=rank)  # one node: round-robin over its GPUs
    log = RunLog(run_dir, rank, world, console=False)
    try:
        trainer = Trainer(config, comm, backend, log)
        for _ in range(args.warmup):
            trainer.train_step()

        # 1. throughput, unmodified train_step
        repeat_ms = []
        for _ in range(args.repeats):
            slowest, _ = _step_times(trainer, comm, args.steps)
            if rank == 0:
                repeat_ms.append(1000.0 * _median_or_nan(slowest))

        # 2. breakdown with probes
        probes = _Probes(trainer, backend.synchronize)
        for _ in range(max(2, args.warmup // 4)):
            trainer.train_step()
        shares = {phase: [] for phase in PHASES}
        instrumented_ms = []
        for _ in range(args.repeats):
            probes.reset()
            slowest, mine = _step_times(trainer, comm, args.steps)
            total = sum(mine)
            local = {k: v / total for k, v in probes.totals.items()}
            local["other"] = 1.0 - sum(local.values())
            gathered = comm.gather(local, root=0)
            if rank == 0:
                instrumented_ms.append(1000.0 * _median_or_nan(slowest))
                for phase in PHASES:
                    shares[phase].append(statistics.fmean(g[phase] for g in gathered))
        probes.remove()

        # 3. matrix products, replayed from a trace of this rank's local batch
        local_batch = len(range(config.data.batch_size)[rank_slice(config.data.batch_size, world, rank)])
        recorded = _trace_matmuls(config, trainer.dataset, local_batch)
        comm.Barrier()
        matmul_s = _time_matmuls(recorded, backend, args.matmul_passes)
        matmul_all = comm.gather(matmul_s, root=0)
        n_params = sum(int(a.size) for _, a in trainer.model.parameters())
        buckets = len(trainer.allreduce.buckets)
    finally:
        log.close()

    if rank != 0:
        return None
    ms = _median_or_nan(repeat_ms)
    matmul_ms = 1000.0 * statistics.fmean(matmul_all)
    result = {
        "samples_per_s": config.data.batch_size / (ms / 1000.0),
        "ms_per_step": ms,
        "repeat_ms_per_step": repeat_ms,
        "instrumented_ms_per_step": _median_or_nan(instrumented_ms),
        "matmul_ms": matmul_ms,
        "matmul_share": matmul_ms / ms,
        "matmuls_per_step": len(recorded),
        "parameters": n_params,
        "allreduce_buckets": buckets,
        "global_batch": config.data.batch_size,
    }
    for phase in PHASES:
        result[f"{phase}_share"] = _median_or_nan(shares[phase])
    return result


def worker(args):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    run_dir = tempfile.mkdtemp(prefix="bench_train_") if comm.Get_rank() == 0 else None
    run_dir = comm.bcast(run_dir, root=0)
    results = {}
    try:
        for model_name in args.models.split(","):
            results[model_name] = _bench_model(model_name, args, comm, run_dir)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
    if comm.Get_rank() == 0:
        write_json(args.out, results)


# ------------------------------------------------------------------------------------------
# parent side


def _run_job(args, device, ranks):
    worker_args = ["--device", device, "--models", args.models, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                   "--matmul-passes", str(args.matmul_passes), "--batch-size", str(args.batch_size)]
    return run_worker(__file__, ranks, worker_args, f"{device} job with {ranks} ranks", mpiexec=args.mpiexec)


def _print_table(rows):
    header = ("device", "model", "ranks", "samples/s", "ms/step", "repeats ms/step", "compute",
              "ar stage", "ar wait", "optim", "other", "matmul", "instr ms")
    lines = [header]
    for device, model, ranks, r in rows:
        lines.append((device, model, str(ranks), f"{r['samples_per_s']:.0f}", f"{r['ms_per_step']:.3f}",
                      f"{min(r['repeat_ms_per_step']):.3f}-{max(r['repeat_ms_per_step']):.3f}",
                      *(f"{100 * r[f'{p}_share']:.0f}%" for p in PHASES),
                      f"{100 * r['matmul_share']:.0f}%", f"{r['instrumented_ms_per_step']:.3f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


def parent(args):
    devices = ["cpu"]
    if args.device in ("gpu", "all"):
        devices = ["gpu"] if args.device == "gpu" else ["cpu", "gpu"]
    elif args.device == "auto":
        from hpcckpt.cluster.backend import gpu_available

        if gpu_available():
            devices.append("gpu")
    ranks_list = [int(r) for r in args.ranks.split(",")]
    host = machine(args.mpiexec)
    print(f"bench_train: devices {devices}, ranks {ranks_list}, models {args.models}, "
          f"{args.warmup} warm-up + {args.steps} steps x {args.repeats} repeats", flush=True)
    print_machine(host)
    flat = {"meta": {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                     "cpus": host["cpus"], "mpiexec": host["mpiexec"], "devices": devices,
                     "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "date": time.strftime("%Y-%m-%d")}}
    flat["meta"]["loadavg_before"] = round(os.getloadavg()[0], 2)
    rows = []
    for device in devices:
        for ranks in ranks_list:
            with ForeignLoad() as foreign:
                results, elapsed = _run_job(args, device, ranks)
            load = foreign.summary()
            flat["meta"][f"{device}_r{ranks}_foreign_load"] = load
            print(f"  {device} {ranks} rank(s): {elapsed:.1f} s; another process was runnable in "
                  f"{load['busy_fraction'] if load['samples'] else '?'} of {load['samples']} samples "
                  f"{load['processes']}", flush=True)
            if load["samples"] and load["busy_fraction"] > 0.1:
                print("  warning: other work shared the CPUs during this job; its numbers are distorted", flush=True)
            prefix = "" if device == "cpu" else "gpu_"
            for model, r in results.items():
                rows.append((device, model, ranks, r))
                for key, value in r.items():
                    flat[f"{prefix}{model}_r{ranks}_{key}"] = value
    flat["meta"]["loadavg_after"] = round(os.getloadavg()[0], 2)
    _print_table(rows)
    if args.json:
        write_json(args.json, flat, host)
        print(f"wrote {args.json}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps and repeats (under a minute on 2 cores)")
    parser.add_argument("--json", help="write a flat dict of results, e.g. mlp_r4_samples_per_s, to this file")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    parser.add_argument("--steps", type=int, help="timed steps per repeat (default 200, --quick 30)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 20, --quick 5)")
    parser.add_argument("--repeats", type=int, help="repeats (default 5, --quick 3; at least 3 is advised)")
    parser.add_argument("--models", default="mlp,conv1d", help="comma-separated subset of mlp,conv1d")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu", "all"),
                        help="auto: CPU, plus GPU when CuPy sees one (default)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (default 64, the default job's)")
    parser.add_argument("--matmul-passes", type=int, help="replays of the traced matmuls (default 50, --quick 10)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, full, quick in (("steps", 200, 30), ("warmup", 20, 5), ("repeats", 5, 3), ("matmul_passes", 50, 10)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; allowed are {', '.join(MODELS)}")
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")
    if args.worker:
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
