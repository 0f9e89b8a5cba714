"""Checkpoint cost of hpcckpt against simpler approaches (issue #5, items 5 and 6): DeepFreeze's
figures 5 and 6 on this code, with the same model, the same ranks and the same run.

One command runs everything: this script (the parent) launches itself as
`mpiexec -n N python perf/bench_checkpoint.py --worker ...` once per (model size, rank count);
each worker job builds one `Trainer`, drives `train_step()` itself and runs
every approach on that same trainer, one after the other, in rounds; rank 0 writes a JSON file
that the parent collects, prints, checks against the issue's targets and plots.

    python perf/bench_checkpoint.py                      # full: 100 MB and 1 GB states, 1/2/4 ranks
    python perf/bench_checkpoint.py --quick              # under 2 minutes: 100 MB state, 4 ranks
    python perf/bench_checkpoint.py --json out.json      # plus perf/figures/checkpoint_*.png

Approaches (all checkpoint the whole model state: parameters + SGD momentum, float32):

- h5py_default: rank 0 writes every array into one HDF5 file in the PFS directory (h5py
  defaults: contiguous datasets, no fsync), synchronously; the other ranks wait in a quiet
  barrier (Ibarrier polled with a short sleep). Durability is measured by a background fsync of
  the file and its directory right after the close (h5py itself never fsyncs).
- single: rank 0 copies every array into reused buffers, then a background thread writes them
  into one file and fsyncs it (and the directory); the other ranks do nothing.
- sharded: every rank copies its 1/N slice of every (flattened) array into reused buffers and a
  background thread writes one file per rank + fsync.
- hpcckpt: the real engine, `Checkpointer` with extraction during backprop (the trainer's
  `CaptureAfterUpdate` hook): begin_checkpoint(step, copy_in_background=True) before the step,
  capture() after each weight update queues that layer's copy, which the engine's worker
  thread takes while training goes on; before_update() makes the next step's update of a
  layer wait for its copy (CheckFreq); end_checkpoint() after the step; then the same thread
  persists. Levels: 4 ranks -> local, partner, erasure (group 4, parity 2), pfs on 4 simulated
  nodes; 2 ranks -> local, partner, erasure (group 2, parity 1), pfs on 2 simulated nodes;
  1 rank -> local, pfs.
- hpcckpt_l1l3 (4 ranks only): the same engine with levels local + erasure (group 4, parity 2),
  for the durability target.
- dcp_async: torch.distributed.checkpoint.async_save (thread executor, FileSystemWriter with
  its default fsync) of torch.from_numpy views of the same arrays over a gloo process group
  initialised from the MPI rank/size; at most one save in flight (the previous future is
  awaited before the next save, inside the measured blocking time).
- io_only (only when named in --approaches; an attribution, not a checkpoint): every rank
  writes the bytes hpcckpt's levels store for it (O_DIRECT, fsync, as hpcckpt does, but always
  into new files where hpcckpt overwrites node-local spares), from one reused buffer in a
  background thread, with no copy, MPI, encoding or checksum. Its overhead is about what the
  checkpoint's I/O alone costs training on the machine (a little more: new files cost more).

Every approach is preceded by one untimed warm-up checkpoint (buffer allocation, layout, DCP
planning) that is waited for; then `--nckpt` timed checkpoints every `--every` steps. Between
approaches everything is drained and the run directories are deleted.

Metrics (per approach; a step's time and a checkpoint's cost are the slowest rank's):

- blocking_ms: how long the training loop is stopped by the checkpoint call(s) of one
  checkpoint: for hpcckpt begin_checkpoint() + capture() during the step
  (PersistReport.captured_early_s) + end_checkpoint() + the waits in before_update() for
  copies not yet taken (copy_wait_s); for the others the call(s) around the
  step, including waiting for a previous persist still in flight. Median over checkpoints.
- prep_ms: the snapshot / copy work (hpcckpt: captured_early_s + snapshot_s + the copies its
  worker thread took behind the step, background_copy_s, which block only as copy_wait_s; single and
  sharded: the copies; dcp_async: not separable, reported as null; h5py: none).
- overhead_pct (the paper's definition): mean duration of the checkpointed steps and of the
  steps right after them, minus the mean of the other steps, as a % of the latter.
- wall_overhead_pct: mean step time of the whole segment against the no-checkpoint baseline
  segment of the same job (catches background work that slows more than one step).
- durable_s: seconds from the checkpoint call until each level was durable (hpcckpt:
  PersistReport.durable_s per level; the others: until their fsync returned). Median.
- disk: rank 0 writes one file of the state's size and fsyncs it (and the directory), the
  other ranks waiting quietly; median of --disk-repeats; gives the sequential write rate.
- RSS of every rank after each checkpoint (VmRSS), for the flat-memory target.
- ckpt_cpu_core_s (hpcckpt): CPU seconds of the engine's background threads per checkpoint
  (PersistReport.cpu_s), summed over ranks, median; by thread in ckpt_cpu_core_s_by_thread.
  cpu_floor_pct: the overhead that CPU alone causes on saturated cores, CPU / (cores x
  baseline step time x interval), with cores = min(ranks, CPUs). A measured overhead far
  above it points at waits and stragglers rather than the checkpoint's own work.

--levels picks hpcckpt's levels (default all four at 2+ ranks), to cost each one on its own.

Item 6 (the `frequency` block of the 100 MB / 4 ranks job): hpcckpt with all levels every 1,
10, 100 steps and never, over --freq-steps steps each (default 100; every 100 then means one checkpoint); overhead = mean step time against
"never" (run before and after the sweep, averaged). With --freq-rounds R the sweep runs R
times, each round between two "never" segments that are its baseline; the median is reported.

Children run with OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1. A sampler in the
parent records how often a process outside this benchmark was runnable (other load).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import (REPO, Dcp, ForeignLoad, alternated, available, fsync_path, gloo_close,  # perf/ is on sys.path
                     h5py_save, machine, print_machine, run_worker, shard_bounds, write_durably, write_json)
from harness import median as _median
from harness import paper_overhead as _paper_overhead
from harness import quiet_barrier as _quiet_barrier

FIGURES = REPO / "perf" / "figures"
FEATURES = 1024
# MLP 1024 -> hidden -> 10 on synthetic data; SGD with momentum doubles the state.
MODELS = {
    "100MB": (3072, 3072),    # 12.62 M parameters -> 100.9 MB of parameters + momentum
    "1GB": (11008, 11008),    # 132.6 M parameters -> 1.061 GB (0.988 GiB)
}
# The default rate (0.05) makes the 11008-wide model overflow to inf/NaN within ~30 steps;
# 0.01 trains it without overflow, so the timed steps do ordinary arithmetic.
LEARNING_RATES = {"100MB": 0.05, "1GB": 0.01}
APPROACHES = ("h5py_default", "single", "sharded", "hpcckpt", "hpcckpt_l1l3", "dcp_async")
# Run only when asked for (--approaches): an attribution, not a way to checkpoint.
EXTRA_APPROACHES = ("io_only",)


# ------------------------------------------------------------------------------------------
# worker side (runs under mpiexec)

def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


class _Approach:
    """One way to checkpoint. before_step/after_step wrap the checkpointed step; each returns
    the seconds it blocked. Records: one dict per checkpoint (blocking, prep, durable)."""

    name = "?"

    def __init__(self, ctx):
        self.ctx = ctx
        self.comm = ctx["comm"]
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.arrays = ctx["arrays"]  # [(name, ndarray)] params + optimizer state, same on all ranks
        self.dir = ctx["dir"]
        self.records = []
        self.current = None

    def before_step(self, step):
        return 0.0

    def after_step(self, step):
        return 0.0

    def finish(self):
        """Wait until everything is durable (untimed)."""

    def close(self):
        pass


class _BackgroundWriter:
    """At most one persist in flight, like a real two-phase checkpointer."""

    def __init__(self):
        self.thread = None

    def join(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def start(self, target):
        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()


class H5pyDefault(_Approach):
    name = "h5py_default"

    def __init__(self, ctx):
        super().__init__(ctx)
        import h5py  # noqa: F401  (imported before the timed checkpoints)

        self.syncer = _BackgroundWriter()
        self.files = []

    def after_step(self, step):
        started = time.perf_counter()
        record = {"step": step, "prep": None, "durable": {}}
        self.syncer.join()
        record["wait"] = time.perf_counter() - started
        if self.rank == 0:
            path = os.path.join(self.dir, f"ckpt-{step}.h5")
            h5py_save(path, self.arrays)
            self.files.append(path)
            while len(self.files) > 2:
                _remove(self.files.pop(0))

            def sync():
                fsync_path(path)
                fsync_path(self.dir)
                record["durable"]["pfs"] = time.perf_counter() - started

            self.syncer.start(sync)
        _quiet_barrier(self.comm)
        record["blocking"] = time.perf_counter() - started
        self.records.append(record)
        return record["blocking"]

    def finish(self):
        self.syncer.join()


class _WrittenInBackground(_Approach):
    """An approach that takes its copy on the step (prepare) and writes it in a background
    thread (write), keeping the two newest versions, with at most one write in flight."""

    durable_level = "pfs"
    remove_old_first = True  # the older version goes before the write; else after it

    def __init__(self, ctx):
        super().__init__(ctx)
        self.writer = _BackgroundWriter()
        self.versions = []

    def prepare(self, step):
        """Take this rank's copy; returns the path of the version to write, or None."""
        raise NotImplementedError

    def write(self, path):
        raise NotImplementedError

    def after_step(self, step):
        started = time.perf_counter()
        record = {"step": step, "durable": {}}
        self.writer.join()
        record["wait"] = time.perf_counter() - started
        copy_started = time.perf_counter()
        path = self.prepare(step)
        record["prep"] = time.perf_counter() - copy_started if path is not None else 0.0
        if path is not None:
            self.versions.append(path)
            old, self.versions = self.versions[:-2], self.versions[-2:]

            def persist():
                for p in old if self.remove_old_first else ():
                    _remove(p)
                self.write(path)
                record["durable"][self.durable_level] = time.perf_counter() - started
                for p in () if self.remove_old_first else old:
                    _remove(p)

            self.writer.start(persist)
        record["blocking"] = time.perf_counter() - started
        self.records.append(record)
        return record["blocking"]

    def finish(self):
        self.writer.join()


