"""Many ranks on NODES simulated nodes (default 8; the suite runs 8 and 32 ranks, by hand
`mpiexec -n 64 ... RUN_DIR run 16` goes further), all four levels (groups of 4, parity 2):
checkpoints at steps 20, 40 and 60 of a deterministic update of a replicated array cut over
every rank.

    scale_restart.py RUN_DIR run [NODES]     steps 1-60, a checkpoint every 20; prints the digest at 60
    scale_restart.py RUN_DIR resume [NODES]  restart (from what the test left), then on to 60;
                                             prints the step restored, where shards came from
                                             and the digest
"""

import json
import sys
from pathlib import Path

import numpy as np
import xxhash
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config


def advance(weights: np.ndarray, step: int) -> None:
    weights *= np.float32(0.999)
    weights += np.float32(step) * np.float32(1e-3)


def main():
    run_dir, action = Path(sys.argv[1]), sys.argv[2]
    nodes = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", f"cluster.simulated_nodes={nodes}", "checkpoint.keep_local=3",
                                "checkpoint.split_threshold_kb=1",
                                "checkpoint.keep_pfs=3", 'resilience.levels=["local","partner","erasure","pfs"]',
                                "resilience.group_size=4", "resilience.parity=2", "storage.pfs_async=false"],
                         environ={})
    weights = np.linspace(0, 1, 64 * 257 + 5, dtype=np.float32)  # cut over every rank, unequal pieces
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    result = {"rank": comm.rank}
    first = 1
    if action == "resume":
        restored = ckpt.restart("require")
        result.update(restored=restored, source=ckpt.restored_sources[comm.rank])
        first = restored + 1
    for step in range(first, 61):
        advance(weights, step)
        if step % 20 == 0:
            ckpt.checkpoint(step, final=step == 60)
            ckpt.wait()
    result["digest"] = xxhash.xxh3_64_hexdigest(weights.tobytes())
    ckpt.close()
    for record in comm.gather(result, root=0) or []:
        print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
