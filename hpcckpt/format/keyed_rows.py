"""Keyed tables in a version (pure): where a row lives, what a version stores of a table, and
how a chain of versions gives the table back.

Conventions every other module relies on:

- A table is a set of rows keyed by a 64-bit integer id, each row `dim` values of one dtype.
  The row of id `i` lives on rank `owner_of(i, world_size)`: splitmix64's finalizer of the id,
  modulo the world size. The rule depends on nothing but the id and the rank count, so a job
  on any number of ranks knows where every row goes, and it is recorded by name
  (HASH_RULE) in every version that holds a table.
- Each rank's shard of a version holds, per table, two pieces: `table/<name>/ids` (int64,
  one per row) and `table/<name>/rows` (n x dim), in the same order. A full version holds
  every row of the rank; a delta version only the rows added or changed since the version
  before it. Rows are never deleted.
- A version's chain lists the versions its tables need, oldest first: a full version and the
  deltas after it, ending with the version itself. Applying the chain's rows in order, a
  later row of an id replacing an earlier one, gives the tables as they were at the version.
  Every table of a job shares one chain: versions are full or delta for all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from hpcckpt.errors import FormatError

HASH_RULE = "splitmix64"
TABLE_PREFIX = "table/"


def piece_names(table: str) -> tuple[str, str]:
    """The shard pieces of one table: (ids, rows)."""
    return f"{TABLE_PREFIX}{table}/ids", f"{TABLE_PREFIX}{table}/rows"


def is_table_piece(name: str) -> bool:
    return name.startswith(TABLE_PREFIX)


def mix(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of each id (as uint64): consecutive ids land far apart."""
    return _mixed(np.asarray(ids, dtype=np.int64).astype(np.uint64, copy=True))


def _mixed(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 values, in place."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def rows_digest(ids: np.ndarray, rows: np.ndarray) -> tuple[int, int]:
    """(row count, the sum mod 2^64 of a hash of each id and its row's bytes): a rank's part of
    a table's digest, added over ranks; the same for the same rows whatever their order and
    however they are spread over ranks. digest_text() writes it."""
    data = np.ascontiguousarray(rows).reshape(len(ids), -1).view(np.uint8)
    pad = -data.shape[1] % 4
    if pad:
        data = np.concatenate([data, np.zeros((len(ids), pad), np.uint8)], axis=1)
    hashes = mix(ids)
    for column in data.view(np.uint32).T:  # one pass per 4 bytes of a row, over every row at once
        hashes = _mixed(hashes ^ column.astype(np.uint64))
    return len(ids), int(hashes.sum(dtype=np.uint64))


def digest_text(count: int, total: int) -> str:
    return f"{count}:{total % (1 << 64):016x}"


def owner_of(ids, world_size: int) -> np.ndarray:
    """The rank that holds the row of each id among `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"world size {world_size}")
    return (mix(ids) % np.uint64(world_size)).astype(np.int64)


@dataclass(frozen=True)
class TableSpec:
    """What a version records of one table: enough to read its pieces back anywhere."""

    dim: int
    dtype: str

    def to_dict(self) -> dict:
        return {"dim": self.dim, "dtype": self.dtype, "hash": HASH_RULE}

    @classmethod
    def from_dict(cls, name: str, data: Mapping) -> "TableSpec":
        if data.get("hash", HASH_RULE) != HASH_RULE:
            raise FormatError(f"table {name!r} was placed by the hash rule {data.get('hash')!r}; this hpcckpt knows "
                              f"{HASH_RULE!r} only: use the hpcckpt that wrote it")
        return cls(int(data["dim"]), str(data["dtype"]))


def check_pieces(name: str, spec: TableSpec, ids: np.ndarray, rows: np.ndarray, origin: str) -> None:
    """A shard's pieces of a table fit what its version recorded."""
    if ids.ndim != 1 or rows.ndim != 2 or rows.shape != (ids.size, spec.dim) or ids.dtype != np.int64 \
            or rows.dtype != np.dtype(spec.dtype):
        raise FormatError(f"{origin}: table {name!r} holds ids {ids.dtype}{list(ids.shape)} and rows "
                          f"{rows.dtype}{list(rows.shape)}; its version recorded {spec.dim} {spec.dtype} value(s) a row")


def merge_rows(base_ids: np.ndarray, base_rows: np.ndarray, ids: np.ndarray, rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """`base` with `ids`' rows applied (replacing the row of an id `base` holds, added
    otherwise), sorted by id. Within `ids` the last row of an id wins."""
    all_ids = np.concatenate([base_ids, ids])
    all_rows = np.concatenate([base_rows, rows]) if len(rows) else base_rows
    if not len(ids):
        order = np.argsort(base_ids, kind="stable")
        return base_ids[order], base_rows[order]
    # The last occurrence of each id: unique over the reversed list gives its first there.
    reversed_ids = all_ids[::-1]
    unique, first = np.unique(reversed_ids, return_index=True)
    keep = len(all_ids) - 1 - first
    return unique, all_rows[keep]
