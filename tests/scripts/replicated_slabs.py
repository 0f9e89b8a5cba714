"""Replicated arrays gathered back a slab at a time at restart (#26: a restore holds no second
copy of a large tensor), whatever axis their pieces were cut along.

    mpiexec -n N python replicated_slabs.py <run dir> save|restore <chunk bytes>

Arrays (each cut by rank along its longest axis): "wide" (6, 1000) and "cube" (7, 5, 300)
are cut along their last axis, so every piece spans the first; "lead_one" (1, 3, 500) the
same behind an axis 1 long; "tall" (900, 4), cut along its first axis, is a strided view of
a larger array (no gather in place); "row" (1, 2000) and "scalar" () are gathered in place.
save: checkpoint step 7 on L1 and L4. restore: zeroed arrays, restart with
checkpoint.chunk_mib = <chunk bytes> (small: every array takes many slabs); each rank says
which arrays came back byte for byte.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config

run_dir, mode, chunk_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
comm = MPI.COMM_WORLD
SHAPES = {"wide": ((6, 1000), np.float32), "cube": ((7, 5, 300), np.int32), "lead_one": ((1, 3, 500), np.float64),
          "tall": ((900, 4), np.float32), "row": ((1, 2000), np.float32), "scalar": ((), np.float64)}


def saved_values(name: str) -> np.ndarray:
    shape, dtype = SHAPES[name]
    return (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 1.5 - len(name)).astype(dtype)


config = load_config(None, [f"run.dir={run_dir}", f"cluster.simulated_nodes={comm.size}",
                            'resilience.levels=["local", "pfs"]', "storage.pfs_async=false", "storage.pfs_every=1",
                            "checkpoint.split_threshold_kb=1", f"checkpoint.chunk_mib={chunk_bytes / (1 << 20)}"])
ckpt = Checkpointer(comm, config)
arrays, tall_base = {}, np.zeros((900, 8), np.float32)
for name, (shape, dtype) in SHAPES.items():
    arrays[name] = tall_base[:, ::2] if name == "tall" else np.zeros(shape, dtype)
    if mode == "save":
        arrays[name][...] = saved_values(name)
    ckpt.protect(name, arrays[name])
result = {"rank": comm.rank}
if mode == "save":
    ckpt.checkpoint(7)
    ckpt.wait()
else:
    result["step"] = ckpt.restart(mode="require")
    result["same"] = sorted(name for name, array in arrays.items() if np.array_equal(array, saved_values(name)))
    result["untouched"] = bool(not tall_base[:, 1::2].any())  # the strided view's neighbours
ckpt.close()
for each in comm.gather(result, root=0) or []:
    print("RESULT " + json.dumps(each), flush=True)
