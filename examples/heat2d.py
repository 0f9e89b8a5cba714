"""2-D heat diffusion (Jacobi) on a block-decomposed grid, checkpointed with hpcckpt.

    mpiexec -n 4 python examples/heat2d.py --run-dir /tmp/heat2d

The global grid (rows x cols, boundary included) has its top edge held at 1 and the other
edges at 0. MPI_Dims_create cuts it into a px x py grid of blocks, one per rank, uneven where
the sizes do not divide; each rank holds its block with one halo cell on every side and
trades halos with its four neighbours every iteration. The interior of the local array (the
rank's block, a view) is protected as a block of the global grid, so a restart may use any
number of ranks: each new rank's block is filled from the old blocks it overlaps. Under the
fault-tolerant MPI (python -m hpcckpt.cluster.ulfm_mpiexec) the survivors of a dead rank go
on in the job; with --spares K (or resilience.spares, which the job scripts' SPARE_RANKS sets)
the last K ranks wait idle and one takes a dead rank's place, so the grid keeps its cut and the
spare's block comes from the nearest level that holds it; with resilience.out_of_spares =
"relaunch" a death no spare is left for ends the job for a relaunch at its size instead.

Jacobi is pointwise and the convergence test a max-reduction, both exact, so the grid is
bit-identical whatever the decomposition: an interrupted run restarted on any rank count
ends on the same grid as an uninterrupted one.

The library decides when to checkpoint (`--every auto`, the default: the shortest interval
whose overhead stays under checkpoint.max_overhead, from the costs it measures; a number for
a fixed interval; `--set checkpoint.mtbf_hours=H` for Young/Daly) and when to stop: on
SIGTERM, SIGUSR1 or SIGUSR2 (a batch system's warning), a file <run-dir>/HALT (`hpcckpt halt`)
or the allocation's end (run.end_time, which the job scripts set), every rank stops after the
same iteration with a final version on L4 and the process exits 75; run it again to go on.
close() leaves the newest version on L4 in any case. Under jobs/slurm.sbatch or jobs/pbs.pbs:
APP="python examples/heat2d.py --run-dir run --nodes 0".

At the end rank 0 prints one JSON line (RESULT ...): the rank count, the version restored and
where each old rank's shard came from, the iterations, the last change and why it stopped
early, if it did. The largest change of an iteration is handed to the library after every
iteration (Checkpointer.observe): a solution that blows up (NaN or inf, or with
resilience.divergence_factor a change that spikes) is never checkpointed, and with
`--set resilience.rewind_on_divergence=true` the solver goes back in process to the newest
version before it and goes on (else it stops, exit 2). Options for tests and demos:
--poison-at K puts a NaN into the last rank's block at iteration K, once per process (a silent
data error); --crash-at K kills the last rank at iteration K
as a node crash would, once the versions before it are durable, so which one a restart loads
is known (mpiexec then stops the job; under a job script's restart loop, in its first attempt
only); --dump DIR makes rank 0 write the global
grid to DIR as it is after a restart (restored.npy), at every checkpoint (step-<K>.npy) and
at the end (final.npy; not written when it stopped early).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main, run_surviving
from hpcckpt.faults import current_attempt
from hpcckpt.run.in_job import revoke_on_failure


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, help="the run's directory (checkpoints, logs)")
    parser.add_argument("--shape", type=int, nargs=2, default=(48, 40), metavar=("ROWS", "COLS"))
    parser.add_argument("--iterations", type=int, default=2000, help="at most this many iterations")
    parser.add_argument("--tol", type=float, default=1e-4, help="stop when no point moves more than this")
    parser.add_argument("--every", default="auto", type=_interval,
                        help="checkpoint interval in iterations, or auto (default: chosen from measured costs)")
    parser.add_argument("--nodes", type=int, default=2,
                        help="simulated nodes (ranks split evenly); 0: the real nodes, as under a batch system")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a job setting (hpcckpt's config keys), e.g. resilience.parity=1")
    parser.add_argument("--spares", type=int, default=None, metavar="K",
                        help="the last K ranks wait idle and take dead ranks' places (the fault-tolerant MPI; "
                             "default: resilience.spares, which the job scripts' SPARE_RANKS sets); with none "
                             "left the job shrinks, or ends for a relaunch at its size with --set "
                             "resilience.out_of_spares=relaunch")
    parser.add_argument("--crash-at", type=int, default=None, metavar="K")
    parser.add_argument("--poison-at", type=int, default=None, metavar="K")
    parser.add_argument("--dump", type=Path, default=None, metavar="DIR")
    return parser.parse_args(argv)


def _interval(text: str):
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of iterations, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a number of iterations >= 1, got {value}")
    return value


class Block:
    """This rank's block of the global grid: where it lies, and its local array with halos."""

    def __init__(self, comm, shape: tuple[int, int]):
        dims = MPI.Compute_dims(comm.size, 2)
        self.cart = comm.Create_cart(dims, periods=[False, False], reorder=False)
        coords = self.cart.Get_coords(self.cart.rank)
        self.shape = shape
        self.start, self.stop = [], []
        for axis in range(2):
            base, extra = divmod(shape[axis], dims[axis])
            start = coords[axis] * base + min(coords[axis], extra)
            self.start.append(start)
            self.stop.append(start + base + (coords[axis] < extra))
        rows, cols = self.stop[0] - self.start[0], self.stop[1] - self.start[1]
        self.local = np.zeros((rows + 2, cols + 2))
        self.interior = self.local[1:-1, 1:-1]  # the block, as a view: protected, updated in place
        # Points on the global boundary keep their value; top edge hot.
        global_rows = np.arange(self.start[0], self.stop[0])[:, None]
        global_cols = np.arange(self.start[1], self.stop[1])[None, :]
        self.fixed = (global_rows == 0) | (global_rows == shape[0] - 1) | (global_cols == 0) | \
            (global_cols == shape[1] - 1)
        self.interior[...] = np.where(global_rows == 0, 1.0, 0.0) * np.ones_like(self.interior)
        self.up, self.down = self.cart.Shift(0, 1)
        self.left, self.right = self.cart.Shift(1, 1)

    def exchange_halos(self) -> None:
        u = self.local
        self.cart.Sendrecv(u[1, :].copy(), self.up, 0, recvbuf=(row := np.empty(u.shape[1])), source=self.down)
        if self.down != MPI.PROC_NULL:
            u[-1, :] = row
        self.cart.Sendrecv(u[-2, :].copy(), self.down, 1, recvbuf=row, source=self.up)
        if self.up != MPI.PROC_NULL:
            u[0, :] = row
        col = np.empty(u.shape[0])
        self.cart.Sendrecv(np.ascontiguousarray(u[:, 1]), self.left, 2, recvbuf=col, source=self.right)
        if self.right != MPI.PROC_NULL:
            u[:, -1] = col
        self.cart.Sendrecv(np.ascontiguousarray(u[:, -2]), self.right, 3, recvbuf=col, source=self.left)
        if self.left != MPI.PROC_NULL:
            u[:, 0] = col

    def jacobi(self) -> float:
        """One sweep, in place; the largest change of any point of this block."""
        self.exchange_halos()
        u = self.local
        new = 0.25 * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:])
        new = np.where(self.fixed, self.interior, new)
        change = float(np.max(np.abs(new - self.interior))) if new.size else 0.0
        self.interior[...] = new
        return change

    def gather(self) -> np.ndarray | None:
        """The global grid on rank 0 (None elsewhere)."""
        blocks = self.cart.gather((self.start, self.interior.copy()), root=0)
        if blocks is None:
            return None
        grid = np.empty(self.shape)
        for (row, col), block in blocks:
            grid[row:row + block.shape[0], col:col + block.shape[1]] = block
        return grid