class Single(_WrittenInBackground):
    name = "single"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.buffers = [np_empty_like(a) for _, a in self.arrays] if self.rank == 0 else []

    def prepare(self, step):
        if self.rank != 0:
            return None
        for (_, array), buffer in zip(self.arrays, self.buffers):
            np_copyto(buffer, array)
        return os.path.join(self.dir, f"ckpt-{step}.bin")

    def write(self, path):
        write_durably(path, self.buffers)

    def close(self):
        self.buffers = []


class Sharded(_WrittenInBackground):
    name = "sharded"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.slices = []
        for _, array in self.arrays:
            lo, hi = shard_bounds(array.size, self.rank, self.size)
            self.slices.append((array.reshape(-1)[lo:hi], np_empty(hi - lo, array.dtype)))

    def prepare(self, step):
        for view, buffer in self.slices:
            np_copyto(buffer, view)
        return os.path.join(self.dir, f"ckpt-{step}-r{self.rank}.bin")

    def write(self, path):
        write_durably(path, [b for _, b in self.slices])

    def close(self):
        self.slices = []


class IoOnly(_WrittenInBackground):
    """Attribution, not a checkpoint: every rank writes the bytes hpcckpt's levels store for it
    (its shard on L1 and on L4, the replica it holds, its parity) with hpcckpt's writer
    (write_bytes_atomically, O_DIRECT, the two newest versions kept, the older one removed
    after the write as hpcckpt's retention does), from one reused buffer in a background
    thread: no copy, no MPI, no encoding, no checksums. It always writes new files, where
    hpcckpt overwrites node-local spares, so its overhead is an upper bound on what the
    checkpoint's I/O alone costs training on this machine."""

    name = "io_only"
    durable_level = "all"
    remove_old_first = False

    def __init__(self, ctx):
        super().__init__(ctx)
        from hpcckpt.io.direct_io import aligned_empty

        shard = sum(int(a.nbytes) for _, a in self.arrays) // self.size
        per_level = {"local": 1.0, "partner": 1.0 if self.size > 1 else 0.0,
                     "erasure": ctx["parity"] / (ctx["group_size"] - ctx["parity"]) if self.size > 1 else 0.0,
                     "pfs": 1.0}
        self.sizes = [int(shard * per_level[lv]) for lv in ctx["levels"] if per_level.get(lv)]
        self.buffer = aligned_empty(max(self.sizes))
        self.buffer[:] = 7

    def prepare(self, step):
        return os.path.join(self.dir, f"r{self.rank}-v{step}")

    def write(self, path):
        from hpcckpt.io.atomic import write_bytes_atomically

        os.makedirs(path, exist_ok=True)
        for index, size in enumerate(self.sizes):
            write_bytes_atomically(os.path.join(path, f"file{index}.bin"), memoryview(self.buffer)[:size], direct=True)

    def close(self):
        self.buffer = None


