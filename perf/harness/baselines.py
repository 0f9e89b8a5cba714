"""The usual ways to checkpoint, which the benchmarks measure beside hpcckpt in the same run:
raw files written durably (each rank its slice of the state, or one writer), h5py (one HDF5
file, h5py's defaults) and torch.distributed.checkpoint over a gloo group of the MPI ranks.

These are the operations only; each benchmark keeps its own clock around them, so what a
figure includes stays visible where it is measured. h5py, torch and mpi4py are imported
inside the functions: mpi4py must not be imported at the top of a script that uses DCP.
"""

from __future__ import annotations

import os

# -- raw files ----------------------------------------------------------------------------------


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | os.PathLike, buffers, chunk: int | None = 64 << 20, *, sync_dir: bool = True) -> None:
    """Write the buffers back to back into a new file, unbuffered, in writes of at most
    `chunk` bytes (None: each buffer in one write), fsync it and, with `sync_dir`, its
    directory."""
    with open(path, "wb", buffering=0) as f:
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            step = chunk or max(1, len(view))
            for start in range(0, len(view), step):
                part = view[start:start + step]
                while len(part):
                    part = part[f.write(part):]
        os.fsync(f.fileno())
    if sync_dir:
        fsync_path(os.path.dirname(os.path.abspath(path)))


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of rank's equal share of n elements, as a sharded save cuts a flattened array."""
    return n * rank // size, n * (rank + 1) // size


# -- h5py ---------------------------------------------------------------------------------------


def h5py_save(target, arrays, *, durable: str | None = None) -> None:
    """Every (name, array) as a dataset of one HDF5 file (h5py's defaults: contiguous datasets)
    at `target`, a path or a file object. h5py itself never fsyncs; `durable`: "file" fsyncs
    the file after the close, "os" syncs every file system (os.sync)."""
    import h5py

    with h5py.File(target, "w") as f:
        for name, array in arrays:
            f.create_dataset(name, data=array)
    if durable == "file":
        fsync_path(target)
    elif durable == "os":
        os.sync()
    elif durable is not None:
        raise ValueError(f"durable={durable!r}: expected None, 'file' or 'os'")


def h5py_load(source, arrays, *, read_direct: bool = True) -> None:
    """Fill every (name, array) from the dataset of that name in the HDF5 file at `source`,
    a path or a file object: read_direct into the array, or (read_direct=False) read the
    dataset into a new array and copy it over."""
    import h5py

    with h5py.File(source, "r") as f:
        for name, array in arrays:
            if read_direct:
                f[name].read_direct(array)
            else:
                array[...] = f[name][()]


def bcast_arrays(comm, arrays, root: int = 0) -> None:
    """MPI Bcast of each array from `root`, one after the other (after root alone read them)."""
    for array in arrays:
        comm.Bcast(array, root=root)


# -- torch DCP ----------------------------------------------------------------------------------


def gloo_group(comm):
    """The torch.distributed gloo process group over the MPI ranks (rank 0 picks a free
    localhost port); what torch DCP needs to save and load across them. Collective; the
    group of an earlier call when one exists."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size(),
                            init_method=f"tcp://127.0.0.1:{port}")
    return dist.group.WORLD


def gloo_close() -> None:
    """Destroy the process group gloo_group made, if any."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Dcp:
    """torch.distributed.checkpoint over gloo_group(comm). `threads`: torch's intra-op threads
    (set before the group starts)."""

    def __init__(self, comm, threads: int | None = None):
        import torch
        import torch.distributed.checkpoint as dcp

        if threads is not None:
            torch.set_num_threads(threads)
        self.torch, self.dcp = torch, dcp
        self.group = gloo_group(comm)

    def views(self, arrays) -> dict:
        """{name: tensor} aliasing each (name, NumPy array): DCP saves from them and loads
        into them in place."""
        return {name: self.torch.from_numpy(array) for name, array in arrays}

    def save(self, state: dict, **where) -> None:
        """dcp.save (fsyncs its files by default); `where`: checkpoint_id or storage_writer."""
        self.dcp.save(state, process_group=self.group, **where)

    def load(self, state: dict, **where) -> None:
        """dcp.load into `state`'s tensors; `where`: checkpoint_id or storage_reader."""
        self.dcp.load(state, process_group=self.group, **where)

    def async_save(self, state: dict, **where):
        """dcp.async_save (thread executor, FileSystemWriter's fsync); the future that is done
        once the files are written (the upload's, where torch returns a staging one too)."""
        response = self.dcp.async_save(state, process_group=self.group, **where)
        return getattr(response, "upload_completion", response)
