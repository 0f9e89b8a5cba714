"""The baselines of perf/bench_goodput.py: the same trainer (hpcckpt/train/trainer.py, the same
model, data order and steps as `hpcckpt train`) checkpointed by another approach, restarting
from its own files, run under the job scripts' restart loop as an APP:

    APP="python perf/goodput_app.py --approach dcp --config job.toml --dir DIR --mtbf-s 30 \
         --pfs-mbps 80" NRANKS=4 bash jobs/slurm.sbatch

Approaches (each at its own Young/Daly interval, sqrt(2 C MTBF), from its measured cost C,
chosen by the same policy as hpcckpt's, schedule/policy.py):

- dcp: torch.distributed.checkpoint.async_save of the replicated arrays (DCP's planner writes
  each once, spread over the ranks) over a gloo group, at most one save in flight; a version
  counts once rank 0's completion marker (with the training state) is written after the save
  finished on every rank.
- h5py: rank 0 writes every array into one HDF5 file, synchronously, the other ranks wait.

The PFS these write to and read from is capped at `--pfs-mbps` MB/s for the job (DCP: an
equal share per rank, as they move data at once; h5py: rank 0 alone), as hpcckpt's L4 is with
storage.pfs_bandwidth_mb and pfs_read_bandwidth_mb, so every approach meets the same slow
shared file system.

It prints the lines bench_goodput.py reads from `hpcckpt train` too: "restored version N",
"the previous run had reached step S", "checkpoints: N taken, blocking median X ms" and
"done: N steps ..., weights DIGEST".
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from harness import Dcp, bcast_arrays, fsync_path, h5py_load, h5py_save  # perf/ is on sys.path

from hpcckpt.levels.base import hold_to_bandwidth

DONE = "done.pickle"  # a version's completion marker, with the training state
PROGRESS = "progress.json"  # the step the run last reached (rank 0, every step)


class ThrottledStream:
    """A file whose writes and reads average at most `rate` bytes/s (the PFS's share of this
    rank)."""

    def __init__(self, stream, rate: float):
        self._stream, self._rate = stream, rate
        self._moved, self._started = 0, time.perf_counter()

    def _account(self, nbytes: int) -> None:
        self._moved += nbytes
        hold_to_bandwidth(self._moved, self._rate, self._started)

    def write(self, data) -> int:
        written = self._stream.write(data)
        self._account(len(memoryview(data).cast("B")))
        return written

    def read(self, size=-1):
        data = self._stream.read(size)
        self._account(len(data))
        return data

    def readinto(self, buffer) -> int:
        n = self._stream.readinto(buffer)
        self._account(n or 0)
        return n

    def __getattr__(self, name):
        return getattr(self._stream, name)


def write_throttled(path: Path, data: bytes, rate: float, chunk: int = 4 << 20) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        stream = ThrottledStream(f, rate)
        view = memoryview(data)
        for offset in range(0, len(view), chunk):
            stream.write(view[offset: offset + chunk])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def versions(root: Path) -> list[int]:
    """Steps with a complete version under `root`, newest first."""
    found = []
    for entry in root.glob("step-*"):
        step = entry.name.split("-", 1)[1].split(".", 1)[0]
        if step.isdigit() and (entry / DONE).is_file():
            found.append(int(step))
    return sorted(set(found), reverse=True)


class H5pyFromRankZero:
    """Rank 0 writes one HDF5 file per version; the others wait. Synchronous."""

    def __init__(self, comm, arrays, root: Path, pfs_rate: float):
        self.comm, self.arrays, self.root, self.rate = comm, arrays, root, pfs_rate

    def save(self, step: int, state: dict) -> None:
        started = time.perf_counter()
        if self.comm.Get_rank() == 0:
            image = io.BytesIO()  # whole, then written through the PFS's throttle
            h5py_save(image, self.arrays)
            directory = self.root / f"step-{step}"
            directory.mkdir(parents=True, exist_ok=True)
            write_throttled(directory / "state.h5", image.getbuffer(), self.rate)
            write_throttled(directory / DONE, pickle.dumps(state), 0)
        self.comm.Barrier()
        self.last_durable = time.perf_counter() - started

    def close(self) -> None:
        pass

    def load(self, step: int) -> dict:
        directory = self.root / f"step-{step}"
        if self.comm.Get_rank() == 0:
            with open(directory / "state.h5", "rb") as raw:
                h5py_load(ThrottledStream(raw, self.rate), self.arrays, read_direct=False)
        bcast_arrays(self.comm, (array for _, array in self.arrays))
        return pickle.loads((directory / DONE).read_bytes())

    def in_flight(self) -> bool:
        return False


class DcpAsync:
    """torch DCP async_save; a version is complete once rank 0's marker follows the save."""

    def __init__(self, comm, arrays, root: Path, pfs_rate: float):
        from torch.distributed.checkpoint.filesystem import FileSystem

        class ThrottledFileSystem(FileSystem):
            @contextmanager
            def create_stream(self, path, mode):
                with super().create_stream(path, mode) as stream:
                    yield ThrottledStream(stream, pfs_rate / comm.Get_size())

        self.comm, self.root, self.dcp = comm, root, Dcp(comm)
        self.ThrottledFileSystem = ThrottledFileSystem
        self.state = {"state": self.dcp.views(arrays)}
        self.future = None
        self.pending = None
        self.last_durable = None  # seconds from a save's start until it was written everywhere

    def _writer(self, path: Path):
        writer = self.dcp.dcp.FileSystemWriter(str(path))
        writer.fs = self.ThrottledFileSystem()
        return writer

    def in_flight(self) -> bool:
        return self.future is not None and not self.future.done()

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        self.comm.Barrier()  # every rank's share written: the marker may follow

    def save(self, step: int, state: dict) -> None:
        self.finish()
        self._mark_previous()
        path = self.root / f"step-{step}"
        started = time.perf_counter()
        self.future = self.dcp.async_save(self.state, storage_writer=self._writer(path))
        self.future.add_done_callback(lambda _: setattr(self, "last_durable", time.perf_counter() - started))
        self.pending = (path, state)

    def _mark_previous(self) -> None:
        pending = self.pending
        if pending is not None and self.comm.Get_rank() == 0:
            write_throttled(pending[0] / DONE, pickle.dumps(pending[1]), 0)
        self.pending = None

    def close(self) -> None:
        self.finish()
        self._mark_previous()

    def load(self, step: int) -> dict:
        path = self.root / f"step-{step}"
        reader = self.dcp.dcp.FileSystemReader(str(path))
        reader.fs = self.ThrottledFileSystem()
        self.dcp.load(self.state, storage_reader=reader)
        return pickle.loads((path / DONE).read_bytes())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--approach", choices=("dcp", "h5py"), required=True)
    parser.add_argument("--config", required=True, help="the job TOML `hpcckpt train` runs (model, data, steps)")
    parser.add_argument("--dir", required=True, help="where this approach's versions go (the PFS)")
    parser.add_argument("--mtbf-s", type=float, required=True, help="mean time between failures, for Young/Daly")
    parser.add_argument("--pfs-mbps", type=float, default=0.0, help="the PFS's bandwidth for this job, MB/s")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    from hpcckpt.schedule.policy import IntervalPolicy
    from hpcckpt.cluster.backend import select_backend
    from hpcckpt.config import load_config
    from hpcckpt.exit_record import record_started
    from hpcckpt.runlog import RunLog
    from hpcckpt.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    record_started(comm)  # the restart loop's start-up watchdog: every rank is through MPI_Init
    config = load_config(args.config, [], environ={})
    root = Path(args.dir)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    log = RunLog(root / "log", rank, comm.Get_size(), console=False)
    trainer = Trainer(config, comm, select_backend("cpu", local_rank=rank), log)
    arrays = trainer.protected_arrays()
    make = {"dcp": DcpAsync, "h5py": H5pyFromRankZero}[args.approach]
    approach = make(comm, arrays, root, args.pfs_mbps * 1e6)
    say = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)

    policy = IntervalPolicy("auto", config.checkpoint.max_overhead, args.mtbf_s / 3600)
    found = comm.bcast(versions(root) if rank == 0 else None, root=0)
    if found:
        state = approach.load(found[0])
        trainer.load_training_state(state["trainer"])
        policy.load_state(state["policy"])
        say(f"restored version {found[0]}: 4 rank(s) from {args.approach}")
        if rank == 0 and (root / PROGRESS).is_file():
            reached = json.loads((root / PROGRESS).read_text())["step"]
            say(f"the previous run had reached step {reached}: {reached - found[0]} step(s) are done again")
    else:
        say("starting from scratch (no checkpoint to resume from)")
    policy.last_checkpoint = trainer.step

    last = config.run.steps
    blocking = []
    started = time.perf_counter()
    while trainer.step < last:
        persisting = approach.in_flight()
        # The loss reduced and printed every step, as `hpcckpt train` does with run.log_every = 1:
        # bench_goodput.py counts the steps each attempt reached from these lines.
        result = trainer.train_step()
        policy.observe_step(result.seconds, persisting)
        say(f"step {trainer.step:6d}  loss {result.loss:.4f}")
        if rank == 0:
            (root / (PROGRESS + ".tmp")).write_text(json.dumps({"step": trainer.step}))
            os.replace(root / (PROGRESS + ".tmp"), root / PROGRESS)
        if not policy.due(trainer.step, last):
            continue
        begun = time.perf_counter()
        profiling = policy.interval == 0
        approach.save(trainer.step, {"trainer": trainer.training_state(), "policy": policy.state()})
        if profiling or trainer.step == last:
            approach.close()  # the profiling version measures the time until durable
        blocked = time.perf_counter() - begun
        blocking.append(blocked)
        durable = blocked if profiling else approach.last_durable
        local = np.array([policy.step_time, policy.busy_step_time, blocked, durable or 0.0])
        measured = np.empty_like(local)
        comm.Allreduce(local, measured, op=MPI.MAX)  # every rank decides alike, on the slowest's costs
        policy.step_time, policy.busy_step_time = measured[0], measured[1]
        said = policy.observe_checkpoint(trainer.step, measured[2], measured[3] or None)
        if said:
            say(said)
    approach.close()
    seconds = time.perf_counter() - started
    median_ms = 1000 * statistics.median(blocking) if blocking else 0.0
    say(f"checkpoints: {len(blocking)} taken, blocking median {median_ms:.1f} ms, max "
        f"{1000 * max(blocking, default=0):.1f} ms")
    say(f"done: {trainer.step} steps in {seconds:.1f} s, final val_accuracy n/a, weights "
        f"{trainer.weights_digest()[:16]} (identical on all ranks)")
    log.close()
    return 0


if __name__ == "__main__":
    from hpcckpt.application import run_main

    sys.exit(run_main(main))