class Hpcckpt(_Approach):
    name = "hpcckpt"

    def __init__(self, ctx, levels=None):
        super().__init__(ctx)
        from hpcckpt.ckpt.engine import Checkpointer
        from hpcckpt.config import load_config
        from hpcckpt.train.loop import CaptureAfterUpdate

        trainer = ctx["trainer"]
        self.trainer = trainer
        levels = levels or ctx["levels"]
        overrides = list(ctx["overrides"]) + [
            f"run.dir={self.dir}",
            f"cluster.simulated_nodes={self.size}",
            f"resilience.levels={json.dumps(list(levels))}",
            f"resilience.group_size={ctx['group_size']}",
            f"resilience.parity={ctx['parity']}",
        ]
        config = load_config(None, overrides, environ={})
        self.levels = tuple(levels)
        self.ckpt = Checkpointer(self.comm, config, log=ctx["log"])
        for name, array in trainer.protected_arrays():
            self.ckpt.protect(name, array)
        self.ckpt.register_state("trainer", trainer.training_state, trainer.load_training_state)
        self.hook = CaptureAfterUpdate(self.ckpt, trainer)
        # Installed for good: the step after a checkpoint waits in before_update() for copies.
        trainer.step_hooks = (self.hook,)
        self.reports = []
        self.begin_s = 0.0
        self.rss = []

    def before_step(self, step):
        started = time.perf_counter()
        self.ckpt.begin_checkpoint(step, copy_in_background=True)
        self.begin_s = time.perf_counter() - started
        return self.begin_s

    def after_step(self, step):
        started = time.perf_counter()
        report = self.ckpt.end_checkpoint({})
        end_s = time.perf_counter() - started
        self.reports.append(report)
        self.records.append({"step": step, "report": report, "begin": self.begin_s, "end": end_s})
        self.rss.append(_rss_kib())
        # The captures ran inside the step: they are part of its time but were not timed by the loop.
        return end_s

    def finish(self):
        self.ckpt.wait()
        for record in self.records:
            report = record.pop("report", None)
            if report is None:
                continue
            record["prep"] = report.captured_early_s + report.snapshot_s + report.background_copy_s
            record["blocking"] = record["begin"] + report.captured_early_s + record["end"] + report.copy_wait_s
            record["durable"] = dict(report.durable_s)
            record["cpu_by_thread"] = dict(report.cpu_s)  # this rank's background threads
            record["cpu"] = sum(report.cpu_s.values())
            record["wait"] = record["begin"]
            record["parts"] = {"begin": record["begin"], "capture": report.captured_early_s, "end": record["end"],
                               "copy_wait": report.copy_wait_s}
            if "pfs" in record["durable"]:
                # L4's own time: its write, fsync and commit, from the moment the persist turns
                # to it. (Until 2026-11-24 this was counted from the last earlier level's
                # durability, which also took in the L1-L3 commit's small fsyncs.)
                record["l4_flush"] = record["durable"]["pfs"] - report.started_s.get("pfs", 0.0)
                before = [v for lv, v in record["durable"].items() if lv != "pfs"]
                record["l4_after_earlier"] = record["durable"]["pfs"] - max(before or [0.0])

    def shard_bytes(self):
        layout = self.ckpt.layout
        return sum(int(tl.piece_nbytes(self.rank)) for tl in layout.rank_pieces(self.rank))

    def close(self):
        self.trainer.step_hooks = ()
        self.ckpt.close()


class DcpAsync(_Approach):
    name = "dcp_async"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.dcp = Dcp(self.comm)
        self.state = {"state": self.dcp.views(self.arrays)}
        self.future = None
        self.dirs = []

    def _await(self):
        if self.future is not None:
            self.future.result()
            self.future = None

    def after_step(self, step):
        started = time.perf_counter()
        record = {"step": step, "prep": None, "durable": {}}
        self._await()
        record["wait"] = time.perf_counter() - started
        path = os.path.join(self.dir, f"step-{step}")
        self.dirs.append(path)
        if self.rank == 0:
            for old in self.dirs[:-2]:
                _remove(old)
        self.dirs = self.dirs[-2:]
        future = self.dcp.async_save(self.state, checkpoint_id=path)

        def done(_):
            record["durable"]["pfs"] = time.perf_counter() - started

        future.add_done_callback(done)
        self.future = future
        record["blocking"] = time.perf_counter() - started
        self.records.append(record)
        return record["blocking"]

    def finish(self):
        self._await()
        time.sleep(0.01)  # done-callbacks run right after the result is set


def np_empty_like(array):
    import numpy as np

    buffer = np.empty_like(array)
    buffer.fill(0)  # touch the pages now, like a long-lived buffer pool
    return buffer


def np_empty(n, dtype):
    import numpy as np

    buffer = np.empty(n, dtype=dtype)
    buffer.fill(0)
    return buffer


def np_copyto(dst, src):
    import numpy as np

    np.copyto(dst, src)


def _run_segment(ctx, approach, steps, every, nckpt):
    """Timed steps with a checkpoint every `every` steps (nckpt of them). Per-step seconds."""
    trainer = ctx["trainer"]
    times = []
    flags = []
    for i in range(1, steps + 1):
        due = approach is not None and every and i % every == 0 and i // every <= nckpt
        started = time.perf_counter()
        if due:
            approach.before_step(trainer.step + 1)
        trainer.train_step()
        if due:
            approach.after_step(trainer.step)
        times.append(time.perf_counter() - started)
        flags.append(bool(due))
    return times, flags


