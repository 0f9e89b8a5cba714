"""What the application handed over: the protected arrays (with where each lies among the
ranks), the keyed tables and the registered small state, in protect order.

It outlives any communicator: the snapshot buffers and the layout are built from one
(ckpt/snapshot.py), and a new communicator builds them again over the same registry. The
arrays are checked here for what one rank alone can tell (a block's offset and shape, the
memory a framework's tensor computes on); what needs every rank is checked at the first
checkpoint or restart.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from hpcckpt.ckpt.array_views import MemoryWitness, Protectable
from hpcckpt.ckpt.foreign_arrays import followed, protectable, seen_as
from hpcckpt.ckpt.replicas import BlockCopies
from hpcckpt.errors import CheckpointError, ConfigError
from hpcckpt.format.keyed_rows import piece_names

ENGINE_STATE_KEY = "_hpcckpt"


@dataclass(frozen=True)
class BlockOf:
    """Where a rank's block lies in its global array, as protect() was told."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    gaps: bool


@dataclass(frozen=True)
class RegisteredState:
    """Small state handed over with register_state: read with get() at each checkpoint,
    given to set() at a restart. `per_rank`: each rank's own, saved in its shard;
    `reshard(states, rank, size)`: what this rank gets onto another rank count, from the old
    ranks' states handed to it ({old rank: state}, old rank r to new rank r % size)."""

    get: Callable[[], object]
    set: Callable[[object], None]
    per_rank: bool = False
    reshard: Callable | None = None


@dataclass
class Protected:
    name: str
    array: object
    replicated: bool
    block: BlockOf | None = None  # a block of a global array (neither replicated nor per-rank)
    witness: MemoryWitness | None = None  # a framework's tensor: whether it still computes on `array`
    copies: BlockCopies | None = None  # a block held whole by several ranks, `array` empty but on one
    # Protected by reference: source() is the application's object now (a getter's result, a
    # framework's array that carries its own split), read again at each capture and restore;
    # `seen` tells whether it is the one `array` was made from; `given` protect()'s arguments.
    source: Callable[[], object] | None = None
    seen: tuple = ()
    given: tuple = ()
    # Protected by value: the references to the application's object that protect() added
    # (the registry's, a framework's hold through the view): beyond them, the application's.
    held_refs: int = 0

    @property
    def per_rank(self) -> bool:
        return not self.replicated and self.block is None

    @property
    def geometry(self) -> tuple:
        """What the layout is made from: shape, dtype and where it lies among the ranks."""
        copies = (self.copies.group, self.copies.owner, self.copies.arrangement) if self.copies is not None else None
        return (self.name, tuple(self.array.shape), str(self.array.dtype), self.replicated, self.block, copies)


class ArrayRegistry:
    """The arrays, tables and state protected so far; closed to more once a layout is made."""

    def __init__(self):
        self.arrays: dict[str, Protected] = {}
        self.tables: dict = {}  # name -> KeyedTable, in protect order
        self.states: dict[str, RegisteredState] = {}
        self.closed = False  # a layout was made: the first checkpoint or restart

    def protect(self, name: str, obj, replicated: bool, global_shape: Sequence[int] | None = None,
                offset: Sequence[int] | None = None, allow_gaps: bool = False) -> None:
        """`obj`: the application's array, a getter of it, or a framework's array followed by
        reference (ckpt/foreign_arrays.py's followed()); a Protectable as it is. Where the
        object gives its own geometry (a DTensor's placements, a DNDarray's split), the
        arguments may not."""
        if self.closed:
            raise CheckpointError(f"protect({name!r}) after the first checkpoint or restart; protect everything first")
        if name in self.arrays:
            raise CheckpointError(f"an array named {name!r} is already protected")
        source = None if isinstance(obj, Protectable) else followed(obj)
        given = (replicated, global_shape, offset, allow_gaps)
        if source is not None:
            current = source()
            protected = _protected(name, protectable(name, current), *given)
            protected.source, protected.seen, protected.given = source, seen_as(current), given
        else:
            before = sys.getrefcount(obj)
            protected = _protected(name, obj if isinstance(obj, Protectable) else protectable(name, obj), *given)
            protected.held_refs = sys.getrefcount(obj) - before
        self.arrays[name] = protected

    @property
    def followed(self) -> bool:
        """Some array is protected by reference."""
        return any(p.source is not None for p in self.arrays.values())

    def refresh(self) -> None:
        """(this rank) Each array protected by reference made from the application's object as
        it is now, where that is another object than the one seen last (a name rebound, a
        framework's local tensor swapped); its geometry may change (ProtectedArrays lays the
        arrays out again)."""
        for name, p in list(self.arrays.items()):
            if p.source is None:
                continue
            current = p.source()
            if seen_as(current) == p.seen:
                continue
            protected = _protected(name, protectable(name, current), *p.given)
            protected.source, protected.seen, protected.given = p.source, seen_as(current), p.given
            self.arrays[name] = protected

    @property
    def geometry(self) -> tuple:
        """Every array's shape, dtype and place among the ranks: what a layout is made from."""
        return tuple(p.geometry for p in self.arrays.values())

    def check_memory(self) -> None:
        """This rank's protected tensors still compute on the memory kept (foreign_arrays.py's
        MemoryWitness): else a ConfigError naming them, before anything is saved or restored.
        One rank's error, not every rank's: the application's main ends the job."""
        moved = [said for p in self.arrays.values() if p.witness is not None for said in [p.witness.moved(p.name)]
                 if said]
        if moved:
            raise ConfigError("; ".join(moved[:4]) + (f" (and {len(moved) - 4} more)" if len(moved) > 4 else ""),
                              collective=False)

    def add_table(self, name: str, table) -> None:
        from hpcckpt.ckpt.keyed_table import KeyedTable

        if self.closed:
            raise CheckpointError(f"protect_table({name!r}) after the first checkpoint or restart; protect everything "
                                  "first")
        if not isinstance(table, KeyedTable):
            raise CheckpointError(f"protect_table({name!r}): expected an hpcckpt KeyedTable, got {type(table).__name__}")
        if name in self.tables or any(n in self.arrays for n in piece_names(name)):
            raise CheckpointError(f"a table named {name!r} is already protected")
        if any(t is table for t in self.tables.values()):
            raise CheckpointError(f"protect_table({name!r}): this KeyedTable is protected under another name already")
        if not name or "/" in name:
            raise CheckpointError(f"protect_table({name!r}): a table's name must be non-empty and hold no '/'")
        self.tables[name] = table

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None], per_rank: bool = False,
                       reshard: Callable | None = None) -> None:
        if name in self.states or name == ENGINE_STATE_KEY:
            raise CheckpointError(f"state {name!r} is already registered")
        if reshard is not None and not per_rank:
            raise ConfigError(f"register_state({name!r}): reshard says what each rank gets of per-rank state onto "
                              "another rank count; give per_rank=True too (replicated state goes to every rank as "
                              "it is)")
        if reshard is not None and not callable(reshard):
            raise ConfigError(f"register_state({name!r}): reshard must be callable (states, rank, size) -> state, "
                              f"got {type(reshard).__name__}")
        self.states[name] = RegisteredState(get, set, bool(per_rank), reshard)

    @property
    def per_rank_states(self) -> set[str]:
        return {name for name, registered in self.states.items() if registered.per_rank}

    @property
    def local_array_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.arrays.values() if p.per_rank)


