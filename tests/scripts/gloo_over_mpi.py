"""A torch.distributed gloo process group over the MPI ranks of a test script (rank 0 picks a
free localhost port): what PyTorch's DTensors and FSDP2 need beside mpi4py."""


def init_gloo(comm) -> None:
    import socket

    import torch.distributed as dist

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size, init_method=f"tcp://127.0.0.1:{port}")