def _cpu_floor(cpus, base_s_per_step, every, ranks):
    """The checkpoint's CPU (background threads, summed over ranks) and the overhead it would
    cause at the least: on saturated cores every core-second it takes is one training loses,
    spread over the cores the ranks share (perf/log/2026-11-23.md, "What a checkpoint costs the
    CPU")."""
    cores = min(ranks, len(os.sched_getaffinity(0)))  # what this process may use, not the host's
    core_s = _median(cpus)
    floor = 100.0 * core_s / (cores * base_s_per_step * every) if core_s is not None and every else None
    return {"ckpt_cpu_core_s": core_s, "cpu_floor_pct": floor}


def _clean_dir(comm, path):
    _quiet_barrier(comm)
    if comm.Get_rank() == 0:
        _remove(path)
        os.makedirs(path, exist_ok=True)
    _quiet_barrier(comm)


def _disk_rate(comm, root, nbytes, repeats):
    """Rank 0 writes one file of nbytes + fsync (file and directory); the rest wait quietly."""
    import numpy as np

    results = []
    buffer = None
    if comm.Get_rank() == 0:
        buffer = np.random.default_rng(1).integers(0, 255, size=min(nbytes, 256 << 20), dtype=np.uint8)
    for r in range(repeats):
        _clean_dir(comm, root)
        if comm.Get_rank() == 0:
            path = os.path.join(root, f"disk-{r}.bin")
            whole, rest = divmod(nbytes, buffer.size)
            started = time.perf_counter()
            write_durably(path, [buffer] * whole + [buffer[:rest]], chunk=None)
            results.append(time.perf_counter() - started)
        _quiet_barrier(comm)
    _clean_dir(comm, root)
    if comm.Get_rank() == 0:
        seconds = _median(results)
        return {"bytes": nbytes, "seconds": seconds, "seconds_all": results, "gb_per_s": nbytes / seconds / 1e9}
    return None


