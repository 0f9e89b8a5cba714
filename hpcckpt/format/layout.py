"""Shard layout: which part of which tensor each rank stores (the "what" of a checkpoint).

Pure functions, no I/O and no MPI, so every rank computes the same layout from the same
inputs and tests can check it exhaustively without processes.

Conventions every other module relies on:

- A tensor is cut along ONE axis, its largest dimension (lowest axis on ties). That axis
  depends only on the global shape, so two layouts of the same tensor (different world
  size or split threshold) always cut along the same axis.
- A piece is stored "axis-major": the cut axis is moved to the front and the piece is
  made C-contiguous. A run of consecutive indices along the cut axis is then one
  contiguous byte range of the stored piece, which is what lets a restore onto a different
  number of ranks read exactly the bytes it needs (see `read_requests`).
- Tensors smaller than the split threshold are not cut: one rank holds all of it. They are
  described the same way, with bounds (0, dim) on the owner and (0, 0) everywhere else.
- A 0-d tensor is handled as a tensor of logical shape (1,) cut along axis 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from hpcckpt.errors import ConfigError, FormatError, IncompatibleCheckpointError

LAYOUT_FORMAT = 1


def _canonical_dtype(dtype: Any) -> str:
    """Name a dtype so that np.dtype(name) gives it back exactly.

    "float32" style names are used where they are unambiguous; a non-native byte order
    would be lost by the short name, so those keep numpy's full "<f4"-style string.
    """
    parsed = np.dtype(dtype)
    if parsed.hasobject:
        raise ConfigError(f"dtype {parsed} holds Python objects and cannot be checkpointed")
    if parsed.fields is not None or parsed.subdtype is not None:
        # Neither name nor str keeps the field names or the sub-array shape.
        raise ConfigError(f"dtype {parsed} is structured; checkpoint each field as an array of its own")
    try:
        if np.dtype(parsed.name) == parsed:
            return parsed.name
    except TypeError:  # "bytes24", "str96", "void24": names numpy does not read back
        pass
    return parsed.str


@dataclass(frozen=True)
class TensorSpec:
    """One global tensor: what a checkpoint must hold, independent of any rank."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ConfigError(f"tensor {self.name!r}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @classmethod
    def of(cls, name: str, array) -> "TensorSpec":
        """Spec of an existing array (NumPy or CuPy)."""
        return cls(name, _canonical_dtype(array.dtype), tuple(array.shape))


def _split_axis(shape: tuple[int, ...]) -> int:
    if not shape:
        return 0
    # max() returns the first maximal element, i.e. the lowest axis on ties.
    return max(range(len(shape)), key=lambda axis: shape[axis])


def _even_bounds(dim: int, world_size: int) -> tuple[tuple[int, int], ...]:
    base, extra = divmod(dim, world_size)
    bounds = []
    start = 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


