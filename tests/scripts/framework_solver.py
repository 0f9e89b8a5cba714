"""A finite-difference framework as users bring one: it starts MPI itself (mpi4py's
rc.initialize = False, MPI_Init at its first grid), decomposes the grid itself and hands each
rank its part as a tuple of slices (with NumPy integers), and keeps a halo of one cell around
each rank's part.

    mpiexec -n N python framework_solver.py RUN_DIR MODE

modes:
  early    the Checkpointer is made before the framework's first grid started MPI
  save     the interior of each rank's part protected with the framework's slices, step 10
  restore  a job on any rank count restores it into its own parts (NaN before)
  halo     the parts protected with their halo cells, as slices (starting before the edge)
  halo-rows  the parts' rows protected with their halo rows, at integer offsets (overlapping
           the neighbours', the last past the edge)
A RESULT line per rank; exit code the error's, or 0.
"""

import json
import sys

import mpi4py

mpi4py.rc.initialize = False

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hpcckpt import Checkpointer, load_config, run_main  # noqa: E402

SHAPE = (23, 9)


class Grid:
    """The framework's grid: rows cut into uneven parts, one per rank, each with a halo."""

    def __init__(self, shape):
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        self.comm = MPI.COMM_WORLD
        rank, size = self.comm.rank, self.comm.size
        edges = np.linspace(0, shape[0], size + 1).astype(np.int64)  # NumPy integers, as frameworks hand them
        low, high = edges[rank], edges[rank + 1]
        self.part = (slice(low, high, None), slice(np.int64(0), np.int64(shape[1]), None))
        self.halo_part = (slice(low - 1, high + 1, None), slice(np.int64(-1), np.int64(shape[1] + 1), None))
        self.u = np.full((high - low + 2, shape[1] + 2), np.nan)

    @property
    def interior(self):
        return self.u[1:-1, 1:-1]


def expected(part) -> np.ndarray:
    rows, cols = np.arange(part[0].start, part[0].stop), np.arange(part[1].start, part[1].stop)
    return rows[:, None] * 1000.0 + cols[None, :] + 0.25


def main() -> int:
    run_dir, mode = sys.argv[1], sys.argv[2]
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", "checkpoint.split_threshold_kb=1",
                                'resilience.levels=["local", "partner", "pfs"]', "storage.pfs_async=false"])
    if mode == "early":
        Checkpointer(MPI.COMM_WORLD, config)  # MPI not started yet: the framework starts it at its first grid
        Grid(SHAPE)
        return 0
    grid = Grid(SHAPE)
    ckpt = Checkpointer(grid.comm, config)
    result = {"rank": grid.comm.rank}
    try:
        if mode == "halo":
            ckpt.protect("u", grid.u, global_shape=SHAPE, offset=grid.halo_part)
        elif mode == "halo-rows":  # whole rows with their halo rows, at integer offsets
            low = int(grid.part[0].start)
            ckpt.protect("u", grid.u[:, 1:-1], global_shape=SHAPE, offset=(max(low - 1, 0), 0))
        else:
            ckpt.protect("u", grid.interior, global_shape=SHAPE, offset=grid.part)
        if mode == "save":
            grid.interior[...] = expected(grid.part)
            ckpt.checkpoint(10)
        elif mode == "restore":
            result["step"] = ckpt.restart(mode="require")
            result["equal"] = bool(np.array_equal(grid.interior, expected(grid.part)))
            result["halo_untouched"] = bool(np.isnan(grid.u[0]).all() and np.isnan(grid.u[-1]).all())
        else:
            ckpt.checkpoint(10)
    finally:
        code = ckpt.close()
        for each in grid.comm.gather(result, root=0) or []:
            print("RESULT " + json.dumps(each), flush=True)
    return code


if __name__ == "__main__":
    code = run_main(main)
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()  # the framework's own end
    raise SystemExit(code)
