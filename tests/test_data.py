from types import SimpleNamespace

import numpy as np
import pytest

from hpcckpt.train.data import (
    ResumableBatches,
    load_dataset,
    load_digits_arrays,
    rank_slice,
    synthetic_classification,
    write_hdf5_dataset,
)


def test_every_sample_once_per_epoch_with_partial_last_batch():
    batches = ResumableBatches(n_samples=103, global_batch=10, seed=4)
    seen = []
    while batches.epoch == 0:
        seen.extend(batches.next_global_batch().tolist())
    assert sorted(seen) == list(range(103))
    # Next epoch is shuffled differently.
    second = batches.next_global_batch()
    assert list(second) != seen[:10]


def test_resume_from_saved_position_continues_identically():
    a = ResumableBatches(50, 8, seed=1)
    for _ in range(9):
        a.next_global_batch()
    state = a.state()
    expected = [a.next_global_batch().tolist() for _ in range(12)]
    b = ResumableBatches(50, 8, seed=1)
    b.load_state(state)
    assert [b.next_global_batch().tolist() for _ in range(12)] == expected


@pytest.mark.parametrize("count", [0, 1, 5, 64, 65])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_rank_slices_split_without_overlap(count, world):
    covered = []
    for rank in range(world):
        covered.extend(range(count)[rank_slice(count, world, rank)])
    assert covered == list(range(count))


def test_synthetic_is_deterministic_and_sized():
    x1, y1 = synthetic_classification(100, 7, 3, seed=2)
    x2, y2 = synthetic_classification(100, 7, 3, seed=2)
    assert x1.shape == (100, 7) and y1.max() < 3
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_digits_are_real_data():
    x, y = load_digits_arrays()
    assert x.shape == (1797, 64)
    assert set(np.unique(y)) == set(range(10))
    assert 0.0 <= x.min() and x.max() <= 1.0


def test_hdf5_source_reads_only_requested_rows(tmp_path):
    path = tmp_path / "d.h5"
    write_hdf5_dataset(str(path), samples=200, features=5, classes=4, seed=9)
    cfg = SimpleNamespace(source="hdf5", path=str(path), val_fraction=0.25, samples=0, features=0, classes=0)
    dataset = load_dataset(cfg, seed=0)
    assert dataset.train.size == 150 and dataset.val.size == 50
    assert dataset.train.inputs is None  # nothing loaded up front
    x_all, y_all = synthetic_classification(200, 5, 4, seed=9)
    idx = np.array([17, 3, 99, 4])
    x, y = dataset.train.rows(idx)
    assert np.array_equal(x, x_all[idx]) and np.array_equal(y, y_all[idx])
    xv, yv = dataset.val.rows(np.array([0, 49]))
    assert np.array_equal(xv, x_all[[150, 199]])
