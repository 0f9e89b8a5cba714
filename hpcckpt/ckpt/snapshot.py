"""The protected arrays and their snapshot: what a checkpoint copies, into which buffers.

Each rank copies its slice of every replicated array (format/layout.py says which), its
block of every block array and its per-rank arrays whole into reused host buffers laid out as its shard file, so the file's
bytes need no second copy; CuPy arrays go device to device on a side stream and then to
pinned host memory (ckpt/device_snapshot.py). Copies may be taken now (capture) or queued
for the copier thread (save/pipeline.py), which before_update() waits for. Keyed tables
(ckpt/keyed_table.py) grow between versions, so their rows are copied when the snapshot is
frozen into pieces of their own, placed after the fixed ones in the shard file
(format/keyed_rows.py): every row in a full version, the rows changed since in a delta.
"""

from __future__ import annotations

import copy
import hashlib
import sys
import json
import threading
from collections import defaultdict

import numpy as np
import xxhash

from hpcckpt.ckpt.registry import ENGINE_STATE_KEY, ArrayRegistry
from hpcckpt.ckpt.replicas import CopyGroups, check_alike, check_state_alike
from hpcckpt.save.save_types import BackgroundCopies, Snapshot
from hpcckpt.cluster.backend import array_module
from hpcckpt.cluster.collectives import decide_at_root, quiet_any
from hpcckpt.errors import ConfigError
from hpcckpt.format import pytree
from hpcckpt.format.layout import (
    BlockLayout,
    Layout,
    TensorSpec,
    block_problems,
    copy_strided,
    piece_view_slices,
    plan_layout,
)
from hpcckpt.format.keyed_rows import TableSpec, piece_names
from hpcckpt.format.rank_state import PER_RANK_NAMES_KEY, RANK_STATE_PIECE, rank_state_piece, split_state
from hpcckpt.format.shardfile import payload_layout
from hpcckpt.io import direct_io, inherited_memory


