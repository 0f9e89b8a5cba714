"""The restore's fetch and verify (restore/fetch.py) on one real rank: each rank's shard from
the first level of the stack that delivers it verified; a bad or missing node-local copy
falls through to L4 and is put back; a version whose loss was finite refuses a copy that
restores NaN. Through Checkpointer.restart(), on real files damaged by the test."""

import math
import shutil

import numpy as np
import pytest
from single_rank import App, committed, damage, opened, shard, take_versions, version_dir

from hpcckpt.errors import UnrecoverableError


def restart(run_dir, *settings, **options):
    app = App()
    with opened(run_dir, *settings) as ckpt:
        app.attach(ckpt)
        step = ckpt.restart(**options)
        return step, app.state(), ckpt.restored_sources


@pytest.fixture
def written(tmp_path):
    return take_versions(tmp_path, [1, 2], "checkpoint.keep_local=3", "checkpoint.keep_pfs=3")


def test_a_damaged_node_local_copy_falls_through_to_l4_and_is_put_back(tmp_path, written):
    damage(shard(tmp_path, "local", 2), "counts")
    assert restart(tmp_path) == (2, written[2], ("pfs",))
    assert shard(tmp_path, "local", 2).read_bytes() == shard(tmp_path, "pfs", 2).read_bytes()
    assert restart(tmp_path)[2] == ("local",)  # whole again on L1


def test_a_lost_node_local_version_is_read_from_l4_and_written_back(tmp_path, written):
    shutil.rmtree(version_dir(tmp_path, "local", 2))  # the node's storage lost it
    assert restart(tmp_path) == (2, written[2], ("pfs",))
    assert 2 in committed(tmp_path)["local"]  # protected again on the node-local level
    assert restart(tmp_path)[2] == ("local",)


def test_reading_an_explicit_version_repairs_nothing(tmp_path, written):
    damage(shard(tmp_path, "local", 2), "counts")
    damaged = shard(tmp_path, "local", 2).read_bytes()
    assert restart(tmp_path, step=2) == (2, written[2], ("pfs",))
    assert shard(tmp_path, "local", 2).read_bytes() == damaged  # evaluating a version writes nothing


def nan_versions(run_dir, *settings):
    """Version 1 healthy; version 2 with a NaN in an array though its loss was finite."""
    app = App()
    with opened(run_dir, *settings) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.checkpoint(1, {"loss": 1.0})
        healthy = app.state()
        app.step(2)
        app.weights[1, 2] = math.nan
        ckpt.checkpoint(2, {"loss": 0.5})
        ckpt.wait()
    return healthy


def test_a_copy_restoring_nan_where_the_loss_was_finite_is_refused(tmp_path):
    healthy = nan_versions(tmp_path)
    assert restart(tmp_path)[:2] == (1, healthy)  # each copy of 2 refused: the version before


def test_verify_finite_off_loads_arrays_that_hold_nan_on_purpose(tmp_path):
    nan_versions(tmp_path, "checkpoint.verify_finite=false")
    step, (weights, *_), _ = restart(tmp_path, "checkpoint.verify_finite=false")
    assert step == 2 and np.isnan(np.frombuffer(weights).reshape(4, 6)[1, 2])


def test_a_version_missing_on_every_level_of_a_rank_is_not_loaded(tmp_path, written):
    for step in written:
        damage(shard(tmp_path, "local", step), "weights")
        shard(tmp_path, "pfs", step).unlink()
    with pytest.raises(UnrecoverableError):
        restart(tmp_path)
