"""storage.local_bandwidth_mb and storage.pfs_bandwidth_mb hold each rank's writes to the cap:
with 4 MB per rank and level at 8 MB/s, every level needs at least half a second."""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config


def main():
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={sys.argv[1]}", "cluster.simulated_nodes=2",
                                'resilience.levels=["local","partner","pfs"]',
                                "storage.pfs_every=1", "storage.local_bandwidth_mb=8", "storage.pfs_bandwidth_mb=8"],
                         environ={})
    weights = np.arange(1 << 20, dtype=np.float64)  # 8 MiB, sharded: 4 MiB per rank
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    ckpt.checkpoint(1)
    report = ckpt.wait()
    ckpt.close()
    results = comm.gather({"rank": comm.rank, "durable_s": report.durable_s, "started_s": report.started_s,
                           "cpu_s": report.cpu_s}, root=0)
    if comm.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
