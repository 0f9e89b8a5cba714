"""Writing checkpoint files with O_DIRECT: the bytes go from our buffers to the device.

A buffered write of checkpoint data costs the CPU far more than the copy suggests: the kernel
allocates a page-cache page per 4 KiB, ext4 books each one for delayed allocation, and the
fsync then walks them all into block requests: tens of times the CPU of an O_DIRECT write,
which is also durable sooner (perf/bench_write.py; the numbers are in perf/log/2026-11-23.md).
Those cycles come out of training, which shares the cores with the persist. The page cache
would rarely serve these bytes again: L2-L4 take the snapshot's bytes from memory, and a
restart mostly follows a crash. (Draining L1 to L4 and verifying files do read them back, now
from the disk.)

O_DIRECT wants the memory address, the file offset and the length of every write aligned to
the device's block. Aligned parts of the caller's buffers (the snapshot buffer is allocated
page-aligned and laid out as the file, see shardfile.payload_layout) go to the kernel as
they are; everything else is gathered into a page-aligned bounce buffer per thread. The last
block is padded and the file truncated to its real size.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

ALIGNMENT = 4096  # covers 512-byte and 4 KiB logical blocks
MIN_DIRECT_BYTES = 1 << 20  # smaller files (manifests, ledgers) gain nothing from it
BOUNCE_BYTES = 8 << 20
_MAX_BYTES_PER_CALL = 1 << 30
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS): buffered writes

_per_thread = threading.local()


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages are faulted in as written
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (mmap has no name for it before Python 3.13)
_populate_write_works = [True]  # until a kernel without it says EINVAL once


def aligned_empty(nbytes: int, populate: bool = False) -> np.ndarray:
    """A uint8 array whose first byte sits on an ALIGNMENT boundary. `populate`: a large one
    has its pages mapped now, in one call, for memory that is written whole right after (a
    snapshot buffer): about half the cost of faulting them in page by page on first write.

    Large ones are private anonymous mappings of their own, returned to the system when the
    array goes (private: mmap's default for anonymous memory, shared, is backed by shmem,
    whose pages cost more to fault in and to populate). From malloc they could land inside a
    thread's heap (glibc raises its mmap threshold after the first large free), and a
    long-lived buffer such as the bounce buffer then kept the freed receive buffers of every
    later checkpoint resident: RSS rose by ~27 MiB per rank over the first checkpoints
    (perf/log/2026-11-23.md).

    They ask for transparent huge pages (the kernel's default policy, `madvise`, gives them
    only to memory that asks): these buffers are written whole, so a 2 MiB page wastes
    nothing, and mapping one costs what mapping a 4 KiB page does, so a buffer is populated
    several times faster (a spare readying its snapshot buffer while the survivors wait on
    it), and copies through it miss the TLB less. The advice is only advice: where the
    kernel has no huge pages the buffer is the same, in small pages.
    """
    nbytes = int(nbytes)
    if nbytes >= MIN_DIRECT_BYTES:
        return np.frombuffer(_private_mapping(nbytes, populate), dtype=np.uint8)  # page-aligned, zero-filled
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes]


def _private_mapping(nbytes: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if _MADV_HUGEPAGE is None:
        return mmap.mmap(-1, nbytes, flags=flags | (_MAP_POPULATE if populate else 0))
    mapping = mmap.mmap(-1, nbytes, flags=flags)
    try:
        mapping.madvise(_MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: small pages it is
        pass
    if populate and _populate_write_works[0]:
        try:
            mapping.madvise(_MADV_POPULATE_WRITE)  # after the advice, so that it maps huge pages
            return mapping
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                # Best effort, as MAP_POPULATE is: the pages left are faulted in as written.
                return mapping
            _populate_write_works[0] = False
    if populate:  # no MADV_POPULATE_WRITE: populated at mapping time, as before the advice
        mapping.close()
        return mmap.mmap(-1, nbytes, flags=flags | _MAP_POPULATE)
    return mapping


def aligned_zeros(nbytes: int) -> np.ndarray:
    buffer = aligned_empty(nbytes)
    buffer.fill(0)
    return buffer


class ReusedBuffers:
    """Aligned buffers kept from one checkpoint to the next, by role (e.g. the replica from
    rank 3). A fresh mapping costs a page fault per 4 KiB on first touch: receiving 25 MB
    into one took 26-32 ms of CPU against 5-6 ms into a reused one (4 ranks, this VM), on
    every checkpoint. Memory stays flat: one buffer per role, grown only when a role needs
    more. Not thread-safe: one level's transfers run on one thread at a time."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, role, nbytes: int) -> np.ndarray:
        nbytes = int(nbytes)
        buffer = self._buffers.get(role)
        if buffer is None or buffer.size < nbytes:
            buffer = self._buffers[role] = aligned_empty(nbytes)
        return buffer[:nbytes]


