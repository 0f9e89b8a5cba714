"""A solver that goes on inside the job when ranks die (hpcckpt.run_surviving), for the tests
of in-job recovery on real ranks.

    mpiexec --with-ft ulfm -n N python surviving_app.py RUN_DIR NODES STEPS [--set KEY=VALUE ...]
        [--kill STEP:RANK] [--inject rank-kill:rank=R:step=S:phase=P]

Protects replicated weights, a block of a global field (partitioned over the ranks there are)
and the loop's state; each step adds to them and ends with an allreduce of the field's sum,
as a solver's residual. --kill STEP:RANK: that rank SIGKILLs itself at STEP, before the
allreduce (repeatable); --fail-at STEP: every rank raises an error that is no process failure;
--die-before-checkpointer RANK: that rank dies before main's first Checkpointer exists;
--inject: the library's fault injection (a kill inside a checkpoint's
phase); --spares K: the last K ranks are spares (run_surviving's spares); --spare-dies-after S:
the last rank, a spare, SIGKILLs itself S seconds after every rank is through start-up;
--step-seconds S: each step sleeps that long (a run long enough for that). Ranks in --kill and --inject are COMM_WORLD's,
so a fault strikes once: its rank dies with it. Rank 0 prints one RESULT line: each entry of main's restored step and rank count, the last step, the
exit code, and digests of the weights, the field and the residuals, which do not depend on the
rank count: a run that lost ranks must end on the digests of one that did not.
"""

import argparse
import hashlib
import json
import os
import signal
import threading
import time

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main, run_surviving
from hpcckpt.faults import FaultInjector, parse_fault

N = 1200


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("nodes", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--fail-at", type=int, help="every rank raises an error of its own at this step")
    parser.add_argument("--max-recoveries", type=int, help="run_surviving's bound (default: none)")
    parser.add_argument("--die-before-checkpointer", type=int, help="this rank dies before the first Checkpointer")
    parser.add_argument("--spares", type=int, default=0)
    parser.add_argument("--spare-dies-after", type=float)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    return parser.parse_args(argv)


def solve(comm, args, entries: list) -> int:
    world_rank = MPI.COMM_WORLD.Get_rank()
    kills = {int(step): int(rank) for step, rank in (spec.split(":") for spec in args.kill)}
    config = load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={args.nodes}", *args.set])
    weights = np.zeros((128, 17))
    low, high = comm.rank * N // comm.size, (comm.rank + 1) * N // comm.size
    block = np.zeros(high - low)
    loop = {"step": 0, "residuals": 0.0}
    faults = FaultInjector([parse_fault(text) for text in args.inject], world_rank, 0, None)
    if world_rank == args.die_before_checkpointer and not entries:
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt = Checkpointer(comm, config, faults=faults)
    try:
        ckpt.protect("weights", weights)
        ckpt.protect("field", block, global_shape=(N,), offset=(low,))
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        restored = ckpt.restart()
        entries.append({"restored": restored, "ranks": comm.size})
        for step in range(loop["step"] + 1, args.steps + 1):
            if kills.get(step) == world_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.fail_at:
                raise RuntimeError(f"the solver's own error at step {step}")
            time.sleep(args.step_seconds)
            weights += step
            block += step * (1 + np.arange(low, high))
            total = np.array([block.sum()])
            comm.Allreduce(MPI.IN_PLACE, total)
            loop.update(step=step, residuals=loop["residuals"] + float(total[0]) % 1000.0)
            if ckpt.due(step, last=step == args.steps):
                ckpt.checkpoint(step)
    finally:
        code = ckpt.close()
    blocks = comm.gather(block.copy(), root=0)
    if comm.rank == 0:
        print("RESULT " + json.dumps({
            "entries": entries, "step": loop["step"], "code": code, "ranks": comm.size,
            "weights": hashlib.sha256(weights.tobytes()).hexdigest()[:16],
            "field": hashlib.sha256(np.concatenate(blocks).tobytes()).hexdigest()[:16],
            "residuals": loop["residuals"]}), flush=True)
    return code


def main(argv=None) -> int:
    args = parse(argv)
    entries: list = []
    world = MPI.COMM_WORLD
    if args.spare_dies_after is not None:
        # Counted from when every rank is through its start-up, which on loaded cores is
        # seconds apart: a spare dead before the spares are set up ends the job instead.
        world.Barrier()
        if world.Get_rank() == world.Get_size() - 1:
            # A daemon: a spare released before its time leaves without dying.
            dying = threading.Timer(args.spare_dies_after, os.kill, (os.getpid(), signal.SIGKILL))
            dying.daemon = True
            dying.start()
    code = run_surviving(lambda comm: solve(comm, args, entries), max_recoveries=args.max_recoveries,
                         spares=args.spares)
    return 0 if code is None else code  # None: an idle spare, released at the end


if __name__ == "__main__":
    raise SystemExit(run_main(main))
