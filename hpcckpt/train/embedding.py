"""The embedding model's table, sharded by the hash of each id (all ranks, in lockstep).

Each rank holds the rows of the ids that hash to it (a KeyedTable, protected whole or as
deltas by the checkpointer). A step:
- lookup: each rank sends the distinct ids of its samples to their owners and gets their
  rows back (two route_rows); an id seen for the first time in training gets its row from
  the initializer, which depends on the run's seed and the id alone, so a row starts the
  same whatever the rank count. Each sample's fields' rows, side by side, extend its dense
  features.
- backward: the MLP's input gradient for those values is summed per distinct id on each rank
  (in sample order), sent to the owners (one route_rows, the counts known from the lookup),
  summed there in source-rank order, and the row takes a plain SGD step at optimizer.lr; the
  rows it changed are marked for the next delta version.
Every rank's gradient is already scaled by its share of the global batch, so the sum is the
global mean, as for the dense parameters. The order of every sum is fixed, so a run restarted
on as many ranks goes on bit for bit.
"""

from __future__ import annotations

import numpy as np

from hpcckpt.ckpt.keyed_table import KeyedTable
from hpcckpt.cluster.collectives import route_rows
from hpcckpt.format.keyed_rows import mix, owner_of

TABLE_NAME = "embedding"


class ShardedEmbedding:
    def __init__(self, comm, dim: int, dtype, seed: int):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.dim = int(dim)
        self.dtype = np.dtype(dtype)
        self.salt = int(mix(np.array([seed, 0xE4B]))[0]) & 0x7FFFFFFFFFFFFFFF
        self.table = KeyedTable(self.dim, self.dtype, initializer=self.initial_rows)
        self.table.bind(self.rank, self.size)
        self._step = None  # what backward() needs of the last training lookup

    def initial_rows(self, ids: np.ndarray) -> np.ndarray:
        """Uniform in +-0.5/sqrt(dim), from the seed and the id alone."""
        words = mix((np.asarray(ids, np.int64)[:, None] * self.dim + np.arange(self.dim)[None, :]) ^ self.salt)
        unit = (words >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return ((unit - 0.5) / np.sqrt(self.dim)).astype(self.dtype)

    def lookup(self, ids: np.ndarray, train: bool) -> np.ndarray:
        """(all ranks) The rows of `ids` (samples, fields), as (samples, fields x dim) values.
        With `train`, ids the table lacks are added (evaluation only reads them)."""
        ids = np.asarray(ids, np.int64)  # (samples, fields); samples may be 0
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        owners = owner_of(unique, self.size)
        asked, counts = route_rows(self.comm, unique, owners)
        slots = self.table.slots(asked, create=train)
        found = np.empty((asked.size, self.dim), self.dtype)
        held = slots >= 0
        found[held] = self.table.values[slots[held]]
        if not held.all():
            found[~held] = self.initial_rows(asked[~held])
        back_to = np.repeat(np.arange(self.size), counts)
        answered, _ = route_rows(self.comm, found, back_to)
        rows = np.empty((unique.size, self.dim), self.dtype)
        rows[np.argsort(owners, kind="stable")] = answered  # route_rows sent them grouped by owner
        if train:
            self._step = (unique.size, inverse, owners, slots, back_to, counts)
        return rows[inverse].reshape(ids.shape[0], ids.shape[1] * self.dim)

    def backward(self, grad: np.ndarray, lr: float) -> None:
        """(all ranks) Apply the gradient of the last training lookup's values to their rows."""
        count, inverse, owners, slots, back_to, counts = self._step
        self._step = None
        summed = np.zeros((count, self.dim), np.float64 if self.dtype == np.float64 else self.dtype)
        np.add.at(summed, inverse, np.asarray(grad, summed.dtype).reshape(-1, self.dim))
        received, _ = route_rows(self.comm, summed, owners, sizes_known=counts)
        if not received.size:
            return
        # Sum per row in source-rank order (the order route_rows delivers), then one step.
        rows, position = np.unique(slots, return_inverse=True)
        total = np.zeros((rows.size, self.dim), summed.dtype)
        np.add.at(total, position, received)
        self.table.values[rows] -= (lr * total).astype(self.dtype)
        self.table.mark_changed(rows)
