"""Snapshots of CuPy arrays without stopping the GPU or the host.

A piece's copy is enqueued on a side stream, ordered after everything the compute stream had
enqueued when capture() was called (its weight update included), so the host returns at once
and the copy overlaps the kernels that follow. Two places to copy to:

- "device": preallocated GPU buffers, device to device (the fastest copy, HBM bandwidth); the
  persist thread brings them down to pinned host buffers before the L1 write.
- "pinned": straight into pinned host buffers (PCIe bandwidth), for states whose GPU copy
  does not fit; strided pieces are first gathered into a temporary on the side stream.

"auto" picks "device" while the device buffers take at most half of the free GPU memory.

Ordering, all of it on the GPU (the host never waits for a copy while training):
- guard(name) makes the compute stream wait for the copy of `name`: the caller's next update
  of that array then runs after the copy (the trainer calls it from before_update(); without
  copy_in_background the engine calls it right after the copy is enqueued).
- to_host() (persist thread) finishes the copies and returns when the pinned host buffers
  hold the snapshot.

Buffers live as long as the Checkpointer, so GPU and host memory stay flat over checkpoints;
the next snapshot reuses them only after the previous persist is done with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcckpt.cluster.backend import pinned_empty
from hpcckpt.errors import ConfigError

DEVICE_SHARE_OF_FREE_MEMORY = 0.5


@dataclass
class _Piece:
    host: np.ndarray  # pinned
    device: object | None  # CuPy buffer ("device" mode)
    started: object | None = None  # cupy.cuda.Events on the side stream around the copy
    copied: object | None = None
    temporary: object | None = None  # a gathered strided piece kept alive until its copy is done


class DeviceSnapshot:
    """Snapshot buffers and copies of this rank's CuPy pieces; `host_buffers` are what the
    persist writes."""

    def __init__(self, pieces: dict[str, tuple[tuple[int, ...], np.dtype]], mode: str = "auto", log=None):
        import cupy

        self.cupy = cupy
        self.device_id = cupy.cuda.runtime.getDevice()
        nbytes = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                     for shape, dtype in pieces.values())
        free, _ = cupy.cuda.runtime.memGetInfo()
        if mode == "auto":
            mode = "device" if nbytes <= DEVICE_SHARE_OF_FREE_MEMORY * free else "pinned"
        elif mode == "device" and nbytes > free:
            raise ConfigError(f"checkpoint.gpu_snapshot = 'device' needs {nbytes / 2**20:.0f} MiB of GPU memory "
                              f"for the snapshot buffers, but {free / 2**20:.0f} MiB are free; use 'pinned' or 'auto'")
        self.mode = mode
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pieces: dict[str, _Piece] = {}
        for name, (shape, dtype) in pieces.items():
            device = cupy.empty(shape, dtype=dtype) if mode == "device" else None
            self.pieces[name] = _Piece(pinned_empty(shape, dtype), device)
        self._pending: list[_Piece] = []
        if log:
            log.info(f"GPU snapshot: {mode} buffers for {nbytes / 2**20:.1f} MiB of this rank's pieces "
                     f"({free / 2**20:.0f} MiB of GPU memory free)")

    @property
    def host_buffers(self) -> dict[str, np.ndarray]:
        return {name: piece.host for name, piece in self.pieces.items()}

    def copy(self, name: str, region) -> None:
        """Enqueue the copy of `region` (a CuPy view of the piece, any strides) on the side
        stream, after what the current stream has enqueued so far."""
        cupy = self.cupy
        piece = self.pieces[name]
        compute_done = cupy.cuda.Event(disable_timing=True)
        compute_done.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(compute_done)
        with self.stream:
            piece.started = cupy.cuda.Event()
            piece.started.record(self.stream)
            if piece.device is not None:
                cupy.copyto(piece.device, region)
            else:
                source = region if region.flags.c_contiguous else cupy.ascontiguousarray(region)
                piece.temporary = source if source is not region else None
                source.get(out=piece.host, stream=self.stream, blocking=False)
            piece.copied = cupy.cuda.Event()
            piece.copied.record(self.stream)
        self._pending.append(piece)

    def guard(self, name: str) -> None:
        """The current stream waits (on the GPU) until the copy of `name` is taken."""
        piece = self.pieces.get(name)
        copied = piece.copied if piece is not None else None  # once: to_host() may clear it
        if copied is not None:
            self.cupy.cuda.get_current_stream().wait_event(copied)

    def to_host(self) -> float:
        """(persist thread) Bring the snapshot into the pinned host buffers; raises the CUDA
        error of a failed copy. Returns the GPU time of the snapshot's copies (seconds, from
        the side stream's events), for reports and benchmarks."""
        cupy = self.cupy
        pending, self._pending = self._pending, []
        with cupy.cuda.Device(self.device_id):
            with self.stream:
                for piece in pending:
                    if piece.device is not None:
                        piece.device.get(out=piece.host, stream=self.stream, blocking=False)
            self.stream.synchronize()
            copy_ms = sum(cupy.cuda.get_elapsed_time(p.started, p.copied) for p in pending)
        for piece in pending:
            piece.temporary = piece.started = piece.copied = None
        return copy_ms / 1e3
