"""A data-parallel loop whose whole protected state is replicated, for the tests of going on
from the survivors' memory after a rank's death (restore/from_memory.py).

    mpiexec --with-ft ulfm -n N python held_state_app.py RUN_DIR STEPS [--set KEY=VALUE ...]
        [--kill STEP:RANK:WHEN] [--no-commit] [--break-promise STEP]

Protects weights and a momentum array (replicated) and the loop's state (step, an RNG); each
step draws a "gradient" from the RNG, allreduces a checksum (the step's collective), calls
commit_step, updates both arrays in place and calls due(). The update does not depend on the
rank count, so a run that lost ranks ends on the digests of one that did not.
--kill STEP:RANK:WHEN: that (COMM_WORLD) rank SIGKILLs itself in STEP, WHEN "before" the
allreduce, "commit" between the allreduce and commit_step (the other ranks finish the
allreduce and meet the death in the agreement), or "after" the update, before due().
--no-commit: commit_step is not called. --break-promise STEP: after due(STEP) of the first
attempt each rank adds its rank to the weights, a change outside commit_step .. due().
Rank 0 prints one RESULT line: each main's restored step and rank count, the last step and
digests of the arrays and the loop's state.
"""

import argparse
import hashlib
import json
import os
import signal

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main, run_surviving


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--no-commit", action="store_true")
    parser.add_argument("--break-promise", type=int)
    return parser.parse_args(argv)


def run(comm, args, entries: list) -> int:
    world_rank = MPI.COMM_WORLD.Get_rank()
    kills = {}
    for spec in args.kill:
        step, rank, when = spec.split(":")
        kills[(int(step), when)] = int(rank)
    config = load_config(None, [f"run.dir={args.run_dir}", "cluster.simulated_nodes=4", *args.set])
    weights = np.zeros((300, 41))
    momentum = np.zeros_like(weights)
    rng = np.random.default_rng(7)
    loop = {"step": 0}
    ckpt = Checkpointer(comm, config)
    try:
        ckpt.protect("weights", weights)
        ckpt.protect("momentum", momentum)
        ckpt.register_state("loop", lambda: {"step": loop["step"], "rng": rng.bit_generator.state},
                            lambda state: (loop.update(step=state["step"]),
                                           setattr(rng.bit_generator, "state", state["rng"])))
        restored = ckpt.restart()
        entries.append({"restored": restored, "ranks": comm.size})
        for step in range(loop["step"] + 1, args.steps + 1):
            if kills.get((step, "before")) == world_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            gradient = rng.standard_normal(weights.shape)
            checksum = np.array([float(weights.sum())])
            comm.Allreduce(MPI.IN_PLACE, checksum)
            if kills.get((step, "commit")) == world_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if not args.no_commit:
                ckpt.commit_step(step)
            momentum *= 0.9
            momentum += gradient
            weights -= 0.01 * momentum
            loop["step"] = step
            if kills.get((step, "after")) == world_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt.due(step, last=step == args.steps):
                ckpt.checkpoint(step)
            if step == args.break_promise and len(entries) == 1:
                weights += comm.rank
    finally:
        code = ckpt.close()
    if comm.rank == 0:
        print("RESULT " + json.dumps({
            "entries": entries, "step": loop["step"], "code": code, "ranks": comm.size,
            "weights": hashlib.sha256(weights.tobytes()).hexdigest()[:16],
            "momentum": hashlib.sha256(momentum.tobytes()).hexdigest()[:16],
            "rng": hashlib.sha256(json.dumps(rng.bit_generator.state).encode()).hexdigest()[:16]}), flush=True)
    return code


def main(argv=None) -> int:
    args = parse(argv)
    entries: list = []
    return run_surviving(lambda comm: run(comm, args, entries))


if __name__ == "__main__":
    raise SystemExit(run_main(main))
