"""Every node-local directory turns into a file mid-run: the background L1 write fails, no
other level stands in for it (L1 is the only one), and with max_unprotected_checkpoints = 1
the failure must surface as the same error on every rank at the next call, and in the log.
(A level that fails while another holds the version does not stop a job:
tests/test_degraded_storage_mpi.py.)"""

import shutil
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import HpcckptError
from hpcckpt.runlog import RunLog


def main():
    run_dir = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2",
                                'resilience.levels=["local"]', "resilience.max_unprotected_checkpoints=1"],
                         environ={})
    log = RunLog(run_dir, comm.rank, comm.size, console=False)
    weights = np.arange(4096, dtype=np.float64)
    ckpt = Checkpointer(comm, config, log=log)
    ckpt.protect("w", weights)
    ckpt.checkpoint(1)
    ckpt.wait()
    comm.Barrier()
    if comm.rank % 2 == 0:  # the first rank of each of the 2 simulated nodes
        local = Path(ckpt.local_dir)
        shutil.rmtree(local)
        local.write_text("the node-local disk went away")
    comm.Barrier()
    ckpt.checkpoint(2)  # its L1 write fails in the background
    try:
        ckpt.checkpoint(3)  # the failure of step 2 surfaces here
        print(f"rank {comm.rank}: no error surfaced", flush=True)
    except HpcckptError as exc:
        print(f"rank {comm.rank}: surfaced: {type(exc).__name__}: {exc} |", flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
