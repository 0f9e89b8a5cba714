"""The same step written by two runs: 4 ranks write steps 1-3 (L4 has 2), 2 ranks resume
from 2 and write 3 again with other values, then 4 ranks resume. Node-local directories still
hold the first run's step 3 for ranks the 2-rank job did not have; every rank must restore
the same writing (or none of a step), never a mix, and never hang on it.

    rewritten_step.py RUN_DIR FIRST_STEP LAST_STEP SCALE PFS_EVERY
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hang_guard import abort_if_stuck  # tests/scripts, the script's own directory
from hpcckpt import Checkpointer, load_config

HANG_S = 60


def main():
    run_dir, first, last, scale, pfs_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
        int(sys.argv[5])
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", f"storage.pfs_every={pfs_every}",
                                'resilience.levels=["local","pfs"]', "checkpoint.split_threshold_kb=1"],
                         environ={})
    weights = np.zeros((64, 32))
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    with abort_if_stuck(HANG_S, "in restart"):
        restored = ckpt.restart("auto") if first > 1 else None
    result = {"rank": comm.rank, "restored": restored, "values": sorted(set(weights.ravel().tolist()))}
    for step in range(first, last + 1):
        weights[:] = step * scale
        ckpt.checkpoint(step)
    ckpt.close(drain=False)  # L4 keeps only the versions pfs_every sent there (the test's premise)
    for record in comm.gather(result, root=0) or []:
        print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
