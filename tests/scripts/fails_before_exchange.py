"""One rank fails inside L2 or L3 before or between its transfers (an allocation, the
encoding), or in the commit, with one erasure group or several (argv: run dir, group size,
parity): every rank must get the same CheckpointError naming that rank,
instead of the others waiting for its messages for ever, no rank may keep a commit record of the
failed version, and the next checkpoint must work."""

import errno
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hang_guard import abort_if_stuck  # tests/scripts, the script's own directory
from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import CheckpointError

HANG_S = 60


def fail_once(obj, name, exc):
    original = getattr(obj, name)

    def failing(*args, **kwargs):
        setattr(obj, name, original)
        raise exc

    setattr(obj, name, failing)


def main():
    run_dir = Path(sys.argv[1])
    group_size, parity = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("4", "2")
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=4", f"resilience.group_size={group_size}",
                                f"resilience.parity={parity}", 'resilience.levels=["local","partner","erasure"]'],
                         environ={})
    weights = np.arange(1 << 16, dtype=np.float64)
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    faults = {
        1: (1, lambda: fail_once(ckpt.levels.partner._receive_buffers, "get", MemoryError("injected allocation failure"))),
        2: (2, lambda: fail_once(ckpt.levels.erasure.code, "encode", RuntimeError("injected encoder failure"))),
        3: (3, lambda: fail_once(ckpt.levels.erasure._receive_buffers, "get",
                                 OSError(errno.ENOMEM, "Cannot allocate memory (injected)"))),
        # Not a storage failure (those degrade: tests/test_degraded_storage_mpi.py): it stops the version.
        4: (0, lambda: fail_once(ckpt.levels.local, "commit", OSError(errno.ENOMEM, "Cannot allocate memory (injected)"))),
    }
    outcomes = []
    for step in (1, 2, 3, 4, 5):
        if step in faults and comm.rank == faults[step][0]:
            faults[step][1]()
        with abort_if_stuck(HANG_S, f"at step {step}"):
            ckpt.checkpoint(step)
            try:
                ckpt.wait()
                outcomes.append([step, None, []])
            except CheckpointError as exc:
                outcomes.append([step, str(exc), sorted(exc.failures_by_rank)])
    committed = ckpt.levels.local.committed_steps()
    everything = comm.gather({"rank": comm.rank, "outcomes": outcomes, "committed": committed}, root=0)
    if comm.rank == 0:
        for record in everything:
            print("RESULT " + json.dumps(record), flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
