"""A diffusion solver that meets a NaN (a silent data error) and rewinds in process.

    rewind_solver.py RUN_DIR ITERATIONS POISON_AT     POISON_AT 0: undisturbed

Each rank protects its block of a 1-D grid and the iteration in registered state, and
checkpoints every 5 iterations (all four levels but L4's pace: every version). At POISON_AT a
NaN enters rank 1's block once; the next check finds the block non-finite on some rank (agreed
with one allreduce), the solver rewinds to the newest version before it and goes on; the final
grid must equal the undisturbed run's, bit for bit.
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config


def main():
    run_dir, iterations, poison_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", "checkpoint.keep_local=3",
                                'resilience.levels=["local","partner","pfs"]', "storage.pfs_async=false"],
                         environ={})
    grid = np.zeros(1000, dtype=np.float64)
    grid[0] = 1.0 if comm.rank == 0 else 0.0
    state = {"iteration": 0}
    ckpt = Checkpointer(comm, config)
    ckpt.protect("grid", grid, replicated=False)
    ckpt.register_state("solver", lambda: dict(state), state.update)
    ckpt.restart("auto")
    poisoned, rewinds = False, []
    while state["iteration"] < iterations:
        state["iteration"] += 1
        grid[1:-1] = grid[1:-1] + 0.25 * (grid[2:] - 2 * grid[1:-1] + grid[:-2])
        if state["iteration"] == poison_at and not poisoned and comm.rank == 1:
            grid[500] = np.nan
        poisoned = poisoned or state["iteration"] == poison_at
        bad = comm.allreduce(0 if np.isfinite(grid).all() else 1, op=MPI.MAX)
        if bad:
            went_wrong = state["iteration"]
            back = ckpt.rewind(went_wrong, f"non-finite grid at iteration {went_wrong}")
            rewinds.append([went_wrong, back, state["iteration"]])
            continue
        if state["iteration"] % 5 == 0:
            ckpt.checkpoint(state["iteration"])
    ckpt.close()
    digest = comm.gather(grid.tobytes().hex()[:64] + str(float(grid.sum())), root=0)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"rewinds": rewinds, "grid": digest}), flush=True)


if __name__ == "__main__":
    main()