def _progress(rank, message):
    if rank == 0:
        print(f"    [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def worker(args):
    from mpi4py import MPI  # inside main, not at module top: DCP dislikes it

    from hpcckpt.cluster.backend import select_backend
    from hpcckpt.config import load_config
    from hpcckpt.runlog import RunLog
    from hpcckpt.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    root = Path(args.run_root)
    hidden = [int(h) for h in args.hidden.split(",")]
    overrides = [
        f"model.hidden={json.dumps(hidden)}", "data.source=synthetic", f"data.features={FEATURES}",
        "data.samples=4096", "data.batch_size=64", "optimizer.kind=sgd", f"optimizer.lr={args.lr}",
        "run.device=cpu",
        f"run.dir={root / 'train'}",
    ] + list(args.set or [])
    config = load_config(None, overrides, environ={})
    log = RunLog(root / "train", rank, size, console=False)
    trainer = Trainer(config, comm, select_backend("cpu", local_rank=rank), log)
    arrays = trainer.protected_arrays()
    state_bytes = sum(int(a.nbytes) for _, a in arrays)
    if size >= 4:
        levels, group_size, parity = ["local", "partner", "erasure", "pfs"], 4, 2
    elif size >= 2:
        levels, group_size, parity = ["local", "partner", "erasure", "pfs"], size, 1
    else:
        levels, group_size, parity = ["local", "pfs"], 4, 2
    if args.levels:
        from hpcckpt.config import LEVEL_ORDER

        levels = [lv for lv in LEVEL_ORDER if lv in args.levels.split(",")]  # the data-flow order
    ctx = {"comm": comm, "trainer": trainer, "arrays": arrays, "log": log, "overrides": overrides,
           "levels": levels, "group_size": group_size, "parity": parity}
    approaches = [a for a in args.approaches.split(",") if a]
    if size < 4 and "hpcckpt_l1l3" in approaches:
        approaches.remove("hpcckpt_l1l3")
    out = {"ranks": size, "hidden": hidden, "features": FEATURES, "state_bytes": state_bytes,
           "parameters": int(sum(a.size for _, a in trainer.model.parameters())),
           "levels": levels, "group_size": group_size if size > 1 else None,
           "parity": parity if size > 1 else None, "every": args.every, "nckpt": args.nckpt,
           "rounds": args.rounds, "approaches": {}, "rss_start_kib": comm.allreduce(_rss_kib())}

    def gather_max(values):
        rows = comm.gather(values, root=0)
        if rank != 0:
            return None
        # NaN marks "nothing on this rank" (e.g. single: only rank 0 persists)
        return [max((v for v in col if v == v), default=None) for col in zip(*rows)] if rows and rows[0] else []

    def gather_sum(values):
        rows = comm.gather(values, root=0)
        return [sum(col) for col in zip(*rows)] if rank == 0 and rows and rows[0] else None

    for _ in range(3):  # warm-up steps
        trainer.train_step()
    out["disk"] = _disk_rate(comm, str(root / "disk"), state_bytes, args.disk_repeats)
    _progress(rank, f"state {state_bytes / 1e6:.1f} MB; disk {out['disk']}")

    steps = args.every * args.nckpt + 2
    raw = {name: {"times": [], "flags": [], "records": [], "rss": []} for name in ["none", *approaches]}
    factories = {"h5py_default": H5pyDefault, "single": Single, "sharded": Sharded, "hpcckpt": Hpcckpt,
                 "hpcckpt_l1l3": lambda c: Hpcckpt(c, levels=["local", "erasure"]), "dcp_async": DcpAsync,
                 "io_only": IoOnly}
    for round_index in range(args.rounds):
        for name in alternated(["none", *approaches], round_index):
            directory = root / name
            _clean_dir(comm, str(directory))
            ctx["dir"] = str(directory)
            approach = None if name == "none" else factories[name](ctx)
            if approach is not None:  # untimed warm-up checkpoint, waited for
                approach.before_step(trainer.step + 1)
                trainer.train_step()
                approach.after_step(trainer.step)
                approach.finish()
                approach.records.clear()
                if isinstance(approach, Hpcckpt):
                    approach.rss.clear()
            _quiet_barrier(comm)
            segment_started = time.perf_counter()
            times, flags = _run_segment(ctx, approach, steps, args.every, args.nckpt)
            if approach is not None:
                approach.finish()
            times = gather_max(times)
            entry = raw[name]
            if rank == 0:
                entry["times"].append(times)
                entry["flags"].append(flags)
            if approach is not None:
                recs = approach.records
                blocking = gather_max([r["blocking"] for r in recs])
                prep = gather_max([r["prep"] if r["prep"] is not None else -1.0 for r in recs])
                wait = gather_max([r["wait"] for r in recs])
                unwaited = gather_max([r["blocking"] - r["wait"] for r in recs])
                l4_flush = gather_max([r.get("l4_flush", float("nan")) for r in recs])
                l4_after_earlier = gather_max([r.get("l4_after_earlier", float("nan")) for r in recs])
                level_names = sorted(set().union(*comm.allgather({k for r in recs for k in r["durable"]})))
                durable = {lv: gather_max([r["durable"].get(lv, float("nan")) for r in recs]) for lv in level_names}
                parts = cpu = cpu_by_thread = None
                if isinstance(approach, Hpcckpt):
                    parts = {part: gather_max([r["parts"][part] for r in recs]) for part in recs[0]["parts"]}
                    cpu_by_thread = {t: gather_sum([r["cpu_by_thread"].get(t, 0.0) for r in recs])
                                     for t in ("copy", "persist", "l1_write")}
                    if rank == 0 and recs:
                        cpu = [sum(per_thread) for per_thread in zip(*cpu_by_thread.values())]
                    rss = comm.gather(approach.rss, root=0)
                    if rank == 0:
                        entry["rss"].append([sum(col) for col in zip(*rss)])
                    entry["shard_bytes_total"] = comm.allreduce(approach.shard_bytes())
                if rank == 0:
                    entry["records"].append({"blocking": blocking, "prep": [p if p >= 0 else None for p in prep],
                                             "durable": durable, "wait": wait, "unwaited": unwaited,
                                             "l4_flush": l4_flush, "l4_after_earlier": l4_after_earlier,
                                             "parts": parts, "cpu": cpu,
                                             "cpu_by_thread": cpu_by_thread})
                approach.close()
            del approach
            gc.collect()
            _clean_dir(comm, str(directory))
            _progress(rank, f"{name}: {steps} steps in {time.perf_counter() - segment_started:.1f} s")

    if rank == 0:
        base_means = [statistics.fmean(t) for t in raw["none"]["times"]]
        base = _median(base_means)
        out["baseline_ms_per_step"] = 1000 * base
        for name in approaches:
            entry = raw[name]
            blocking = [b for rec in entry["records"] for b in rec["blocking"]]
            prep = [p for rec in entry["records"] for p in rec["prep"]]
            levels_seen = sorted({lv for rec in entry["records"] for lv in rec["durable"]})
            durable = {lv: _median([d for rec in entry["records"] for d in rec["durable"].get(lv, [])])
                       for lv in levels_seen}
            paper = [_paper_overhead(t, f)[0] for t, f in zip(entry["times"], entry["flags"])]
            wall = [100.0 * (statistics.fmean(t) - base) / base for t in entry["times"]]
            result = {
                "blocking_ms": 1000 * _median(blocking),
                "blocking_ms_all": [round(1000 * b, 2) for b in blocking],
                "prep_ms": 1000 * _median(prep) if _median(prep) is not None else None,
                "wait_ms": 1000 * _median([w for rec in entry["records"] for w in rec["wait"]]),
                "blocking_no_wait_ms": 1000 * _median([w for rec in entry["records"] for w in rec["unwaited"]]),
                "overhead_pct": _median(paper),
                "overhead_pct_rounds": paper,
                "wall_overhead_pct": _median(wall),
                "durable_s": durable,
                "ms_per_step": 1000 * _median([statistics.fmean(t) for t in entry["times"]]),
            }
            cpus = [c for rec in entry["records"] for c in (rec.get("cpu") or [])]
            if cpus:
                result.update(_cpu_floor(cpus, base, args.every, size))
                threads = [rec["cpu_by_thread"] for rec in entry["records"] if rec.get("cpu_by_thread")]
                result["ckpt_cpu_core_s_by_thread"] = {t: _median([v for th in threads for v in (th[t] or [])])
                                                       for t in threads[0]}
            part_records = [rec["parts"] for rec in entry["records"] if rec.get("parts")]
            if part_records:  # where hpcckpt's blocking goes, slowest rank, median per part
                result["blocking_parts_ms"] = {part: 1000 * _median([v for p in part_records for v in p[part]])
                                               for part in part_records[0]}
            if entry["rss"]:
                rss = [r for r in entry["rss"] if r]
                result["rss_first_kib"] = rss[0][0] if rss else None
                result["rss_last_kib"] = rss[-1][-1] if rss else None
                # Within one engine's life: between rounds the other approaches' memory (torch,
                # allocator arenas) stays in the process and is not the engine's.
                result["rss_change_by_round"] = [r[-1] / r[0] - 1 for r in rss]
                result["rss_kib_by_round"] = rss
            if "shard_bytes_total" in entry:
                result["shard_bytes_total"] = entry["shard_bytes_total"]
            if name.startswith("hpcckpt") and "pfs" in durable:
                # per rank: L4 durable minus the last earlier level, slowest rank, median over checkpoints
                flush = _median([f for rec in entry["records"] for f in rec["l4_flush"]])
                result["l4_flush_s"] = flush
                result["l4_gb_per_s"] = entry["shard_bytes_total"] / flush / 1e9 if flush > 0 else None
                result["l4_after_earlier_s"] = _median([f for rec in entry["records"] for f in rec["l4_after_earlier"]])
            out["approaches"][name] = result
        out["rss_end_kib"] = None
    out_rss = comm.allreduce(_rss_kib())
    if rank == 0:
        out["rss_end_kib"] = out_rss

    if args.freq:
        out["frequency"] = _frequency(ctx, args, root, gather_max, gather_sum)

    if "dcp_async" in approaches:
        gloo_close()
    _quiet_barrier(comm)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        write_json(args.out, out)


def _frequency(ctx, args, root, gather_max, gather_sum):
    """Item 6: hpcckpt (all levels, or --levels) every 1, 10, 100 steps and never; overhead vs never."""
    comm = ctx["comm"]
    rank = comm.Get_rank()
    trainer = ctx["trainer"]
    intervals = [int(x) for x in args.freq.split(",")]
    # Rounds alternate with "never" segments, so each round has a baseline measured next to it:
    # on a shared VM the step time drifts by 20 % within minutes.
    order = [0] + ([i for i in intervals if i] + [0]) * args.freq_rounds
    runs = {}
    for every in order:
        directory = root / f"freq{every}"
        _clean_dir(comm, str(directory))
        ctx["dir"] = str(directory)
        approach = None
        if every:
            approach = Hpcckpt(ctx)
            approach.before_step(trainer.step + 1)  # untimed warm-up checkpoint
            trainer.train_step()
            approach.after_step(trainer.step)
            approach.finish()
            approach.records.clear()
            approach.rss.clear()
        _quiet_barrier(comm)
        steps = min(args.freq_steps, args.freq_steps_every1) if every == 1 else args.freq_steps
        nckpt = steps // every if every else 0
        times, flags = _run_segment(ctx, approach, steps, every, nckpt)
        if approach is not None:
            approach.finish()
        times = gather_max(times)
        blocking = durable_pfs = cpu = None
        rss = None
        if approach is not None:
            blocking = gather_max([r["blocking"] for r in approach.records])
            cpu = gather_sum([r["cpu"] for r in approach.records])
            durable_pfs = gather_max([max(r["durable"].values()) if r["durable"] else float("nan")
                                      for r in approach.records])
            rss = comm.gather(approach.rss, root=0)
            approach.close()
        del approach
        gc.collect()
        _clean_dir(comm, str(directory))
        _progress(rank, f"frequency every {every or 'never'}: {steps} steps done")
        if rank == 0:
            runs.setdefault(every, []).append({
                "times": times, "flags": flags, "blocking": blocking, "durable": durable_pfs, "cpu": cpu,
                "rss": [sum(col) for col in zip(*rss)] if rss else None})
    if rank != 0:
        return None
    nevers = [statistics.fmean(r["times"]) for r in runs[0]]
    base = statistics.fmean(nevers)
    result = {"steps": args.freq_steps, "rounds": args.freq_rounds, "never_ms_per_step": [1000 * t for t in nevers],
              "intervals": {}}
    for every in intervals:
        if not every:
            continue
        rounds = runs[every]
        means = [statistics.fmean(run["times"]) for run in rounds]
        # Round r ran between never segments r and r + 1.
        local_bases = [statistics.fmean(nevers[r:r + 2]) for r in range(len(rounds))]
        overheads = [100.0 * (m - b) / b for m, b in zip(means, local_bases)]
        papers = [_paper_overhead(run["times"], run["flags"])[0] for run in rounds]
        blocking = [b for run in rounds for b in (run["blocking"] or [])]
        durable = [d for run in rounds for d in (run["durable"] or [])]
        rss = rounds[0]["rss"] or []
        result["intervals"][str(every)] = {
            "checkpoints": sum(rounds[0]["flags"]),
            "ms_per_step": 1000 * statistics.fmean(means),
            "overhead_pct": _median(overheads),
            "overhead_pct_rounds": overheads,
            "paper_overhead_pct": _median([p for p in papers if p is not None]) if any(
                p is not None for p in papers) else None,
            "blocking_ms": 1000 * _median(blocking) if blocking else None,
            "max_level_durable_s": _median(durable) if durable else None,
            "rss_kib_first": rss[0] if rss else None,
            "rss_kib_last": rss[-1] if rss else None,
            "rss_kib_max": max(rss) if rss else None,
            **_cpu_floor([c for run in rounds for c in (run["cpu"] or [])], base, every, comm.Get_size()),
        }
    result["intervals"]["never"] = {"checkpoints": 0, "ms_per_step": 1000 * base, "overhead_pct": 0.0}
    return result


# ------------------------------------------------------------------------------------------
# parent side

def _run_job(args, model, ranks, approaches, every, nckpt, rounds, freq):
    run_root = tempfile.mkdtemp(prefix=f"bench_ckpt_{model}_r{ranks}_", dir=args.tmp)
    worker_args = ["--run-root", run_root, "--hidden", ",".join(map(str, MODELS[model])),
               "--lr", str(LEARNING_RATES[model]),
               "--approaches", ",".join(approaches), "--every", str(every), "--nckpt", str(nckpt),
               "--rounds", str(rounds), "--disk-repeats", str(args.disk_repeats),
               "--freq", freq, "--freq-steps", str(args.freq_steps), "--freq-rounds", str(args.freq_rounds),
               "--freq-steps-every1", str(args.freq_steps_every1)]
    if args.levels:
        worker_args += ["--levels", args.levels]
    for setting in args.set or []:
        worker_args += ["--set", setting]
    try:
        with ForeignLoad() as load:
            # The ranks' progress lines go to stderr and stream; stdout is shown only on failure.
            result, elapsed = run_worker(__file__, ranks, worker_args, f"{model} job with {ranks} ranks",
                                         mpiexec=args.mpiexec, capture="stdout")
        result["elapsed_s"] = elapsed
        result["load"] = load.summary()
        return result
    finally:
        shutil.rmtree(run_root, ignore_errors=True)


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def _print_run(key, run):
    disk = run["disk"]
    print(f"\n== {key}: {run['ranks']} rank(s), state {run['state_bytes'] / 1e6:.1f} MB "
          f"({run['parameters']:,} parameters x2), every {run['every']} steps, {run['nckpt']} checkpoints x "
          f"{run['rounds']} round(s); baseline {run['baseline_ms_per_step']:.1f} ms/step; disk write+fsync "
          f"{disk['seconds']:.3f} s = {disk['gb_per_s']:.2f} GB/s; hpcckpt levels {run['levels']}; "
          f"{run['elapsed_s']:.0f} s; other load runnable {run['load']['busy_fraction']}, "
          f"loadavg {run['load']['loadavg_median']}")
    header = ("approach", "blocking ms", "of it waiting", "prep ms", "overhead %", "wall ovh %", "ms/step",
              "durable s (per level)")
    rows = [header]
    for name, r in run["approaches"].items():
        durable = " ".join(f"{lv}={v:.3f}" for lv, v in r["durable_s"].items() if v is not None)
        rows.append((name, _fmt(r["blocking_ms"]), _fmt(r["wait_ms"]), _fmt(r["prep_ms"]), _fmt(r["overhead_pct"]),
                     _fmt(r["wall_overhead_pct"]), _fmt(r["ms_per_step"]), durable))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) if i in (0, 7) else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))))
    for name, r in run["approaches"].items():
        if r.get("blocking_parts_ms"):
            parts = ", ".join(f"{part} {ms:.1f}" for part, ms in r["blocking_parts_ms"].items())
            print(f"  {name} blocking by part (ms, slowest rank, median): {parts}")
        if r.get("ckpt_cpu_core_s") is not None:
            print(f"  {name} CPU of a checkpoint (background threads, sum of ranks, median): "
                  f"{r['ckpt_cpu_core_s']:.3f} core-s, a floor of {_fmt(r['cpu_floor_pct'])} % overhead on saturated cores"
                  f" ({', '.join(f'{t} {v:.3f}' for t, v in r.get('ckpt_cpu_core_s_by_thread', {}).items())})")
    if "frequency" in run and run["frequency"]:
        freq = run["frequency"]
        rounds = freq.get("rounds", 1)
        print(f"  overhead vs frequency (hpcckpt, all levels, {freq['steps']} steps each, {rounds} round(s), "
              f"median; never: {', '.join(f'{v:.1f}' for v in freq['never_ms_per_step'])} ms/step):")
        for every, r in freq["intervals"].items():
            rss = ""
            if r.get("rss_kib_first"):
                rss = (f", RSS (sum of ranks) {r['rss_kib_first'] / 1024:.0f} -> {r['rss_kib_last'] / 1024:.0f} MiB"
                       f" (max {r['rss_kib_max'] / 1024:.0f})")
            cpu = ""
            if r.get("ckpt_cpu_core_s") is not None:
                cpu = f", CPU {r['ckpt_cpu_core_s']:.3f} core-s per checkpoint (floor {_fmt(r['cpu_floor_pct'])} %)"
            per_round = ""
            if len(r.get("overhead_pct_rounds", ())) > 1:
                per_round = f" [{', '.join(f'{v:.1f}' for v in r['overhead_pct_rounds'])}]"
            print(f"    every {every:>5}: {r['checkpoints']:3d} ckpts, {r['ms_per_step']:.1f} ms/step, overhead "
                  f"{r['overhead_pct']:.1f} %{per_round} (paper def. {_fmt(r.get('paper_overhead_pct'))} %), blocking "
                  f"{_fmt(r.get('blocking_ms'))} ms{rss}{cpu}")


