"""Training data and the resumable iterator.

The iterator's position is global (epoch, offset into that epoch's permutation), independent of
the number of ranks: a global batch is the same samples whatever the world size, and only its
split across ranks follows the rank count. That is what lets a job restart on a different number
of ranks and still see every sample exactly once per epoch.
"""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcckpt.errors import DataError
from hpcckpt.train.clicks import synthetic_clicks


@dataclass(frozen=True)
class Split:
    """The training or validation part of a dataset, addressable by global sample index."""

    inputs: np.ndarray | None  # None when rows are read from HDF5 on demand
    labels: np.ndarray | None
    hdf5_path: str | None = None
    row_offset: int = 0  # first row of this split in the HDF5 file
    size: int = 0
    ids: np.ndarray | None = None  # categorical ids (samples, fields), in memory
    fields: int = 0  # categorical fields per sample (0: none)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.inputs is not None:
            return self.inputs[indices], self.labels[indices]
        return _read_hdf5_rows(self.hdf5_path, self.row_offset, indices)

    def categorical(self, indices: np.ndarray) -> np.ndarray:
        """The categorical ids (len(indices), fields) of these samples."""
        if self.ids is not None:
            return self.ids[indices]
        return _read_hdf5_rows(self.hdf5_path, self.row_offset, indices, dataset="ids")


@dataclass(frozen=True)
class Dataset:
    train: Split
    val: Split
    input_shape: tuple[int, ...]
    n_classes: int
    fields: int = 0  # categorical fields per sample (train/clicks.py); 0: none


def _read_hdf5_rows(path: str, row_offset: int, indices: np.ndarray, dataset: str | None = None):
    """(x, y) of these rows, or the rows of `dataset` alone."""
    import h5py

    if dataset is not None:
        with h5py.File(path, "r") as f:
            data = f[dataset]
            if len(indices) == 0:
                return np.empty((0,) + data.shape[1:], data.dtype)
            order = np.argsort(indices, kind="stable")
            rows = data[np.asarray(indices[order] + row_offset)]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return np.asarray(rows)[inverse]
    if len(indices) == 0:
        with h5py.File(path, "r") as f:
            return (np.empty((0,) + f["x"].shape[1:], np.float32), np.empty(0, np.int64))
    # h5py fancy indexing needs increasing indices; read sorted, then restore the batch order.
    order = np.argsort(indices, kind="stable")
    sorted_rows = indices[order] + row_offset
    with h5py.File(path, "r") as f:
        if np.all(np.diff(sorted_rows) == 1):
            x = f["x"][sorted_rows[0]: sorted_rows[-1] + 1]
            y = f["y"][sorted_rows[0]: sorted_rows[-1] + 1]
        else:
            x = f["x"][sorted_rows]
            y = f["y"][sorted_rows]
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return np.asarray(x, np.float32)[inverse], np.asarray(y, np.int64)[inverse]


