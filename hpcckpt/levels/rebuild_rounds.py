"""Erasure-coded blocks rebuilt in rounds of chunks: a restore's memory bounded as a checkpoint's.

A rebuild makes the blocks a decoder wants of some stripes from k surviving blocks of each.
Whole, the decoder would hold k segments of every stripe (the group's shards over again)
and the rebuilt shard; in rounds, one round per chunk of each stripe's segment, it holds k
chunks, twice (the next round travels while this one is decoded), and hands each rebuilt
chunk to its target (a file written at offsets) at once. Providers read their chunks where
they lie (views of mapped files).

Point to point only: a rank with no part in a rebuild does not call it. Provider and decoder
walk the same rounds in the same order (stripes as the targets list them, chunks in order
within each): MPI keeps one sender's messages of one tag in order, so one tag serves all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hpcckpt.cluster.collectives import wait_all
from hpcckpt.cluster.mpi_gate import gated_call
from hpcckpt.io.direct_io import ReusedBuffers


@dataclass(frozen=True)
class SurvivingBlock:
    """One of the k surviving blocks a stripe is rebuilt from. `read(start, length)`, on the
    provider only: the block's bytes [start, start + length), zero-padded past the end of
    the shard it is cut from."""

    stripe: int
    block: int
    provider: int
    read: Callable[[int, int], np.ndarray] | None = None


@dataclass(frozen=True)
class WantedBlock:
    """A block the decoder rebuilds; `write(chunk, start)`, on the decoder only, takes its
    bytes [start, start + len(chunk))."""

    stripe: int
    block: int
    write: Callable[[np.ndarray, int], None] | None = None


def rebuild_in_rounds(comm, code, decoder: int, segment: int, chunk: int, sources: list[SurvivingBlock],
                      targets: list[WantedBlock], buffers: ReusedBuffers, tag: int) -> BaseException | None:
    """(the providers and the decoder of one rebuild) Every target's bytes, chunk by chunk.
    A failure (a provider's read, the decoder's decode or write) is kept and returned once
    every round has travelled, so no rank waits on one that stopped; a provider whose read
    failed sends zeros, which the checksum of what is rebuilt then refuses."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    if rank != decoder and not any(source.provider == rank for source in sources):
        return None
    stripes = list(dict.fromkeys(target.stripe for target in targets))
    sources_of = {t: [source for source in sources if source.stripe == t] for t in stripes}
    targets_of = {t: [target for target in targets if target.stripe == t] for t in stripes}
    chunk = max(1, min(int(chunk), segment))
    rounds = [(t, start, min(chunk, segment - start)) for t in stripes for start in range(0, segment, chunk)]
    failure = None

    def post(index: int):
        nonlocal failure
        stripe, start, length = rounds[index]
        requests, available = [], {}
        for j, source in enumerate(sources_of[stripe]):
            if source.provider == rank:
                try:
                    data = np.ascontiguousarray(source.read(start, length))
                except Exception as exc:  # noqa: BLE001 (kept: the decoder waits for these bytes)
                    failure = failure or exc
                    data = np.zeros(length, dtype=np.uint8)
                if rank == decoder:
                    available[source.block] = data
                else:
                    requests.append((gated_call(comm.Isend, [data, MPI.BYTE], dest=decoder, tag=tag), data))
            elif rank == decoder:
                buffer = buffers.get(("rebuild", index % 2, j), length)
                requests.append((gated_call(comm.Irecv, [buffer, MPI.BYTE], source=source.provider, tag=tag), buffer))
                available[source.block] = buffer
        return requests, available

    pending = post(0) if rounds else None
    for index, (stripe, start, _) in enumerate(rounds):
        requests, available = pending
        # The next round's buffers are the slot of the round before this one, decoded already.
        pending = post(index + 1) if index + 1 < len(rounds) else None
        wait_all([request for request, _ in requests])
        if rank != decoder or failure is not None:
            continue
        try:
            rebuilt = code.rebuild(available, [target.block for target in targets_of[stripe]])
            for target in targets_of[stripe]:
                target.write(rebuilt[target.block], start)
        except Exception as exc:  # noqa: BLE001 (kept: the providers' rounds go on)
            failure = exc
    return failure


def padded_chunk(data: np.ndarray, position: int, length: int, tail: np.ndarray | None = None,
                 zeros: np.ndarray | None = None) -> np.ndarray:
    """Bytes [position, position + length) of `data`, zero-padded past its end: a view where
    the range lies inside (no copy); where the end cuts it, a copy in `tail` (a reused
    buffer of at least `length`) or a new array; wholly past the end, `zeros[:length]` or a
    new array of zeros."""
    if position + length <= data.size:
        return data[position:position + length]
    if position >= data.size:
        return zeros[:length] if zeros is not None and zeros.size >= length else np.zeros(length, dtype=np.uint8)
    piece = tail[:length] if tail is not None else np.empty(length, dtype=np.uint8)
    cut = data[position:]
    piece[:cut.size] = cut
    piece[cut.size:] = 0
    return piece


def segment_reader(data: np.ndarray, offset: int):
    """A SurvivingBlock's read for a data segment that starts at `offset` of a shard."""
    return lambda start, length: padded_chunk(data, offset + start, length)


def segment_writer(file, offset: int, size: int):
    """A WantedBlock's write for a data segment that starts at `offset` of a shard of `size`
    bytes, into `file` (anything with pwrite(data, offset); None: not wanted): the padding
    past the shard's end is dropped."""
    def write(chunk: np.ndarray, start: int) -> None:
        keep = min(chunk.size, size - offset - start)
        if file is not None and keep > 0:
            file.pwrite(chunk[:keep], offset + start)
    return write
