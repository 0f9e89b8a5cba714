"""Publishing a file all at once: temp name, fsync, link into place, fsync the directory.

Checkpoint files are written once and never overwritten: a reader sees the
whole file under its name or no file. Pointer-like records (ledgers) may ask to replace.
"""

from __future__ import annotations

import errno
import os
from typing import Iterable, Sequence

from hpcckpt.errors import StorageError
from hpcckpt.io import direct_io

# Linux moves at most 0x7ffff000 bytes per write call and IOV_MAX buffers per writev.
_MAX_BYTES_PER_CALL = 0x7FFFF000
try:
    _IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if os.sysconf("SC_IOV_MAX") > 0 else 1024
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024


class ShardExistsError(StorageError, FileExistsError):
    """The path already exists; checkpoint files are never overwritten."""


def write_bytes_atomically(path: str | os.PathLike, data: bytes, fsync: bool = True,
                           overwrite: bool = False, direct: bool = False,
                           recycle: str | os.PathLike | None = None, mode: int = 0o666) -> None:
    """Publish `data` under `path` all at once: temp name, fsync, rename, fsync directory.

    Refuses to replace an existing file unless `overwrite` (for pointer-like records, not
    checkpoint data, which is never overwritten in place). `recycle`: a retired file to overwrite in place if it
    exists (levels/spares.py).
    """
    path = os.fspath(path)
    if not overwrite and os.path.lexists(path):
        raise exists_error(path)
    write_buffers_atomically(path, [data], fsync=fsync, overwrite=overwrite, direct=direct, recycle=recycle,
                              mode=mode)


