"""Taking one checkpoint (ckpt/taking.py) on one real rank: checkpoint(), or begin, capture
and end around a step; metrics that are not finite refused; wait() until durable; the
profiling checkpoint of an adaptive interval waited for. What a version holds is read back
by a restart in a new checkpointer."""

import math

import pytest
from single_rank import App, blocking_records, checkpointer, committed, opened, records

from hpcckpt.errors import CheckpointError


def restored(run_dir):
    """The state a restart in a new checkpointer gives back, and the step it loaded."""
    app = App()
    with opened(run_dir) as ckpt:
        app.attach(ckpt)
        step = ckpt.restart()
    return step, app.state()


def test_checkpoint_returns_the_previous_checkpoints_report(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        assert ckpt.checkpoint(1) is None
        app.step(2)
        previous = ckpt.checkpoint(2)  # waits for the persist of 1, whose buffers it reuses
        assert previous.step == 1 and "local" in previous.durable_s  # L4 copies it at its own pace


def test_wait_returns_once_the_version_is_durable_on_every_level(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.checkpoint(1)
        report = ckpt.wait()
        assert report.step == 1 and report.held and set(report.durable_s) == {"local", "pfs"}
        assert committed(tmp_path) == {"local": [1], "pfs": [1]}
        assert ckpt.wait() is None  # nothing in flight


def test_each_checkpoint_taken_records_what_it_blocked(tmp_path):
    take = [3, 6, 9]
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        for step in take:
            app.step(step)
            ckpt.checkpoint(step)
    assert [r["step"] for r in blocking_records(tmp_path)] == take
    assert all(r["checkpoint_blocking_s"] >= 0 for r in blocking_records(tmp_path))
    assert records(tmp_path, "checkpoint_summary")[0]["checkpoints"] == 3


def test_an_array_captured_during_the_step_is_saved_as_it_was_then(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.begin_checkpoint(1)
        ckpt.capture("weights")
        captured = app.state()
        app.weights += 100  # the rest of the step changes it after its capture
        ckpt.checkpoint(1)  # closes the snapshot opened
    step, state = restored(tmp_path)
    assert step == 1 and state == captured


def test_copies_in_the_background_save_the_values_at_capture(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.begin_checkpoint(1, copy_in_background=True)
        ckpt.capture("weights")
        ckpt.capture("field")
        ckpt.end_checkpoint()
        saved = app.state()
        for name in ("weights", "field", "counts"):  # the next step changes them, each after before_update
            ckpt.before_update(name)
        app.step(2)
        ckpt.wait()
    step, state = restored(tmp_path)
    assert step == 1 and state == saved


@pytest.mark.parametrize("metrics", [{"loss": math.nan}, {"loss": 0.5, "grad_norm": math.inf}])
def test_a_step_whose_metrics_are_not_finite_is_not_checkpointed(tmp_path, metrics):
    app = App()
    with opened(tmp_path, "storage.pfs_every=2") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.checkpoint(1, {"loss": 1.0})
        app.step(2)
        ckpt.checkpoint(2, metrics)
        ckpt.wait()
        assert committed(tmp_path) == {"local": [1], "pfs": []}
        app.step(3)
        ckpt.checkpoint(3, {"loss": 0.25})  # the refused step took no number: this is the 2nd, due on L4
        ckpt.wait()
        assert committed(tmp_path) == {"local": [1, 3], "pfs": [3]}
    [refused] = records(tmp_path, "checkpoint_refused")
    assert refused["step"] == 2 and refused["metrics"] == [name for name, v in metrics.items() if not math.isfinite(v)]
    assert [r["step"] for r in blocking_records(tmp_path)] == [1, 3]


def test_end_without_begin_and_begin_twice_are_refused(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        with pytest.raises(CheckpointError, match="without begin_checkpoint"):
            ckpt.end_checkpoint()
        ckpt.begin_checkpoint(1)
        with pytest.raises(CheckpointError, match="is open"):
            ckpt.begin_checkpoint(2)
        ckpt.end_checkpoint()


def test_the_profiling_checkpoint_is_waited_for_but_not_l4_at_its_own_pace(tmp_path):
    from hpcckpt.faults import FaultInjector, parse_fault

    app = App()
    # L4 takes 4 s per version: the profiling checkpoint must not hold training for it.
    slow_pfs = FaultInjector([parse_fault("slow-level:level=pfs:seconds=4")], 0, 0, None)
    ckpt = checkpointer(tmp_path, 'checkpoint.every_steps="auto"', "storage.pfs_async=true", faults=slow_pfs)
    try:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.checkpoint(1)
        assert not ckpt.persisting  # its node-local persist's time is what the first interval is chosen from
        assert committed(tmp_path) == {"local": [1], "pfs": []}
        ckpt.wait()  # ...and L4 takes it at its own pace
        assert committed(tmp_path) == {"local": [1], "pfs": [1]}
    finally:
        ckpt.close()