@dataclass(frozen=True)
class TensorLayout:
    """How one tensor is spread over ranks: bounds[r] = (start, stop) along `axis`."""

    spec: TensorSpec
    axis: int
    bounds: tuple[tuple[int, int], ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The global shape the bounds refer to: the real shape, or (1,) for a 0-d tensor."""
        return self.spec.shape if self.spec.shape else (1,)

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the cut axis; a piece's rows are this size each."""
        shape = self.logical_shape
        return math.prod(shape[:self.axis] + shape[self.axis + 1:]) * self.spec.itemsize

    @property
    def is_split(self) -> bool:
        return sum(1 for start, stop in self.bounds if stop > start) > 1

    def rows(self, rank: int) -> int:
        start, stop = self.bounds[rank]
        return stop - start

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank's piece as stored: axis-major (cut axis first)."""
        shape = self.logical_shape
        return (self.rows(rank),) + shape[:self.axis] + shape[self.axis + 1:]

    def piece_nbytes(self, rank: int) -> int:
        return self.rows(rank) * self.row_bytes


@dataclass(frozen=True)
class Layout:
    """The layout of every tensor for one world size, in the order the specs were given."""

    world_size: int
    tensors: tuple[TensorLayout, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"tensor names must be unique; repeated: {duplicates}")

    def tensor(self, name: str) -> TensorLayout:
        for tensor_layout in self.tensors:
            if tensor_layout.name == name:
                return tensor_layout
        raise KeyError(f"no tensor named {name!r} in this layout")

    def piece_shape(self, name: str, rank: int) -> tuple[int, ...]:
        return self.tensor(name).piece_shape(self._check_rank(rank))

    def rank_pieces(self, rank: int) -> tuple[TensorLayout, ...]:
        """Tensors of which `rank` holds at least one row, in layout order."""
        rank = self._check_rank(rank)
        return tuple(t for t in self.tensors if t.rows(rank) > 0)

    def bytes_of_rank(self, rank: int) -> int:
        rank = self._check_rank(rank)
        return sum(t.piece_nbytes(rank) for t in self.tensors)

    def specs(self) -> tuple[TensorSpec, ...]:
        return tuple(t.spec for t in self.tensors)

    def same_tensors(self, other: "Layout", this_label: str = "checkpoint",
                     other_label: str = "model") -> list[str]:
        """Differences in names, dtypes and global shapes; empty when `other` fits.

        Only what a restore needs to match is compared: world size and how tensors are
        cut may differ, that is what re-partitioning is for.
        """
        mine = {t.name: t.spec for t in self.tensors}
        theirs = {t.name: t.spec for t in other.tensors}
        problems = []
        for name in mine:
            if name not in theirs:
                problems.append(f"tensor {name!r} is in the {this_label} but not in the {other_label}")
        for name in theirs:
            if name not in mine:
                problems.append(f"tensor {name!r} is in the {other_label} but not in the {this_label}")
        for name, spec in mine.items():
            if name not in theirs:
                continue
            if spec.dtype != theirs[name].dtype:
                problems.append(f"tensor {name!r}: dtype {spec.dtype} in the {this_label}, "
                                f"{theirs[name].dtype} in the {other_label}")
            if spec.shape != theirs[name].shape:
                problems.append(f"tensor {name!r}: shape {spec.shape} in the {this_label}, "
                                f"{theirs[name].shape} in the {other_label}")
        return problems

    def to_dict(self) -> dict:
        return {
            "format": LAYOUT_FORMAT,
            "world_size": self.world_size,
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.spec.dtype,
                    "shape": list(t.spec.shape),
                    "axis": t.axis,
                    "bounds": [list(b) for b in t.bounds],
                }
                for t in self.tensors
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "Layout":
        try:
            if data["format"] != LAYOUT_FORMAT:
                raise FormatError(f"layout format {data['format']!r} is not supported "
                                  f"(supported: {LAYOUT_FORMAT})")
            world_size = int(data["world_size"])
            tensors = []
            for entry in data["tensors"]:
                spec = TensorSpec(str(entry["name"]), str(entry["dtype"]), tuple(entry["shape"]))
                bounds = tuple((int(start), int(stop)) for start, stop in entry["bounds"])
                tensors.append(TensorLayout(spec, int(entry["axis"]), bounds))
            layout = cls(world_size, tuple(tensors))
        except FormatError:
            raise
        except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
            raise FormatError(f"malformed layout record: {exc}") from exc
        layout._validate()
        return layout

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Layout":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise FormatError(f"layout record is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def _validate(self) -> None:
        """Reject a decoded layout whose pieces do not tile their tensors exactly."""
        if self.world_size < 1:
            raise FormatError(f"layout world size {self.world_size} must be at least 1")
        for t in self.tensors:
            shape = t.logical_shape
            if not 0 <= t.axis < len(shape):
                raise FormatError(f"layout of {t.name!r}: axis {t.axis} out of range for shape {shape}")
            if len(t.bounds) != self.world_size:
                raise FormatError(f"layout of {t.name!r}: {len(t.bounds)} bounds for "
                                  f"{self.world_size} ranks")
            covered = sorted(b for b in t.bounds if b[1] > b[0])
            position = 0
            for start, stop in covered:
                if start != position:
                    raise FormatError(f"layout of {t.name!r}: pieces do not tile axis {t.axis}")
                position = stop
            if position != shape[t.axis] or any(stop < start for start, stop in t.bounds):
                raise FormatError(f"layout of {t.name!r}: pieces do not tile axis {t.axis}")

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return rank


def plan_layout(specs: Sequence[TensorSpec], world_size: int,
                split_threshold_bytes: int = 1 << 20) -> Layout:
    """Cut large tensors across all ranks; give each small one whole to a single rank.

    Small tensors are placed greedily, largest first, on the rank with the fewest bytes so
    far (lowest rank on ties), counting the pieces of the cut tensors, so that every rank
    writes about the same amount. The result depends only on the arguments.
    """
    if world_size < 1:
        raise ConfigError(f"world size {world_size} must be at least 1")
    if split_threshold_bytes < 0:
        raise ConfigError(f"split threshold {split_threshold_bytes} must not be negative")

    layouts: list[TensorLayout | None] = [None] * len(specs)
    load = [0] * world_size
    whole: list[int] = []
    for index, spec in enumerate(specs):
        if spec.shape and spec.nbytes >= split_threshold_bytes:
            axis = _split_axis(spec.shape)
            tensor_layout = TensorLayout(spec, axis, _even_bounds(spec.shape[axis], world_size))
            layouts[index] = tensor_layout
            for rank in range(world_size):
                load[rank] += tensor_layout.piece_nbytes(rank)
        else:
            whole.append(index)

    for index in sorted(whole, key=lambda i: (-specs[i].nbytes, i)):
        spec = specs[index]
        owner = min(range(world_size), key=lambda rank: (load[rank], rank))
        axis = _split_axis(spec.shape)
        dim = spec.shape[axis] if spec.shape else 1
        bounds = tuple((0, dim) if rank == owner else (0, 0) for rank in range(world_size))
        layouts[index] = TensorLayout(spec, axis, bounds)
        load[owner] += spec.nbytes

    return Layout(world_size, tuple(layouts))


def piece_view_slices(tensor_layout: TensorLayout, rank: int) -> tuple[slice, ...]:
    """Index tuple selecting rank's piece from the global array, in global axis order.

    It applies to the array reshaped to `tensor_layout.logical_shape` (only differs for
    0-d tensors), so a CuPy caller can do: `xp.ascontiguousarray(xp.moveaxis(
    a.reshape(tl.logical_shape)[slices], tl.axis, 0))`.
    """
    start, stop = tensor_layout.bounds[rank]
    index = [slice(None)] * len(tensor_layout.logical_shape)
    index[tensor_layout.axis] = slice(start, stop)
    return tuple(index)


def _check_global_shape(array, tensor_layout: TensorLayout) -> None:
    if tuple(array.shape) != tensor_layout.spec.shape:
        raise ValueError(f"tensor {tensor_layout.name!r}: array shape {tuple(array.shape)} "
                         f"does not match the layout's {tensor_layout.spec.shape}")


def extract_piece(array, tensor_layout: TensorLayout, rank: int):
    """Rank's piece of `array`, axis-major and C-contiguous (NumPy or CuPy).

    When the piece is already contiguous (a cut along axis 0 of a C-contiguous array) the
    result is a VIEW of `array`; callers that need a stable snapshot must copy it.
    """
    _check_global_shape(array, tensor_layout)
    logical = array.reshape(tensor_layout.logical_shape)
    piece = logical[piece_view_slices(tensor_layout, rank)]
    if tensor_layout.axis != 0:
        order = [tensor_layout.axis] + [a for a in range(piece.ndim) if a != tensor_layout.axis]
        piece = piece.transpose(order)
    if not piece.flags.c_contiguous:
        piece = piece.copy()  # ndarray.copy() is C-ordered in NumPy and CuPy alike
    return piece


def insert_piece(target_array, tensor_layout: TensorLayout, rank: int, piece_axis_major) -> None:
    """Write an axis-major piece back into its place in the full array, in place."""
    _check_global_shape(target_array, tensor_layout)
    expected = tensor_layout.piece_shape(rank)
    if math.prod(piece_axis_major.shape) != math.prod(expected):
        raise ValueError(f"tensor {tensor_layout.name!r}, rank {rank}: piece of shape "
                         f"{tuple(piece_axis_major.shape)} does not fit {expected}")
    piece = piece_axis_major.reshape(expected)
    if not tensor_layout.spec.shape:
        if expected[0]:
            target_array[()] = piece[0]
        return
    region = target_array[piece_view_slices(tensor_layout, rank)]
    order = [tensor_layout.axis] + [a for a in range(region.ndim) if a != tensor_layout.axis]
    region.transpose(order)[...] = piece


@dataclass(frozen=True)
class ReadRequest:
    """One contiguous byte range of an old piece that a new piece needs.

    Bytes [byte_offset_in_piece, +nbytes) of old rank `old_rank`'s stored piece of `name`
    become rows [dest_start, dest_stop) of the new piece, counted from the new piece's
    first row (not the global index).

    `reslice` is True only in the fallback for layouts that cut a tensor along different
    axes: then the request covers the WHOLE old piece and the rows it gives cannot be
    copied as they are; `place_read` picks the right elements out of it.
    """

    name: str
    old_rank: int
    byte_offset_in_piece: int
    nbytes: int
    dest_start: int
    dest_stop: int
    reslice: bool = False


def read_requests(old: Layout, new: Layout, new_rank: int) -> list[ReadRequest]:
    """What `new_rank` must read from the old shards to build its pieces under `new`.

    Requests come in new-layout tensor order, and by old rank within a tensor. When both
    layouts cut a tensor along the same axis (always true for layouts made by
    `plan_layout`, since the axis depends only on the shape), each request is exactly the
    overlapping rows, so the total requested equals the bytes of new_rank's pieces.
    Otherwise every old piece is read whole (see `ReadRequest.reslice`).
    """
    problems = old.same_tensors(new, "checkpoint", "current model")
    if problems:
        raise IncompatibleCheckpointError(
            "the checkpoint does not match the current tensors: " + "; ".join(problems))
    new._check_rank(new_rank)

    requests = []
    for new_tl in new.rank_pieces(new_rank):
        old_tl = old.tensor(new_tl.name)
        new_start, new_stop = new_tl.bounds[new_rank]
        for old_rank, (old_start, old_stop) in enumerate(old_tl.bounds):
            if old_stop <= old_start:
                continue
            if old_tl.axis != new_tl.axis:
                requests.append(ReadRequest(new_tl.name, old_rank, 0, old_tl.piece_nbytes(old_rank),
                                            0, new_stop - new_start, reslice=True))
                continue
            low, high = max(old_start, new_start), min(old_stop, new_stop)
            if low >= high:
                continue
            requests.append(ReadRequest(
                new_tl.name, old_rank,
                byte_offset_in_piece=(low - old_start) * old_tl.row_bytes,
                nbytes=(high - low) * old_tl.row_bytes,
                dest_start=low - new_start,
                dest_stop=high - new_start,
            ))
    return requests


def place_read(new_piece: np.ndarray, request: ReadRequest, data, old: Layout, new: Layout,
               new_rank: int) -> None:
    """Copy the bytes read for `request` into `new_piece` (axis-major, NumPy), in place."""
    new_tl = new.tensor(request.name)
    dtype = np.dtype(new_tl.spec.dtype)
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) \
        else data.reshape(-1).view(np.uint8)
    if raw.size != request.nbytes:
        raise ValueError(f"tensor {request.name!r}: got {raw.size} bytes for a request "
                         f"of {request.nbytes}")
    values = raw.view(dtype)
    if not request.reslice:
        rows = request.dest_stop - request.dest_start
        new_piece[request.dest_start:request.dest_stop] = values.reshape((rows,) + new_piece.shape[1:])
        return

    # Different cut axes: bring both pieces back to global axis order, where the old
    # piece covers its range along old_axis and the new piece its range along new_axis.
    old_tl = old.tensor(request.name)
    logical = new_tl.logical_shape
    old_piece = values.reshape(old_tl.piece_shape(request.old_rank))
    old_global = np.moveaxis(old_piece, 0, old_tl.axis)
    new_global = np.moveaxis(new_piece, 0, new_tl.axis)
    old_start, old_stop = old_tl.bounds[request.old_rank]
    new_start, new_stop = new_tl.bounds[new_rank]
    source = [slice(None)] * len(logical)
    target = [slice(None)] * len(logical)
    source[new_tl.axis] = slice(new_start, new_stop)      # old piece spans all of new_axis
    target[old_tl.axis] = slice(old_start, old_stop)      # new piece spans all of old_axis
    new_global[tuple(target)] = old_global[tuple(source)]


_TILE = 256


def copy_strided(destination: np.ndarray, source: np.ndarray) -> None:
    """np.copyto, tiled when `source` is a transposed view (a piece cut along an axis other
    than 0): NumPy walks such a copy with cache misses on every element, at ~0.2 GB/s here;
    256 x 256 tiles keep both sides in cache and run 2-3x faster."""
    if source.ndim < 2 or source.flags.c_contiguous or destination.shape[0] * destination.shape[1] < 4 * _TILE * _TILE:
        np.copyto(destination, source)
        return
    rows, cols = destination.shape[:2]
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            np.copyto(destination[i:i + _TILE, j:j + _TILE], source[i:i + _TILE, j:j + _TILE])
