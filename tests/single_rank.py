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

from hpcckpt import Checkpointer, load_config
from hpcckpt.levels.naming import COMMIT_GLOB, PFS_COMMIT_NAME, step_of_version_dir


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
