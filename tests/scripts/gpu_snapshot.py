"""GPU snapshots (ckpt/device_snapshot.py) on real ranks: copies enqueued on a side stream must
hold the values the CuPy arrays had at capture(), although every array is overwritten by a
kernel enqueued right after its guard (trainer contract) or right after checkpoint() (library
contract, no guard), for both buffer modes; and GPU memory stays flat over checkpoints.

    mpiexec -n 2 python tests/scripts/gpu_snapshot.py RUN_DIR [--unguarded]

--unguarded turns the guard off (a check that this script can see a torn snapshot at all)."""

import json
import sys
from pathlib import Path

import cupy
import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config

SHAPES = {
    "vector": (8 << 20,),        # 32 MiB, cut along axis 0: contiguous pieces
    "dense": (2048, 4096),       # 32 MiB, cut along axis 1: strided pieces
    "bias": (1000,),             # small: whole on one rank
}
LOCAL = "rank_local"             # protect(replicated=False): every rank stores its own


def make_checkpointer(comm, run_dir, arrays, mode):
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2",
                                'resilience.levels=["local","partner","pfs"]',
                                f'checkpoint.gpu_snapshot="{mode}"', "checkpoint.split_threshold_kb=64",
                                "checkpoint.keep_local=10", "checkpoint.keep_pfs=10"],
                         environ={})
    ckpt = Checkpointer(comm, config)
    for name, array in arrays.items():
        ckpt.protect(name, array, replicated=name != LOCAL)
    return ckpt


def fresh_arrays(rank, fill=None):
    """Replicated arrays hold the same values on every rank (as data-parallel weights do);
    the rank-local one differs by rank."""
    arrays = {name: cupy.zeros(shape, dtype=cupy.float32) for name, shape in SHAPES.items()}
    arrays[LOCAL] = cupy.zeros((4 << 20,), dtype=cupy.float32)
    if fill is not None:
        for name, array in arrays.items():
            rng = cupy.random.default_rng(fill + (rank if name == LOCAL else 0))
            array[...] = rng.standard_normal(array.shape, dtype=cupy.float32)
    return arrays


def host_copy(arrays):
    return {name: cupy.asnumpy(array) for name, array in arrays.items()}


def run_mode(comm, run_dir, mode):
    arrays = fresh_arrays(comm.rank, fill=1)
    ckpt = make_checkpointer(comm, run_dir, arrays, mode)
    # Trainer contract: update, capture; the next step guards, then overwrites at once. No
    # host synchronisation from the update to the overwrite: the GPU's ordering alone must
    # keep the copies consistent (x * 3 is exact in float32 on both sides).
    at_capture_1 = {name: value * np.float32(3.0) for name, value in host_copy(arrays).items()}
    ckpt.begin_checkpoint(1, copy_in_background=True)
    for array in arrays.values():
        array *= 3.0  # the weight update the snapshot must include
    for name in arrays:
        ckpt.capture(name)
    ckpt.end_checkpoint({})
    for name, array in arrays.items():
        ckpt.before_update(name)
        array.fill(-1.0)
    ckpt.wait()
    # Library contract: checkpoint() then overwrite with no guard at all.
    for array in arrays.values():
        array += 5.0
    at_capture_2 = host_copy(arrays)
    ckpt.checkpoint(2)
    for array in arrays.values():
        array.fill(-2.0)
    ckpt.wait()
    # Memory stays flat: five more checkpoints allocate nothing that stays.
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    used_before = pool.used_bytes()
    for step in range(3, 8):
        ckpt.begin_checkpoint(step, copy_in_background=True)
        for name in arrays:
            ckpt.capture(name)
        ckpt.end_checkpoint({})
    ckpt.wait()
    cupy.cuda.Device().synchronize()
    used_after = pool.used_bytes()
    chosen = ckpt.arrays.device_snapshot.mode
    ckpt.close()

    restored = fresh_arrays(comm.rank)
    again = make_checkpointer(comm, run_dir, restored, "auto")
    equal = {}
    for step, expected in ((1, at_capture_1), (2, at_capture_2)):
        again.restart("require", step=step)
        got = host_copy(restored)
        equal[step] = {name: got[name].tobytes() == expected[name].tobytes() for name in expected}
    again.close()
    return {"mode": chosen, "equal": equal, "used_before": used_before, "used_after": used_after}


def main():
    run_dir = Path(sys.argv[1])
    if "--unguarded" in sys.argv:
        from hpcckpt.ckpt.device_snapshot import DeviceSnapshot

        DeviceSnapshot.guard = lambda self, name: None
    comm = MPI.COMM_WORLD
    result = {"rank": comm.rank}
    for mode in ("device", "pinned"):
        result[mode] = run_mode(comm, run_dir / mode, mode)
    results = comm.gather(result, root=0)
    if comm.rank == 0:
        for result in results:
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
