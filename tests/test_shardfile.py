"""Shard file format: round trips, checksums, header/table repair, atomic never-overwrite."""

import io
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import reedsolo

from hpcckpt.codec.header_ecc import rs_encode
from hpcckpt.errors import ChecksumError, FormatError, StorageError
from hpcckpt.format import shardfile
from hpcckpt.format.layout import TensorSpec, extract_piece, plan_layout
from hpcckpt.format.shardfile import (
    HEADER_CODEWORD_BYTES,
    PAYLOAD_ALIGNMENT,
    read_shard_table,
    read_tensor,
    verify_shard,
    write_shard,
)
from hpcckpt.io import atomic
from hpcckpt.io.atomic import ShardExistsError, write_bytes_atomically
from hpcckpt.io.direct_io import O_DIRECT


def _pieces(rng):
    return [
        ("f32", rng.standard_normal((33, 7)).astype(np.float32)),
        ("f64", rng.standard_normal((5, 2, 3))),
        ("i64", rng.integers(-10**12, 10**12, size=(129,), dtype=np.int64)),
        ("u8", rng.integers(0, 256, size=(3, 4), dtype=np.uint8)),
        ("empty", np.zeros((0, 4), dtype=np.float32)),
        ("scalar_piece", np.array([2.5], dtype=np.float64)),
        ("large", rng.standard_normal(20000).astype(np.float32)),  # 80 KB: 4096-aligned
        ("strided", np.arange(60, dtype=np.int64).reshape(6, 10)[:, ::3]),  # not contiguous
        ("zero_d", np.array(7, dtype=np.int32)),
        ("flags", np.array([True, False, True])),
        ("half", np.arange(5, dtype=np.float16)),
    ]


@pytest.fixture
def shard(tmp_path):
    rng = np.random.default_rng(1)
    pieces = _pieces(rng)
    path = tmp_path / "shard.r3.bin"
    info = write_shard(path, step=1234, rank=3, world_size=8, pieces=pieces,
                       extra={"note": "hello", "layout_hash": 42}, fsync=False)
    return path, pieces, info


def test_round_trip(shard):
    path, pieces, info = shard
    assert info.step == 1234 and info.rank == 3 and info.path == str(path)
    assert info.size == os.path.getsize(path)
    assert set(info.checksums) == {name for name, _ in pieces}
    table = read_shard_table(path)
    assert (table.format_version, table.step, table.rank, table.world_size) == (1, 1234, 3, 8)
    assert table.extra == {"note": "hello", "layout_hash": 42}
    assert table.names == tuple(name for name, _ in pieces)
    assert table.corrected_bytes == 0
    assert table.payload_offset % PAYLOAD_ALIGNMENT == 0
    for entry in table.entries:
        assert entry.offset % (4096 if entry.nbytes >= 65536 else 64) == 0
        assert entry.checksum == info.checksums[entry.name]
    for name, array in pieces:
        got = read_tensor(path, table, name)
        assert got.dtype == array.dtype and got.shape == array.shape
        np.testing.assert_array_equal(got, array)
    assert verify_shard(path) == []
    assert not os.path.exists(str(path) + ".tmp")
    assert os.listdir(path.parent) == [path.name]


def test_read_into_preallocated_and_from_file_object(shard):
    path, pieces, _ = shard
    table = read_shard_table(path)
    name, array = pieces[0]
    out = np.empty(array.shape, dtype=array.dtype)
    assert read_tensor(path, table, name, out=out) is out
    np.testing.assert_array_equal(out, array)
    with open(path, "rb") as stream:
        for name, array in pieces:
            np.testing.assert_array_equal(read_tensor(stream, table, name), array)
    with pytest.raises(ValueError):
        read_tensor(path, table, name, out=np.empty(3, dtype=np.uint8))
    with pytest.raises(FormatError, match="no tensor named"):
        read_tensor(path, table, "missing")


