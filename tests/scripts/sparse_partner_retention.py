"""Partner copies every 3rd checkpoint, two node-local versions kept: retention must keep the
newest version that has partner copies as well, so a node loss still has a way back.

    sparse_partner_retention.py RUN_DIR save      five checkpoints; w = step
    sparse_partner_retention.py RUN_DIR restore   restart; prints what came back
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config


def main():
    run_dir, action = Path(sys.argv[1]), sys.argv[2]
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", "checkpoint.keep_local=2",
                                'resilience.levels=["local","partner"]', "resilience.partner_every=3"], environ={})
    weights = np.zeros(4096, dtype=np.float64)
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    if action == "save":
        for step in range(1, 6):
            weights[:] = step
            ckpt.checkpoint(step)
            ckpt.wait()
        result = {"rank": comm.rank, "committed": ckpt.levels.local.committed_steps()}
    else:
        restored = ckpt.restart("require")
        result = {"rank": comm.rank, "restored": restored, "values": sorted(set(weights.tolist())),
                  "sources": list(ckpt.restored_sources)}
    ckpt.close()
    for record in comm.gather(result, root=0) or []:
        print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
