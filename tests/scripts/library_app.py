"""A small SPMD application on the library's pattern (restart, due, stopping, close), for the
library's own tests on real ranks.

    mpiexec -n N python library_app.py RUN_DIR NODES STEPS [--set KEY=VALUE ...] [--explicit K ...]
        [--crash-at K] [--steps-ms MS] [--no-due] [--close-with-error] [--every-step]
        [--rank-state [--reshard]] [--state-differs]

Protects a replicated array, a block of a global array and a per-rank-free nested state;
each step adds the step number to them. --explicit K: checkpoint at step K by hand (no due());
--no-due: only the explicit checkpoints; --crash-at K: rank N-1 dies at step K; --steps-ms:
each step sleeps that long; --close-with-error: raise inside the loop after the last step, so
close() runs while an exception is being handled. Rank 0 prints one RESULT line: the step
restored, the last step, the interval chosen, why it stopped, the exit code, and a digest of
each array's global bytes. --every-step: checkpoint() every step, without due() (the last step
too, not as the final one). --rank-state: each rank registers per-rank state ({"owner": its
rank, "count": grows by rank + 1 each step}) and RESULT has every rank's as restored
("rank_states"); --reshard gives it a reshard hook that sums the old ranks' counts it is
handed. --state-differs: a state registered as shared holds the rank (refused at the first
checkpoint).
"""

import argparse
import hashlib
import json
import os
import signal
import time

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main

N = 1000


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("nodes", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--explicit", type=int, action="append", default=[])
    parser.add_argument("--no-due", action="store_true")
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--steps-ms", type=float, default=0.0)
    parser.add_argument("--close-with-error", action="store_true")
    parser.add_argument("--every-step", action="store_true")
    parser.add_argument("--rank-state", action="store_true")
    parser.add_argument("--reshard", action="store_true")
    parser.add_argument("--state-differs", action="store_true")
    return parser.parse_args(argv)


def digest(comm, weights, block) -> dict:
    blocks = comm.gather(block.copy(), root=0)
    if comm.rank != 0:
        return {}
    return {"weights": hashlib.sha256(weights.tobytes()).hexdigest()[:16],
            "field": hashlib.sha256(np.concatenate(blocks).tobytes()).hexdigest()[:16]}


def resharded(states: dict, rank: int, size: int) -> dict:
    """This rank's state onto another rank count: the old ranks' counts it is handed, summed."""
    return {"owner": rank, "count": sum(state["count"] for state in states.values()), "from": sorted(states)}


def main(argv=None) -> int:
    args = parse(argv)
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={args.nodes}", *args.set])
    weights = np.zeros((256, 33))
    low, high = comm.rank * N // comm.size, (comm.rank + 1) * N // comm.size
    block = np.zeros(high - low)
    loop = {"step": 0}
    ckpt = Checkpointer(comm, config)
    code = None
    try:
        ckpt.protect("weights", weights)
        ckpt.protect("field", block, global_shape=(N,), offset=(low,))
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        mine = {"owner": comm.rank, "count": 0}
        if args.rank_state:
            ckpt.register_state("mine", lambda: dict(mine), mine.update, per_rank=True,
                                reshard=resharded if args.reshard else None)
        if args.state_differs:
            ckpt.register_state("rank", lambda: {"rank": comm.rank}, lambda state: None)
        restored = ckpt.restart()
        rank_states = comm.gather(dict(mine), root=0)
        for step in range(loop["step"] + 1, args.steps + 1):
            if step == args.crash_at and comm.rank == comm.size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            weights += step
            block += step * (1 + np.arange(low, high))
            loop["step"] = step
            if args.steps_ms:
                time.sleep(args.steps_ms / 1000)
            mine["count"] += comm.rank + 1
            if step in args.explicit or args.every_step:
                ckpt.checkpoint(step)
            elif not args.no_due and ckpt.due(step, last=step == args.steps):
                ckpt.checkpoint(step)
            if ckpt.stopping:
                break
        if args.close_with_error:
            raise RuntimeError("the application failed after its last step")
    except RuntimeError:
        if args.close_with_error:
            code = ckpt.close()  # inside the except block: not a clean close
        raise
    finally:
        code = ckpt.close() if code is None else code
    result = digest(comm, weights, block)
    if comm.rank == 0:
        policy = ckpt.schedule.policy
        print("RESULT " + json.dumps({"restored": restored, "step": loop["step"], "interval": policy.interval,
                                      "reason": policy.reason, "stopped": ckpt.stopping, "code": code,
                                      "rank_states": rank_states, **result}),
              flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(run_main(main))
