"""COUNT checkpoints of a small model (argv[2]); prints this rank's resident memory along the way."""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main():
    run_dir, count = sys.argv[1], int(sys.argv[2])
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", 'resilience.levels=["local","pfs"]',
                                "checkpoint.keep_local=2",
                                "checkpoint.keep_pfs=2", "storage.pfs_every=10", "checkpoint.split_threshold_kb=64"],
                         environ={})
    weights = [np.random.default_rng(i).normal(size=(256, 128)).astype(np.float32) for i in range(4)]
    ckpt = Checkpointer(comm, config)
    for i, w in enumerate(weights):
        ckpt.protect(f"w{i}", w)
    state = {"step": 0}
    ckpt.register_state("loop", lambda: dict(state), state.update)
    samples = {}
    for step in range(1, count + 1):
        for w in weights:
            w += 1e-3
        state["step"] = step
        ckpt.checkpoint(step, {"val_loss": 1.0 / step})
        if step in (count // 10, count // 2, count):
            ckpt.wait()
            samples[step] = rss_bytes()
    ckpt.close()
    everyone = comm.gather(samples, root=0)
    if comm.rank == 0:
        print("RSS " + json.dumps(everyone))


if __name__ == "__main__":
    main()