def test_byte_range_read_equals_slice(shard):
    path, pieces, _ = shard
    table = read_shard_table(path)
    for name, array in pieces:
        raw = np.ascontiguousarray(array).tobytes()
        for start, length in [(0, len(raw)), (0, 0), (len(raw) // 3, len(raw) // 2), (len(raw), 0)]:
            got = read_tensor(path, table, name, byte_range=(start, length))
            assert got.dtype == np.uint8 and got.tobytes() == raw[start:start + length]
    with pytest.raises(ValueError):
        read_tensor(path, table, "u8", byte_range=(10, 5))


def test_payload_flip_is_checksum_error(shard):
    path, pieces, _ = shard
    table = read_shard_table(path)
    entry = table.entry("f64")
    with open(path, "r+b") as stream:
        stream.seek(entry.offset + 17)
        byte = stream.read(1)
        stream.seek(entry.offset + 17)
        stream.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError) as caught:
        read_tensor(path, table, "f64")
    message = str(caught.value)
    assert str(path) in message and "'f64'" in message and entry.checksum in message
    # Other tensors are still fine, and an unverified read returns the bytes as they are.
    np.testing.assert_array_equal(read_tensor(path, table, "f32"), pieces[0][1])
    read_tensor(path, table, "f64", verify=False)
    problems = verify_shard(path)
    assert len(problems) == 1 and "'f64'" in problems[0]


def _flip(path, positions, rng):
    data = bytearray(path.read_bytes())
    for position in positions:
        data[position] ^= int(rng.integers(1, 256))
    path.write_bytes(bytes(data))


def _table_encoded_length(path):
    with open(path, "rb") as stream:
        header = stream.read(HEADER_CODEWORD_BYTES)[:shardfile._HEADER.size]
    return shardfile._HEADER.unpack(header)[9]


@pytest.mark.parametrize("seed", range(6))
def test_few_header_and_table_flips_are_corrected(shard, seed):
    path, pieces, _ = shard
    clean = read_shard_table(path)
    table_encoded = _table_encoded_length(path)
    rng = np.random.default_rng(seed)
    header_hits = rng.choice(HEADER_CODEWORD_BYTES, size=5, replace=False)
    table_hits = HEADER_CODEWORD_BYTES + rng.choice(table_encoded, size=6, replace=False)
    _flip(path, list(header_hits) + list(table_hits), rng)
    repaired = read_shard_table(path)
    assert repaired.entries == clean.entries
    assert (repaired.step, repaired.rank, repaired.world_size, repaired.extra) == \
        (clean.step, clean.rank, clean.world_size, clean.extra)
    assert repaired.corrected_bytes == 11
    for name, array in pieces:
        np.testing.assert_array_equal(read_tensor(path, repaired, name), array)


def test_magic_flip_is_corrected(shard):
    path, _, _ = shard
    _flip(path, [0, 1, 2], np.random.default_rng(0))
    assert read_shard_table(path).step == 1234


def test_many_table_flips_are_format_error(shard):
    path, _, _ = shard
    rng = np.random.default_rng(3)
    _flip(path, range(HEADER_CODEWORD_BYTES, HEADER_CODEWORD_BYTES + 40), rng)
    with pytest.raises(FormatError, match="corrupted"):
        read_shard_table(path)
    assert verify_shard(path)


def test_many_header_flips_are_format_error(shard):
    path, _, _ = shard
    rng = np.random.default_rng(4)
    _flip(path, range(8, 8 + 40), rng)  # magic intact, the rest of the header wrecked
    with pytest.raises(FormatError, match="corrupted beyond repair"):
        read_shard_table(path)
    _flip(path, range(0, 8), rng)
    with pytest.raises(FormatError):
        read_shard_table(path)


def test_not_a_shard(tmp_path):
    for content in [b"", b"hello", os.urandom(5000), b"PK\x03\x04" + bytes(300)]:
        path = tmp_path / "other.bin"
        path.write_bytes(content)
        with pytest.raises(FormatError, match="not an hpcckpt shard file"):
            read_shard_table(path)
        path.unlink()


def test_unknown_format_version(tmp_path, monkeypatch):
    monkeypatch.setattr(shardfile, "FORMAT_VERSION", 99)
    path = tmp_path / "future.bin"
    write_shard(path, 1, 0, 1, [("a", np.ones(3))], fsync=False)
    monkeypatch.undo()
    with pytest.raises(FormatError, match=r"version 99.*version 1"):
        read_shard_table(path)


def test_truncated_file(shard):
    path, _, _ = shard
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(FormatError, match="truncated"):
        read_shard_table(path)
    path.write_bytes(data[:50])
    with pytest.raises(FormatError, match="truncated"):
        read_shard_table(path)


def test_existing_path_is_never_overwritten(shard):
    path, _, _ = shard
    before = path.read_bytes()
    with pytest.raises(ShardExistsError) as caught:
        write_shard(path, 9, 0, 1, [("a", np.zeros(2))], fsync=False)
    assert isinstance(caught.value, StorageError) and isinstance(caught.value, FileExistsError)
    assert path.read_bytes() == before
    assert not os.path.exists(str(path) + ".tmp")


def test_fsync_path_and_empty_shard(tmp_path):
    path = tmp_path / "empty.bin"
    info = write_shard(path, 0, 0, 1, [], fsync=True)
    table = read_shard_table(path)
    assert table.entries == () and info.size == os.path.getsize(path) == table.payload_offset
    assert verify_shard(path) == []


_WRITE_INTO_LOCKED = """
import os, sys
import numpy as np
from hpcckpt.format.shardfile import write_shard
from hpcckpt.errors import StorageError
locked, scratch = sys.argv[1:]
# One write where it is allowed first, so every import happens before privileges are dropped
# (the checkout and the interpreter may be readable by root only).
write_shard(os.path.join(scratch, "warm.bin"), 1, 0, 1, [("a", np.ones(4))], fsync=False)
if os.geteuid() == 0:
    try:  # nobody: root would ignore the directory's permissions
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    except OSError as error:  # e.g. a user namespace without that user
        print(f"cannot become nobody: {error}")
        sys.exit(4)
try:
    write_shard(os.path.join(locked, "s.bin"), 1, 0, 1, [("a", np.ones(4))], fsync=False)
except StorageError as error:
    print(error)
    sys.exit(3)
"""


def test_unwritable_directory_is_storage_error(tmp_path):
    """A real permission check: as root, the write runs in a child that drops to `nobody`."""
    from conftest import mpi_env

    # Outside pytest's tmp_path, whose parents are private to the user running the tests.
    parent = tempfile.mkdtemp(prefix="hpcckpt_locked_")
    locked = os.path.join(parent, "locked")
    try:
        os.chmod(parent, 0o755)
        os.mkdir(locked)
        os.chmod(locked, 0o555)
        child = subprocess.run([sys.executable, "-c", _WRITE_INTO_LOCKED, locked, str(tmp_path)],
                               env=mpi_env(), capture_output=True, text=True, timeout=120)
        if child.returncode == 4:
            pytest.skip(child.stdout.strip())  # root here cannot drop its privileges
        assert child.returncode == 3, child.stdout + child.stderr
        assert "not writable" in child.stdout
        assert os.listdir(locked) == []
    finally:
        if os.path.isdir(locked):
            os.chmod(locked, 0o700)
        shutil.rmtree(parent)


def test_permission_denied_is_storage_error(tmp_path, monkeypatch):
    """The same error when open() itself is refused, by injection."""
    real_open = os.open

    def denied(path, flags, *args):
        if str(path).endswith(".tmp"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(atomic.os, "open", denied)
    with pytest.raises(StorageError, match="not writable"):
        write_shard(tmp_path / "s.bin", 1, 0, 1, [("a", np.ones(4))], fsync=False)
    assert os.listdir(tmp_path) == []


def test_parent_is_a_file_is_storage_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageError, match="cannot write"):
        write_shard(tmp_path / "file" / "s.bin", 1, 0, 1, [("a", np.ones(4))], fsync=False)


def test_missing_directory_is_storage_error(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        write_shard(tmp_path / "nope" / "s.bin", 1, 0, 1, [("a", np.ones(4))], fsync=False)


def test_write_failure_removes_tmp(tmp_path, monkeypatch):
    def full_disk(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "writev", full_disk)
    path = tmp_path / "s.bin"
    with pytest.raises(StorageError, match="no space left"):
        write_shard(path, 1, 0, 1, [("a", np.ones(4))], fsync=False)
    assert os.listdir(tmp_path) == []


def test_writev_partial_writes_and_batches(tmp_path, monkeypatch):
    """The writer copes with short writes and splits calls at IOV_MAX buffers."""
    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):
        assert len(buffers) <= 4
        calls.append(len(buffers))
        first = bytes(buffers[0])[:max(1, len(buffers[0]) // 2)]
        return real_writev(fd, [first])

    monkeypatch.setattr(atomic, "_IOV_MAX", 4)
    monkeypatch.setattr(atomic.os, "writev", short_writev)
    rng = np.random.default_rng(2)
    pieces = [(f"p{i}", rng.standard_normal(i + 1)) for i in range(10)]
    path = tmp_path / "s.bin"
    write_shard(path, 5, 1, 2, pieces, fsync=False)
    monkeypatch.undo()
    table = read_shard_table(path)
    for name, array in pieces:
        np.testing.assert_array_equal(read_tensor(path, table, name), array)
    assert len(calls) > 10


def test_pieces_from_layout_round_trip(tmp_path):
    specs = [TensorSpec("w", "float32", (40, 6)), TensorSpec("b", "float64", (6,))]
    layout = plan_layout(specs, 3, split_threshold_bytes=64)
    rng = np.random.default_rng(5)
    arrays = {s.name: rng.standard_normal(s.shape).astype(s.dtype) for s in specs}
    for rank in range(3):
        pieces = [(t.name, extract_piece(arrays[t.name], t, rank)) for t in layout.rank_pieces(rank)]
        path = tmp_path / f"r{rank}.bin"
        write_shard(path, 7, rank, 3, pieces, extra={"layout": layout.to_dict()}, fsync=False)
        table = read_shard_table(path)
        assert table.extra["layout"] == layout.to_dict()
        for name, piece in pieces:
            np.testing.assert_array_equal(read_tensor(path, table, name), piece)


def test_many_tensors_large_table(tmp_path):
    """A table spanning many codewords and pages, padded up to the payload."""
    pieces = [(f"layer{i}.weight", np.full(i % 5, i, dtype=np.float32)) for i in range(1500)]
    path = tmp_path / "many.bin"
    info = write_shard(path, 3, 0, 1, pieces, fsync=False)
    assert info.size == os.path.getsize(path)
    table = read_shard_table(path)
    assert table.payload_offset > 4 * PAYLOAD_ALIGNMENT
    for name, array in pieces[::97]:
        np.testing.assert_array_equal(read_tensor(path, table, name), array)
    assert verify_shard(path) == []


def test_write_bytes_atomically(tmp_path):
    path = tmp_path / "COMMIT"
    write_bytes_atomically(path, b"v1")
    assert path.read_bytes() == b"v1"
    with pytest.raises(ShardExistsError):
        write_bytes_atomically(path, b"v2")
    assert path.read_bytes() == b"v1"
    write_bytes_atomically(path, b"v3", overwrite=True)
    assert path.read_bytes() == b"v3"
    assert os.listdir(tmp_path) == ["COMMIT"]


def test_rs_encode_matches_reedsolo():
    rng = np.random.default_rng(0)
    # Both ways of computing parity: 20000 bytes take the division steps for 32 parity bytes,
    # 70000 for 8; smaller inputs the parity matrix.
    for length in [1, 71, 72, 222, 223, 224, 447, 3000, 20000, 70000]:
        data = rng.integers(0, 256, size=length, dtype=np.uint8).tobytes()
        for nsym in (32, 8):
            assert rs_encode(data, nsym) == bytes(reedsolo.RSCodec(nsym).encode(data))


def test_extra_must_be_json(tmp_path):
    with pytest.raises(FormatError, match="JSON"):
        write_shard(tmp_path / "s.bin", 1, 0, 1, [("a", np.ones(2))], extra={"x": object()}, fsync=False)
    assert os.listdir(tmp_path) == []


def test_file_object_reads_in_memory_copy(shard):
    path, pieces, _ = shard
    table = read_shard_table(path)
    stream = io.BytesIO(path.read_bytes())
    np.testing.assert_array_equal(read_tensor(stream, table, "i64"), pieces[2][1])


def test_bad_header_values_rejected(tmp_path):
    for step, rank, world in [(-1, 0, 1), (0, 2, 2), (0, 0, 0)]:
        with pytest.raises(FormatError):
            write_shard(tmp_path / "s.bin", step, rank, world, [], fsync=False)
    assert os.listdir(tmp_path) == []


def test_pieces_placed_at_payload_layout_give_the_file_bytes_in_place(tmp_path):
    """The engine keeps its snapshot buffers inside one file-sized buffer at the offsets
    payload_layout gives; the planned image must then be that buffer plus its header, byte
    for byte the file write_shard writes, with the pieces left where they are."""
    pieces = _pieces(np.random.default_rng(3))
    extra = {"node": 2}
    _, offsets, size = shardfile.payload_layout([(n, a.dtype, a.shape) for n, a in pieces], extra)
    arena = np.zeros(size, dtype=np.uint8)
    placed = []
    for (name, array), offset in zip(pieces, offsets):
        view = arena[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
        placed.append((name, view))
    image = shardfile.plan_shard(5, 1, 4, placed, extra)
    assert image.size == size
    shard = image.copy_into(arena)
    assert np.shares_memory(shard, placed[0][1])
    write_shard(tmp_path / "s.hck", 5, 1, 4, pieces, extra)
    assert shard.tobytes() == (tmp_path / "s.hck").read_bytes()
    # Into any other buffer the same bytes, copied.
    other = np.full(size + 10, 0xAB, dtype=np.uint8)
    assert image.copy_into(other).tobytes() == shard.tobytes()
    with pytest.raises(ValueError, match="cannot hold"):
        image.copy_into(np.empty(size - 1, dtype=np.uint8))


@pytest.mark.parametrize("chunk", [1, 4097, 3 * PAYLOAD_ALIGNMENT, 1 << 22])
@pytest.mark.parametrize("direct", [False, True])
def test_a_shard_written_in_chunks_is_the_same_file_as_written_whole(tmp_path, chunk, direct):
    """Chunks of any size (one byte, an odd number, aligned, larger than every piece), pieces
    interleaved as parity rounds deliver them: byte for byte what write_shard writes."""
    rng = np.random.default_rng(chunk)
    size = 3 << 20 if chunk > 1 else 70 << 10  # large pieces start on a block (O_DIRECT takes them)
    pieces = [("stripe0.block2", rng.integers(0, 255, size, dtype=np.uint8)),
              ("stripe3.block3", rng.integers(0, 255, size, dtype=np.uint8)),
              ("small", rng.standard_normal(7).astype(np.float32))]
    extra = {"group": [0, 1, 2, 3], "parity": 2}
    whole = write_shard(tmp_path / "whole.hck", 5, 1, 4, pieces, extra=extra)
    writer = shardfile.ShardFileWriter(tmp_path / "chunks.hck", 5, 1, 4, [(n, a.dtype, a.shape) for n, a in pieces],
                                       extra, chunk_bytes=chunk, direct=direct)
    if direct and chunk % PAYLOAD_ALIGNMENT == 0:
        assert writer.file.direct == bool(O_DIRECT)  # else buffered: chunks would not start on a block
    assert not (tmp_path / "chunks.hck").exists()
    flat = {name: array.reshape(-1).view(np.uint8) for name, array in pieces}
    for start in range(0, max(a.size for a in flat.values()), chunk):  # round by round
        for name, data in flat.items():
            if start < data.size:
                writer.write(name, data[start:start + chunk])
    info = writer.finish()
    assert info.checksums == whole.checksums and info.size == whole.size
    assert (tmp_path / "chunks.hck").read_bytes() == (tmp_path / "whole.hck").read_bytes()
    assert verify_shard(tmp_path / "chunks.hck") == []


def test_a_chunked_shard_refuses_too_many_or_too_few_bytes_and_publishes_nothing(tmp_path):
    writer = shardfile.ShardFileWriter(tmp_path / "s.hck", 1, 0, 1, [("a", np.uint8, (10,))], chunk_bytes=4)
    with pytest.raises(FormatError, match="11 bytes for piece 'a' of 10"):
        writer.write("a", np.zeros(11, np.uint8))
    writer.write("a", np.zeros(4, np.uint8))
    with pytest.raises(FormatError, match="incomplete"):
        writer.finish()
    assert list(tmp_path.iterdir()) == []
