"""Going back to a version (ckpt/resuming.py) on one real rank: restart() sets the arrays in
place and the registered state, and the schedule goes on from the version; a resumed run is
confirmed by its first steps; rewind() marks versions bad and restores an older one in
process; init_from() starts a new run from another run's arrays. The restore flow itself is
in tests/test_restore_flow.py; on several ranks, tests/test_checkpoint_mpi.py and
tests/test_rewind_mpi.py."""

import json

import numpy as np
import pytest
from single_rank import App, checkpointer, committed, opened, records, take_versions

from hpcckpt.errors import DivergenceError
from hpcckpt.run.ledger import RestartLedger, ledger_path


def test_a_fresh_start_restores_nothing_and_says_so(tmp_path):
    with opened(tmp_path) as ckpt:
        App().attach(ckpt)
        assert ckpt.restart() is None and ckpt.restored_sources == ()
    [restart] = records(tmp_path, "restart")
    assert (restart["step"], restart["sources"], restart["ranks"]) == (0, [], 1)


def test_restart_sets_every_array_in_place_and_the_state_with_its_types(tmp_path):
    states = take_versions(tmp_path, [1, 2, 3])
    app = App()
    arrays = (app.weights, app.field, app.counts)
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        assert ckpt.restart() == 3
        assert ckpt.restored_sources == ("local",)
    assert app.state() == states[3]
    assert all(a is b for a, b in zip((app.weights, app.field, app.counts), arrays))  # the same arrays, filled
    seen = app.loop["seen"]
    assert type(seen) is tuple and type(seen[1]) is bytes and type(seen[2]) is np.int64
    assert records(tmp_path, "restart")[-1]["sources"] == ["local"]


def test_the_checkpoints_count_on_from_the_version_loaded(tmp_path):
    # L4 takes every 2nd checkpoint: ordinals 1, 2, 3 went to steps 1, 2, 3; the resumed run's
    # next checkpoint is the 4th, due on L4, as if the run had never stopped.
    take_versions(tmp_path, [1, 2, 3], "storage.pfs_every=2")
    app = App()
    with opened(tmp_path, "storage.pfs_every=2") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        app.step(4)
        ckpt.checkpoint(4)
        ckpt.wait()
        assert 4 in committed(tmp_path)["pfs"]
        app.step(5)
        ckpt.checkpoint(5)
        ckpt.wait()
        assert 5 not in committed(tmp_path)["pfs"]


def crash_after_restart(run_dir, steps_done=0):
    """A resumed run that dies before close() says it went well (confirm=False)."""
    app = App()
    ckpt = checkpointer(run_dir, "checkpoint.confirm_after_steps=1")
    app.attach(ckpt)
    restored = ckpt.restart()
    for step in range(restored + 1, restored + 1 + steps_done):
        app.step(step)
        ckpt.due(step)
    ckpt.close(confirm=False, drain=False)
    return restored


def test_a_restart_that_dies_twice_unconfirmed_falls_back_to_the_version_before(tmp_path):
    take_versions(tmp_path, [1, 2, 3])
    assert crash_after_restart(tmp_path) == 3
    assert crash_after_restart(tmp_path) == 3  # one crash may be a node that died under it
    assert crash_after_restart(tmp_path) == 2  # two in a row: version 3 is failed
    assert 3 not in committed(tmp_path)["local"]


def test_a_resumed_run_that_did_its_first_step_is_confirmed(tmp_path):
    take_versions(tmp_path, [1, 2, 3])
    assert crash_after_restart(tmp_path, steps_done=1) == 3  # confirmed by its first step, then died
    assert crash_after_restart(tmp_path) == 3  # so this is the first crash counted, not the second
    assert RestartLedger(ledger_path(tmp_path)).failed_steps() == {}


def test_rewind_marks_the_newer_versions_bad_and_restores_the_newest_older(tmp_path):
    app = App()
    states = {}
    with opened(tmp_path) as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        for step in (2, 4, 6):
            app.step(step)
            ckpt.checkpoint(step)
            ckpt.wait()  # on L4 too: at its own pace it would skip versions on a slow machine
            states[step] = app.state()
        app.step(7)
        assert ckpt.rewind(5, "the loss spiked") == 4
        assert app.state() == states[4]
        # 6 is marked bad; the restore fell back past it, so its files were set aside with the mark.
        assert "v000000000006.failed" in json.loads(ledger_path(tmp_path).read_text())["set_aside"]
        assert (tmp_path / "pfs" / "v000000000006.failed").is_dir() and 6 not in committed(tmp_path)["local"]
        # The run goes on from 4 and writes its steps again: version 6's files were moved aside.
        app.step(6)
        ckpt.checkpoint(6)
        ckpt.wait()
        assert committed(tmp_path)["local"][-1] == 6
    [rewind] = records(tmp_path, "rewind")
    assert (rewind["from_step"], rewind["step"], rewind["marked_bad"]) == (5, 4, [6])
    assert records(tmp_path, "restart")[-1]["step"] == 0  # a rewind is not a restart


def test_diverging_again_from_the_version_rewound_to_goes_further_back(tmp_path):
    app = App()
    states = {}
    with opened(tmp_path, "checkpoint.keep_local=4", "checkpoint.keep_pfs=4") as ckpt:
        app.attach(ckpt)
        ckpt.restart()
        for step in (2, 4, 6):
            app.step(step)
            ckpt.checkpoint(step)
            ckpt.wait()  # on L4 too: at its own pace it would skip versions on a slow machine
            states[step] = app.state()
        assert ckpt.rewind(5, "NaN") == 4
        assert ckpt.rewind(5, "NaN again") == 2  # no version since 4: 4 is to blame too
        assert app.state() == states[2]
        with pytest.raises(DivergenceError):
            ckpt.rewind(3, "NaN once more")  # 2 is to blame now, and nothing is older
    assert [r["marked_bad"] for r in records(tmp_path, "rewind")] == [[6], [4]]


def test_init_from_takes_another_runs_arrays_but_not_its_step_or_state(tmp_path):
    source = take_versions(tmp_path / "source", [1, 2])
    app = App()
    with opened(tmp_path / "new") as ckpt:
        app.attach(ckpt)
        assert ckpt.restart() is None
        assert ckpt.init_from(str(tmp_path / "source")) == 2
        assert (app.weights.tobytes(), app.field.tobytes()) == source[2][:2]
        assert app.loop["step"] == 0  # the new run starts at its own step 0
        app.step(1)
        ckpt.checkpoint(1)
        ckpt.wait()
    assert committed(tmp_path / "new")["local"] == [1]  # its versions are its own


def test_init_from_loads_only_the_arrays_selected(tmp_path):
    source = take_versions(tmp_path / "source", [3])
    app = App()
    with opened(tmp_path / "new") as ckpt:
        app.attach(ckpt)
        ckpt.init_from(str(tmp_path / "source"), select=lambda name: name == "weights")
    assert app.weights.tobytes() == source[3][0]
    assert not app.field.any()
