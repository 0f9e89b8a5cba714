"""DTensors of every placement hpcckpt takes, and what it refuses, on real ranks (gloo, CPU).

    mpiexec -n 4 python dtensor_cases.py RUN_DIR MODE

modes:
  placements  DTensors on a 1-D mesh of 4 and a 2-D mesh of 2 x 2 (Shard on either dimension,
              uneven and empty shards, two mesh dimensions cutting one tensor dimension,
              Replicate, Replicate beside Shard): each rank's place as hpcckpt computes it
              and as torch does; all protected, checkpointed, overwritten and restored; a
              RESULT per rank says which came back equal to the original, and a Partial
              DTensor's refusal
  to-local    each rank's to_local() shard protected without global_shape (as if it were
              replicated): the first checkpoint is refused, exit 2
  moved       a parameter protected, then given new storage (param.data = ...): the next
              checkpoint is refused, exit 2
A RESULT line per rank; the process exits with the error's exit code.
"""

import json
import sys

import torch
from mpi4py import MPI

from gloo_over_mpi import init_gloo
from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import HpcckptError

run_dir, mode = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
init_gloo(comm)

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

from hpcckpt.ckpt.dtensors import local_shape_and_offset  # noqa: E402

torch.set_num_threads(1)
line = init_device_mesh("cpu", (comm.size,))
square = init_device_mesh("cpu", (2, comm.size // 2), mesh_dim_names=("a", "b"))
CASES = {  # name -> (global shape, mesh, placements)
    "rows": ((10, 3), line, [Shard(0)]),               # 3, 3, 3, 1
    "cols_uneven": ((4, 5), line, [Shard(1)]),         # 2, 2, 1, 0: an empty shard
    "grid": ((7, 9), square, [Shard(0), Shard(1)]),
    "nested": ((11, 2), square, [Shard(0), Shard(0)]),  # two mesh dimensions cut one tensor dimension
    "replicated": ((3, 4), line, [Replicate()]),
    "hsdp": ((9, 4), square, [Replicate(), Shard(0)]),  # a block held whole by the 2 ranks of each replica
    "scalar_like": ((1,), line, [Shard(0)]),            # one rank holds it all
}
config = load_config(None, [f"run.dir={run_dir}", f"cluster.simulated_nodes={comm.size}",
                            "checkpoint.split_threshold_kb=1", 'resilience.levels=["local", "partner", "pfs"]'])
result = {"rank": comm.rank}
code = 0
ckpt = Checkpointer(comm, config)
try:
    if mode == "placements":
        originals, tensors = {}, {}
        for name, (shape, mesh, placements) in CASES.items():
            full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) * 0.5 + 1
            tensors[name] = distribute_tensor(full, mesh, placements)
            originals[name] = full
            ours = local_shape_and_offset(shape, tuple(mesh.mesh.shape), mesh.get_coordinate(), placements)
            theirs = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
            result.setdefault("same_place", {})[name] = [list(ours[0]), list(ours[1])] == \
                [list(theirs[0]), list(theirs[1])] and tuple(tensors[name].to_local().shape) == ours[0]
            ckpt.protect(name, tensors[name])
        partial = DTensor.from_local(torch.ones(4), line, [Partial()])  # sums pending, as a reduction leaves them
        try:
            ckpt.protect("partial", partial)
        except HpcckptError as exc:
            result["partial"] = str(exc)
        ckpt.checkpoint(10)
        ckpt.wait()
        for tensor in tensors.values():
            tensor.to_local().fill_(-3.0)
        result["step"] = ckpt.restart(mode="require")
        result["equal"] = {name: bool(torch.equal(tensors[name].full_tensor(), originals[name])) for name in CASES}
        result["local_equal"] = {name: bool(torch.equal(tensors[name].to_local(), distribute_tensor(
            originals[name], CASES[name][1], CASES[name][2]).to_local())) for name in CASES}
    elif mode == "to-local":
        shard = distribute_tensor(torch.arange(16.0).reshape(8, 2), line, [Shard(0)]).to_local()
        ckpt.protect("head.weight", shard)
        ckpt.checkpoint(10)
    elif mode == "moved":
        layer = torch.nn.Linear(3, 2)
        with torch.no_grad():
            layer.weight.fill_(1.0)
        ckpt.protect("layer.weight", layer.weight)
        ckpt.checkpoint(10)
        ckpt.wait()
        layer.weight.data = torch.zeros(2, 3)  # new storage: what hpcckpt holds is stale now
        ckpt.checkpoint(20)
except HpcckptError as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
    code = exc.exit_code
finally:
    ckpt.close(confirm=False)
for each in comm.gather(result, root=0) or []:
    print("RESULT " + json.dumps(each), flush=True)
# As in fsdp_model.py: nobody leaves gloo while a peer still uses it, rank 0's store last.
dist.barrier()
dist.destroy_process_group()
comm.Barrier()
sys.exit(code)