def main(argv=None) -> int:
    args = parse_args(argv)
    config = job_config(args)
    # With an MPI that survives a dead rank, solve() is entered again on the survivors: the
    # grid is cut anew for their number and the newest version restored onto it; with spares
    # the cut stays, a spare in each dead rank's place, its block from the nearest level.
    code = run_surviving(lambda comm: solve(comm, args, config), spares=config.resilience.spares,
                         shrink=config.resilience.out_of_spares == "shrink")
    return 0 if code is None else code  # None: an idle spare, released at the end


def job_config(args):
    spares = [] if args.spares is None else [f"resilience.spares={args.spares}"]
    return load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={args.nodes}",
                              'resilience.levels=["local", "partner", "erasure", "pfs"]',
                              f"checkpoint.every_steps={args.every!r}".replace("'", '"'), *args.set, *spares])


def solve(comm, args, config) -> int:
    block = Block(comm, tuple(args.shape))
    revoke_on_failure(block.cart)
    solver = {"iteration": 0, "change": float("inf")}
    # A job script's loop counts its attempts, and a recovery in the job counts as one.
    first_attempt = current_attempt() == 1
    poisoned = False
    ckpt = Checkpointer(comm, config)
    try:
        ckpt.protect("u", block.interior, global_shape=block.shape, offset=block.start)
        ckpt.register_state("solver", lambda: dict(solver), solver.update)
        restored = ckpt.restart()
        started = solver["iteration"]
        dump(args, block, "restored.npy" if restored is not None else None)
        while solver["iteration"] < args.iterations and solver["change"] > args.tol:
            if solver["iteration"] == args.crash_at and first_attempt:
                ckpt.wait()  # the versions before the crash are durable: which one a restart loads is known
                if comm.rank == comm.size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            change = block.jacobi()
            solver["iteration"] += 1
            if solver["iteration"] == args.poison_at and comm.rank == comm.size - 1 and not poisoned:
                block.interior[block.interior.shape[0] // 2, block.interior.shape[1] // 2] = np.nan
                poisoned = True  # the next sweep spreads it, and its change is not finite
            # NaN does not order under MAX: a block that is not finite reports inf.
            change = change if np.isfinite(change) else float("inf")
            largest = np.array([change])
            comm.Allreduce(MPI.IN_PLACE, largest, op=MPI.MAX)  # a buffer collective: Revoke reaches it
            solver["change"] = float(largest[0])
            if ckpt.observe(solver["iteration"], solver["change"]) is not None:
                continue  # diverged and rewound: the grid and the solver state are the older version's
            iteration = solver["iteration"]
            if ckpt.due(iteration, last=iteration == args.iterations or solver["change"] <= args.tol):
                ckpt.checkpoint(iteration)
                dump(args, block, f"step-{iteration}.npy")
            if ckpt.stopping:
                break
        if not ckpt.stopping:
            dump(args, block, "final.npy")
    finally:
        code = ckpt.close()  # the newest version durable on L4; 75 after a stop
    if comm.rank == 0:
        print("RESULT " + json.dumps({"ranks": comm.size, "restored": restored, "sources": ckpt.restored_sources,
                                      "started": started, "iteration": solver["iteration"],
                                      "change": solver["change"], "stopped": ckpt.stopping}), flush=True)
    return code


def dump(args, block: Block, name: str | None) -> None:
    if args.dump is None or name is None:
        return
    grid = block.gather()
    if grid is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
        np.save(args.dump / name, grid)


if __name__ == "__main__":
    raise SystemExit(run_main(main))