def bounce_buffer() -> np.ndarray:
    """The calling thread's aligned bounce buffer (BOUNCE_BYTES)."""
    return _bounce()


def _bounce() -> np.ndarray:
    bounce = getattr(_per_thread, "bounce", None)
    if bounce is None:
        bounce = _per_thread.bounce = aligned_empty(BOUNCE_BYTES)
        bounce.fill(0)  # resident from the first write on, so RSS stays flat afterwards
    return bounce


def reserve_bounce() -> None:
    """Give the calling thread its bounce buffer now, at thread start, so the process's
    memory is at its steady size from the first checkpoint on, not after the first write."""
    _bounce()


def wants_direct(buffers: Sequence, enabled: bool) -> bool:
    return bool(enabled and O_DIRECT and sum(memoryview(b).nbytes for b in buffers) >= MIN_DIRECT_BYTES)


def open_for_writing(path: str, flags: int, mode: int, direct: bool) -> tuple[int, bool]:
    """(fd, whether it is O_DIRECT): file systems that refuse O_DIRECT get a buffered fd."""
    if direct:
        try:
            return os.open(path, flags | O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def write_direct(fd: int, buffers: Sequence) -> int:
    """Write the buffers, concatenated, from offset 0 of an O_DIRECT `fd`. Returns the size."""
    bounce = _bounce()
    fill = 0  # bytes waiting in the bounce buffer; what is already in the file is aligned
    total = 0
    for buffer in buffers:
        view = np.frombuffer(buffer, dtype=np.uint8)
        position, size = 0, view.size
        while position < size:
            aligned_here = size - position >= ALIGNMENT and (view.ctypes.data + position) % ALIGNMENT == 0
            if aligned_here and fill % ALIGNMENT == 0:
                if fill:
                    _write_all(fd, bounce[:fill])
                    fill = 0
                count = min((size - position) // ALIGNMENT * ALIGNMENT, _MAX_BYTES_PER_CALL)
                _write_all(fd, view[position:position + count])
                position += count
                continue
            take = min(bounce.size - fill, size - position)
            bounce[fill:fill + take] = view[position:position + take]
            fill += take
            position += take
            if fill == bounce.size:
                _write_all(fd, bounce)
                fill = 0
        total += size
    if fill:
        padded = -(-fill // ALIGNMENT) * ALIGNMENT
        bounce[fill:padded] = 0
        _write_all(fd, bounce[:padded])
        os.ftruncate(fd, total)
    return total


def _write_all(fd: int, view: np.ndarray) -> None:
    done = 0
    while done < view.size:
        # After a short write (a disk filling up) the next call reports the real errno, or
        # EINVAL if the rest is no longer aligned, which sends the file to a buffered rewrite.
        written = os.write(fd, view[done:])
        if written <= 0:
            raise OSError(errno.EIO, f"direct write wrote nothing ({view.size - done} bytes left)")
        done += written


def drop_direct(fd: int) -> None:
    """Turn an O_DIRECT fd back into a buffered one, rewound and emptied."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
