"""An application whose rank dies before MPI start-up, run by the job scripts' loop on the
fault-tolerant MPI (LAUNCHER=ulfm), where the other ranks then wait in MPI_Init for good.

    APP="python start_up_death.py [--nodes N]" LAUNCHER=ulfm NRANKS=4 bash jobs/slurm.sbatch

Attempt 1 gets through start-up (its Checkpointer marks it) and fails (exit code 1); in
attempt 2 rank 2 SIGKILLs itself before importing MPI; attempt 3 protects, checkpoints and
finishes. --nodes: simulated nodes (default 2; 0 on real hosts).
"""

import argparse
import os
import signal

ATTEMPT = int(os.environ.get("HPCCKPT_ATTEMPT", "1"))
if ATTEMPT == 2 and os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")) == "2":
    os.kill(os.getpid(), signal.SIGKILL)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcckpt import Checkpointer, load_config, run_main  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    nodes = parser.parse_args().nodes
    comm = MPI.COMM_WORLD
    config = load_config(None, ["run.dir=run", f"cluster.simulated_nodes={nodes}", "checkpoint.every_steps=1"])
    weights = np.zeros(1024)
    ckpt = Checkpointer(comm, config)
    try:
        ckpt.protect("weights", weights)
        ckpt.restart()
        if ATTEMPT == 1:
            return 1
        weights += 1.0
        ckpt.checkpoint(1)
    finally:
        code = ckpt.close()
    print(f"attempt {ATTEMPT} rank {comm.Get_rank()} finished", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(run_main(main))
