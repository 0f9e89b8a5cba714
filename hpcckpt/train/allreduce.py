"""Gradient averaging with non-blocking allreduce, bucketed Horovod-style.

Gradients arrive from the backward pass output layer first. Small tensors are fused into
buckets (one message each) and a bucket's Iallreduce starts as soon as its last gradient is in,
so the reduction of upper layers overlaps the backward pass of the layers below. On a GPU the
buckets live in pinned host memory (the MPI need not be CUDA-aware).

One scalar rides in the first bucket (`add_scalar` before backward, `scalar` after
`reduced()`): the step's loss reaches every rank, summed, with no message of its own, so a
check on it (divergence) is decided alike everywhere without a collective. It is summed in
the bucket's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from hpcckpt.cluster.backend import pinned_empty
from hpcckpt.cluster.collectives import test_all


@dataclass
class _Slot:
    name: str
    offset: int  # in elements, within the bucket
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class _Bucket:
    dtype: np.dtype
    slots: list[_Slot] = field(default_factory=list)
    send: np.ndarray | None = None
    recv: np.ndarray | None = None
    filled: int = 0
    request: object = None


_SCALAR = "\0scalar"  # no parameter has this name


def _host_buffer(count: int, dtype, pinned: bool) -> np.ndarray:
    return pinned_empty(count, dtype) if pinned else np.empty(count, dtype)


class GradientAllreduce:
    """(all ranks) One per training job; every rank must add the same gradients in the same order."""

    def __init__(self, comm, parameters: Sequence[tuple[str, object]], bucket_bytes: int, backend):
        self.comm = comm
        self.backend = backend
        self._alone: list[tuple[str, object]] = []
        self._scalar_added = False
        self.scalar: float | None = None  # the summed scalar of the last step, once reduced()
        self.finite = True  # the last step's reduced gradients and scalar were all finite
        self._bucket_of: dict[str, tuple[_Bucket, _Slot]] = {}
        self.buckets: list[_Bucket] = []
        current: _Bucket | None = None
        current_bytes = 0
        # Reverse order: buckets fill in the order backward produces gradients.
        for name, array in reversed(list(parameters)):
            dtype = np.dtype(array.dtype)
            nbytes = array.size * dtype.itemsize
            if current is None or current.dtype != dtype or (current_bytes and current_bytes + nbytes > bucket_bytes):
                current = _Bucket(dtype)
                self.buckets.append(current)
                current_bytes = 0
            offset = sum(s.size for s in current.slots)
            slot = _Slot(name, offset, tuple(array.shape))
            current.slots.append(slot)
            self._bucket_of[name] = (current, slot)
            current_bytes += nbytes
        if self.buckets:  # the scalar's slot: the last element of the first bucket to complete
            first = self.buckets[0]
            scalar = _Slot(_SCALAR, sum(s.size for s in first.slots), ())
            first.slots.append(scalar)
            self._bucket_of[_SCALAR] = (first, scalar)
        for bucket in self.buckets:
            count = sum(s.size for s in bucket.slots)
            bucket.send = _host_buffer(count, bucket.dtype, backend.is_gpu)
            bucket.recv = _host_buffer(count, bucket.dtype, backend.is_gpu)

    def add_scalar(self, value: float) -> None:
        """Stage this rank's share of the step's scalar, before the first gradient is added;
        `scalar` holds the sum over ranks once reduced() has run. Optional: a step that adds
        none sends 0."""
        self._scalar_added = True
        if self.comm.Get_size() == 1 or not self.buckets:
            self.scalar = float(value)
            return
        bucket, slot = self._bucket_of[_SCALAR]
        bucket.send[slot.offset] = value
        self._fill(bucket)

    def add(self, name: str, grad) -> None:
        """Stage one gradient; starts its bucket's allreduce once the bucket is complete."""
        if self.comm.Get_size() == 1:
            # Nothing to exchange: the gradient is already the global one.
            self._alone.append((name, grad))
            return
        bucket, slot = self._bucket_of[name]
        view = bucket.send[slot.offset: slot.offset + slot.size].reshape(slot.shape)
        if self.backend.is_gpu:
            grad.get(out=view)
        else:
            np.copyto(view, grad)
        if bucket is self.buckets[0] and not self._scalar_added:
            self.add_scalar(0.0)
        self._fill(bucket)

    def _fill(self, bucket: _Bucket) -> None:
        from mpi4py import MPI

        bucket.filled += 1
        if bucket.filled == len(bucket.slots):
            bucket.request = self.comm.Iallreduce(bucket.send, bucket.recv, op=MPI.SUM)
        self._progress()

    def _progress(self) -> None:
        # MPICH advances non-blocking collectives only inside MPI calls; poke them between layers.
        pending = [b.request for b in self.buckets if b.request is not None]
        if pending:
            test_all(pending)  # a bucket that failed raises its own error (a dead rank's, say)

    def reduced(self) -> Iterator[tuple[str, object]]:
        """Yield (name, summed gradient) bucket by bucket as each completes, output layer first.
        Once every one was taken, `finite` says whether all of them and the scalar were finite
        (one sum per bucket, on the host buffer the reduction landed in)."""
        added, self._scalar_added = self._scalar_added, False
        total = 0.0
        if self.comm.Get_size() == 1:
            if not added:
                self.scalar = 0.0
            alone, self._alone = self._alone, []
            for name, grad in alone:
                total = total + self.backend.xp.sum(grad)
                yield name, grad
        for bucket in self.buckets if self.comm.Get_size() > 1 else ():
            if bucket.request is None:
                missing = len(bucket.slots) - bucket.filled
                raise RuntimeError(f"gradient bucket incomplete: {missing} gradient(s) never added")
            bucket.request.Wait()
            bucket.request = None
            bucket.filled = 0
            total = total + bucket.recv.sum()  # the scalar's slot is in it too
            for slot in bucket.slots:
                if slot.name == _SCALAR:
                    self.scalar = float(bucket.recv[slot.offset])
                    continue
                view = bucket.recv[slot.offset: slot.offset + slot.size].reshape(slot.shape)
                yield slot.name, (self.backend.from_host(view) if self.backend.is_gpu else view)
        self.finite = math.isfinite(float(total)) and math.isfinite(self.scalar)
