"""A PyTorch model and its Adam state protected as they are (CPU tensors, no copies), trained
data-parallel over MPI, for the library's tests on real ranks.

    mpiexec -n N python torch_model.py RUN_DIR STEPS [--crash-at K]

Every rank trains the same model on its part of each batch; gradients are averaged with an
MPI allreduce through NumPy views of the .grad tensors. Checkpoints every 10 steps; rank 0
prints a RESULT line at each checkpoint (the digest of every protected tensor's bytes), after
the restart (the digest of what was restored) and at the end. --crash-at K: the last rank
dies at step K.
"""

import argparse
import hashlib
import json
import os
import signal

import numpy as np
import torch
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config, run_main


def state_tensors(model, optimizer) -> dict:
    """The tensors a restart must bring back: parameters and Adam's state, made now as Adam
    would make them at its first step (the same values), so they exist to be protected."""
    tensors = {f"model/{name}": p for name, p in model.named_parameters()}
    for index, p in enumerate(model.parameters()):
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            tensors[f"optim/{index}/{key}"] = state[key]
    return tensors


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--crash-at", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tensors = state_tensors(model, optimizer)
    data = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(512, 16, generator=data), torch.randn(512, 4, generator=data)

    config = load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={comm.size}",
                                "checkpoint.every_steps=10", "checkpoint.split_threshold_kb=1",
                                'resilience.levels=["local", "partner", "pfs"]'])
    ckpt = Checkpointer(comm, config)
    try:
        for name, tensor in tensors.items():
            ckpt.protect(name, tensor)  # the tensor itself: restored into its own storage
        loop = {"step": 0}
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        restored = ckpt.restart()
        if comm.rank == 0:
            print("RESULT " + json.dumps({"restored": restored, "digest": digest(tensors)}), flush=True)
        for step in range(loop["step"] + 1, args.steps + 1):
            if step == args.crash_at:
                ckpt.wait()  # the versions before the crash are durable: which one a restart loads is known
                if comm.rank == comm.size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            batch = slice((step * 64) % 512, (step * 64) % 512 + 64)
            mine = slice(batch.start + comm.rank * 64 // comm.size, batch.start + (comm.rank + 1) * 64 // comm.size)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine], reduction="sum") / 64
            loss.backward()
            for p in model.parameters():
                grad = p.grad.numpy()
                comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
            optimizer.step()
            loop["step"] = step
            if ckpt.due(step, last=step == args.steps):
                ckpt.checkpoint(step)
                if comm.rank == 0:
                    print("RESULT " + json.dumps({"saved": step, "digest": digest(tensors)}), flush=True)
            if ckpt.stopping:
                break
    finally:
        code = ckpt.close()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"final": loop["step"], "digest": digest(tensors)}), flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(run_main(main))
