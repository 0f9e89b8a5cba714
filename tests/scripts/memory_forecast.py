"""The memory forecast (#26 item 3) on real ranks: this node "has" `available_mib` MiB
available (a stand-in /proc/meminfo), and the job protects a 64 MiB replicated state with all
four levels. Rank 0 prints the warning (stderr) at the first checkpoint; the job goes on.
With a memory directory (a {node} template on a RAM file system) and its budget in MB, the
node-local versions are kept there first.

    mpiexec -n 4 python memory_forecast.py <run dir> <available MiB> [<memory dir> <budget MB>]
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config
from hpcckpt.ckpt import memory_forecast
from hpcckpt.runlog import RunLog

run_dir, available_mib = Path(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
run_dir.parent.mkdir(parents=True, exist_ok=True)
fake = run_dir.parent / f"meminfo-{comm.rank}"
fake.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_mib * 1024} kB\n")
memory_forecast.MEMINFO = fake
config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", "resilience.group_size=2",
                            "resilience.parity=1", 'resilience.levels=["local", "partner", "erasure", "pfs"]',
                            "checkpoint.chunk_mib=1"]
                     + ([f"storage.memory_dir={sys.argv[3]}", f"storage.memory_budget_mb={sys.argv[4]}"]
                        if len(sys.argv) > 4 else []))
ckpt = Checkpointer(comm, config, log=RunLog(run_dir, comm.rank, comm.size))
state = np.ones(16 << 20, dtype=np.float32)  # 64 MiB: 16 MiB per rank's shard
ckpt.protect("state", state)
ckpt.checkpoint(1)
ckpt.close()
if comm.rank == 0:
    print("DONE", flush=True)