def _protected(name: str, kept: Protectable, replicated: bool, global_shape, offset, allow_gaps: bool) -> Protected:
    array = kept.array
    if not hasattr(array, "dtype") or not hasattr(array, "shape"):
        raise CheckpointError(f"protect({name!r}): expected a NumPy or CuPy array, got {type(array).__name__}")
    geometry = kept.geometry
    copies = None
    if geometry is not None:
        if global_shape is not None or offset is not None or not replicated:
            raise ConfigError(f"protect({name!r}): the object says where it lies among the ranks itself (a "
                              "DTensor's placements, a DNDarray's split); leave global_shape, offset and replicated "
                              "out")
        replicated, global_shape, offset = True, geometry.global_shape, geometry.offset
        if geometry.copy_group is not None:
            copies = BlockCopies(geometry.copy_group, geometry.copy_owner, kept.copy_target, geometry.copy_arrangement)
    return Protected(name, array, replicated, _block_of(name, array, replicated, global_shape, offset, allow_gaps),
                     kept.witness, copies)


def _block_of(name: str, array, replicated: bool, global_shape, offset, allow_gaps: bool) -> BlockOf | None:
    """protect()'s block arguments, checked for what this rank alone can tell."""
    if global_shape is None:
        if offset is not None or allow_gaps:
            raise ConfigError(f"protect({name!r}): offset and allow_gaps describe a block of a global array; "
                              "give its global_shape too")
        return None
    if not replicated:
        raise ConfigError(f"protect({name!r}): a block of a global array (global_shape=...) is not a per-rank "
                          "array; leave replicated at its default")
    try:
        global_shape = tuple(int(d) for d in global_shape)
        given = tuple(offset) if offset is not None else (0,) * len(global_shape)
        offset = tuple(_start_of(name, o, axis, array.shape) for axis, o in enumerate(given))
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"protect({name!r}): global_shape must be a sequence of integers and offset one of "
                          f"integers or slices (this rank's block in the global array), got {global_shape!r} and "
                          f"{offset!r}") from None
    return BlockOf(global_shape, offset, bool(allow_gaps))


def _start_of(name: str, where, axis: int, shape: tuple) -> int:
    """An offset as a framework hands it: the block's first index on `axis`, or the slice of
    the global array the block is (step 1, its length the block's on that axis)."""
    if not isinstance(where, slice):
        return int(where)
    start = 0 if where.start is None else int(where.start)
    if where.step not in (None, 1):
        raise ConfigError(f"protect({name!r}): offset {where} on axis {axis} has step {where.step}; a block is a "
                          "contiguous part of the global array (step 1)")
    if start < 0 or (where.stop is not None and int(where.stop) < 0):
        raise ConfigError(f"protect({name!r}): offset {where} on axis {axis} starts before the global array (a block "
                          "with halo cells reaches past its edge: protect the interior without them, e.g. "
                          "u[1:-1, 1:-1], with the interior's slices)")
    extent = shape[axis] if axis < len(shape) else None
    if where.stop is not None and extent is not None and int(where.stop) - start != extent:
        raise ConfigError(f"protect({name!r}): offset {where} on axis {axis} spans {int(where.stop) - start} "
                          f"element(s), but the array protected is {extent} long there (shape {tuple(shape)}); "
                          "protect the block the slices describe (without halo cells, e.g. u[1:-1, 1:-1])")
    return start
