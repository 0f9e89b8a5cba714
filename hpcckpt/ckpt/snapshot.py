"""The protected arrays and their snapshot: what a checkpoint copies, into which buffers.

Each rank copies its slice of every replicated array (format/layout.py says which) and its
per-rank arrays whole into reused host buffers laid out as its shard file, so the file's
bytes need no second copy; CuPy arrays go device to device on a side stream and then to
pinned host memory (ckpt/device_snapshot.py). Copies may be taken now (capture) or queued
for the copier thread (ckpt/pipeline.py), which before_update() waits for.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hpcckpt.ckpt.pipeline import BackgroundCopies, Snapshot
from hpcckpt.cluster.backend import array_module
from hpcckpt.errors import CheckpointError
from hpcckpt.format import pytree
from hpcckpt.format.layout import Layout, TensorSpec, copy_strided, piece_view_slices, plan_layout
from hpcckpt.format.shardfile import payload_layout
from hpcckpt.io import direct_io

ENGINE_STATE_KEY = "_hpcckpt"


@dataclass
class Protected:
    name: str
    array: object
    replicated: bool


class ProtectedArrays:
    """The registry (arrays and small state, in protect order) and, once laid out, the
    snapshot buffers. The layout is fixed by the first checkpoint or restart."""

    def __init__(self, rank: int, world_size: int, split_threshold_bytes: int, gpu_snapshot: str, shard_extra: dict,
                 log=None):
        self.rank = rank
        self.world_size = world_size
        self.split_threshold_bytes = split_threshold_bytes
        self.gpu_snapshot = gpu_snapshot
        self.shard_extra = shard_extra
        self.log = log
        self.arrays: dict[str, Protected] = {}
        self.states: dict[str, tuple[Callable[[], dict], Callable[[dict], None]]] = {}
        self.layout: Layout | None = None
        self.buffers: dict[str, np.ndarray] | None = None
        self.shard_bytes: np.ndarray | None = None  # laid out as the shard file; holds the host snapshot
        self.device_snapshot = None  # copies of CuPy arrays (ckpt/device_snapshot.py), if any

    def protect(self, name: str, array, replicated: bool) -> None:
        if self.layout is not None:
            raise CheckpointError(f"protect({name!r}) after the first checkpoint or restart; protect everything first")
        if name in self.arrays:
            raise CheckpointError(f"an array named {name!r} is already protected")
        if not hasattr(array, "dtype") or not hasattr(array, "shape"):
            raise CheckpointError(f"protect({name!r}): expected a NumPy or CuPy array, got {type(array).__name__}")
        self.arrays[name] = Protected(name, array, replicated)

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None]) -> None:
        if name in self.states or name == ENGINE_STATE_KEY:
            raise CheckpointError(f"state {name!r} is already registered")
        self.states[name] = (get, set)

    @property
    def local_array_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.arrays.values() if not p.replicated)

    def on_gpu(self, name: str) -> bool:
        return not isinstance(self.arrays[name].array, np.ndarray)

    def ensure_layout(self) -> Layout:
        if self.layout is None:
            specs = [TensorSpec.of(p.name, p.array) for p in self.arrays.values() if p.replicated]
            self.layout = plan_layout(specs, self.world_size, self.split_threshold_bytes)
            shapes = {tl.name: (tl.piece_shape(self.rank), tl.spec.dtype) for tl in self.layout.rank_pieces(self.rank)}
            shapes.update({p.name: (p.array.shape, p.array.dtype) for p in self.arrays.values() if not p.replicated})
            on_gpu = {name: shape for name, shape in shapes.items() if self.on_gpu(name)}
            self.buffers = self._host_buffers(shapes, on_gpu)
            if on_gpu:
                from hpcckpt.ckpt.device_snapshot import DeviceSnapshot  # CuPy only where arrays are on a GPU

                self.device_snapshot = DeviceSnapshot(on_gpu, self.gpu_snapshot, self.log)
                self.buffers.update(self.device_snapshot.host_buffers)
        return self.layout

    def _host_buffers(self, shapes: dict, on_gpu: dict) -> dict[str, np.ndarray]:
        """Host snapshot buffers as views into one buffer laid out as this rank's shard file
        (shardfile.payload_layout, in freeze()'s piece order): the contiguous file bytes that
        L2 and L3 send then cost only the header, not a second copy of the shard."""
        order = [tl.name for tl in self.layout.rank_pieces(self.rank)] + list(self.local_array_names)
        _, offsets, size = payload_layout([(name, shapes[name][1], shapes[name][0]) for name in order],
                                          self.shard_extra)
        self.shard_bytes = direct_io.aligned_empty(size)  # so O_DIRECT writes take the pieces in place
        return {name: np.ndarray(shapes[name][0], dtype=shapes[name][1], buffer=self.shard_bytes, offset=offset)
                for name, offset in zip(order, offsets) if name not in on_gpu}

    def take_or_queue(self, name: str, copies: BackgroundCopies | None) -> None:
        if self.on_gpu(name):
            # Enqueued on the GPU's side stream, so the host goes on at once either way. Without
            # the before_update() promise the compute stream must not run ahead of the copy.
            self.copy_piece(name)
            if copies is None:
                self.device_snapshot.guard(name)
        elif copies is not None:
            copies.taken[name] = threading.Event()
        else:
            self.copy_piece(name)

    def copy_piece(self, name: str) -> None:
        protected = self.arrays[name]
        buffer = self.buffers.get(name)
        if buffer is None:  # a whole tensor that another rank stores
            return
        if not protected.replicated:
            region = protected.array
        else:
            tl = self.layout.tensor(name)
            if not tl.piece_nbytes(self.rank):
                return
            region = protected.array.reshape(tl.logical_shape)[piece_view_slices(tl, self.rank)]
            region = array_module(protected.array).moveaxis(region, tl.axis, 0) if tl.axis else region
        if self.on_gpu(name):
            self.device_snapshot.copy(name, region)
        else:
            copy_strided(buffer, region)

    def _pieces(self) -> list:
        pieces = [(tl.name, self.buffers[tl.name]) for tl in self.layout.rank_pieces(self.rank)]
        return pieces + [(name, self.buffers[name]) for name in self.local_array_names]

    def restored_snapshot(self, step: int, ordinal: int, state: dict, metrics: dict, levels: tuple) -> Snapshot:
        """A version just loaded, as a snapshot to write to `levels` again: a restore leaves
        this rank's pieces in the buffers, and the state is the version's own."""
        return Snapshot(step, ordinal, tuple(self._pieces()), state, copy.deepcopy(metrics), False, tuple(levels))

    def freeze(self, step: int, ordinal: int, metrics: dict, final: bool) -> Snapshot:
        pieces = self._pieces()
        # Encoded (format/pytree.py: nested containers, scalars, small arrays, types kept) and
        # through JSON once: the state is frozen as it is now, whatever get() returned.
        state = {name: pytree.encode(get(), repr(name)) for name, (get, _) in self.states.items()}
        state[ENGINE_STATE_KEY] = {"ordinal": ordinal}
        state = json.loads(json.dumps(state))
        return Snapshot(step, ordinal, tuple(pieces), state, copy.deepcopy(metrics), final)
