"""A rank dies where only its neighbour sees it (tests/test_in_job_recovery_mpi.py, ULFM).

    mpiexec --with-ft ulfm -n 4 python neighbour_death.py RUN_DIR STEPS KILL_STEP

Each step, ranks exchange with a partner only (0 with 1, 2 with 3, as a halo exchange does
with its neighbours), then commit the step (commit_step), update a replicated array and ask
due(). At KILL_STEP rank 3 waits 0.5 s and SIGKILLs itself before its exchange: rank 2 learns
of the death in that exchange, while ranks 0 and 1, whose exchange went through, are already
in commit_step's agreement, which a revoke does not end. Rank 0 prints one RESULT line: the
ranks left and the step the survivors went on from.
"""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main, run_surviving

run_dir, steps, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
entries = []


def solve(comm) -> int:
    config = load_config(None, [f"run.dir={run_dir}", f"cluster.simulated_nodes={comm.size}",
                                "checkpoint.every_steps=100", 'resilience.levels=["local"]'])
    weights = np.zeros(1000)
    loop = {"step": 0}
    ckpt = Checkpointer(comm, config)
    try:
        ckpt.protect("w", weights)
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        restored = ckpt.restart()
        entries.append({"restored": restored, "ranks": comm.size, "rank": comm.rank})
        for step in range(loop["step"] + 1, steps + 1):
            world = MPI.COMM_WORLD.Get_rank()
            if step == kill_step and world == 3:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            if comm.size == 4:
                partner = comm.rank ^ 1
                got = np.empty(1)
                comm.Sendrecv(np.array([float(step)]), partner, recvbuf=got, source=partner)
            ckpt.commit_step(step)
            weights += step
            loop["step"] = step
            if ckpt.due(step, last=step == steps):
                ckpt.checkpoint(step)
    finally:
        code = ckpt.close()
    return code


def main() -> int:
    code = run_surviving(solve, timeout=20.0)
    last = entries[-1]
    if last["rank"] == 0:
        print("RESULT " + json.dumps({"entries": entries, "code": code}), flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(run_main(main))
