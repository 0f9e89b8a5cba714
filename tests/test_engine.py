"""The library API (ckpt/engine.py) on one real rank, as an application's loop uses it: due()
once per step, a stop asked for and agreed, observe() for a step that diverged, mark_bad(),
close() after a clean run or with an exception in flight. Taking and resuming have files of
their own (tests/test_taking.py, tests/test_resuming.py); the same loop on several ranks is
tests/test_library_schedule_mpi.py."""

import math

import pytest
from single_rank import App, blocking_records, checkpointer, committed, opened, records, take_versions

from hpcckpt import EXIT_HALTED
from hpcckpt.errors import CheckpointError, DivergenceError


def loop(ckpt, app, last, on_step=None):
    """The library's loop: a checkpoint when due() says so, out on a stop. The last step done."""
    step = 0
    for step in range(1, last + 1):
        app.step(step)
        if on_step is not None:
            on_step(step)
        if ckpt.due(step, last=step == last):
            ckpt.checkpoint(step, {"loss": 1.0 / step})
        if ckpt.stopping:
            break
    return step


def test_due_follows_the_interval_and_the_last_step(tmp_path):
    app = App()
    with opened(tmp_path, "checkpoint.every_steps=3") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        assert [step for step in range(1, 8) if ckpt.planned(step, last=step == 7)] == [3, 4, 5, 6, 7]
        loop(ckpt, app, 7)
        assert ckpt.stopping is None and ckpt.exit_code == 0
        code = ckpt.close()
    assert code == 0
    assert [r["step"] for r in blocking_records(tmp_path)] == [3, 6, 7]
    assert records(tmp_path, "checkpoint_summary")[0]["checkpoints"] == 3
    assert committed(tmp_path)["pfs"][-1] == 7


def test_a_stop_asked_for_is_agreed_checkpointed_and_ends_with_exit_halted(tmp_path):
    app = App()
    with opened(tmp_path, "checkpoint.every_steps=100") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        stopped_at = loop(ckpt, app, 50, on_step=lambda step: step == 4 and ckpt.request_stop("maintenance"))
        assert stopped_at == 5  # asked during step 4: agreed after step 5, the same step on every rank
        assert "maintenance" in ckpt.stopping and ckpt.exit_code == EXIT_HALTED
        assert ckpt.close() == EXIT_HALTED
    [halted] = records(tmp_path, "halted")
    assert halted["step"] == 5
    assert [r["step"] for r in blocking_records(tmp_path)] == [5]
    assert committed(tmp_path)["pfs"] == [5]  # the final version is durable on L4
    assert ckpt.close() == EXIT_HALTED  # closed once; asked again, the same answer


def test_nothing_can_be_protected_after_the_first_checkpoint(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        with pytest.raises(CheckpointError, match="protect everything first"):
            ckpt.protect("late", app.weights.copy())


def test_a_diverged_step_is_rewound_in_process(tmp_path):
    app = App()
    with opened(tmp_path, "checkpoint.every_steps=2", "resilience.rewind_on_divergence=true") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        states = {}
        for step in range(1, 5):
            app.step(step)
            assert ckpt.observe(step, 1.0 / step) is None
            if ckpt.due(step):
                ckpt.checkpoint(step, {"loss": 1.0 / step})
                states[step] = app.state()
        app.step(5)
        rewound = ckpt.observe(5, math.nan)
        assert rewound.step == 4 and app.state() == states[4]
    [diverged] = records(tmp_path, "diverged")
    assert (diverged["step"], diverged["rewound_to"]) == (5, 4)
    assert records(tmp_path, "rewind")[0]["step"] == 4


def test_a_diverged_step_without_rewinds_stops_the_run(tmp_path):
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        with pytest.raises(DivergenceError):
            ckpt.observe(1, math.inf)


def test_a_version_marked_bad_is_never_loaded_again(tmp_path):
    take_versions(tmp_path, [1, 2, 3])
    app = App()
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.mark_bad(3, "a wrong result")
        assert ckpt.restart() == 2
    assert 3 not in committed(tmp_path)["local"]


def test_closing_while_an_exception_is_handled_copies_nothing_more_and_summarises_nothing(tmp_path):
    app = App()
    ckpt = checkpointer(tmp_path, "storage.pfs_every=10")
    app.attach(ckpt)
    ckpt.restart()
    with pytest.raises(RuntimeError):
        try:
            app.step(1)
            ckpt.checkpoint(1)
            raise RuntimeError("the step failed")
        finally:
            assert ckpt.close() == 0
    assert committed(tmp_path) == {"local": [1], "pfs": []}  # not drained to L4
    assert records(tmp_path, "checkpoint_summary") == []


def test_a_clean_close_makes_the_newest_version_durable_on_l4(tmp_path):
    app = App()
    with opened(tmp_path, "storage.pfs_every=10") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(1)
        ckpt.checkpoint(1)
        ckpt.wait()
        assert committed(tmp_path)["pfs"] == []
        assert ckpt.drain() == [1]
        assert committed(tmp_path)["pfs"] == [1]
