"""Files read as mapped memory rather than into buffers, so a restore's memory stays bounded.

A restore reads shard files it only passes on: a replica sent back to its rank, a survivor's
segments and parity pieces sent to a rebuild, an old shard whose byte ranges go to the new
ranks. Read into a buffer, each would cost anonymous memory the size of a shard beside the
snapshot's; mapped, its pages come from the page cache as MPI or the checksum touches them
and the kernel may drop them again, so the rank's own memory stays the snapshot plus its
chunk buffers whatever the files' sizes.
"""

from __future__ import annotations

import os
import tempfile
import threading

import numpy as np


def map_readonly(path: str | os.PathLike, whole: bool = False) -> np.ndarray:
    """The bytes of the file at `path` as a read-only uint8 array backed by the page cache
    (an empty file: an empty array; mmap refuses a length of 0). `whole`: every byte is read
    soon after (a shard verified whole), so what is not in the page cache yet is read in now,
    in large sequential reads (read_into_page_cache)."""
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=np.uint8)
    if whole:
        read_into_page_cache(path)
    # A plain array over the mapping (which it keeps alive): its slices, one per chunk in
    # flight, are plain views too, not memmap objects each carrying the file's details.
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)


def read_into_page_cache(path: str | os.PathLike) -> None:
    """The file's pages into the page cache, sent to /dev/null by the kernel (no copy to this
    process). A mapping first touched page by page reads a file written past the page cache
    (O_DIRECT) in small reads, one fault at a time: about twice the time for a shard. Advice
    only: where the kernel refuses it (no sendfile from this file system), the mapping reads
    the pages itself, and a file that cannot be read fails there, with its own error."""
    try:
        # Non-blocking: a special file (a FIFO) must not hold the restore up here.
        source = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return
    try:
        with open(os.devnull, "wb") as sink:
            size, done = os.fstat(source).st_size, 0
            while done < size:
                sent = os.sendfile(sink.fileno(), source, done, size - done)
                if sent <= 0:
                    return
                done += sent
    except OSError:
        return
    finally:
        os.close(source)


def read_into_page_cache_behind(paths) -> threading.Thread:
    """read_into_page_cache for each of `paths`, one after the other, on a thread of its own
    (a daemon: advice never holds a process up at its end), while the caller goes on."""
    def read_all() -> None:
        for path in paths:
            read_into_page_cache(path)
    reader = threading.Thread(target=read_all, name="hpcckpt-read-ahead", daemon=True)
    reader.start()
    return reader


class ScratchFile:
    """Bytes computed in chunks that are needed again whole afterwards (an old shard rebuilt
    from parity during a re-partitioning restore), kept in an unnamed file in `directory`:
    written at offsets, then mapped (no `directory`: the system's temporary directory).
    The file has no name (O_TMPFILE where the filesystem
    has it, else deleted at once), so a crash leaves nothing behind to clean up."""

    def __init__(self, directory: str | os.PathLike | None, size: int):
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.size = int(size)
        self._file = tempfile.TemporaryFile(dir=directory)
        os.ftruncate(self._file.fileno(), self.size)

    def pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            written = os.pwrite(self._file.fileno(), view, offset)
            view, offset = view[written:], offset + written

    def mapped(self) -> np.ndarray:
        """The file's bytes, read-only and mapped; the file goes once the array does."""
        try:
            if self.size == 0:
                return np.empty(0, dtype=np.uint8)
            return np.memmap(self._file, dtype=np.uint8, mode="r", shape=(self.size,)).view(np.ndarray)
        finally:
            self.close()

    def close(self) -> None:
        self._file.close()
