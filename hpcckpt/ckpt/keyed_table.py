"""A keyed table: the rows of one rank of a table whose rows are placed by the hash of their id
(an embedding table of a recommendation model), which grows as new ids appear.

    table = KeyedTable(dim=16, dtype=np.float32, initializer=lambda ids: rows)
    ckpt.protect_table("emb", table)       # before the first checkpoint or restart
    slots = table.slots(ids, create=True)  # this rank's ids; new ones get initializer's rows
    table.values[slots] -= lr * grads       # change rows in place ...
    table.mark_changed(slots)               # ... and say so: the next delta version holds them
    table.owner(ids)                        # the rank each id lives on (format/keyed_rows.py)

A checkpoint stores this rank's rows (every row in a full version, the rows added or marked
changed since the version before in a delta one); a restart onto any rank count hands each
rank the rows whose id hashes to it. Rows are never deleted.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hpcckpt.errors import CheckpointError, ConfigError
from hpcckpt.format.keyed_rows import digest_text, owner_of, rows_digest

_FIRST_CAPACITY = 1024


class KeyedTable:
    def __init__(self, dim: int, dtype=np.float32, initializer: Callable[[np.ndarray], np.ndarray] | None = None):
        """`initializer(ids)` gives the rows of ids that slots(..., create=True) adds (zeros
        without one); it should depend on the id alone, so a row starts the same on any rank."""
        dtype = np.dtype(dtype)
        if int(dim) < 1:
            raise ConfigError(f"KeyedTable: dim must be >= 1, got {dim}")
        if dtype.kind not in "fciu" or dtype.hasobject:
            raise ConfigError(f"KeyedTable: dtype {dtype} is not a numeric dtype")
        self.dim = int(dim)
        self.dtype = dtype
        self.initializer = initializer
        self._ids = np.empty(_FIRST_CAPACITY, np.int64)
        self._values = np.empty((_FIRST_CAPACITY, self.dim), dtype)
        self._changed = np.zeros(_FIRST_CAPACITY, bool)
        self._count = 0
        self._slot_of: dict[int, int] = {}
        self.rank, self.world_size = 0, 1  # where the table is protected (Checkpointer.protect_table)
        self._in_flight: np.ndarray | None = None  # slots the version in flight took as changed

    # -- what the application uses ---------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    @property
    def ids(self) -> np.ndarray:
        """This rank's ids, in slot order (a view)."""
        return self._ids[:self._count]

    @property
    def values(self) -> np.ndarray:
        """This rank's rows, in slot order (a view: write rows in place, then mark_changed)."""
        return self._values[:self._count]

    def owner(self, ids) -> np.ndarray:
        """The rank each id's row lives on, among the ranks the table is protected on."""
        return owner_of(ids, self.world_size)

    def slots(self, ids, create: bool = False) -> np.ndarray:
        """The slot (row index into `values`) of each id; with `create`, ids not held yet are
        added (rows from the initializer, or zeros) and count as changed; without it, -1."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        found = np.fromiter((self._slot_of.get(i, -1) for i in ids.tolist()), np.int64, ids.size)
        if create and (found < 0).any():
            new = np.unique(ids[found < 0])
            self._append(new, self._initial_rows(new))
            found = np.fromiter((self._slot_of[i] for i in ids.tolist()), np.int64, ids.size)
        return found

    def get(self, ids) -> np.ndarray:
        """Copies of the rows of `ids` (which must all be held)."""
        slots = self.slots(ids)
        if (slots < 0).any():
            missing = np.asarray(ids).reshape(-1)[slots < 0][:5].tolist()
            raise KeyError(f"ids not in this rank's table: {missing}")
        return self._values[slots]

    def set(self, ids, rows) -> None:
        """Rows for `ids`, added or replacing those held; they count as changed."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(rows, dtype=self.dtype).reshape(ids.size, self.dim)
        slots = self.slots(ids)
        held = slots >= 0
        self._values[slots[held]] = rows[held]
        self._changed[slots[held]] = True
        if not held.all():
            new_ids, last = np.unique(ids[~held][::-1], return_index=True)
            self._append(new_ids, rows[~held][::-1][last])

    def mark_changed(self, slots) -> None:
        """Rows changed in place (by slot): the next delta version holds them."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size and (slots.min() < 0 or slots.max() >= self._count):
            raise CheckpointError(f"mark_changed: slot(s) outside this rank's {self._count} row(s), e.g. "
                                  f"{int(slots[(slots < 0) | (slots >= self._count)][0])} (slots(ids) gives -1 for an id "
                                  "the table does not hold)")
        self._changed[slots] = True

    def digest(self, comm) -> str:
        """(all ranks of comm) "rows:hash" of every rank's rows (format/keyed_rows.py
        rows_digest): equal for equal tables, whatever the rank count. One allreduce."""
        from mpi4py import MPI

        count, total = rows_digest(self.ids, self.values)
        summed = np.zeros(2, np.uint64)
        comm.Allreduce(np.array([count, total], np.uint64), summed, op=MPI.SUM)
        return digest_text(int(summed[0]), int(summed[1]))

    # -- what the checkpointer uses ----------------------------------------------------------
    def bind(self, rank: int, world_size: int) -> None:
        """The ranks the table is protected on; rows added before must belong here too."""
        self.rank, self.world_size = rank, world_size
        owners = owner_of(self.ids, world_size)
        if (owners != rank).any():
            raise CheckpointError(f"KeyedTable: id {int(self.ids[owners != rank][0])} belongs on rank "
                                  f"{int(owners[owners != rank][0])} of {world_size}, not on rank {rank}: add to each "
                                  "rank only the ids table.owner(ids) gives it")

    def take(self, full: bool) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the rows a version stores (every row, or those changed since the last
        version taken), in slot order; they no longer count as changed, until settle() says
        the version was lost. A version taken before and never settled (its checkpoint went
        no further) counts as lost."""
        self.settle(held=False)
        if full:
            slots = np.arange(self._count)
        else:
            slots = np.flatnonzero(self._changed[:self._count])
        self._in_flight = slots
        self._changed[:self._count] = False
        return self._ids[slots], self._values[slots]

    def settle(self, held: bool) -> None:
        """The version taken last is held by some level (its rows are safe), or lost: then
        its rows count as changed again, for the next delta to hold."""
        if self._in_flight is not None and not held:
            self._changed[self._in_flight] = True
        self._in_flight = None

    def load(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Replace the table's rows with these (a restart), none changed."""
        self._count = 0
        self._slot_of = {}
        self._changed[:] = False
        self._in_flight = None
        if len(ids):
            self._append(np.asarray(ids, np.int64), np.asarray(rows, self.dtype))
        self._changed[:self._count] = False

    # -- internals -------------------------------------------------------------------------
    def _initial_rows(self, ids: np.ndarray) -> np.ndarray:
        if self.initializer is None:
            return np.zeros((ids.size, self.dim), self.dtype)
        rows = np.asarray(self.initializer(ids))
        if rows.shape != (ids.size, self.dim):
            raise CheckpointError(f"KeyedTable initializer gave rows of shape {rows.shape} for {ids.size} id(s); "
                                  f"expected ({ids.size}, {self.dim})")
        return rows.astype(self.dtype, copy=False)

    def _append(self, ids: np.ndarray, rows: np.ndarray) -> None:
        if self.world_size > 1 and ids.size:
            owners = owner_of(ids, self.world_size)
            wrong = owners != self.rank
            if wrong.any():
                raise CheckpointError(f"KeyedTable: id {int(ids[wrong][0])} belongs on rank {int(owners[wrong][0])} of "
                                      f"{self.world_size}, not on rank {self.rank}: add to each rank only the ids "
                                      "table.owner(ids) gives it")
        need = self._count + ids.size
        if need > self._ids.size:
            capacity = max(need, self._ids.size * 2)
            self._ids = _grown(self._ids, capacity)
            self._values = _grown(self._values, capacity)
            self._changed = _grown(self._changed, capacity)
        start = self._count
        self._ids[start:need] = ids
        self._values[start:need] = rows
        self._changed[start:need] = True
        self._slot_of.update(zip(ids.tolist(), range(start, need)))
        self._count = need


def _grown(array: np.ndarray, capacity: int) -> np.ndarray:
    grown = np.zeros((capacity,) + array.shape[1:], array.dtype)
    grown[:array.shape[0]] = array
    return grown
