"""A small transformer under PyTorch FSDP2 (fully_shard, gloo on the CPU) with AdamW, its
DTensors protected as they are, trained, killed and resumed on any rank count.

    mpiexec -n N python fsdp_model.py RUN_DIR STEPS [--crash-at K] [--state-dict] [--mesh R]

Each block and the root are fully_shard'ed over a 1-D mesh of the N ranks (--mesh R: a 2-D
mesh of R replicas x N/R shards, HSDP: Replicate on the first mesh dimension, Shard(0) on the
second). The model's and AdamW's DTensors (sharded unevenly: the head's 5 outputs over 4
ranks are 2, 2, 1, 0) are protected one by one, or with --state-dict in one call as torch's
get_state_dict hands them. Checkpoints every 5 steps. Rank 0 prints RESULT lines: the
digest of the gathered full state (every DTensor's full_tensor(), the step counts) at each
checkpoint, right after the restart, and at the end. --crash-at K: the last rank dies at
step K, once the versions before it are durable.
"""

import argparse
import hashlib
import json
import os
import signal

import torch
from mpi4py import MPI

from gloo_over_mpi import init_gloo
from hpcckpt import Checkpointer, load_config, run_main

D_MODEL, HEADS, HIDDEN, OUT, LAYERS = 12, 2, 20, 5, 2


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(D_MODEL, HEADS, HIDDEN, dropout=0.0, batch_first=True)
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(D_MODEL, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def digests(comm, model, optimizer) -> dict:
    """(all ranks) sha256 of the model's and optimizer's state in key order: "digest" of every
    DTensor gathered whole, "locals" of what each rank holds (its local shards), by rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    full, local = hashlib.sha256(), hashlib.sha256()

    def walk(prefix, node):
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(f"{prefix}/{key}", node[key])
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(f"{prefix}/{i}", value)
        elif isinstance(node, torch.Tensor):
            whole = node.full_tensor() if isinstance(node, DTensor) else node
            mine = node.to_local() if isinstance(node, DTensor) else node
            for h, tensor in ((full, whole), (local, mine)):
                h.update(prefix.encode())
                h.update(tensor.detach().contiguous().numpy().tobytes())
    for i, sd in enumerate(get_state_dict(model, optimizer)):
        walk(str(i), sd)
    return {"digest": full.hexdigest()[:16], "locals": comm.gather(local.hexdigest()[:16], root=0)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--state-dict", action="store_true")
    parser.add_argument("--mesh", type=int, default=1, help="replicas of a 2-D (HSDP) mesh; 1: a 1-D mesh")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    init_gloo(comm)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (comm.size,)) if args.mesh == 1 else \
        init_device_mesh("cpu", (args.mesh, comm.size // args.mesh), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # also makes AdamW's state, so it can be protected
    assert optim_sd["state"], "AdamW's state is made by get_state_dict"
    data = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(96, 6, D_MODEL, generator=data), torch.randn(96, OUT, generator=data)

    config = load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={comm.size}",
                                "checkpoint.every_steps=5", "checkpoint.split_threshold_kb=1",
                                'resilience.levels=["local", "partner", "pfs"]'])
    ckpt = Checkpointer(comm, config)
    try:
        if args.state_dict:
            state = {"model": model_sd, "optim": optim_sd}
            ckpt.protect_state_dict("train", state)
        else:
            for name, tensor in model_sd.items():
                ckpt.protect(f"model/{name}", tensor)
            for name, values in optim_sd["state"].items():
                for key, tensor in values.items():
                    ckpt.protect(f"optim/{name}/{key}", tensor)
        loop = {"step": 0}
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        restored = ckpt.restart()
        if restored and args.state_dict:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        digest = digests(comm, model, optimizer)
        if comm.rank == 0:
            print("RESULT " + json.dumps({"restored": restored, **digest, "ranks": comm.size}), flush=True)
        for step in range(loop["step"] + 1, args.steps + 1):
            if step == args.crash_at:
                ckpt.wait()  # the versions before the crash are durable: which one a restart loads is known
                if comm.rank == comm.size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
            batch = slice((step * 8) % 96, (step * 8) % 96 + 8)
            mine = slice(batch.start + comm.rank * 8 // comm.size, batch.start + (comm.rank + 1) * 8 // comm.size)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs[mine]), targets[mine], reduction="sum") / 8
            loss.backward()
            optimizer.step()
            loop["step"] = step
            if ckpt.due(step, last=step == args.steps):
                ckpt.checkpoint(step)
                digest = digests(comm, model, optimizer)
                if comm.rank == 0:
                    print("RESULT " + json.dumps({"saved": step, **digest}), flush=True)
            if ckpt.stopping:
                break
    finally:
        code = ckpt.close()
    digest = digests(comm, model, optimizer)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"final": loop["step"], **digest}), flush=True)
    import torch.distributed as dist

    # Gloo's threads end with the group; a rank tearing it down while a peer still talks to it,
    # or rank 0 (which hosts its store) leaving first, aborts a process at exit.
    dist.barrier()
    dist.destroy_process_group()
    comm.Barrier()
    return code


if __name__ == "__main__":
    raise SystemExit(run_main(main))
