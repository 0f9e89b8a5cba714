"""O_DIRECT writes (io/direct_io.py): the same bytes as a buffered write, whatever the
alignment of the caller's buffers, and a buffered write where O_DIRECT is refused."""

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.errors import StorageError
from hpcckpt.format.shardfile import verify_shard, write_shard
from hpcckpt.io import atomic, direct_io
from hpcckpt.io.atomic import write_bytes_atomically
from hpcckpt.io.direct_io import ALIGNMENT, MIN_DIRECT_BYTES, aligned_empty

pytestmark = pytest.mark.skipif(not direct_io.O_DIRECT, reason="this platform has no O_DIRECT")

_BOUNCE = 8 << 20


def _random(rng, nbytes):
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def _aligned_copy(data):
    out = aligned_empty(data.size)
    out[:] = data
    return out


def _cases():
    rng = np.random.default_rng(7)
    big = _aligned_copy(_random(rng, 3 * _BOUNCE + 5000))
    return {
        "one aligned buffer, a whole number of blocks": [_aligned_copy(_random(rng, 64 * ALIGNMENT))],
        "one aligned buffer with a tail": [_aligned_copy(_random(rng, 300 * ALIGNMENT + 17))],
        "unaligned start": [_random(rng, 2 * _BOUNCE + 3)[1:]],
        "header bytes, then aligned pieces": [bytes(_random(rng, 700)), bytes(ALIGNMENT - 700), big[:ALIGNMENT * 90],
                                              big[ALIGNMENT * 90 + 64:ALIGNMENT * 400], b"", big[5:ALIGNMENT * 3]],
        "larger than the bounce buffer, unaligned": [big[1:], bytes(_random(rng, 99))],
        "many small buffers": [bytes(_random(rng, n)) for n in range(1, 3000, 7)] * 3,
        "exactly the bounce buffer": [_random(rng, _BOUNCE)[3:], bytes(3)],
        "a memoryview of floats": [memoryview(rng.standard_normal(300000).astype(np.float32))],
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_direct_write_gives_the_bytes_of_a_plain_write(tmp_path, case):
    buffers = _cases()[case]
    expected = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    path = tmp_path / "out"
    fd, is_direct = direct_io.open_for_writing(str(path), os.O_WRONLY | os.O_CREAT, 0o644, True)
    try:
        if not is_direct:
            pytest.skip(f"{tmp_path} refuses O_DIRECT")
        assert direct_io.write_direct(fd, buffers) == len(expected)
    finally:
        os.close(fd)
    assert path.read_bytes() == expected


def test_aligned_empty_starts_on_a_block_boundary():
    for nbytes in (0, 1, ALIGNMENT - 1, 12345678):
        array = aligned_empty(nbytes)
        assert array.size == nbytes and array.dtype == np.uint8
        assert nbytes == 0 or array.ctypes.data % ALIGNMENT == 0


def test_large_aligned_buffers_are_their_own_mappings():
    # Not from malloc's heap, where a long-lived buffer would keep freed ones resident.
    import mmap

    array = aligned_empty(MIN_DIRECT_BYTES)
    base = array.base.obj if isinstance(array.base, memoryview) else array.base
    assert isinstance(base, mmap.mmap) and array.flags.writeable
    array[:] = 5
    assert int(array.sum()) == 5 * MIN_DIRECT_BYTES


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="no /proc (not Linux)")
@pytest.mark.parametrize("kernel", ["populate-write", "no-populate-write", "remembered"])
def test_a_populated_buffer_is_resident_and_zero_before_its_first_write(monkeypatch, kernel):
    """populate=True maps every page at once, by MADV_POPULATE_WRITE after the huge-page
    advice, or by MAP_POPULATE where the kernel refuses that advice (EINVAL, remembered)."""
    from hpcckpt.io import direct_io

    monkeypatch.setattr(direct_io, "_populate_write_works", [kernel != "remembered"])
    if kernel == "no-populate-write":
        monkeypatch.setattr(direct_io, "_MADV_POPULATE_WRITE", 1 << 20)  # no such advice: EINVAL
    nbytes = 24 << 20
    before = _resident_bytes()
    array = aligned_empty(nbytes, populate=True)
    assert _resident_bytes() - before >= nbytes * 0.9
    assert array.ctypes.data % ALIGNMENT == 0 and array.size == nbytes and array.flags.writeable
    assert not array.any()
    assert direct_io._populate_write_works[0] == (kernel == "populate-write")
    lazy_before = _resident_bytes()
    lazy = aligned_empty(nbytes)  # not populated: its pages come as they are written
    assert _resident_bytes() - lazy_before < nbytes / 2
    lazy[:] = 7
    assert int(lazy[::4096].sum()) == 7 * (nbytes // 4096)


def test_reused_buffers_keep_one_aligned_buffer_per_role():
    buffers = direct_io.ReusedBuffers()
    first = buffers.get("replica", 3 << 20)
    assert first.size == 3 << 20 and first.ctypes.data % ALIGNMENT == 0
    first[:4] = 7
    smaller = buffers.get("replica", 1 << 20)
    assert smaller.ctypes.data == first.ctypes.data and smaller.size == 1 << 20  # same memory, no new pages
    other = buffers.get("parity", 1 << 20)
    assert not np.shares_memory(other, first)
    grown = buffers.get("replica", 5 << 20)
    assert grown.size == 5 << 20 and grown.ctypes.data % ALIGNMENT == 0
    assert buffers.get("replica", 4 << 20).ctypes.data == grown.ctypes.data


def test_shard_written_directly_is_the_file_of_a_buffered_write(tmp_path):
    rng = np.random.default_rng(3)
    host = aligned_empty(6 << 20)
    host[:] = _random(rng, host.size)
    pieces = [("weights", host[ALIGNMENT:ALIGNMENT + (4 << 20)].view(np.float32)),
              ("bias", rng.standard_normal(333).astype(np.float32)),
              ("odd", host[1:(1 << 20) + 3])]
    write_shard(tmp_path / "buffered", 5, 0, 1, pieces, direct=False)
    info = write_shard(tmp_path / "direct", 5, 0, 1, pieces, direct=True)
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "buffered").read_bytes()
    assert info.size == os.path.getsize(tmp_path / "direct")
    assert verify_shard(tmp_path / "direct") == []
    assert not (tmp_path / "direct.tmp").exists()


