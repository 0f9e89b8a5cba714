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

import numpy as np


def map_readonly(path: str | os.PathLike) -> np.ndarray:
    """The bytes of the file at `path` as a read-only uint8 array backed by the page cache
    (an empty file: an empty array; mmap refuses a length of 0)."""
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=np.uint8)
    # A plain array over the mapping (which it keeps alive): its slices, one per chunk in
    # flight, are plain views too, not memmap objects each carrying the file's details.
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)


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
