"""Shard file format: one rank's pieces of one version, in one self-describing file.

    offset 0      header codeword  HEADER_CODEWORD_BYTES: 72-byte fixed header + 32 RS bytes
    offset 104    tensor table     JSON, Reed-Solomon encoded in 255-byte codewords
    (zero padding up to a multiple of 4096)
    payload       each piece's raw bytes (C order, axis-major as layout.extract_piece
                  gives them), at offsets aligned to 64 bytes, 4096 for large pieces

Header and table are small and everything else depends on them, so they carry
Reed-Solomon parity: a few flipped bytes there are corrected on read instead of costing the
whole shard. An xxh3_64 of the decoded header and table catches what RS cannot fix
(or miscorrects). Payload bytes are large; each piece has its own xxh3_64 instead, and a
mismatch sends recovery to another copy (every piece carries a checksum; a mismatch is a missing piece).

The header codeword's size, and the position of magic and format version inside it, stay
the same in every format version, so any later reader can tell "not a shard" from
"a shard of a version I do not know".

Files are written once and never overwritten: bytes go to `path + ".tmp"`,
are fsynced, then published under `path`, and the directory is fsynced.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Sequence

import numpy as np
import reedsolo
import xxhash

from hpcckpt.codec.header_ecc import RS_CODEWORD_BYTES, rs_decode, rs_encode, rs_encoded_size, rs_message_bytes
from hpcckpt.errors import ChecksumError, FormatError, StorageError
from hpcckpt.io.atomic import AtomicFile, exists_error, write_buffers_atomically
from hpcckpt.io.direct_io import aligned_zeros

MAGIC = b"HPCKSHRD"
FORMAT_VERSION = 1  # what write_shard writes
SUPPORTED_VERSIONS = (1,)  # what read_shard_table accepts

# magic, version, flags, table_nsym, reserved, step, rank, world_size, table_len,
# table_encoded_len, payload_offset, file_size, meta_checksum
_HEADER = struct.Struct("<8sHHHHQIIQQQQQ")
HEADER_NSYM = 32  # corrects up to 16 wrong bytes in the header
HEADER_CODEWORD_BYTES = _HEADER.size + HEADER_NSYM
TABLE_NSYM = 32  # corrects up to 16 wrong bytes per 255-byte table codeword

PAYLOAD_ALIGNMENT = 4096
SMALL_PIECE_ALIGNMENT = 64
LARGE_PIECE_BYTES = 1 << 16  # pieces this big start on a 4096-byte boundary

_READ_CHUNK = 16 << 20
_ZEROS = bytes(PAYLOAD_ALIGNMENT)


@dataclass(frozen=True)
class ShardInfo:
    """What write_shard produced; checksums are xxh3_64 hex digests by tensor name."""

    path: str
    size: int
    checksums: dict[str, str]
    step: int
    rank: int


@dataclass(frozen=True)
class ShardEntry:
    """One piece in a shard: `shape` is the stored (axis-major) piece shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first payload byte
    nbytes: int
    checksum: str  # xxh3_64 hex digest of the nbytes payload bytes


