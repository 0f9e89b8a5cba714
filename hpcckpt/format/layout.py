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
- A cut is kept as its rule (even over the world size, or whole on one owner), not as a
  list of bounds per rank: a layout's size and the time to plan, store and read it do not
  grow with the rank count; `bounds` expands it where a caller wants them all.
- A 0-d tensor is handled as a tensor of logical shape (1,) cut along axis 0.
- A tensor the application decomposed itself (a stencil code's grid) is a BlockLayout: each
  rank holds one box of the global array (start and stop in every dimension), stored as the
  rank holds it (C order, no axis moved). Its boxes come from the ranks, so they are listed,
  O(ranks); they never overlap and tile the global shape unless the user allowed gaps.
- Every piece of either kind is a box of the global array. Where two layouts of a tensor do
  not cut along the same axis (blocks, or another split), a restore moves the intersection
  of an old and a new box, packed in global C order (`ReadRequest.box`).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from hpcckpt.errors import ConfigError, FormatError, IncompatibleCheckpointError

# 2: each tensor's cut as its rule (an even cut over the world size, or whole on one owner),
# expanded on demand; 1: bounds listed for every (tensor, rank) pair, still read.
LAYOUT_FORMAT = 2
READABLE_LAYOUT_FORMATS = (1, 2)


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
    return tuple(_even_bound(dim, world_size, rank) for rank in range(world_size))


def _even_bound(dim: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank's (start, stop) in an even cut of `dim` rows: the first dim % world_size ranks
    take one row more."""
    base, extra = divmod(dim, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _even_ranks_overlapping(dim: int, world_size: int, start: int, stop: int) -> range:
    """The ranks whose rows of an even cut of `dim` overlap [start, stop)."""
    if stop <= start:
        return range(0)
    base, extra = divmod(dim, world_size)

    def rank_of_row(row: int) -> int:
        wide = extra * (base + 1)  # rows held by the ranks with one row more
        if row < wide:
            return row // (base + 1)
        return extra + (row - wide) // base if base else world_size - 1
    return range(rank_of_row(start), rank_of_row(stop - 1) + 1)


Box = tuple[tuple[int, int], ...]  # (start, stop) in every dimension of the logical shape


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _intersection(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


class TensorLayout:
    """How one tensor is spread over ranks along `axis`: an even cut over `world_size` ranks,
    whole on `owner`, or (read from elsewhere) explicit `bounds`. bounds_of(r) and rows(r)
    answer for one rank without expanding the rule; `bounds` lists them all."""

    __slots__ = ("spec", "axis", "world_size", "owner", "_explicit")

    def __init__(self, spec: TensorSpec, axis: int, bounds: Sequence[Sequence[int]] | None = None, *,
                 world_size: int | None = None, owner: int | None = None):
        self.spec = spec
        self.axis = int(axis)
        self.owner: int | None = None
        self._explicit: tuple[tuple[int, int], ...] | None = None
        if bounds is None:
            if world_size is None:
                raise ValueError("a TensorLayout needs bounds or a world size")
            self.world_size = int(world_size)
            # One canonical rule per set of bounds (an owner of nothing, or of the only rank,
            # is an even cut), so equal layouts compare equal however they were made or read.
            if owner is not None and self.dim > 0 and self.world_size > 1:
                self.owner = int(owner)
            return
        bounds = tuple((int(start), int(stop)) for start, stop in bounds)
        self.world_size = len(bounds)
        dim = self.logical_shape[self.axis] if 0 <= self.axis < len(self.logical_shape) else None
        # Bounds that follow a rule are kept as the rule: equal layouts compare equal however made.
        if dim is not None and bounds == _even_bounds(dim, len(bounds)):
            return
        held = [rank for rank, (start, stop) in enumerate(bounds) if stop > start]
        if dim is not None and len(held) == 1 and bounds[held[0]] == (0, dim) and \
                all(b == (0, 0) for r, b in enumerate(bounds) if r != held[0]):
            self.owner = held[0]
            return
        self._explicit = bounds

    def _key(self):
        return (self.spec, self.axis, self.world_size, self.owner, self._explicit)

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        cut = (f"bounds={self._explicit}" if self._explicit is not None
               else f"owner={self.owner}" if self.owner is not None else "even")
        return f"TensorLayout({self.spec!r}, axis={self.axis}, world_size={self.world_size}, {cut})"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The global shape the bounds refer to: the real shape, or (1,) for a 0-d tensor."""
        return self.spec.shape if self.spec.shape else (1,)

    @property
    def dim(self) -> int:
        """Rows along the cut axis."""
        return self.logical_shape[self.axis]

    @property
    def cut(self) -> str:
        """"even", "whole" (on `owner`) or "explicit"."""
        return "explicit" if self._explicit is not None else "whole" if self.owner is not None else "even"

    def bounds_of(self, rank: int) -> tuple[int, int]:
        if self._explicit is not None:
            return self._explicit[rank]
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world size {self.world_size}")
        if self.owner is not None:
            return (0, self.dim) if rank == self.owner else (0, 0)
        return _even_bound(self.dim, self.world_size, rank)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """Every rank's (start, stop): O(world size), for callers that want them all."""
        if self._explicit is not None:
            return self._explicit
        return tuple(self.bounds_of(rank) for rank in range(self.world_size))

    def holders(self, start: int = 0, stop: int | None = None) -> Iterator[int]:
        """The ranks holding rows of [start, stop) (default: all rows), in rank order, found
        without walking every rank where the rule allows."""
        stop = self.dim if stop is None else stop
        if self._explicit is not None:
            return (rank for rank, (s, e) in enumerate(self._explicit) if e > s and s < stop and e > start)
        if self.owner is not None:
            return iter((self.owner,) if stop > start and self.dim > 0 else ())
        return (rank for rank in _even_ranks_overlapping(self.dim, self.world_size, start, stop)
                if self.rows(rank) > 0)

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along the cut axis; a piece's rows are this size each."""
        shape = self.logical_shape
        return math.prod(shape[:self.axis] + shape[self.axis + 1:]) * self.spec.itemsize

    @property
    def is_split(self) -> bool:
        if self._explicit is not None:
            return sum(1 for start, stop in self._explicit if stop > start) > 1
        return self.owner is None and min(self.dim, self.world_size) > 1

    def rows(self, rank: int) -> int:
        start, stop = self.bounds_of(rank)
        return stop - start

    def holds(self, rank: int) -> bool:
        return self.rows(rank) > 0

    def box_of(self, rank: int) -> Box:
        """Rank's piece as a box of the logical shape: its rows along the axis, all of the rest."""
        box = [(0, d) for d in self.logical_shape]
        box[self.axis] = self.bounds_of(rank)
        return tuple(box)

    def holders_of_box(self, box: Box) -> Iterator[int]:
        return self.holders(*box[self.axis])

    def global_order(self, piece: np.ndarray) -> np.ndarray:
        """A stored (axis-major) piece seen in global axis order: a view, shaped as its box."""
        return np.moveaxis(piece, 0, self.axis) if self.axis else piece

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of rank's piece as stored: axis-major (cut axis first)."""
        shape = self.logical_shape
        return (self.rows(rank),) + shape[:self.axis] + shape[self.axis + 1:]

    def piece_nbytes(self, rank: int) -> int:
        return self.rows(rank) * self.row_bytes

    def to_dict(self) -> dict:
        entry = {"name": self.name, "dtype": self.spec.dtype, "shape": list(self.spec.shape), "axis": self.axis}
        if self._explicit is not None:
            entry["bounds"] = [list(b) for b in self._explicit]
        elif self.owner is not None:
            entry["owner"] = self.owner
        return entry

    @classmethod
    def from_dict(cls, entry: Mapping, world_size: int, layout_format: int) -> "TensorLayout":
        spec = TensorSpec(str(entry["name"]), str(entry["dtype"]), tuple(entry["shape"]))
        if layout_format == 1 or "bounds" in entry:
            return cls(spec, int(entry["axis"]), entry["bounds"])
        owner = entry.get("owner")
        return cls(spec, int(entry["axis"]), world_size=world_size, owner=None if owner is None else int(owner))


class BlockLayout:
    """A tensor decomposed by the application: rank r holds `boxes[r]` of the global array,
    stored as it holds it (C order). An empty box (a zero extent) holds nothing. `gaps`: the
    user allowed parts of the global shape that no rank holds (block_problems checks the
    rest)."""

    __slots__ = ("spec", "boxes", "gaps", "_starts", "_stops")
    cut = "blocks"

    def __init__(self, spec: TensorSpec, boxes: Sequence[Sequence[Sequence[int]]], gaps: bool = False):
        self.spec = spec
        self.boxes: tuple[Box, ...] = tuple(tuple((int(start), int(stop)) for start, stop in box) for box in boxes)
        self.gaps = bool(gaps)
        ndim = len(spec.shape)
        corners = np.array([[edge for pair in box for edge in pair] for box in self.boxes],
                           dtype=np.int64).reshape(len(self.boxes), ndim, 2)
        self._starts, self._stops = corners[:, :, 0], corners[:, :, 1]

    def _key(self):
        return (self.spec, self.boxes, self.gaps)

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"BlockLayout({self.spec!r}, {len(self.boxes)} boxes, gaps={self.gaps})"

    name = property(lambda self: self.spec.name)
    world_size = property(lambda self: len(self.boxes))
    logical_shape = property(lambda self: self.spec.shape)

    def box_of(self, rank: int) -> Box:
        return self.boxes[rank]

    def holds(self, rank: int) -> bool:
        return all(stop > start for start, stop in self.boxes[rank])

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        return box_shape(self.boxes[rank])

    def piece_nbytes(self, rank: int) -> int:
        return math.prod(self.piece_shape(rank)) * self.spec.itemsize

    @property
    def is_split(self) -> bool:
        return sum(1 for rank in range(self.world_size) if self.holds(rank)) > 1

    def holders_of_box(self, box: Box) -> Iterator[int]:
        """The ranks whose boxes intersect `box`, in rank order (vectorized: O(ranks) in C)."""
        if not self.boxes:
            return iter(())
        low = np.array([start for start, _ in box], dtype=np.int64)
        high = np.array([stop for _, stop in box], dtype=np.int64)
        overlapping = np.all((self._starts < high) & (self._stops > low) & (self._stops > self._starts), axis=1)
        return iter(np.flatnonzero(overlapping).tolist())

    @staticmethod
    def global_order(piece):
        return piece

    def to_dict(self) -> dict:
        """The boxes as a grid rule where they are one (O(cuts), not O(ranks)), else listed."""
        entry = {"name": self.name, "dtype": self.spec.dtype, "shape": list(self.spec.shape), "gaps": self.gaps}
        grid = _as_grid(self.boxes)
        if grid is not None:
            entry["grid"], entry["order"] = grid
        else:
            entry["blocks"] = [[edge for pair in box for edge in pair] for box in self.boxes]
        return entry

    def __reduce__(self):
        return (_block_layout_of, (self.to_dict(), self.world_size))

    @classmethod
    def from_dict(cls, entry: Mapping, world_size: int) -> "BlockLayout":
        spec = TensorSpec(str(entry["name"]), str(entry["dtype"]), tuple(entry["shape"]))
        ndim = len(spec.shape)
        if "grid" in entry:
            boxes = _grid_boxes(spec, [[int(e) for e in edges] for edges in entry["grid"]], str(entry["order"]),
                                world_size)
        else:
            boxes = []
            for flat in entry["blocks"]:
                if len(flat) != 2 * ndim:
                    raise ValueError(f"a block of {spec.name!r} has {len(flat)} edges for {ndim} dimensions")
                boxes.append(tuple((int(flat[2 * d]), int(flat[2 * d + 1])) for d in range(ndim)))
        return cls(spec, boxes, bool(entry.get("gaps", False)))


def _block_layout_of(entry: Mapping, world_size: int) -> BlockLayout:
    return BlockLayout.from_dict(entry, world_size)


def _grid_order(counts: Sequence[int], order: str) -> list[tuple[int, ...]]:
    """Cell indices in rank order: C (last axis fastest, as MPI_Cart_create numbers ranks) or F."""
    if order == "C":
        return list(np.ndindex(*counts))
    return [tuple(reversed(cell)) for cell in np.ndindex(*reversed(counts))]


def _as_grid(boxes: Sequence[Box]) -> tuple[list[list[int]], str] | None:
    """(edges per dimension, "C" or "F") where the first ranks hold the cells of a grid in that
    order and the others nothing (boxes of zeros); None for any other decomposition."""
    held = [box for box in boxes if all(stop > start for start, stop in box)]
    if not held or any(box != tuple((0, 0) for _ in box) for box in boxes[len(held):]):
        return None
    ndim = len(held[0])
    edges = [sorted({box[d][0] for box in held} | {box[d][1] for box in held}) for d in range(ndim)]
    counts = [len(e) - 1 for e in edges]
    if math.prod(counts) != len(held):
        return None
    position = [{(e[i], e[i + 1]): i for i in range(len(e) - 1)} for e in edges]
    cells = [tuple(position[d].get(box[d], -1) for d in range(ndim)) for box in held]
    for order in ("C", "F"):
        if cells == _grid_order(counts, order):
            return edges, order
    return None


def _grid_boxes(spec: TensorSpec, edges: list[list[int]], order: str, world_size: int) -> list[Box]:
    if len(edges) != len(spec.shape) or order not in ("C", "F") or any(len(e) < 2 for e in edges):
        raise ValueError(f"the block grid of {spec.name!r} does not fit its {len(spec.shape)} dimensions")
    counts = [len(e) - 1 for e in edges]
    boxes = [tuple((edges[d][cell[d]], edges[d][cell[d] + 1]) for d in range(len(edges)))
             for cell in _grid_order(counts, order)]
    if len(boxes) > world_size:
        raise ValueError(f"the block grid of {spec.name!r} has {len(boxes)} cells for {world_size} ranks")
    return boxes + [tuple((0, 0) for _ in edges)] * (world_size - len(boxes))


def block_problems(spec: TensorSpec, boxes: Sequence[Box], gaps: bool) -> list[str]:
    """What is wrong with `boxes` as blocks of `spec`: boxes outside the global shape, two
    boxes that overlap (named with where), and, unless `gaps`, elements no box covers."""
    shape = spec.shape
    if not shape:
        return [f"array {spec.name!r}: a 0-d array cannot be cut into blocks; protect it as replicated"]
    problems = []
    for rank, box in enumerate(boxes):
        if len(box) != len(shape) or any(not 0 <= start <= stop <= dim for (start, stop), dim in zip(box, shape)):
            problems.append(f"array {spec.name!r}: rank {rank}'s block {_describe_box(box)} is not inside the "
                            f"global shape {shape} (a block that includes halo cells reaches past the global array: "
                            "protect the interior without them, e.g. u[1:-1, 1:-1], at the interior's offset)")
    if problems:
        return problems
    held = [(rank, box) for rank, box in enumerate(boxes) if all(stop > start for start, stop in box)]
    overlap = _first_overlap(held, len(shape))
    if overlap is not None:
        (a, b), where = overlap
        problems.append(f"array {spec.name!r}: the blocks of ranks {a} and {b} overlap in {_describe_box(where)}; "
                        "each element must be held by one rank (blocks that include halo cells overlap their "
                        "neighbours': protect the interior without them, e.g. u[1:-1, 1:-1], at the interior's offset)")
        return problems
    covered = sum(math.prod(box_shape(box)) for _, box in held)
    if not gaps and covered != math.prod(shape):
        problems.append(f"array {spec.name!r}: the blocks cover {covered} of the {math.prod(shape)} elements of the "
                        f"global shape {shape}; give every element to a rank, or pass allow_gaps=True if the "
                        "uncovered part is not to be saved (a restart leaves it as the new ranks' arrays hold it)")
    return problems


def _first_overlap(held: list[tuple[int, Box]], ndim: int):
    """The first two boxes that intersect, and where. Swept along the dimension with the most
    distinct starts: a box is compared only with those that start before it ends there."""
    if len(held) < 2:
        return None
    starts = np.array([[start for start, _ in box] for _, box in held], dtype=np.int64)
    stops = np.array([[stop for _, stop in box] for _, box in held], dtype=np.int64)
    axis = max(range(ndim), key=lambda d: len(np.unique(starts[:, d])))
    order = np.argsort(starts[:, axis], kind="stable")
    starts, stops = starts[order], stops[order]
    for i in range(len(order) - 1):
        end = int(np.searchsorted(starts[:, axis], stops[i, axis], side="left"))
        if end <= i + 1:
            continue
        hits = np.flatnonzero(np.all((starts[i + 1:end] < stops[i]) & (stops[i + 1:end] > starts[i]), axis=1))
        if hits.size:
            j = i + 1 + int(hits[0])
            a, b = sorted((held[order[i]][0], held[order[j]][0]))
            return (a, b), _intersection(held[order[i]][1], held[order[j]][1])
    return None


def _describe_box(box: Box) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"


AnyLayout = TensorLayout | BlockLayout


@dataclass(frozen=True)
class Layout:
    """The layout of every tensor for one world size, in the order the specs were given."""

    world_size: int
    tensors: tuple[AnyLayout, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"tensor names must be unique; repeated: {duplicates}")

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorLayout]:
        return {t.name: t for t in self.tensors}

    @functools.cached_property
    def digest(self) -> str:
        """Equal for equal layouts: whether a version's shards are this job's pieces as they are."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=8).hexdigest()

    def get(self, name: str) -> AnyLayout | None:
        return self._by_name.get(name)

    def tensor(self, name: str) -> AnyLayout:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this layout") from None

    def piece_shape(self, name: str, rank: int) -> tuple[int, ...]:
        return self.tensor(name).piece_shape(self._check_rank(rank))

    def rank_pieces(self, rank: int) -> tuple[AnyLayout, ...]:
        """Tensors of which `rank` holds at least one element, in layout order."""
        rank = self._check_rank(rank)
        return tuple(t for t in self.tensors if t.holds(rank))

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
        return {"format": LAYOUT_FORMAT, "world_size": self.world_size,
                "tensors": [t.to_dict() for t in self.tensors]}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Layout":
        try:
            layout_format = data["format"]
            if layout_format not in READABLE_LAYOUT_FORMATS:
                raise FormatError(f"layout format {layout_format!r} is not supported "
                                  f"(supported: {', '.join(map(str, READABLE_LAYOUT_FORMATS))})")
            world_size = int(data["world_size"])
            tensors = tuple(BlockLayout.from_dict(entry, world_size) if "blocks" in entry or "grid" in entry else
                            TensorLayout.from_dict(entry, world_size, layout_format) for entry in data["tensors"])
            layout = cls(world_size, tensors)
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
        """Reject a decoded layout whose pieces do not tile their tensors exactly (a rule
        tiles by construction; explicit bounds are checked)."""
        if self.world_size < 1:
            raise FormatError(f"layout world size {self.world_size} must be at least 1")
        for t in self.tensors:
            if isinstance(t, BlockLayout):
                if t.world_size != self.world_size:
                    raise FormatError(f"layout of {t.name!r}: {t.world_size} blocks for {self.world_size} ranks")
                grid = _as_grid(t.boxes)
                if grid is not None and all(edges[0] == 0 and edges[-1] == dim for edges, dim in zip(grid[0], t.spec.shape)):
                    continue  # the cells of a grid over the whole shape tile it by construction
                problems = block_problems(t.spec, t.boxes, t.gaps)
                if problems:
                    raise FormatError(f"layout of {t.name!r}: {problems[0]}")
                continue
            shape = t.logical_shape
            if not 0 <= t.axis < len(shape):
                raise FormatError(f"layout of {t.name!r}: axis {t.axis} out of range for shape {shape}")
            if t.world_size != self.world_size:
                raise FormatError(f"layout of {t.name!r}: {t.world_size} bounds for "
                                  f"{self.world_size} ranks")
            if t.owner is not None and not 0 <= t.owner < self.world_size:
                raise FormatError(f"layout of {t.name!r}: owner {t.owner} out of range for "
                                  f"{self.world_size} ranks")
            if t.cut != "explicit":
                continue
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
    # Bytes per rank of the cut tensors, as a difference array: an even cut gives every rank
    # `base` rows and the first `extra` ranks one more, so each tensor costs O(1), not O(ranks).
    base_load = 0
    more = [0] * (world_size + 1)
    whole: list[int] = []
    for index, spec in enumerate(specs):
        if spec.shape and spec.nbytes >= split_threshold_bytes:
            tensor_layout = TensorLayout(spec, _split_axis(spec.shape), world_size=world_size)
            layouts[index] = tensor_layout
            base, extra = divmod(tensor_layout.dim, world_size)
            base_load += base * tensor_layout.row_bytes
            more[0] += tensor_layout.row_bytes if extra else 0
            more[extra] -= tensor_layout.row_bytes if extra else 0
        else:
            whole.append(index)

    # The least loaded rank (lowest on ties) takes the next small tensor: a heap of (load, rank).
    loads, running = [], 0
    for rank in range(world_size):
        running += more[rank]
        loads.append((base_load + running, rank))
    heapq.heapify(loads)
    for index in sorted(whole, key=lambda i: (-specs[i].nbytes, i)):
        spec = specs[index]
        load, owner = heapq.heappop(loads)
        layouts[index] = TensorLayout(spec, _split_axis(spec.shape), world_size=world_size, owner=owner)
        heapq.heappush(loads, (load + spec.nbytes, owner))

    return Layout(world_size, tuple(layouts))


def piece_view_slices(tensor_layout: AnyLayout, rank: int) -> tuple[slice, ...]:
    """Index tuple selecting rank's piece from the global array, in global axis order.

    It applies to the array reshaped to `tensor_layout.logical_shape` (only differs for
    0-d tensors), so a CuPy caller can do: `xp.ascontiguousarray(xp.moveaxis(
    a.reshape(tl.logical_shape)[slices], tl.axis, 0))`.
    """
    return tuple(slice(start, stop) for start, stop in tensor_layout.box_of(rank))


def _check_global_shape(array, tensor_layout: AnyLayout) -> None:
    if tuple(array.shape) != tensor_layout.spec.shape:
        raise ValueError(f"tensor {tensor_layout.name!r}: array shape {tuple(array.shape)} "
                         f"does not match the layout's {tensor_layout.spec.shape}")


def extract_piece(array, tensor_layout: AnyLayout, rank: int):
    """Rank's piece of the global `array`, as stored: C-contiguous, axis-major for a cut
    tensor (NumPy or CuPy).

    When the piece is already contiguous (a cut along axis 0 of a C-contiguous array) the
    result is a VIEW of `array`; callers that need a stable snapshot must copy it.
    """
    _check_global_shape(array, tensor_layout)
    logical = array.reshape(tensor_layout.logical_shape)
    piece = logical[piece_view_slices(tensor_layout, rank)]
    if isinstance(tensor_layout, TensorLayout) and tensor_layout.axis != 0:
        order = [tensor_layout.axis] + [a for a in range(piece.ndim) if a != tensor_layout.axis]
        piece = piece.transpose(order)
    if not piece.flags.c_contiguous:
        piece = piece.copy()  # ndarray.copy() is C-ordered in NumPy and CuPy alike
    return piece


def insert_piece(target_array, tensor_layout: AnyLayout, rank: int, piece) -> None:
    """Write a stored piece back into its place in the full array, in place."""
    _check_global_shape(target_array, tensor_layout)
    expected = tensor_layout.piece_shape(rank)
    if math.prod(piece.shape) != math.prod(expected):
        raise ValueError(f"tensor {tensor_layout.name!r}, rank {rank}: piece of shape "
                         f"{tuple(piece.shape)} does not fit {expected}")
    piece = piece.reshape(expected)
    if not tensor_layout.spec.shape:
        if expected[0]:
            target_array[()] = piece[0]
        return
    target_array[piece_view_slices(tensor_layout, rank)] = tensor_layout.global_order(piece)


@dataclass(frozen=True)
class ReadRequest:
    """What a new piece needs of one old piece.

    Rows (`box` None, both layouts cut the tensor along the same axis): bytes
    [byte_offset_in_piece, +nbytes) of old rank `old_rank`'s stored piece of `name` become
    rows [dest_start, dest_stop) of the new piece, counted from its first row.

    A box (blocks, or cuts along different axes): the part `box` (global coordinates) of
    both pieces; its `nbytes` travel packed in global C order (request_payload cuts them out
    of the old piece, place_read puts them into the new one).
    """

    name: str
    old_rank: int
    byte_offset_in_piece: int
    nbytes: int
    dest_start: int = 0
    dest_stop: int = 0
    box: Box | None = None


def read_requests(old: Layout, new: Layout, new_rank: int) -> list[ReadRequest]:
    """What `new_rank` must read from the old shards to build its pieces under `new`.

    Requests come in new-layout tensor order, and by old rank within a tensor. Only the
    overlapping parts are asked for, so the total requested equals the bytes of new_rank's
    pieces (less any gaps of the old blocks).
    """
    problems = old.same_tensors(new, "checkpoint", "current model")
    if problems:
        raise IncompatibleCheckpointError(
            "the checkpoint does not match the current tensors: " + "; ".join(problems))
    new._check_rank(new_rank)

    requests = []
    for new_tl in new.rank_pieces(new_rank):
        old_tl = old.tensor(new_tl.name)
        if isinstance(old_tl, TensorLayout) and isinstance(new_tl, TensorLayout) and old_tl.axis == new_tl.axis:
            requests += _row_requests(old_tl, new_tl, new_rank)
            continue
        new_box = new_tl.box_of(new_rank)
        for old_rank in old_tl.holders_of_box(new_box):
            part = _intersection(old_tl.box_of(old_rank), new_box)
            if part is not None:
                requests.append(ReadRequest(new_tl.name, old_rank, 0, math.prod(box_shape(part)) * new_tl.spec.itemsize,
                                            box=part))
    return requests


def _row_requests(old_tl: TensorLayout, new_tl: TensorLayout, new_rank: int) -> list[ReadRequest]:
    new_start, new_stop = new_tl.bounds_of(new_rank)
    requests = []
    for old_rank in old_tl.holders(new_start, new_stop):
        old_start, old_stop = old_tl.bounds_of(old_rank)
        low, high = max(old_start, new_start), min(old_stop, new_stop)
        if low < high:
            requests.append(ReadRequest(new_tl.name, old_rank, byte_offset_in_piece=(low - old_start) * old_tl.row_bytes,
                                        nbytes=(high - low) * old_tl.row_bytes, dest_start=low - new_start,
                                        dest_stop=high - new_start))
    return requests


def _box_view(piece: np.ndarray, tensor_layout: AnyLayout, rank: int, part: Box) -> np.ndarray:
    """The elements `part` (global coordinates) of rank's stored piece, as a view in global
    axis order."""
    whole = tensor_layout.global_order(piece.reshape(tensor_layout.piece_shape(rank)))
    origin = tensor_layout.box_of(rank)
    return whole[tuple(slice(start - base, stop - base) for (start, stop), (base, _) in zip(part, origin))]


def _as_bytes(data) -> np.ndarray:
    return data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)


def request_payload(old_piece, request: ReadRequest, old: Layout) -> np.ndarray:
    """The bytes that travel for `request`, cut from the old piece (its stored bytes, whole):
    a view where they lie contiguous in it, else a packed copy."""
    raw = _as_bytes(old_piece)
    if request.box is None:
        return raw[request.byte_offset_in_piece:request.byte_offset_in_piece + request.nbytes]
    old_tl = old.tensor(request.name)
    values = raw.view(np.dtype(old_tl.spec.dtype))
    part = _box_view(values, old_tl, request.old_rank, request.box)
    return np.ascontiguousarray(part).reshape(-1).view(np.uint8)


def destination(new_piece: np.ndarray, request: ReadRequest, new: Layout, new_rank: int) -> np.ndarray | None:
    """Where the request's bytes land in `new_piece`, as bytes to receive straight into,
    where they are contiguous there; None otherwise (place_read then places them)."""
    if not new_piece.flags.c_contiguous:
        return None
    if request.box is None:
        target = new_piece[request.dest_start:request.dest_stop]
    else:
        target = _box_view(new_piece, new.tensor(request.name), new_rank, request.box)
        if not target.flags.c_contiguous:
            return None
    target = target.reshape(-1).view(np.uint8)
    return target if target.size == request.nbytes else None


def place_read(new_piece: np.ndarray, request: ReadRequest, data, old: Layout, new: Layout,
               new_rank: int) -> None:
    """Copy the bytes that travelled for `request` into `new_piece` (stored order, NumPy), in place."""
    new_tl = new.tensor(request.name)
    dtype = np.dtype(new_tl.spec.dtype)
    raw = _as_bytes(data)
    if raw.size != request.nbytes:
        raise ValueError(f"tensor {request.name!r}: got {raw.size} bytes for a request "
                         f"of {request.nbytes}")
    values = raw.view(dtype)
    if request.box is None:
        rows = request.dest_stop - request.dest_start
        new_piece[request.dest_start:request.dest_stop] = values.reshape((rows,) + new_piece.shape[1:])
        return
    _box_view(new_piece, new_tl, new_rank, request.box)[...] = values.reshape(box_shape(request.box))


def place_from_piece(new_piece: np.ndarray, request: ReadRequest, old_piece, old: Layout, new: Layout,
                     new_rank: int) -> None:
    """What `request` asks of an old piece held here (its stored bytes, whole), copied into
    `new_piece` at once: a box goes from one view to the other, with no packed copy between."""
    if request.box is None:
        place_read(new_piece, request, request_payload(old_piece, request, old), old, new, new_rank)
        return
    old_tl = old.tensor(request.name)
    source = _box_view(_as_bytes(old_piece).view(np.dtype(old_tl.spec.dtype)), old_tl, request.old_rank, request.box)
    _box_view(new_piece, new.tensor(request.name), new_rank, request.box)[...] = source


_TILE = 256


def copy_strided(destination: np.ndarray, source: np.ndarray) -> None:
    """np.copyto, tiled when `source` is a transposed view (a piece cut along an axis other
    than 0): NumPy walks such a copy with cache misses on every element, an order of magnitude
    below a contiguous copy; 256 x 256 tiles keep both sides in cache (perf/log/2026-11-23.md has the
    speed-up)."""
    if source.ndim < 2 or source.flags.c_contiguous or destination.shape[0] * destination.shape[1] < 4 * _TILE * _TILE:
        np.copyto(destination, source)
        return
    rows, cols = destination.shape[:2]
    for i in range(0, rows, _TILE):
        for j in range(0, cols, _TILE):
            np.copyto(destination[i:i + _TILE, j:j + _TILE], source[i:i + _TILE, j:j + _TILE])