def synthetic_classification(samples: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian clusters around random class centres; separable enough to learn, not trivially."""
    rng = np.random.default_rng([seed, 0x5EED])
    centres = rng.normal(0.0, 1.0, size=(classes, features))
    labels = rng.integers(0, classes, size=samples)
    inputs = centres[labels] + rng.normal(0.0, 1.2, size=(samples, features))
    return inputs.astype(np.float32), labels.astype(np.int64)


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 handwritten digits that ship inside scikit-learn: real data, no download."""
    # Found, not imported: importing scikit-learn pulls in SciPy, seconds of start-up on every rank
    # for a file of 1797 rows that NumPy reads itself.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source = 'digits' needs scikit-learn; pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataError(f"the digits data set is missing from scikit-learn at {path}")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return (table[:, :-1] / 16.0).astype(np.float32), table[:, -1].astype(np.int64)


def _split_in_memory(inputs, labels, val_fraction: float, seed: int, ids=None) -> tuple[Split, Split]:
    order = np.random.default_rng([seed, 0xDA7A]).permutation(len(labels))
    n_val = max(1, int(round(len(labels) * val_fraction)))
    val_idx, train_idx = order[:n_val], order[n_val:]
    fields = ids.shape[1] if ids is not None else 0
    return (
        Split(inputs[train_idx], labels[train_idx], size=len(train_idx),
              ids=ids[train_idx] if ids is not None else None, fields=fields),
        Split(inputs[val_idx], labels[val_idx], size=len(val_idx),
              ids=ids[val_idx] if ids is not None else None, fields=fields),
    )


def load_dataset(data_cfg, seed: int) -> Dataset:
    if data_cfg.source == "digits":
        inputs, labels = load_digits_arrays()
        train, val = _split_in_memory(inputs, labels, data_cfg.val_fraction, seed)
        return Dataset(train, val, inputs.shape[1:], 10)
    if data_cfg.source == "synthetic":
        inputs, labels = synthetic_classification(data_cfg.samples, data_cfg.features, data_cfg.classes, seed)
        train, val = _split_in_memory(inputs, labels, data_cfg.val_fraction, seed)
        return Dataset(train, val, inputs.shape[1:], data_cfg.classes)
    if data_cfg.source == "clicks":
        inputs, ids, labels = synthetic_clicks(data_cfg.samples, data_cfg.features, data_cfg.fields,
                                               data_cfg.vocabulary, seed)
        train, val = _split_in_memory(inputs, labels, data_cfg.val_fraction, seed, ids)
        return Dataset(train, val, inputs.shape[1:], 2, ids.shape[1])
    if data_cfg.source == "hdf5":
        return _hdf5_dataset(data_cfg.path, data_cfg.val_fraction)
    raise DataError(f"data.source = {data_cfg.source!r}: allowed are digits, synthetic, clicks, hdf5")


def _hdf5_dataset(path: str, val_fraction: float) -> Dataset:
    """Only shapes are read here; rows are read per batch, so each rank loads just its part."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except (OSError, FileNotFoundError) as exc:
        raise DataError(f"data.path {path!r} cannot be opened as HDF5 ({exc}); write one with `hpcckpt make-data`") from None
    with f:
        for name in ("x", "y"):
            if name not in f:
                raise DataError(f"data.path {path!r} has no dataset '{name}'; it needs datasets 'x' (samples, ...) and 'y' (labels)")
        n, input_shape = f["x"].shape[0], f["x"].shape[1:]
        if f["y"].shape != (n,):
            raise DataError(f"data.path {path!r}: 'y' has shape {f['y'].shape}, expected ({n},) to match 'x'")
        n_classes = int(f.attrs.get("classes", 0)) or int(np.max(f["y"][:])) + 1
        fields = 0
        if "ids" in f:  # a click data set (train/clicks.py): categorical ids beside x
            if len(f["ids"].shape) != 2 or f["ids"].shape[0] != n or f["ids"].dtype != np.int64:
                raise DataError(f"data.path {path!r}: 'ids' has shape {f['ids'].shape} and dtype {f['ids'].dtype}, "
                                f"expected int64 ({n}, fields) to match 'x'")
            fields = int(f["ids"].shape[1])
    n_val = max(1, int(round(n * val_fraction)))
    n_train = n - n_val
    return Dataset(
        Split(None, None, hdf5_path=path, row_offset=0, size=n_train, fields=fields),
        Split(None, None, hdf5_path=path, row_offset=n_train, size=n_val, fields=fields),
        tuple(input_shape),
        n_classes,
        fields,
    )


def write_hdf5_dataset(path: str, samples: int, features: int, classes: int, seed: int) -> None:
    """`hpcckpt make-data`: synthetic samples in the layout the hdf5 source reads, rows shuffled."""
    import h5py

    inputs, labels = synthetic_classification(samples, features, classes, seed)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=inputs, chunks=(min(samples, 1024), features))
        f.create_dataset("y", data=labels)
        f.attrs["classes"] = classes
        f.attrs["seed"] = seed


def write_hdf5_clicks(path: str, samples: int, dense_features: int, fields: int, vocabulary: int, seed: int) -> None:
    """`hpcckpt make-data --clicks`: a click data set (train/clicks.py): 'x' dense features,
    'ids' the categorical ids, 'y' the clicks."""
    import h5py

    inputs, ids, labels = synthetic_clicks(samples, dense_features, fields, vocabulary, seed)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=inputs, chunks=(min(samples, 1024), dense_features))
        f.create_dataset("ids", data=ids, chunks=(min(samples, 1024), fields))
        f.create_dataset("y", data=labels)
        f.attrs["classes"] = 2
        f.attrs["seed"] = seed


def rank_slice(count: int, world_size: int, rank: int) -> slice:
    """Contiguous, non-overlapping share of `count` items; the first count % world get one more."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class ResumableBatches:
    """Global batches over `n_samples`, each epoch shuffled with a seed from (run seed, epoch).

    The last batch of an epoch is smaller rather than dropped, so every sample is seen exactly
    once per epoch; callers weight gradients by local/global batch size to stay exact.
    """

    def __init__(self, n_samples: int, global_batch: int, seed: int):
        if n_samples < 1:
            raise DataError("the training split is empty; use more samples or a smaller data.val_fraction")
        self.n_samples = n_samples
        self.global_batch = min(global_batch, n_samples)
        self.seed = seed
        self.epoch = 0
        self.offset = 0
        self._permutation_epoch = -1
        self._permutation = None

    def _epoch_permutation(self) -> np.ndarray:
        if self._permutation_epoch != self.epoch:
            self._permutation = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_samples)
            self._permutation_epoch = self.epoch
        return self._permutation

    def next_global_batch(self) -> np.ndarray:
        batch = self._epoch_permutation()[self.offset: self.offset + self.global_batch]
        self.offset += len(batch)
        if self.offset >= self.n_samples:
            self.epoch += 1
            self.offset = 0
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "n_samples": self.n_samples,
                "global_batch": self.global_batch, "seed": self.seed}

    def load_state(self, state: dict) -> None:
        if state["n_samples"] != self.n_samples:
            raise DataError(
                f"checkpointed data iterator covered {state['n_samples']} samples but the data now has "
                f"{self.n_samples}; restart with the same data set"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