@dataclass(frozen=True)
class ShardTable:
    path: str
    format_version: int
    flags: int
    step: int
    rank: int
    world_size: int
    payload_offset: int
    file_size: int
    entries: tuple[ShardEntry, ...]
    extra: dict
    corrected_bytes: int = 0  # header/table bytes Reed-Solomon had to repair

    def entry(self, name: str) -> ShardEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise FormatError(f"{self.path}: shard has no tensor named {name!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self.entries)


# ---------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------
# Writing

def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _as_bytes_view(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array without copying it."""
    return memoryview(array.reshape(-1).view(np.uint8))


@dataclass(frozen=True)
class ShardImage:
    """A shard file's bytes before they are written: the header, table and padding, and
    views of the pieces, in file order. One image can go to several places (L1's file, L2's
    and L3's messages, L4's file) without another serialisation or checksum pass."""

    step: int
    rank: int
    world_size: int
    buffers: tuple  # bytes and memoryviews, concatenated they are the file
    size: int
    checksums: dict[str, str]

    def copy_into(self, out: np.ndarray) -> np.ndarray:
        """The file's bytes, contiguous, in `out` (uint8, at least `size` long). Pieces that
        already sit at their place in `out` (see payload_layout) are not copied."""
        if out.size < self.size:
            raise ValueError(f"buffer of {out.size} bytes cannot hold a shard of {self.size}")
        base = out.__array_interface__["data"][0]
        position = 0
        for buffer in self.buffers:
            view = np.frombuffer(buffer, dtype=np.uint8)
            if view.__array_interface__["data"][0] != base + position:
                out[position:position + view.size] = view
            position += view.size
        return out[:self.size]


def plan_shard(step: int, rank: int, world_size: int, pieces: Sequence[tuple[str, np.ndarray]],
               extra: dict | None = None, path: str = "shard") -> ShardImage:
    """Checksum `pieces` and lay them out as a shard file (see write_shard); `path` only
    names the shard in errors. The image holds views of the pieces: keep them unchanged
    until the image is written."""
    if step < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise FormatError(f"shard {path}: step {step}, rank {rank}, world size {world_size} "
                          "cannot be stored (need step >= 0 and 0 <= rank < world size)")
    arrays = []
    seen = set()
    for name, array in pieces:
        if name in seen:
            raise FormatError(f"tensor {name!r} given twice for shard {path}")
        seen.add(name)
        array = np.asarray(array)
        if array.dtype.hasobject:
            raise FormatError(f"tensor {name!r} has dtype {array.dtype}, which holds Python objects")
        # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
        arrays.append((name, array if array.flags.c_contiguous else array.copy(order="C")))

    checksums = [xxhash.xxh3_64_hexdigest(_as_bytes_view(a)) for _, a in arrays]
    payload_offset, offsets, file_size = payload_layout([(n, a.dtype, a.shape) for n, a in arrays], extra)
    head = _head(step, rank, world_size, arrays, offsets, checksums, extra, payload_offset, file_size)
    buffers: list[memoryview | bytes] = [*head]
    buffers.extend(_padding(payload_offset - sum(len(b) for b in head)))
    position = payload_offset
    for (_, array), offset in zip(arrays, offsets):
        buffers.extend(_padding(offset - position))
        buffers.append(_as_bytes_view(array))
        position = offset + array.nbytes
    return ShardImage(int(step), int(rank), int(world_size), tuple(b for b in buffers if len(b)), file_size,
                      {name: c for (name, _), c in zip(arrays, checksums)})


def _head(step: int, rank: int, world_size: int, arrays, offsets, checksums, extra, payload_offset: int,
          file_size: int) -> tuple[bytes, bytes]:
    """The encoded header and tensor table of a shard file (the bytes before its padding)."""
    table = _table_bytes(arrays, offsets, checksums, extra)
    encoded_table = rs_encode(table, TABLE_NSYM)
    header = _pack_header(FORMAT_VERSION, 0, step, rank, world_size, table, len(encoded_table),
                          payload_offset, file_size)
    return rs_encode(header, HEADER_NSYM), encoded_table


class ShardFileWriter:
    """A shard file whose pieces arrive in chunks (a replica received, parity encoded, chunk
    by chunk), written as they come: each piece's bytes in order, at its offset, checksummed
    on the way; the header and table go last, then the file is published whole
    (io/atomic.AtomicFile). Same bytes as write_shard would write. `direct` (O_DIRECT) holds
    where every piece starts on a PAYLOAD_ALIGNMENT boundary and `chunk_bytes`, every
    chunk's length but a piece's last, is a multiple of it."""

    def __init__(self, path: str | os.PathLike, step: int, rank: int, world_size: int,
                 pieces: Sequence[tuple[str, np.dtype, tuple]], extra: dict | None = None, *, chunk_bytes: int,
                 direct: bool = False, recycle: str | os.PathLike | None = None, mode: int = 0o666):
        self.step, self.rank, self.world_size, self.extra = int(step), int(rank), int(world_size), extra
        self.metas = [(name, _Meta.of(dtype, shape)) for name, dtype, shape in pieces]
        self.payload_offset, offsets, self.size = payload_layout(pieces, extra)
        self.offsets = {name: offset for (name, _), offset in zip(self.metas, offsets)}
        aligned = chunk_bytes % PAYLOAD_ALIGNMENT == 0 and all(o % PAYLOAD_ALIGNMENT == 0 for o in offsets)
        self.file = AtomicFile(path, self.size, direct=direct and aligned, recycle=recycle, mode=mode)
        self._hashes = {name: xxhash.xxh3_64() for name, _ in self.metas}
        self._filled = {name: 0 for name, _ in self.metas}
        self._nbytes = {name: meta.nbytes for name, meta in self.metas}

    def write(self, name: str, data) -> None:
        """The next bytes of piece `name`."""
        view = memoryview(data).cast("B")
        if self._filled[name] + len(view) > self._nbytes[name]:
            raise FormatError(f"{self.file.path}: {self._filled[name] + len(view)} bytes for piece {name!r} "
                              f"of {self._nbytes[name]}")
        self._hashes[name].update(view)
        self.file.pwrite(view, self.offsets[name] + self._filled[name])
        self._filled[name] += len(view)

    def finish(self, fsync: bool = True) -> ShardInfo:
        short = [name for name, filled in self._filled.items() if filled != self._nbytes[name]]
        if short:
            self.file.discard()
            raise FormatError(f"{self.file.path}: pieces {short} are incomplete")
        checksums = {name: h.hexdigest() for name, h in self._hashes.items()}
        head = b"".join(_head(self.step, self.rank, self.world_size, self.metas, list(self.offsets.values()),
                              [checksums[name] for name, _ in self.metas], self.extra, self.payload_offset,
                              self.size))
        block = aligned_zeros(self.payload_offset)
        block[:len(head)] = np.frombuffer(head, dtype=np.uint8)
        self.file.pwrite(block, 0)
        self.file.publish(fsync)
        return ShardInfo(self.file.path, self.size, checksums, self.step, self.rank)

    def discard(self) -> None:
        self.file.discard()


def payload_layout(pieces: Sequence[tuple[str, np.dtype, tuple]], extra: dict | None = None
                   ) -> tuple[int, list[int], int]:
    """(payload offset, offset of each piece, file size) of a shard of pieces given as (name,
    dtype, shape). Checksums and step do not move them, so a snapshot's buffers can sit at
    these offsets inside one file-sized buffer, and the file's bytes need no second copy."""
    metas = [(name, _Meta.of(dtype, shape)) for name, dtype, shape in pieces]
    # The payload starts after the table, whose length depends on the offsets' digits:
    # size the table with offsets as wide as any uint64, the real one is never longer.
    widest_table = _table_bytes(metas, [10 ** 19] * len(metas), ["0" * 16] * len(metas), extra)
    meta_end = HEADER_CODEWORD_BYTES + rs_encoded_size(len(widest_table), TABLE_NSYM)
    payload_offset = _align(meta_end, PAYLOAD_ALIGNMENT)
    offsets = []
    position = payload_offset
    for _, meta in metas:
        size = meta.nbytes
        alignment = PAYLOAD_ALIGNMENT if size >= LARGE_PIECE_BYTES else SMALL_PIECE_ALIGNMENT
        position = _align(position, alignment)
        offsets.append(position)
        position += size
    return payload_offset, offsets, position


@dataclass(frozen=True)
class _Meta:
    """What the tensor table records of an array, without the array."""

    dtype: np.dtype
    shape: tuple
    nbytes: int

    @classmethod
    def of(cls, dtype, shape) -> "_Meta":
        dtype = np.dtype(dtype)
        shape = tuple(int(n) for n in shape)
        return cls(dtype, shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)


def write_shard_image(path: str | os.PathLike, image: ShardImage, fsync: bool = True,
                      direct: bool = False, recycle: str | os.PathLike | None = None,
                      mode: int = 0o666) -> ShardInfo:
    """Write a planned shard as a new file; never replaces an existing file. `direct`:
    with O_DIRECT where the file system allows (io/direct_io.py). `recycle`: a retired
    file to overwrite in place if it exists (levels/spares.py). `mode`: of a new file, less
    the umask (node-local levels pass a private one: levels/dir_safety.py)."""
    path = os.fspath(path)
    if os.path.lexists(path):
        raise exists_error(path)
    write_buffers_atomically(path, image.buffers, fsync=fsync, overwrite=False, direct=direct, recycle=recycle,
                              mode=mode)
    return ShardInfo(path, image.size, dict(image.checksums), image.step, image.rank)


def write_shard(path: str | os.PathLike, step: int, rank: int, world_size: int,
                pieces: Sequence[tuple[str, np.ndarray]], extra: dict | None = None,
                fsync: bool = True, direct: bool = False, recycle: str | os.PathLike | None = None,
                mode: int = 0o666) -> ShardInfo:
    """Write one rank's pieces as a new shard file; never replaces an existing file.

    `pieces` are (name, NumPy array) in the order to store them (CuPy arrays must be
    copied to the host first); arrays are written as
    they are (shape and dtype recorded), so pass axis-major pieces from
    layout.extract_piece. Non-contiguous arrays are copied first; contiguous ones are
    handed to the kernel directly. `extra` must be JSON-serializable.
    """
    path = os.fspath(path)
    if os.path.lexists(path):  # before the checksum pass, which would be wasted
        raise exists_error(path)
    return write_shard_image(path, plan_shard(step, rank, world_size, pieces, extra, path), fsync, direct, recycle,
                             mode)


def _table_bytes(arrays, offsets, checksums, extra) -> bytes:
    record = {
        "entries": [
            {"name": name, "dtype": array.dtype.str, "shape": list(array.shape),
             "offset": offset, "nbytes": array.nbytes, "xxh3_64": checksum}
            for (name, array), offset, checksum in zip(arrays, offsets, checksums)
        ],
        "extra": extra or {},
    }
    try:
        return json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise FormatError(f"shard extra data is not JSON-serializable: {exc}") from exc


def _pack_header(version: int, flags: int, step: int, rank: int, world_size: int, table: bytes,
                 table_encoded_len: int, payload_offset: int, file_size: int) -> bytes:
    fields = (MAGIC, version, flags, TABLE_NSYM, 0, step, rank, world_size, len(table),
              table_encoded_len, payload_offset, file_size)
    unsummed = _HEADER.pack(*fields, 0)
    checksum = xxhash.xxh3_64_intdigest(unsummed + table)
    return _HEADER.pack(*fields, checksum)


def _padding(count: int) -> list[memoryview]:
    zeros = memoryview(_ZEROS)
    return [zeros[:min(len(zeros), count - start)] for start in range(0, max(count, 0), len(zeros))]


# ---------------------------------------------------------------------------------------
# Reading

def read_shard_table(path: str | os.PathLike) -> ShardTable:
    """Header and tensor table of a shard, repaired by Reed-Solomon where needed.

    Raises FormatError for a file that is not a shard, a shard of an unsupported format
    version, a truncated file, or header/table damage beyond repair.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as stream:
            return _parse_shard_table(stream, os.fstat(stream.fileno()).st_size, path)
    except OSError as exc:
        raise StorageError(f"cannot read shard {path}: {exc.strerror or exc}") from exc


def shard_table_of_bytes(data: np.ndarray, origin: str) -> ShardTable:
    """The table of a shard file held in memory (a rebuilt or received one); `origin` names it
    in errors. Offsets in the table are offsets into `data`."""
    return _parse_shard_table(_MemoryReader(data), int(data.size), origin)


def verified_piece(data: np.ndarray, table: ShardTable, name: str) -> np.ndarray:
    """One piece of a shard file held in memory, as a uint8 view, checked against its checksum."""
    entry = table.entry(name)
    if entry.offset + entry.nbytes > data.size:
        raise FormatError(f"{table.path}: tensor {name!r} lies past the end of the shard")
    piece = data[entry.offset:entry.offset + entry.nbytes]
    actual = xxhash.xxh3_64_hexdigest(piece)
    if actual != entry.checksum:
        raise ChecksumError(f"{table.path}: tensor {name!r} checksum mismatch (expected {entry.checksum}, "
                            f"got {actual})")
    return piece


class _MemoryReader:
    """The two calls _parse_shard_table makes of a file, on bytes in memory (no copy of them)."""

    def __init__(self, data: np.ndarray):
        self._data, self._position = memoryview(data.reshape(-1).view(np.uint8)), 0

    def read(self, count: int) -> bytes:
        chunk = bytes(self._data[self._position:self._position + count])
        self._position += len(chunk)
        return chunk

    def seek(self, position: int) -> None:
        self._position = position


def _parse_shard_table(stream, actual_size: int, path: str) -> ShardTable:
    """Header and tensor table from an open shard (a file, or bytes in memory)."""
    head = stream.read(PAYLOAD_ALIGNMENT)
    header, corrected = _decode_header(head, path)
    fields = _HEADER.unpack(header)
    (_, version, flags, table_nsym, _, step, rank, world_size, table_len,
     table_encoded_len, payload_offset, file_size, checksum) = fields
    if table_nsym <= 0 or table_nsym >= RS_CODEWORD_BYTES or \
            rs_encoded_size(table_len, table_nsym) != table_encoded_len:
        raise FormatError(f"{path}: shard header is corrupted (inconsistent table size)")
    stream.seek(HEADER_CODEWORD_BYTES)
    encoded_table = stream.read(table_encoded_len)
    if len(encoded_table) != table_encoded_len:
        raise FormatError(f"{path}: shard is truncated inside its tensor table")

    unsummed = _HEADER.pack(*fields[:-1], 0)
    table = rs_message_bytes(encoded_table, table_nsym)
    if xxhash.xxh3_64_intdigest(unsummed + table) != checksum:
        try:
            table, table_corrected = rs_decode(encoded_table, table_nsym)
        except reedsolo.ReedSolomonError:
            raise FormatError(f"{path}: shard tensor table is corrupted beyond repair") from None
        corrected += table_corrected
        if xxhash.xxh3_64_intdigest(unsummed + table) != checksum:
            raise FormatError(f"{path}: shard header/table checksum mismatch after repair; "
                              "too many corrupted bytes")
    if actual_size < file_size:
        raise FormatError(f"{path}: shard is truncated: {actual_size} bytes, "
                          f"header says {file_size}")
    if flags:
        raise FormatError(f"{path}: shard uses flags {flags:#x} this version does not know")

    try:
        record = json.loads(table)
        entries = tuple(
            ShardEntry(str(e["name"]), str(e["dtype"]), tuple(int(d) for d in e["shape"]),
                       int(e["offset"]), int(e["nbytes"]), str(e["xxh3_64"]))
            for e in record["entries"])
        extra = dict(record["extra"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{path}: shard tensor table is malformed: {exc!r}") from exc
    return ShardTable(path, version, flags, step, rank, world_size, payload_offset, file_size,
                      entries, extra, corrected)


def _decode_header(head: bytes, path: str) -> tuple[bytes, int]:
    codeword = head[:HEADER_CODEWORD_BYTES]
    looks_like_shard = head[:len(MAGIC)] == MAGIC
    if len(codeword) < HEADER_CODEWORD_BYTES:
        if looks_like_shard:
            raise FormatError(f"{path}: shard is truncated inside its header")
        raise FormatError(f"{path}: not an hpcckpt shard file")
    try:
        header, corrected = rs_decode(codeword, HEADER_NSYM)
    except reedsolo.ReedSolomonError:
        if looks_like_shard:
            raise FormatError(f"{path}: shard header is corrupted beyond repair") from None
        raise FormatError(f"{path}: not an hpcckpt shard file") from None
    if header[:len(MAGIC)] != MAGIC:
        raise FormatError(f"{path}: not an hpcckpt shard file")
    version = struct.unpack_from("<H", header, len(MAGIC))[0]
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
        raise FormatError(f"{path}: shard format version {version} is not supported "
                          f"(this hpcckpt reads version {supported})")
    return header, corrected


def _readinto_exactly(stream: BinaryIO, buffer: memoryview, what: str) -> None:
    done = 0
    while done < len(buffer):
        count = stream.readinto(buffer[done:])
        if not count:
            raise FormatError(f"{what}: file ends {len(buffer) - done} bytes early")
        done += count


def read_tensor(path_or_fileobj, table: ShardTable, name: str, out: np.ndarray | None = None,
                byte_range: tuple[int, int] | None = None, verify: bool = True) -> np.ndarray:
    """Read one piece, or part of it, straight into `out` (or a new array).

    Whole piece: returned with its stored dtype and shape (or `out`, which must be
    C-contiguous with the same number of bytes), checksum verified unless verify=False.

    byte_range=(offset, nbytes) within the piece: returned as a flat uint8 array (or in
    `out`). The checksum covers the whole piece, so a partial read cannot be verified: loading
    code reads whole pieces (the re-partitioning restore too) and slices them.
    """
    entry = table.entry(name)
    if byte_range is None:
        start, nbytes = 0, entry.nbytes
    else:
        start, nbytes = (int(v) for v in byte_range)
        if start < 0 or nbytes < 0 or start + nbytes > entry.nbytes:
            raise ValueError(f"byte range {byte_range} outside tensor {name!r} of {entry.nbytes} bytes")

    if out is None:
        if byte_range is None:
            out = np.empty(entry.shape, dtype=np.dtype(entry.dtype))
        else:
            out = np.empty(nbytes, dtype=np.uint8)
    elif not out.flags.c_contiguous or out.nbytes != nbytes:
        raise ValueError(f"out buffer for tensor {name!r} must be C-contiguous with {nbytes} bytes, "
                         f"got {out.nbytes} bytes")
    buffer = memoryview(out.reshape(-1).view(np.uint8))

    what = f"{table.path}: tensor {name!r}"
    if isinstance(path_or_fileobj, (str, os.PathLike)):
        try:
            with open(path_or_fileobj, "rb", buffering=0) as stream:
                stream.seek(entry.offset + start)
                _readinto_exactly(stream, buffer, what)
        except OSError as exc:
            raise StorageError(f"cannot read {what}: {exc.strerror or exc}") from exc
    else:
        path_or_fileobj.seek(entry.offset + start)
        _readinto_exactly(path_or_fileobj, buffer, what)

    if verify and byte_range is None:
        actual = xxhash.xxh3_64_hexdigest(buffer)
        if actual != entry.checksum:
            raise ChecksumError(f"{table.path}: tensor {name!r} checksum mismatch "
                                f"(expected {entry.checksum}, got {actual})")
    return out


def verify_shard(path: str | os.PathLike) -> list[str]:
    """Every problem found in a shard, reading all of it; an empty list means it is sound."""
    path = os.fspath(path)
    try:
        table = read_shard_table(path)
    except (FormatError, StorageError) as exc:
        return [str(exc)]
    problems = []
    previous_end = table.payload_offset
    for entry in sorted(table.entries, key=lambda e: e.offset):
        try:
            expected = int(np.prod(entry.shape, dtype=np.int64)) * np.dtype(entry.dtype).itemsize
        except TypeError:
            problems.append(f"{path}: tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
            continue
        if expected != entry.nbytes:
            problems.append(f"{path}: tensor {entry.name!r}: {entry.nbytes} bytes recorded, "
                            f"shape {entry.shape} of {entry.dtype} needs {expected}")
        if entry.offset < previous_end or entry.offset + entry.nbytes > table.file_size:
            problems.append(f"{path}: tensor {entry.name!r}: payload range "
                            f"[{entry.offset}, {entry.offset + entry.nbytes}) overlaps or lies outside the file")
            continue
        previous_end = entry.offset + entry.nbytes
    if problems:
        return problems
    try:
        with open(path, "rb", buffering=0) as stream:
            chunk = bytearray(min(_READ_CHUNK, max((e.nbytes for e in table.entries), default=0)) or 1)
            for entry in table.entries:
                hasher = xxhash.xxh3_64()
                stream.seek(entry.offset)
                remaining = entry.nbytes
                while remaining:
                    view = memoryview(chunk)[:min(remaining, len(chunk))]
                    count = stream.readinto(view)
                    if not count:
                        problems.append(f"{path}: tensor {entry.name!r}: file ends early")
                        break
                    hasher.update(view[:count])
                    remaining -= count
                else:
                    if hasher.hexdigest() != entry.checksum:
                        problems.append(f"{path}: tensor {entry.name!r} checksum mismatch "
                                        f"(expected {entry.checksum}, got {hasher.hexdigest()})")
    except OSError as exc:
        problems.append(f"cannot read shard {path}: {exc.strerror}")
    return problems
