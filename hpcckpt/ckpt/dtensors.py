"""PyTorch DTensors (FSDP2, tensor parallelism) protected as what they are.

A DTensor is a wrapper: its own DLPack export is a buffer of the global shape that no one
computes on. What a rank holds is its local shard (to_local(), which shares the storage the
optimizer updates), placed in the global tensor by the placements over the device mesh:

    every mesh dimension Replicate  -> a replicated array (the local tensor is the whole)
    Shard(d) on some mesh dimensions -> a block of the global shape at this rank's offset,
                                        torch.chunk's rule on each sharded mesh dimension in
                                        turn (uneven shards, empty ones included)
    Shard and Replicate mixed (HSDP) -> a block that several ranks hold whole: the rank at
                                        coordinate 0 of the replicated mesh dimensions stores
                                        it; a restore hands it to the others
    Partial, or a placement of another kind -> refused: the local values are not the tensor's

Blocks are restored onto any rank count or mesh through the block path (the ranks' blocks
at the restart say where each goes).
"""

from __future__ import annotations

import math

from hpcckpt.ckpt.array_views import Geometry, MemoryWitness, Protectable, protectable_tensor
from hpcckpt.errors import ConfigError


def is_dtensor(array) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensors
        return False
    return isinstance(array, DTensor)


def protectable_dtensor(name: str, dtensor) -> Protectable:
    """This rank's local shard of `dtensor` and where it lies; ConfigError for placements that
    cannot be restored in place."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(dtensor.placements)
    for placement in placements:
        if placement.is_partial():
            raise ConfigError(f"protect({name!r}): the DTensor's placement {placement} holds partial values awaiting a "
                              "reduction, not the tensor; protect the DTensor it is reduced into (Shard or Replicate "
                              "placements)")
        if type(placement) not in (Shard, Replicate):
            raise ConfigError(f"protect({name!r}): the DTensor's placement {placement} ({type(placement).__name__}) "
                              "does not place contiguous blocks; protect a DTensor with Shard and Replicate placements, "
                              "or its local shard with global_shape and offset")
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ConfigError(f"protect({name!r}): this rank is not in the DTensor's device mesh {mesh}; protect it on "
                          "the mesh's ranks (and give every rank of the checkpointer's communicator its own part)")
    local = dtensor.to_local()
    kept = protectable_tensor(name, local, "DTensor's local shard")
    shape = tuple(local.shape)
    witness = MemoryWitness("DTensor's local shard", kept.witness.pointer, shape,
                            lambda: (int(dtensor.to_local().data_ptr()), tuple(dtensor.to_local().shape)))
    if all(isinstance(p, Replicate) for p in placements):
        return Protectable(kept.array, Geometry(replicated=True), witness)
    global_shape = tuple(int(d) for d in dtensor.shape)
    expected, offset = local_shape_and_offset(global_shape, tuple(mesh.mesh.shape), coordinate, placements)
    if expected != shape:
        raise ConfigError(f"protect({name!r}): the DTensor's local shard has shape {shape}, where its placements "
                          f"{placements} over a mesh of shape {tuple(mesh.mesh.shape)} give {expected}; protect the "
                          "local shard with its global_shape and offset")
    replicated_dims = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    if not replicated_dims:
        return Protectable(kept.array, Geometry(False, global_shape, offset), witness)
    owner = all(coordinate[d] == 0 for d in replicated_dims)
    sharded_dims = [d for d in range(len(placements)) if d not in replicated_dims]
    group = _flat_index([coordinate[d] for d in sharded_dims], [mesh.mesh.shape[d] for d in sharded_dims])
    stored = kept.array if owner else kept.array[tuple(slice(0, 0) for _ in shape)]
    arrangement = (tuple(mesh.mesh.shape), tuple(mesh.mesh.reshape(-1).tolist()), tuple(replicated_dims))
    return Protectable(stored, Geometry(False, global_shape, offset, copy_group=group, copy_owner=owner,
                                        copy_arrangement=arrangement), witness, copy_target=kept.array)


def local_shape_and_offset(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate,
                           placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The local shard's shape and its offset in the global tensor: each Shard(d) placement,
    in mesh-dimension order, cuts what the ones before it left along d as torch.chunk does
    (pieces of ceil(n / size), the last ones shorter or empty)."""
    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        dim = getattr(placement, "dim", None)
        if dim is None or not placement.is_shard():
            continue
        dim %= len(global_shape)
        size, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
        chunk = math.ceil(shape[dim] / size) if size else 0
        start = min(index * chunk, shape[dim])
        stop = min(start + chunk, shape[dim])
        offset[dim] += start
        shape[dim] = stop - start
    return tuple(shape), tuple(offset)


def _flat_index(coordinates: list[int], sizes: list[int]) -> int:
    index = 0
    for coordinate, size in zip(coordinates, sizes):
        index = index * size + coordinate
    return index
