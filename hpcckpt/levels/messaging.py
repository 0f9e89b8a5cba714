"""Transfers and small collectives for the redundancy levels and the persist's agreements,
waiting without spinning.

MPICH's blocking waits spin; on shared cores the persist thread would steal time from
training. These helpers post non-blocking operations and poll them with a short sleep.
"""

from __future__ import annotations

import pickle
import time

import numpy as np

from hpcckpt.errors import PeerFailed

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


def quiet_any(comm, flag: bool) -> bool:
    """True on every rank if `flag` is true on any: one sleeping allreduce round, where
    quiet_allgather needs two (sizes, then payloads). Each round on busy cores waits for
    every rank's thread to be scheduled, so the happy path of an agreement is one round."""
    from mpi4py import MPI

    mine = np.array([1 if flag else 0], dtype=np.int32)
    anyone = np.empty(1, dtype=np.int32)
    wait_all([comm.Iallreduce(mine, anyone, op=MPI.MAX)])
    return bool(anyone[0])


def agree_before_exchange(comm, failure: BaseException | None, what: str) -> None:
    """(all ranks of comm) A rank that failed while preparing a point-to-point exchange
    (allocating its buffers, reading its shard, encoding) would never post its sends and
    receives, and the others would wait for them for ever. So every rank says whether it is
    ready first: if any is not, every rank raises (the failed one its own error) instead of
    exchanging."""
    if not quiet_any(comm, failure is not None):
        return
    if failure is not None:
        raise failure
    raise PeerFailed(f"{what}: another rank failed before the exchange (its error says why)")


def quiet_allgather(comm, value):
    """allgather of picklable values that sleeps while it waits, in both of its rounds.

    A blocking allgather spins until the slowest rank arrives; a sleeping barrier in front of
    it is not enough, since each rank notices the barrier's end at its own next poll and the
    first ones then spin for the others (milliseconds, on cores shared with training).
    """
    from mpi4py import MPI

    payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    wait_all([comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes)])
    offsets = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=offsets[1:])
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait_all([comm.Iallgatherv(payload, [gathered, sizes, offsets, MPI.BYTE])])
    return [pickle.loads(gathered[o:o + n]) for o, n in zip(offsets.tolist(), sizes.tolist())]
