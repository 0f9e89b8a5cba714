"""Arrays protected by reference, on real ranks.

    mpiexec -n N python followed_arrays.py RUN_DIR KIND STEPS [--kill-at K] [--every E]

KIND numpy: W is rebound every step (W = W * 1.5 + step, a new array each time) and protected
through a getter (lambda: W). KIND value: the same code with W protected by value (the case
that saved stale values): the next checkpoint after the rebinding fails. KIND heat: X, a Heat
DNDarray of 10 rows split along axis 0 (Heat's own uneven chunks), protected itself, updated
in place and resplit to axis 1 and back each step (Heat swaps its local tensor), and Y, a
DNDarray rebound by out-of-place operators, protected through a getter.
Checkpoints every E steps (due()); --kill-at K: rank N-1 dies at step K (SIGKILL).
Rank 0 prints RESULT lines: {"restored": step, "at_restore": digests of the arrays right after
the restart, "final": digests at the end, "step": the last step}.
"""

import argparse
import hashlib
import json
import os
import signal

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main


def digest(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("kind", choices=("numpy", "value", "heat"))
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={comm.size}",
                                f"checkpoint.every_steps={args.every}", "checkpoint.split_threshold_kb=1"])
    loop = {"step": 0}
    arrays = {}
    if args.kind == "heat":
        import heat as ht

        arrays["X"] = ht.zeros((10, 3), split=0, dtype=ht.float64)
        arrays["Y"] = ht.ones((10, 3), split=0, dtype=ht.float64)

        def whole() -> dict:
            return {name: digest(array.numpy()) for name, array in arrays.items()}
    else:
        arrays["W"] = np.zeros((64, 8))

        def whole() -> dict:
            return {"W": digest(arrays["W"])}

    ckpt = Checkpointer(comm, config)
    try:
        if args.kind == "heat":
            ckpt.protect("X", arrays["X"])
            ckpt.protect("Y", lambda: arrays["Y"])
        elif args.kind == "numpy":
            ckpt.protect("W", lambda: arrays["W"])
        else:
            ckpt.protect("W", arrays["W"])
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        restored = ckpt.restart()
        at_restore = whole()
        for step in range(loop["step"] + 1, args.steps + 1):
            if step == args.kill_at and comm.rank == comm.size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.kind == "heat":
                x = arrays["X"]
                x *= 1.5
                x += step
                x.resplit_(1)
                x.resplit_(0)
                arrays["Y"] = arrays["Y"] * 2.0 - step
            else:
                arrays["W"] = arrays["W"] * 1.5 + step
            loop["step"] = step
            if ckpt.due(step, last=step == args.steps):
                ckpt.checkpoint(step)
    finally:
        code = ckpt.close()
    final = whole()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"restored": restored, "at_restore": at_restore, "final": final,
                                      "step": loop["step"]}), flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(run_main(main))