def _targets(runs):
    """Check the issue's targets on the largest 4-rank run (and report the others)."""
    out = {}
    for key, run in runs.items():
        if run["ranks"] != 4:
            continue
        a = run["approaches"]
        t = {}
        h = a.get("hpcckpt")
        if h:
            for other, bound in (("h5py_default", 10), ("sharded", 3), ("dcp_async", 20)):
                if other in a:
                    ratio = h["blocking_ms"] / a[other]["blocking_ms"]
                    t[f"blocking_vs_{other}"] = {"ratio": ratio, "bound": 1 / bound, "met": ratio <= 1 / bound}
            if h.get("l4_gb_per_s"):
                share = h["l4_gb_per_s"] / run["disk"]["gb_per_s"]
                t["l4_rate_share_of_disk"] = {"share": share, "bound": 0.7, "met": share >= 0.7}
            if h.get("rss_change_by_round"):
                change = max(h["rss_change_by_round"], key=abs)
                t["rss_change"] = {"change": change, "bound": 0.05, "met": abs(change) <= 0.05}
        l13 = a.get("hpcckpt_l1l3")
        if l13 and l13["durable_s"]:
            durable = max(v for v in l13["durable_s"].values() if v is not None)
            ratio = durable / run["disk"]["seconds"]
            # L1 + L3 write the state and its parity (parity/(group-parity) of it): on one disk
            # the floor is that many times the disk time of the state alone.
            written = 1 + run["parity"] / (run["group_size"] - run["parity"])
            t["l1l3_durable_vs_disk"] = {"durable_s": durable, "disk_s": run["disk"]["seconds"], "ratio": ratio,
                                         "bound": 1.5, "met": ratio <= 1.5,
                                         "bytes_written_vs_state": written,
                                         "ratio_to_disk_time_of_bytes_written": ratio / written}
        freq = run.get("frequency")
        if freq and "10" in freq["intervals"]:
            ovh = freq["intervals"]["10"]["overhead_pct"]
            t["overhead_every10"] = {"overhead_pct": ovh, "bound": 3.5, "met": ovh <= 3.5}
            rss = freq["intervals"].get("1", {})
            if rss.get("rss_kib_first"):
                change = rss["rss_kib_last"] / rss["rss_kib_first"] - 1
                t["rss_change_every1"] = {"checkpoints": rss["checkpoints"], "change": change, "bound": 0.05,
                                          "met": abs(change) <= 0.05}
        out[key] = t
    return out


