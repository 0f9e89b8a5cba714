"""Rank 1's L1 write of step 2 fails (its shard file is already there) while L3 encodes and
stores the same step's parity on every rank meanwhile: the failure must surface as the same
CheckpointError on every rank, step 2 must be committed nowhere, the file in the way must be
left as it was, and step 1 must still restore."""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import CheckpointError


def main():
    run_dir = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=4",
                                'resilience.levels=["local","erasure"]', "resilience.group_size=4",
                                "resilience.parity=2", "checkpoint.keep_local=3"], environ={})
    weights = np.arange(1 << 18, dtype=np.float32)
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    ckpt.checkpoint(1)
    ckpt.wait()
    in_the_way = ckpt.levels.local.shard_path(2)
    if comm.rank == 1:
        in_the_way.parent.mkdir(parents=True)
        in_the_way.write_bytes(b"not a shard")
    comm.Barrier()
    weights += 1
    ckpt.checkpoint(2)
    result = {"rank": comm.rank}
    try:
        ckpt.wait()
        result["error"] = None
    except CheckpointError as exc:
        result["error"] = str(exc)
        result["failed_ranks"] = sorted(exc.failures_by_rank)
    result["parity_of_2"] = ckpt.levels.erasure.parity_path(2).exists()
    result["committed_2"] = ckpt.levels.local.commit_path(2).exists()
    result["in_the_way"] = in_the_way.read_bytes().decode(errors="replace") if comm.rank == 1 else None
    weights[:] = 0
    result["restored"] = ckpt.restart()
    result["weights_back"] = bool(np.array_equal(weights, np.arange(1 << 18, dtype=np.float32)))
    ckpt.close()
    everyone = comm.gather(result, root=0)  # one writer: lines from several ranks interleave
    if comm.rank == 0:
        for one in everyone:
            print("RESULT " + json.dumps(one), flush=True)


if __name__ == "__main__":
    main()