def write_buffers_atomically(path: str, buffers: Sequence, fsync: bool, overwrite: bool,
                              direct: bool = False, recycle: str | os.PathLike | None = None,
                              mode: int = 0o666) -> None:
    temporary = path + ".tmp"
    fd = None
    published = False
    try:
        # The spare becomes the temporary file: its pages (tmpfs) or blocks (ext4) are
        # overwritten instead of allocated, and it is never visible under `path` half-written.
        recycled = _take_spare(recycle, temporary)
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | (0 if recycled else os.O_TRUNC)
        fd, is_direct = direct_io.open_for_writing(temporary, flags, mode, direct_io.wants_direct(buffers, direct))
        if is_direct:
            try:
                direct_io.write_direct(fd, buffers)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Some file systems take O_DIRECT at open and refuse it when writing (EINVAL,
                # from any write): the whole file is written again, buffered.
                direct_io.drop_direct(fd)
                _writev_all(fd, buffers)
        else:
            _writev_all(fd, buffers)
        if recycled:  # a longer spare leaves its tail behind the new bytes
            os.ftruncate(fd, sum(memoryview(b).nbytes for b in buffers))
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = None
        _publish(temporary, path, overwrite)
        published = True
        if fsync:
            _fsync_directory(os.path.dirname(os.path.abspath(path)))
    except ShardExistsError:
        raise
    except OSError as exc:
        raise _storage_error(exc, path) from exc
    finally:
        if fd is not None:
            os.close(fd)
        if not published:
            try:
                os.unlink(temporary)
            except OSError:
                pass


class AtomicFile:
    """A new file written at offsets as its bytes arrive (chunks received or computed one at a
    time) and published whole: a temporary name until publish(), which fsyncs it and links it
    into place, so it is never seen half-written and never replaces a file.

    With `direct` (the caller's promise that every write starts at an ALIGNMENT-aligned offset
    and that the bytes after a write's end, up to the next aligned offset, are padding or past
    the end), aligned buffers go to the device with O_DIRECT; the last partial block of a
    write goes through a small aligned buffer, zero-padded, and publish() cuts the file to
    `size`. Any other write goes through the page cache."""

    def __init__(self, path: str | os.PathLike, size: int, *, direct: bool = False,
                 recycle: str | os.PathLike | None = None, mode: int = 0o666):
        self.path = os.fspath(path)
        self.size = int(size)
        self.temporary = self.path + ".tmp"
        if os.path.lexists(self.path):
            raise exists_error(self.path)
        self.fd = None
        try:
            recycled = _take_spare(recycle, self.temporary)
            flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | (0 if recycled else os.O_TRUNC)
            wants = bool(direct and direct_io.O_DIRECT and self.size >= direct_io.MIN_DIRECT_BYTES)
            self.fd, self.direct = direct_io.open_for_writing(self.temporary, flags, mode, wants)
        except OSError as exc:
            self.discard()
            raise _storage_error(exc, self.path) from exc
        self._block = direct_io.aligned_empty(direct_io.ALIGNMENT) if self.direct else None

    def pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            if self.direct:
                self._pwrite_direct(view, offset)
            else:
                _pwrite_all(self.fd, view, offset)
        except OSError as exc:
            raise _storage_error(exc, self.path) from exc

    def _pwrite_direct(self, view: memoryview, offset: int) -> None:
        import numpy as np

        alignment = direct_io.ALIGNMENT
        if offset % alignment:
            raise ValueError(f"{self.path}: an O_DIRECT write at the unaligned offset {offset}")
        source = np.frombuffer(view, dtype=np.uint8)
        if len(view) and source.ctypes.data % alignment:  # through the thread's aligned bounce buffer
            bounce = direct_io.bounce_buffer()
            for start in range(0, len(view), bounce.size):
                part = source[start:start + bounce.size]
                bounce[:part.size] = part
                self._pwrite_direct(memoryview(bounce[:part.size]), offset + start)
            return
        whole = len(view) // alignment * alignment
        if whole:
            _pwrite_all(self.fd, view[:whole], offset)
        if whole < len(view):
            tail = len(view) - whole
            self._block[:tail] = np.frombuffer(view[whole:], dtype=np.uint8)
            self._block[tail:] = 0
            _pwrite_all(self.fd, memoryview(self._block), offset + whole)

    def publish(self, fsync: bool = True) -> None:
        try:
            os.ftruncate(self.fd, self.size)  # a padded last block, or a longer spare's tail
            if fsync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None
            _publish(self.temporary, self.path, overwrite=False)
            if fsync:
                _fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        except ShardExistsError:
            self.discard()
            raise
        except OSError as exc:
            self.discard()
            raise _storage_error(exc, self.path) from exc

    def discard(self) -> None:
        """Give the temporary file up (a failed transfer): nothing is published."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(self.temporary)
        except OSError:
            pass


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        written = os.pwrite(fd, view[done:done + _MAX_BYTES_PER_CALL], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing ({len(view) - done} bytes left)")
        done += written


def _take_spare(spare: str | os.PathLike | None, temporary: str) -> bool:
    """Move a retired file onto `temporary` to be overwritten; False when there is none, or
    when the file has other names (a hard-linked backup of a retired version, `cp -al`):
    overwriting it would change their bytes, so it is dropped and a new file written."""
    if spare is None:
        return False
    try:
        os.rename(spare, temporary)
        if os.stat(temporary).st_nlink == 1:
            return True
        os.unlink(temporary)
        return False
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StorageError(f"cannot reuse the spare file {os.fspath(spare)!r} for {temporary!r}: "
                           f"{exc.strerror or exc}; delete its directory or set storage.recycle_files = false") from exc


def _publish(temporary: str, path: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(temporary, path)
        return
    # link() fails if `path` exists, so a concurrent writer can never be overwritten;
    # rename() would silently replace. Some file systems lack hard links: fall back.
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise exists_error(path) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
        if os.path.lexists(path):
            raise exists_error(path) from None
        os.rename(temporary, path)
        return
    os.unlink(temporary)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network file systems refuse fsync on directories; the data is already safe.
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _storage_error(exc: OSError, path: str) -> StorageError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = f"no space left writing {path} ({exc.strerror})"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        message = f"cannot write {path}: directory not writable ({exc.strerror})"
    elif exc.errno == errno.ENOENT:
        message = f"cannot write {path}: directory {os.path.dirname(path) or '.'} does not exist"
    else:
        message = f"cannot write {path}: {exc.strerror or exc}"
    error = StorageError(message)
    error.errno = exc.errno  # kept for callers that branch on it; str() stays the message
    return error


def exists_error(path: str) -> ShardExistsError:
    error = ShardExistsError(f"{path} already exists; checkpoint files are never overwritten")
    error.errno = errno.EEXIST
    return error


def _writev_all(fd: int, buffers: Iterable) -> None:
    """Write every buffer in order, in as few writev calls as the kernel limits allow."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    index = 0
    while index < len(pending):
        batch = []
        batch_bytes = 0
        for view in pending[index:index + _IOV_MAX]:
            if batch_bytes + len(view) > _MAX_BYTES_PER_CALL:
                if not batch:  # one buffer larger than a call can take: write a slice of it
                    batch.append(view[:_MAX_BYTES_PER_CALL])
                break
            batch.append(view)
            batch_bytes += len(view)
        written = os.writev(fd, batch)
        if written == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        # Drop what was written; a partial write leaves the rest of one buffer pending.
        while written:
            if written >= len(pending[index]):
                written -= len(pending[index])
                index += 1
            else:
                pending[index] = pending[index][written:]
                written = 0
