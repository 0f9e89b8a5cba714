"""One checkpoint's snapshot while the application fills it (ckpt/capture.py): opened at a
step, arrays captured as they are finalised (now, or queued for the copier), the rest taken
and the small state frozen at the end, or the whole snapshot abandoned. Over a small
ProtectedArrays laid out on one real rank; the copier thread is played by the test."""

import numpy as np
import pytest

from hpcckpt.ckpt.capture import SnapshotCapture
from hpcckpt.ckpt.foreign_arrays import protectable
from hpcckpt.ckpt.registry import ENGINE_STATE_KEY, ArrayRegistry
from hpcckpt.ckpt.snapshot import ProtectedArrays
from hpcckpt.errors import CheckpointError
from hpcckpt.format import pytree


class App:
    """What an application protects: a replicated array, a per-rank one and a small state."""

    def __init__(self):
        from mpi4py import MPI

        self.weights = np.arange(24, dtype=np.float64).reshape(4, 6)
        self.counts = np.arange(5, dtype=np.int64)
        self.loop = {"step": 0, "position": [1, 2]}
        registry = ArrayRegistry()
        registry.protect("weights", protectable("weights", self.weights), True)
        registry.protect("counts", protectable("counts", self.counts), False)
        registry.register_state("loop", lambda: self.loop, self.loop.update)
        self.arrays = ProtectedArrays(MPI.COMM_SELF, registry, 64, "auto", {"node": 0})
        self.arrays.ensure_layout()
        self.capture = SnapshotCapture(self.arrays)

    def close(self, ordinal=1, metrics=None, final=False, levels=("local",)):
        return self.capture.close(ordinal, metrics or {}, final, levels, {"schedule": {"interval": 5}})


def piece(app, snapshot, name) -> np.ndarray:
    """A piece of the snapshot as the array it was taken from: one rank's piece of a
    replicated array is all of it, with the axis it is cut along moved to the front."""
    taken = dict(snapshot.pieces)[name].copy()
    if name in app.arrays.local_array_names:
        return taken
    return np.moveaxis(taken, 0, app.arrays.layout.tensor(name).axis)


@pytest.fixture
def app():
    return App()


def test_an_array_captured_during_the_step_keeps_its_value_at_capture(app):
    app.capture.open(10, in_background=False)
    assert app.capture.is_open_at(10) and not app.capture.is_open_at(11) and app.capture.open_step == 10
    app.capture.capture("weights")
    captured = app.weights.copy()
    app.weights += 100  # the step goes on changing it after its capture
    app.counts += 7  # not captured: taken as it is at the end
    snapshot, report, _ = app.close()
    assert piece(app, snapshot, "weights").tobytes() == captured.tobytes()
    assert piece(app, snapshot, "counts").tobytes() == app.counts.tobytes()
    assert report.step == 10 and app.capture.open_step is None


def test_capturing_twice_keeps_the_first_capture(app):
    app.capture.open(10, in_background=False)
    app.capture.capture("weights")
    first = app.weights.copy()
    app.weights += 1
    app.capture.capture("weights")  # already in the snapshot: a no-op
    snapshot, _, _ = app.close()
    assert piece(app, snapshot, "weights").tobytes() == first.tobytes()


def test_closing_freezes_the_state_step_ordinal_levels_and_metrics(app):
    app.loop.update(step=10, position=[3, 4])
    metrics = {"loss": 0.5}
    app.capture.open(10, in_background=False)
    snapshot, _, _ = app.close(ordinal=3, metrics=metrics, final=True, levels=("local", "pfs"))
    app.loop["position"].append(5)  # changed after the snapshot: the snapshot keeps what it was
    metrics["loss"] = 9.0
    assert (snapshot.step, snapshot.ordinal, snapshot.final, snapshot.levels) == (10, 3, True, ("local", "pfs"))
    assert pytree.decode(snapshot.state["loop"]) == {"step": 10, "position": [3, 4]}
    assert snapshot.state[ENGINE_STATE_KEY] == {"ordinal": 3, "schedule": {"interval": 5}}
    assert snapshot.metrics == {"loss": 0.5}


def test_capture_without_an_open_snapshot_does_nothing(app):
    app.capture.capture("weights")
    assert app.capture.open_step is None


def test_capturing_an_unknown_array_is_refused(app):
    app.capture.open(10, in_background=False)
    with pytest.raises(CheckpointError, match="no protected array"):
        app.capture.capture("bias")


def test_one_snapshot_open_at_a_time(app):
    app.capture.open(10, in_background=False)
    with pytest.raises(CheckpointError, match="step 10 is open"):
        app.capture.open(11, in_background=False)
    with pytest.raises(CheckpointError, match="step 10 is open"):
        app.capture.refuse_if_open(11)


def test_closing_what_was_never_opened_is_refused(app):
    with pytest.raises(CheckpointError, match="without begin_checkpoint"):
        app.close()


def test_an_abandoned_snapshot_is_dropped_with_its_queued_copies(app):
    app.capture.open(10, in_background=True)
    app.capture.capture("weights")
    app.capture.abandon()
    assert app.capture.open_step is None and app.capture.copies is None
    app.capture.before_update("weights")  # nothing queued is waited for
    app.capture.open(11, in_background=False)  # a new snapshot opens
    assert app.capture.is_open_at(11)
    app.capture.abandon()
    app.capture.abandon()  # nothing open: nothing to do


def test_in_the_background_captures_are_queued_and_taken_by_the_copier(app):
    app.capture.open(10, in_background=True)
    copies = app.capture.copies
    app.capture.capture("weights")
    assert not copies.taken["weights"].is_set()  # queued, not copied
    snapshot, report, _ = app.close()
    assert report is copies.report and set(copies.taken) == {"weights", "counts"}
    assert not any(event.is_set() for event in copies.taken.values())
    at_end = (app.weights.copy(), app.counts.copy())
    for name in copies.taken:  # the copier thread, once the step is over
        app.arrays.copy_piece(name)
        copies.taken[name].set()
    app.capture.before_update("weights")  # taken already: returns at once
    app.weights += 1
    assert piece(app, snapshot, "weights").tobytes() == at_end[0].tobytes()
    assert piece(app, snapshot, "counts").tobytes() == at_end[1].tobytes()
    app.capture.copies_done()
    assert app.capture.copies is None


def test_changing_an_array_again_before_the_end_takes_its_queued_copy_first(app):
    app.capture.open(10, in_background=True)
    app.capture.capture("weights")
    captured = app.weights.copy()
    app.capture.before_update("weights")  # the copier has not started: copied here, now
    assert app.capture.copies.taken["weights"].is_set()
    app.weights += 100
    snapshot, _, _ = app.close()
    assert piece(app, snapshot, "weights").tobytes() == captured.tobytes()


def test_before_update_without_background_copies_does_nothing(app):
    app.capture.open(10, in_background=False)
    app.capture.capture("weights")
    app.capture.before_update("weights")
    assert app.capture.copies is None