def _record_open_flags(monkeypatch):
    flags_seen = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        if str(path).endswith(".tmp"):  # the data files, not the directory fsyncs
            flags_seen.append((os.path.basename(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(direct_io.os, "open", recording_open)
    return flags_seen


def test_only_files_of_a_mebibyte_or_more_are_written_directly(tmp_path, monkeypatch):
    flags_seen = _record_open_flags(monkeypatch)
    write_bytes_atomically(tmp_path / "small", bytes(MIN_DIRECT_BYTES - 1), direct=True)
    write_bytes_atomically(tmp_path / "large", bytes(MIN_DIRECT_BYTES), direct=True)
    write_bytes_atomically(tmp_path / "large-off", bytes(MIN_DIRECT_BYTES), direct=False)
    direct = {name: bool(flags & direct_io.O_DIRECT) for name, flags in flags_seen}
    assert direct == {"small.tmp": False, "large.tmp": True, "large-off.tmp": False}
    assert (tmp_path / "large").read_bytes() == bytes(MIN_DIRECT_BYTES)


def test_file_system_refusing_o_direct_at_open_gets_a_buffered_write(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    data = _random(np.random.default_rng(1), 3 << 20)
    write_bytes_atomically(tmp_path / "f", memoryview(data), direct=True)
    assert (tmp_path / "f").read_bytes() == data.tobytes()


def test_file_system_refusing_o_direct_at_the_first_write_gets_a_buffered_write(tmp_path, monkeypatch):
    real_write_direct = direct_io.write_direct

    def refusing_after_a_block(fd, buffers):
        os.write(fd, aligned_empty(ALIGNMENT))  # something landed before the refusal
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(atomic.direct_io, "write_direct", refusing_after_a_block)
    data = _random(np.random.default_rng(2), (2 << 20) + 11)
    write_bytes_atomically(tmp_path / "f", memoryview(data), direct=True)
    assert (tmp_path / "f").read_bytes() == data.tobytes()
    assert real_write_direct is not refusing_after_a_block


def test_other_write_errors_are_not_hidden_by_the_fallback(tmp_path, monkeypatch):
    def full_disk(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.direct_io, "write_direct", full_disk)
    with pytest.raises(StorageError, match="no space left"):
        write_bytes_atomically(tmp_path / "f", bytes(2 << 20), direct=True)
    assert not (tmp_path / "f").exists() and not (tmp_path / "f.tmp").exists()


def test_o_direct_refused_partway_through_a_file_gives_a_whole_buffered_file(tmp_path, monkeypatch):
    real_write = os.write
    calls = []

    def refusing_third_write(fd, data):
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", refusing_third_write)
    rng = np.random.default_rng(5)
    # Two blocks of header from the bounce buffer, an aligned piece in place, then the bounce
    # buffer with the rest is refused: the file is written again, buffered (writev).
    buffers = [bytes(_random(rng, 2 * ALIGNMENT)), _aligned_copy(_random(rng, 3 << 20)), bytes(_random(rng, 77)),
               _aligned_copy(_random(rng, 2 << 20))]
    write_bytes_atomically_of(tmp_path / "f", buffers)
    assert len(calls) == 3
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(memoryview(b).cast("B")) for b in buffers)


def test_short_direct_write_then_a_full_disk_reports_the_full_disk(tmp_path, monkeypatch):
    real_write = os.write
    state = {"short": False}

    def disk_filling_up(fd, data):
        if not state["short"]:
            state["short"] = True
            return real_write(fd, memoryview(data)[:ALIGNMENT])  # room for one block only
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "write", disk_filling_up)
    with pytest.raises(StorageError, match="no space left"):
        write_bytes_atomically(tmp_path / "f", memoryview(_aligned_copy(np.zeros(2 << 20, np.uint8))), direct=True)
    assert not (tmp_path / "f").exists() and not (tmp_path / "f.tmp").exists()


def write_bytes_atomically_of(path, buffers):
    atomic.write_buffers_atomically(str(path), buffers, fsync=True, overwrite=False, direct=True)
