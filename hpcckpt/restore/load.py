"""The restore flow's last stage, load: a version's pieces, read and verified into this
rank's snapshot buffers, become the protected arrays (all ranks, collectively).

Replicated tensors are gathered from every rank's piece: received in place where the pieces
in rank order are the array's bytes, else a slab of about checkpoint.chunk_mib at a time
written in place (a restore holds no second copy of a large tensor); a block array's
block and a per-rank array are this rank's piece as it is. Targets may be NumPy or CuPy,
contiguous or views.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hpcckpt.cluster.backend import array_module
from hpcckpt.cluster.collectives import wait_all
from hpcckpt.format.layout import BlockLayout, Layout, copy_strided, extract_piece
from hpcckpt.format.rank_state import RANK_STATE_PIECE, read_rank_state_piece


def load(ctx, manifest, pieces: dict[str, np.ndarray], rank_states: dict | None = None) -> None:
    """(all ranks) Every replicated tensor everywhere, each rank's blocks on it, and the
    per-rank arrays, written in place; then the engine sets the registered state
    (ctx.targets.apply_state): the version's shared state, and the per-rank states of the old
    ranks handed to this rank (`rank_states`, {old rank: states}; by default this rank's own,
    from its shard's piece; None where the version has none)."""
    assemble(ctx, ctx.job.layout, pieces)
    for name in ctx.job.local_array_names:
        write_in_place(ctx.targets.arrays[name], pieces[name])
    if rank_states is None and RANK_STATE_PIECE in pieces:
        rank_states = {ctx.job.rank: read_rank_state_piece(pieces[RANK_STATE_PIECE])}
    if ctx.targets.apply_state is not None:
        ctx.targets.apply_state(manifest.state, rank_states, manifest.world_size)


def assemble(ctx, layout: Layout, pieces: dict[str, np.ndarray]) -> None:
    """(all ranks) Every replicated tensor of `layout` from every rank's pieces, and this
    rank's block of every block array, written in place."""
    from mpi4py import MPI

    for tl in layout.tensors:
        if isinstance(tl, BlockLayout):
            if tl.holds(ctx.job.rank):
                write_in_place(ctx.targets.arrays[tl.name], pieces[tl.name])
            continue
        target = ctx.targets.arrays[tl.name]
        mine = pieces.get(tl.name)
        send = mine.reshape(-1).view(np.uint8) if mine is not None and mine.size else np.empty(0, np.uint8)
        shape = tl.logical_shape
        if not math.prod(shape):
            continue
        if math.prod(shape[:tl.axis]) == 1 and isinstance(target, np.ndarray) and target.flags.c_contiguous:
            # Pieces hold their rows along the cut axis one after the other: where no axis
            # before it is longer than 1, the pieces in rank order ARE the array's bytes,
            # received in place.
            counts = [tl.piece_nbytes(r) for r in range(ctx.job.world_size)]
            displacements = [0, *itertools.accumulate(counts)][:-1]
            wait_all([ctx.job.comm.Iallgatherv(send, [target.reshape(-1).view(np.uint8), counts, displacements,
                                                   MPI.BYTE])])
        else:
            _gather_in_slabs(ctx, tl, target if target.ndim == len(shape) else target.reshape(shape), send)


def _gather_in_slabs(ctx, tl, target, send: np.ndarray) -> None:
    """(all ranks) One replicated tensor gathered into `target` (in place, any strides,
    NumPy or CuPy) a slab at a time, each about ctx.chunk_bytes (one row of every piece at
    least), so a restore holds no second copy of a large tensor. A piece holds its
    rows along the cut axis one after the other (the axis moved to the front), so a slab is
    the same rows of every piece, one byte range of each."""
    from mpi4py import MPI

    shape, axis, row = tl.logical_shape, tl.axis, tl.row_bytes
    bounds = [tl.bounds_of(rank) for rank in range(ctx.job.world_size)]
    slab = max(1, ctx.chunk_bytes // max(1, row * ctx.job.world_size))
    buffer = np.empty(0, np.uint8)
    for first in range(0, max(stop - start for start, stop in bounds), slab):
        spans = [(start + min(first, stop - start), start + min(first + slab, stop - start)) for start, stop in bounds]
        counts = [(high - low) * row for low, high in spans]
        displacements = [0, *itertools.accumulate(counts)][:-1]
        total = sum(counts)
        if buffer.size < total:
            buffer = np.empty(total, np.uint8)
        offset = (spans[ctx.job.rank][0] - bounds[ctx.job.rank][0]) * row
        mine = send[offset:offset + counts[ctx.job.rank]]
        wait_all([ctx.job.comm.Iallgatherv(mine, [buffer[:total], counts, displacements, MPI.BYTE])])
        for rank, (low, high) in enumerate(spans):
            if not counts[rank]:
                continue
            rows = buffer[displacements[rank]:displacements[rank] + counts[rank]].view(tl.spec.dtype)
            part = np.moveaxis(rows.reshape((high - low,) + shape[:axis] + shape[axis + 1:]), 0, axis)
            write_in_place(target[(slice(None),) * axis + (slice(low, high),)], part)


def write_in_place(target, host: np.ndarray) -> None:
    if isinstance(target, np.ndarray):
        copy_strided(target, host.reshape(target.shape))
    elif target.flags.c_contiguous:
        target.set(np.ascontiguousarray(host.reshape(target.shape)))
    else:  # a view, e.g. a block's interior without its halo: CuPy's set() takes contiguous targets only
        target[...] = array_module(target).asarray(host.reshape(target.shape))


def keep_what_gaps_leave(ctx, old: Layout, new: Layout) -> bool:
    """Where the old blocks of an array left gaps (allowed when they were protected), the
    restored array keeps what the protected array holds there: its current values go into
    this rank's new piece first, and the old blocks are placed over them. Whether any went."""
    wrote = False
    for tl in new.rank_pieces(ctx.job.rank):
        before = old.get(tl.name)
        if not (isinstance(before, BlockLayout) and before.gaps):
            continue
        target = ctx.targets.arrays[tl.name]
        host = target if isinstance(target, np.ndarray) else target.get()
        current = host if isinstance(tl, BlockLayout) else extract_piece(host, tl, ctx.job.rank)
        np.copyto(ctx.targets.buffers[tl.name], current.reshape(ctx.targets.buffers[tl.name].shape))
        wrote = True
    return wrote