class ProtectedArrays:
    """The application's registry (ckpt/registry.py) seen from one communicator: once laid
    out (by the first checkpoint or restart), the layout and the snapshot buffers."""

    def __init__(self, comm, registry: ArrayRegistry, split_threshold_bytes: int, gpu_snapshot: str,
                 shard_extra: dict, log=None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.registry = registry
        self.split_threshold_bytes = split_threshold_bytes
        self.gpu_snapshot = gpu_snapshot
        self.shard_extra = shard_extra
        self.log = log
        self._file_buffer: np.ndarray | None = None  # a shard with tables outgrows shard_bytes
        self.layout: Layout | None = None
        self.buffers: dict[str, np.ndarray] | None = None
        self.shard_bytes: np.ndarray | None = None  # laid out as the shard file; holds the host snapshot
        self.device_snapshot = None  # copies of CuPy arrays (ckpt/device_snapshot.py), if any
        self.copy_groups = CopyGroups(comm)
        self._checked_alike = False
        self._laid_out_from: tuple = ()  # the registry's geometry the layout was made from
        self._said_held = False
        # The snapshot buffers came from a checkpointer set aside after ranks died with their
        # pieces where they were: they may hold this rank's pieces of the version taken last
        # (io/inherited_memory.py), until a snapshot or a restore fills them.
        self.pieces_inherited = False
        # The arrays the checkpointer holds besides the registry (the step held in memory for
        # in-job recovery): counted out when telling whether the application still holds one.
        self.held_elsewhere = dict

    arrays = property(lambda self: self.registry.arrays)
    tables = property(lambda self: self.registry.tables)
    states = property(lambda self: self.registry.states)
    local_array_names = property(lambda self: self.registry.local_array_names)

    def protect_table(self, name: str, table) -> None:
        self.registry.add_table(name, table)
        table.bind(self.rank, self.world_size)

    def check_memory(self) -> None:
        self.registry.check_memory()

    def refresh(self) -> None:
        """(all ranks) Before a snapshot or a restore: each array protected by reference read
        again from the application's object; where one's shape or place changed on some rank
        (a resplit, a getter returning an array of another shape), the layout and snapshot
        buffers are made again by the next ensure_layout() (a version records its layout: a
        restore reads older ones over their own)."""
        if not self.registry.followed:
            return
        self.registry.refresh()
        changed = self.layout is not None and self.registry.geometry != self._laid_out_from
        if quiet_any(self.comm, changed):
            moved = [p.name for p in self.arrays.values() if p.geometry not in self._laid_out_from]
            if self.log:
                which = ", ".join(moved) or "on another rank"
                self.log.info(f"arrays protected by reference changed shape or place ({which}): the arrays are laid "
                              "out again", console=True)
            self.layout = self.buffers = self.shard_bytes = self.device_snapshot = self._file_buffer = None
            self._checked_alike = False
            self.pieces_inherited = False

    def leave_memory(self) -> None:
        """(this checkpointer set aside, its threads stopped) The snapshot buffer goes to the
        next checkpointer of this process (io/inherited_memory.py); this one keeps none."""
        offsets = {name: _offset_in(buffer, self.shard_bytes) for name, buffer in (self.buffers or {}).items()}
        inherited_memory.leave(self.shard_bytes, offsets)
        self.layout = self.buffers = self.shard_bytes = None
        self.pieces_inherited = False

    def check_before_snapshot(self) -> None:
        """(all ranks) Before a snapshot is taken: the tensors still where they were and still
        held by the application, and, at the first checkpoint of a process, what ranks protected
        alike alike (ckpt/replicas.py)."""
        self.check_memory()
        self.check_still_held()
        self.pieces_inherited = False  # the snapshot overwrites them
        if not self._checked_alike:
            check_alike(self.comm, [(p.name, p.array) for p in self.arrays.values()
                                    if p.replicated and p.block is None])
            check_state_alike(self.comm, self.replicated_state_digests())
            self.copy_groups.check_alike(self._block_copies())
            self._checked_alike = True

    def share_block_copies(self) -> None:
        """(all ranks) After a restore: blocks several ranks hold whole, from the rank that stored them."""
        self.copy_groups.share(self._block_copies())

    def _block_copies(self) -> list:
        return [(p.name, p.copies) for p in self.arrays.values() if p.copies is not None]

    @property
    def table_specs(self) -> dict[str, dict]:
        return {name: TableSpec(t.dim, str(t.dtype)).to_dict() for name, t in self.tables.items()}

    def file_buffer(self, size: int) -> np.ndarray:
        """A buffer for this rank's shard file as one contiguous run of bytes (L2 and L3 send
        it): the snapshot's own while the file fits it; a shard whose tables make it larger
        takes a second buffer, kept for the next checkpoints and grown by half when needed."""
        if self.shard_bytes is not None and self.shard_bytes.size >= size:
            return self.shard_bytes
        if self._file_buffer is None or self._file_buffer.size < size:
            self._file_buffer = direct_io.aligned_empty(max(size, size + size // 2))
        return self._file_buffer

    def on_gpu(self, name: str) -> bool:
        return not isinstance(self.arrays[name].array, np.ndarray)

    def check_still_held(self) -> None:
        """An array protected by value that nobody but the checkpointer holds any more was left
        behind by the application (its name rebound: W = W * s makes a new array), and every
        version would keep its old values: a ConfigError naming it (this rank's, as
        check_memory's). Said once in the log: what the checkpointer holds references to."""
        held = self.held_elsewhere()
        orphans = [p.name for p in self.arrays.values()
                   if p.source is None and _left_behind(p, held.get(p.name) is p.array)]
        if not self._said_held and self.log:
            self._said_held = True
            self.log.info("protect() keeps a reference to each array protected by value and saves what it holds: "
                          + ", ".join(f"{p.name!r} ({_described(p.array)})" for p in self.arrays.values()
                                      if p.source is None)
                          + "; code that rebinds a name (W = W * s) must update in place (W *= s, W[...] = ...) "
                          "or protect a getter (protect('W', lambda: W))")
        if orphans:
            raise ConfigError(f"protected array(s) {', '.join(map(repr, orphans))} are no longer held by the "
                              "application, only by the checkpointer: the name was rebound to a new array (W = W * s, "
                              "an out-of-place operator), so every version would keep the values it had then. Update "
                              "the array in place (W *= s, W[...] = new), or protect a getter that returns the current "
                              "one (ckpt.protect('W', lambda: W))", collective=False)

    def ensure_layout(self) -> Layout:
        if self.layout is None:
            self.registry.closed = True
            self._laid_out_from = self.registry.geometry
            specs = [TensorSpec.of(p.name, p.array) for p in self.arrays.values() if p.replicated and p.block is None]
            cut = plan_layout(specs, self.world_size, self.split_threshold_bytes)
            self.layout = Layout(self.world_size, cut.tensors + self._agree_on_blocks(specs))
            shapes = {tl.name: (tl.piece_shape(self.rank), tl.spec.dtype) for tl in self.layout.rank_pieces(self.rank)}
            shapes.update({p.name: (p.array.shape, p.array.dtype) for p in self.arrays.values() if p.per_rank})
            on_gpu = {name: shape for name, shape in shapes.items() if self.on_gpu(name)}
            self.buffers = self._host_buffers(shapes, on_gpu)
            if on_gpu:
                from hpcckpt.ckpt.device_snapshot import DeviceSnapshot  # CuPy only where arrays are on a GPU

                self.device_snapshot = DeviceSnapshot(on_gpu, self.gpu_snapshot, self.log)
                self.buffers.update(self.device_snapshot.host_buffers)
        return self.layout

    @property
    def snapshot_bytes(self) -> int:
        """Host memory the snapshot takes: the shard-file buffer and any pinned buffers of CuPy pieces."""
        pinned = sum(b.nbytes for b in self.device_snapshot.host_buffers.values()) if self.device_snapshot else 0
        return (self.shard_bytes.nbytes if self.shard_bytes is not None else 0) + pinned

    def _agree_on_blocks(self, specs: list[TensorSpec]) -> tuple[BlockLayout, ...]:
        """(all ranks) The block arrays' layouts from every rank's block, checked at rank 0:
        the same arrays protected everywhere (a digest of the rest), one dtype and global
        shape per array, blocks inside it that do not overlap and cover it unless allowed.
        Bad input is one error on every rank, before anything is written."""
        blocks = [(p.name, str(p.array.dtype), p.block.global_shape, p.block.offset, tuple(p.array.shape),
                   p.block.gaps) for p in self.arrays.values() if p.block is not None]
        others = sorted((p.name, "per-rank" if p.per_rank else "replicated") for p in self.arrays.values()
                        if p.block is None) + [(s.name, s.dtype, s.shape) for s in specs] + \
            [(name, "table", t.dim, str(t.dtype)) for name, t in self.tables.items()] + \
            [(name, "state", registered.per_rank) for name, registered in self.states.items()]
        digest = hashlib.blake2b(repr(others).encode(), digest_size=8).hexdigest()
        layouts, _ = decide_at_root(self.comm, "checking the protected arrays", (digest, blocks),
                                    lambda everyone: (_block_layouts(everyone), None), scatter=False)
        return layouts

    def _host_buffers(self, shapes: dict, on_gpu: dict) -> dict[str, np.ndarray]:
        """Host snapshot buffers as views into one buffer laid out as this rank's shard file
        (shardfile.payload_layout, in freeze()'s piece order): the contiguous file bytes that
        L2 and L3 send then cost only the header, not a second copy of the shard."""
        order = [tl.name for tl in self.layout.rank_pieces(self.rank)] + list(self.local_array_names)
        _, offsets, size = payload_layout([(name, shapes[name][1], shapes[name][0]) for name in order],
                                          self.shard_extra)
        on_host = {name: offset for name, offset in zip(order, offsets) if name not in on_gpu}
        # Resident already, where a new mapping faults in every page.
        inherited, self.pieces_inherited = inherited_memory.take(size, on_host)
        # Page-aligned, so O_DIRECT writes take the pieces in place.
        self.shard_bytes = inherited if inherited is not None else direct_io.aligned_empty(size, populate=True)
        return {name: np.ndarray(shapes[name][0], dtype=shapes[name][1], buffer=self.shard_bytes, offset=offset)
                for name, offset in on_host.items()}

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
        if not protected.replicated or protected.block is not None:
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

    def _table_pieces(self, full: bool) -> list:
        pieces = []
        for name, table in self.tables.items():
            ids, rows = table.take(full)
            pieces += list(zip(piece_names(name), (ids, rows)))
        return pieces

    def settle_tables(self, held: bool) -> None:
        """The version taken last is held by some level, or lost (its rows count as changed again)."""
        for table in self.tables.values():
            table.settle(held)

    def restored_snapshot(self, step: int, ordinal: int, state: dict, metrics: dict, levels: tuple) -> Snapshot:
        """A version just loaded, as a snapshot to write to `levels` again: a restore leaves
        this rank's pieces in the buffers, and the state is the version's own (this rank's
        per-rank state as it was just set); its tables go whole, as a version of its own chain."""
        per_rank = self.registry.per_rank_states
        shared, _ = split_state(state, per_rank)
        own = {name: pytree.encode(self.states[name].get(), repr(name)) for name in sorted(per_rank)}
        pieces = self._pieces() + self._table_pieces(full=True) + self._rank_state_pieces(own)
        return Snapshot(step, ordinal, tuple(pieces), shared, copy.deepcopy(metrics), False, tuple(levels),
                        self.table_specs, (step,) if self.tables else ())

    def freeze(self, step: int, ordinal: int, metrics: dict, final: bool, levels: tuple,
               engine_state: dict | None = None, table_chain: tuple = ()) -> Snapshot:
        """The snapshot of `step`; `table_chain` (save/table_chain.py) says whether the tables
        go whole (a chain of this step alone) or as the rows changed since the version before.
        The registered state every rank holds alike goes in the commit record, the per-rank
        state in this rank's shard (format/rank_state.py)."""
        per_rank = self.registry.per_rank_states
        state = frozen_state(self.states, {"ordinal": ordinal, **(engine_state or {})})
        shared, own = split_state(state, per_rank)
        # The tables' rows last: a state that fails to encode leaves their changed rows as they were.
        pieces = self._pieces() + self._table_pieces(full=len(table_chain) <= 1) + self._rank_state_pieces(own)
        return Snapshot(step, ordinal, tuple(pieces), shared, copy.deepcopy(metrics), final, tuple(levels),
                        self.table_specs, tuple(table_chain) if self.tables else ())

    def _rank_state_pieces(self, own: dict) -> list:
        return [(RANK_STATE_PIECE, rank_state_piece(own))] if self.registry.per_rank_states else []

    def replicated_state_digests(self) -> list[tuple[str, int]]:
        """(name, xxh3_64 of its encoding) of each registered state that is not per rank."""
        return [(name, xxhash.xxh3_64_intdigest(json.dumps(pytree.encode(registered.get(), repr(name)),
                                                           sort_keys=True).encode()))
                for name, registered in self.states.items() if not registered.per_rank]


def _left_behind(protected, held_in_memory: bool) -> bool:
    """Nothing but the checkpointer refers to the application's object an array protected by
    value was made from (an array that owns its memory, or a framework's tensor): the
    application dropped it. Views of something else are not judged. (No local name may refer
    to the object here: it would count; getrefcount's argument is one more.)"""
    witness = protected.witness
    if witness is not None and witness.owner is not None:
        return witness.dropped or sys.getrefcount(witness.owner()) - 1 <= protected.held_refs
    if getattr(protected.array, "base", None) is not None or protected.copies is not None:
        return False
    return sys.getrefcount(protected.array) - 1 <= protected.held_refs + held_in_memory


def _offset_in(view: np.ndarray, buffer: np.ndarray) -> int:
    return view.__array_interface__["data"][0] - buffer.__array_interface__["data"][0]


def _described(array) -> str:
    return f"{type(array).__module__.split('.')[0]}.{type(array).__name__} {array.dtype}{list(array.shape)}"


def frozen_state(states: dict, engine_state: dict) -> dict:
    """The registered state (name -> (get, set)) as it is now, with the engine's under
    ENGINE_STATE_KEY: encoded (format/pytree.py: nested containers, scalars, small arrays,
    types kept) and through JSON once, so that nothing get() returned is shared with it."""
    state = {name: pytree.encode(registered.get(), repr(name)) for name, registered in states.items()}
    per_rank = sorted(name for name, registered in states.items() if registered.per_rank)
    state[ENGINE_STATE_KEY] = {**engine_state, **({PER_RANK_NAMES_KEY: per_rank} if per_rank else {})}
    return json.loads(json.dumps(state))


def _block_layouts(everyone: list) -> tuple[BlockLayout, ...]:
    """(rank 0) Every block array's layout from each rank's (digest, blocks); raises naming
    what does not fit."""
    by_digest = defaultdict(list)
    for rank, (digest, _) in enumerate(everyone):
        by_digest[digest].append(rank)
    problems = []
    if len(by_digest) > 1:
        groups = sorted(by_digest.values(), key=len, reverse=True)
        problems.append("the ranks protected different arrays or registered different state (names, kinds, dtypes, "
                        "shapes, per_rank): ranks "
                        + " vs ranks ".join(_ranks(g) for g in groups))
    names = [tuple(b[0] for b in blocks) for _, blocks in everyone]
    if len(set(names)) > 1:
        problems.append(f"the ranks protected different block arrays: rank 0 {list(names[0])}, "
                        + ", ".join(f"rank {r} {list(n)}" for r, n in enumerate(names) if n != names[0]))
    if problems:
        raise ConfigError("; ".join(problems) + "; every rank protects the same arrays under the same names (a "
                          "replicated array with the same shape everywhere; a rank's part of a larger array as a "
                          "block: global_shape and offset)")
    layouts = []
    for index, name in enumerate(names[0]):
        each = [blocks[index] for _, blocks in everyone]
        for label, position in (("dtype", 1), ("global_shape", 2), ("allow_gaps", 5)):
            values = {b[position] for b in each}
            if len(values) > 1:
                problems.append(f"array {name!r}: the ranks give different values of {label}: "
                                + ", ".join(f"{v} (ranks {_ranks([r for r, b in enumerate(each) if b[position] == v])})"
                                            for v in sorted(values, key=str)))
        if problems:
            continue
        _, dtype, global_shape, _, _, gaps = each[0]
        bad_rank = next((r for r, b in enumerate(each) if not len(b[2]) == len(b[3]) == len(b[4])), None)
        if bad_rank is not None:
            _, _, _, offset, shape, _ = each[bad_rank]
            problems.append(f"array {name!r}: rank {bad_rank}'s block of shape {shape} at offset {offset} does not "
                            f"have the {len(global_shape)} dimensions of the global shape {global_shape}")
            continue
        try:
            spec = TensorSpec(name, dtype, global_shape)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        boxes = [tuple((o, o + d) for o, d in zip(offset, shape)) for _, _, _, offset, shape, _ in each]
        found = block_problems(spec, boxes, gaps)
        if found:
            problems += found
        else:
            layouts.append(BlockLayout(spec, boxes, gaps))
    if problems:
        raise ConfigError("the protected block arrays do not fit together: " + "; ".join(problems))
    return tuple(layouts)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
