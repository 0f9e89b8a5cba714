"""Registered state as a nested pytree, saved and restored on real ranks.

    mpiexec -n 2 python nested_state.py <run dir> save|restore|bad

save: protects one array, registers a nested state and checkpoints step 10; restore: a new
job restores it and prints what came back (RESULT lines); bad: a state holding a set.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import CheckpointError

run_dir, mode = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD


def expected(rank: int) -> dict:
    return {"step": 10, "lr": 0.125, "pair": (1, "two"), "ids": {3: "c", (4, 5): [6, None]}, "loss": float("nan"),
            "scale": np.float32(0.5), "count": np.int64(7), "raw": b"\x00\xffok", "done": False,
            "mask": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2] * (rank + 1),
            "nested": [{"moments": (np.zeros(3, np.float64), np.ones((2, 2), np.float32))}]}


def describe(value):
    """The value with its types spelled out, to compare across processes."""
    if isinstance(value, np.ndarray):
        return ["ndarray", value.dtype.str, list(value.shape), value.tolist()]
    if isinstance(value, np.generic):
        return ["scalar", value.dtype.str, value.item()]
    if isinstance(value, float) and value != value:
        return ["nan"]
    if isinstance(value, dict):
        return ["dict", sorted([describe(k), describe(v)] for k, v in value.items())]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [describe(v) for v in value]]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    return [type(value).__name__, value]


config = load_config(None, [f"run.dir={run_dir}", 'resilience.levels=["local", "partner"]',
                            "cluster.simulated_nodes=2"])
ckpt = Checkpointer(comm, config)
weights = np.zeros(1000, np.float32)
ckpt.protect("w", weights)
holder = {"state": expected(comm.rank) if mode == "save" else {}}
if mode == "bad":
    holder["state"] = {"seen": {1, 2}}
# Per rank: the mask differs by rank, and each rank gets its own back.
ckpt.register_state("loop", lambda: holder["state"], lambda s: holder.update(state=s), per_rank=True)
result = None
try:
    if mode == "restore":
        step = ckpt.restart(mode="require")
        result = {"rank": comm.rank, "step": step, "got": describe(holder["state"]),
                  "want": describe(expected(comm.rank))}
    else:
        weights[:] = 1.0
        try:
            ckpt.checkpoint(10 if mode == "save" else 20)
            ckpt.wait()
        except CheckpointError as exc:
            result = {"rank": comm.rank, "error": str(exc)}
finally:
    ckpt.close()
# Rank 0 prints every rank's result: lines printed by two ranks at once can interleave.
for each in comm.gather(result, root=0) or []:
    if each is not None:
        print("RESULT " + json.dumps(each), flush=True)