def _plot(result, quick):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)")
        return []
    FIGURES.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    suffix = "_quick" if quick else ""
    written = []
    models = sorted({k.split("_", 1)[1] for k in runs}, key=lambda m: list(MODELS).index(m))
    names = [n for n in APPROACHES if any(n in r["approaches"] for r in runs.values())]
    for metric, label, fname, log in (("blocking_ms", "blocking time per checkpoint (ms)", "blocking", True),
                                      ("overhead_pct", "runtime overhead (%, paper's definition)", "overhead",
                                       False)):
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            keys = sorted((k for k in runs if k.endswith("_" + model)), key=lambda k: runs[k]["ranks"])
            width = 0.8 / max(1, len(names))
            for j, name in enumerate(names):
                xs, ys = [], []
                for i, k in enumerate(keys):
                    r = runs[k]["approaches"].get(name)
                    if r and r.get(metric) is not None:
                        xs.append(i + j * width)
                        ys.append(max(r[metric], 1e-3) if log else r[metric])
                ax.bar(xs, ys, width, label=name)
            ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(keys))])
            ax.set_xticklabels([f"{runs[k]['ranks']} rank(s)" for k in keys])
            ax.set_title(f"{model} state ({runs[keys[0]]['state_bytes'] / 1e6:.0f} MB)")
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
            else:
                ax.axhline(0, color="black", linewidth=0.5)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = FIGURES / f"checkpoint_{fname}{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    freq_runs = [(k, r["frequency"]) for k, r in runs.items() if r.get("frequency")]
    if freq_runs:
        key, freq = freq_runs[0]
        labels = list(freq["intervals"])
        values = [freq["intervals"][x]["overhead_pct"] for x in labels]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([f"every {x}" if x != "never" else "never" for x in labels], values, color="tab:blue")
        ax.axhline(3.5, color="red", linestyle="--", linewidth=1, label="3.5 % target")
        ax.set_ylabel("runtime overhead vs never (%)")
        ax.set_title(f"hpcckpt, all levels, {key}")
        ax.legend()
        fig.tight_layout()
        path = FIGURES / f"checkpoint_frequency{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def parent(args):
    approaches = [a for a in args.approaches.split(",") if a]
    if "dcp_async" in approaches and not available("torch"):
        print("torch is not installed: dcp_async skipped")
        approaches.remove("dcp_async")
    models = args.models.split(",")
    ranks_list = [int(r) for r in args.ranks.split(",")]
    host = machine(args.mpiexec, args.tmp)
    print(f"bench_checkpoint: models {models}, ranks {ranks_list}, approaches {approaches}", flush=True)
    print_machine(host)
    result = {"meta": {"command": " ".join([Path(sys.executable).name, *sys.argv]), "cpus": host["cpus"],
                       "mpiexec": host["mpiexec"], "date": host["date"], "loadavg_before": host["loadavg_start"]},
              "runs": {}}
    # Most ranks first: the 4-rank runs carry the targets.
    jobs = sorted(((m, r) for m in models for r in ranks_list), key=lambda j: (-j[1], models.index(j[0])))
    for model, ranks in jobs:
        every, nckpt, rounds = args.every, args.nckpt, args.rounds
        if model == "1GB":
            every, nckpt, rounds = args.every_1gb, args.nckpt_1gb, args.rounds_1gb
        freq = args.freq if (model == "100MB" and ranks == 4) else ""
        key = f"r{ranks}_{model}"
        print(f"running {key} ...", flush=True)
        run = _run_job(args, model, ranks, approaches, every, nckpt, rounds, freq)
        result["runs"][key] = run
        _print_run(key, run)
        if args.json:  # partial results survive an interrupted run
            write_json(args.json, result, host)
    largest = max(result["runs"], key=lambda k: (result["runs"][k]["state_bytes"], result["runs"][k]["ranks"]))
    result["largest_run"] = largest
    result["approaches"] = result["runs"][largest]["approaches"]
    result["targets"] = _targets(result["runs"])
    result["meta"]["loadavg_after"] = round(os.getloadavg()[0], 2)
    print("\ntargets (4-rank runs):")
    for key, targets in result["targets"].items():
        for name, t in targets.items():
            detail = ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items()
                               if k != "met")
            print(f"  {key} {name}: {'MET' if t['met'] else 'missed'} ({detail})")
    written = _plot(result, args.quick)
    result["figures"] = written
    if written:
        print("figures: " + ", ".join(written))
    if args.json:
        write_json(args.json, result, host)
        print(f"wrote {args.json}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 MB state, 4 ranks, few steps (under 2 minutes)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--models", help="comma-separated subset of 100MB,1GB (default both; --quick 100MB)")
    parser.add_argument("--ranks", help="comma-separated rank counts (default 1,2,4; --quick 4)")
    parser.add_argument("--approaches", default=",".join(APPROACHES), help="comma-separated approaches")
    parser.add_argument("--every", type=int, help="checkpoint every N steps, 100 MB runs (default 10, --quick 5)")
    parser.add_argument("--nckpt", type=int, help="timed checkpoints per segment, 100 MB (default 3, --quick 3)")
    parser.add_argument("--rounds", type=int, help="rounds over all approaches, 100 MB (default 1; 2 alternates the order)")
    parser.add_argument("--every-1gb", type=int, default=3, help="checkpoint interval for the 1 GB runs (default 3)")
    parser.add_argument("--nckpt-1gb", type=int, default=2, help="timed checkpoints per segment, 1 GB (default 2)")
    parser.add_argument("--rounds-1gb", type=int, default=1, help="rounds, 1 GB (default 1)")
    parser.add_argument("--freq", help="item 6 intervals for 100 MB / 4 ranks (default 1,10,100; --quick 1,10)")
    parser.add_argument("--freq-steps", type=int, help="steps per frequency run (default 100, --quick 12)")
    parser.add_argument("--freq-rounds", type=int, default=1,
                        help="rounds of the frequency sweep, each next to its own never segments; the median "
                             "overhead is reported (default 1)")
    parser.add_argument("--freq-steps-every1", type=int, default=30,
                        help="steps of the every-step run (default 30: each checkpoint takes seconds here)")
    parser.add_argument("--disk-repeats", type=int, help="disk write+fsync repeats (default 3, --quick 2)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="config override for hpcckpt's engine, e.g. checkpoint.persist_nice=0 (repeatable)")
    parser.add_argument("--levels", help="comma-separated levels for hpcckpt and the frequency sweep "
                        "(default: all four at 2+ ranks), to see what each level costs")
    parser.add_argument("--tmp", default="/tmp", help="where run directories go (default /tmp)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH; \"ulfm\": the "
                        "fault-tolerant MPI as hpcckpt.cluster.ulfm_mpiexec launches it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-root", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=0.05, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {"models": ("100MB,1GB", "100MB"), "ranks": ("1,2,4", "4"), "every": (10, 5), "nckpt": (3, 3),
                "rounds": (1, 1), "freq": ("1,10,100", "1,10"), "freq_steps": (100, 12), "disk_repeats": (3, 2)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.worker:
        worker(args)
        return
    if args.freq_rounds < 1:
        parser.error("--freq-rounds must be at least 1")
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; allowed are {', '.join(MODELS)}")
    unknown = set(a for a in args.approaches.split(",") if a) - set(APPROACHES) - set(EXTRA_APPROACHES)
    if unknown:
        parser.error(f"--approaches: unknown {sorted(unknown)}; allowed are "
                     f"{', '.join(APPROACHES + EXTRA_APPROACHES)}")
    if args.levels is not None:
        from hpcckpt.config import LEVEL_ORDER

        levels = [lv for lv in args.levels.split(",") if lv]
        if not levels or set(levels) - set(LEVEL_ORDER):
            parser.error(f"--levels {args.levels!r}: expected a comma-separated subset of {', '.join(LEVEL_ORDER)}")
    parent(args)


if __name__ == "__main__":
    main()
