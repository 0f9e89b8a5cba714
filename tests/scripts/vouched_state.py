"""Versions whose recorded loss vouches for their arrays (run/health.py), on real ranks.

    vouched_state.py RUN_DIR write               versions 5, 10, 15 (see below)
    vouched_state.py RUN_DIR restore [SETTING]   restart; SETTING e.g. checkpoint.verify_finite=false

write: every rank protects replicated weights and its block of a global field, on two
simulated nodes, levels L1 + L2 + L4. Version 5 is healthy. Before version 10 a NaN enters the
weights after the loss was computed (a bit flipped in memory): its recorded loss is finite, so
it vouches for arrays that are not. Version 15's loss is NaN: the checkpoint is refused.
restore: prints the version restored and whether its arrays are finite.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config

N = 4000


def main():
    run_dir, mode, *settings = sys.argv[1:]
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", "storage.pfs_async=false",
                                'resilience.levels=["local","partner","pfs"]', "checkpoint.split_threshold_kb=4",
                                *settings], environ={})
    weights = np.zeros((64, 32))
    low, high = comm.rank * N // comm.size, (comm.rank + 1) * N // comm.size
    field = np.zeros(high - low, dtype=np.float32)
    state = {"step": 0}
    ckpt = Checkpointer(comm, config)
    ckpt.protect("weights", weights)
    ckpt.protect("field", field, global_shape=(N,), offset=(low,))
    ckpt.register_state("loop", lambda: dict(state), state.update)
    if mode == "write":
        for step in (5, 10, 15):
            weights += step
            field += step
            state["step"] = step
            loss = float("nan") if step == 15 else 1.0 / step
            if step == 10:
                weights[7, 3] = np.nan
            ckpt.checkpoint(step, {"loss": loss})
        ckpt.close()
        return
    restored = ckpt.restart("require")
    finite = bool(comm.allreduce(int(np.isfinite(weights).all() and np.isfinite(field).all()), op=MPI.MIN))
    ckpt.close()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"restored": restored, "finite": finite}), flush=True)


if __name__ == "__main__":
    main()
