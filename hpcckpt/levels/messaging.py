"""Point-to-point transfers for the redundancy levels, waiting without spinning.

MPICH's blocking waits spin; on shared cores the persist thread would steal time from
training. These helpers post non-blocking operations and poll them with a short sleep.
"""

from __future__ import annotations

import time

import numpy as np

POLL_S = 0.0005


def wait_all(requests) -> None:
    from mpi4py import MPI

    requests = [r for r in requests if r is not None]
    while requests and not MPI.Request.Testall(requests):
        time.sleep(POLL_S)


def exchange(comm, sends: list[tuple[int, np.ndarray]], receives: list[tuple[int, np.ndarray]], tag: int) -> None:
    """Post every receive and send (rank, contiguous uint8 buffer), then wait for all."""
    from mpi4py import MPI

    requests = [comm.Irecv([buffer, MPI.BYTE], source=source, tag=tag) for source, buffer in receives]
    requests += [comm.Isend([buffer, MPI.BYTE], dest=dest, tag=tag) for dest, buffer in sends]
    wait_all(requests)


def quiet_allgather(comm, value):
    """allgather after a sleeping barrier, so nobody spins while the slowest rank arrives."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)
    return comm.allgather(value)
