"""One real MPI rank inside the test process (MPI.COMM_SELF): the checkpointer's orchestration
(taking, resuming, the save pipeline, the restore flow) run without mpiexec, on a run
directory of its own. No mocking: the levels write real files, the collectives are MPI's.

Assertions read what a run leaves behind: the versions each level directory commits, and
the structured records in <run.dir>/metrics.jsonl (never console wording or timings).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from hpcckpt import Checkpointer, load_config
from hpcckpt.format.shardfile import read_shard_table
from hpcckpt.levels.naming import COMMIT_GLOB, PFS_COMMIT_NAME, shard_file_name, step_of_version_dir, version_dir_name


# The embedded job (jobs/local.toml) made a one-node job: L1 and L4 (L2 and L3 need other
# nodes), each version on both, explicit checkpoints only, retention by age alone.
ONE_NODE = ("cluster.simulated_nodes=1", 'resilience.levels=["local", "pfs"]', "storage.pfs_every=1",
            "checkpoint.every_steps=0", 'checkpoint.keep_best=""')


def config(run_dir, *settings):
    """A one-node job config; `settings` as load_config's overrides, over ONE_NODE's."""
    return load_config(None, [f"run.dir={run_dir}", *ONE_NODE, *settings])


def checkpointer(run_dir, *settings, **options) -> Checkpointer:
    """A Checkpointer on MPI.COMM_SELF. Signals are left to pytest unless asked for."""
    from mpi4py import MPI

    options.setdefault("catch_signals", False)
    return Checkpointer(MPI.COMM_SELF, config(run_dir, *settings), **options)


@contextlib.contextmanager
def opened(run_dir, *settings, **options):
    """A checkpointer closed however the test ends (close() is where the lease is released)."""
    ckpt = checkpointer(run_dir, *settings, **options)
    try:
        yield ckpt
    finally:
        ckpt.close()


class App:
    """A small application with one array of each kind and nested state: a replicated array
    (cut along its columns), a block of a global array, a per-rank array, and state whose
    types must come back intact. Step k changes each of them."""

    def __init__(self):
        self.weights = np.zeros((4, 6))
        self.field = np.zeros(12, dtype=np.float32)
        self.counts = np.zeros(3, dtype=np.int64)
        self.loop = {"step": 0, "seen": (0, b"", np.int64(0))}

    def attach(self, ckpt) -> None:
        ckpt.protect("weights", self.weights)
        ckpt.protect("field", self.field, global_shape=(12,), offset=(0,))
        ckpt.protect("counts", self.counts, replicated=False)
        ckpt.register_state("loop", lambda: dict(self.loop), self.loop.update)

    def step(self, k: int) -> None:
        self.weights += k * np.arange(24).reshape(4, 6)
        self.field += k
        self.counts[k % 3] += k
        self.loop.update(step=k, seen=(k, bytes([k]), np.int64(k)))

    def state(self) -> tuple:
        """Everything a restore must give back, as bytes and values."""
        return (self.weights.tobytes(), self.field.tobytes(), self.counts.tobytes(), dict(self.loop))


def take_versions(run_dir, steps, *settings, app: App | None = None) -> dict[int, tuple]:
    """A run that checkpoints each of `steps` (its loss 1/k), each waited for until durable,
    and closes cleanly. Returns the application's state at each version."""
    app = app or App()
    states = {}
    with opened(run_dir, *settings) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        for k in steps:
            app.step(k)
            ckpt.checkpoint(k, {"loss": 1.0 / k})
            ckpt.wait()
            states[k] = app.state()
    return states


def records(run_dir, event: str | None = None) -> list[dict]:
    """The records of <run.dir>/metrics.jsonl, those of one `event` if given."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in found if event is None or r.get("event") == event]


def blocking_records(run_dir) -> list[dict]:
    """One record per checkpoint taken: what it blocked the application."""
    return [r for r in records(run_dir) if "checkpoint_blocking_s" in r]


def committed(run_dir) -> dict[str, list[int]]:
    """The versions committed on each level directory: L1 under the node's local directory
    (this rank's commit record written), L4 under pfs/ (its manifest written)."""
    run_dir = Path(run_dir)
    local = [path.parent for path in (run_dir / "local").glob(f"node0/*/v*/{COMMIT_GLOB}")]
    pfs = [path.parent for path in (run_dir / "pfs").glob(f"v*/{PFS_COMMIT_NAME}")]
    return {"local": sorted({step_of_version_dir(d.name) for d in local} - {None}),
            "pfs": sorted({step_of_version_dir(d.name) for d in pfs} - {None})}


def version_dir(run_dir, level: str, step: int) -> Path:
    """Version `step`'s directory on level "local" (this run's, under node 0) or "pfs"."""
    run_dir = Path(run_dir)
    if level == "pfs":
        return run_dir / "pfs" / version_dir_name(step)
    [found] = (run_dir / "local").glob(f"node0/*/{version_dir_name(step)}") or [None]
    assert found is not None, f"no L1 directory of version {step} under {run_dir}"
    return found


def shard(run_dir, level: str, step: int) -> Path:
    return version_dir(run_dir, level, step) / shard_file_name(0)


def damage(path, tensor: str) -> None:
    """Flip one byte in the middle of `tensor`'s bytes in a shard file: its checksum no
    longer matches (the header and tensor table stay readable)."""
    entry = read_shard_table(path).entry(tensor)
    with open(path, "r+b") as f:
        f.seek(entry.offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
