"""The restore driver (restore/flow.py) on one real rank: the newest version every rank can
load wins; one that no level delivers whole falls back to the version before; the restart
ledger's failed versions are skipped; the modes; an explicit version; a version that does
not fit the job. Through Checkpointer.restart(), on real files damaged by the test. Each
level's part (fetch), the arrays (load) and what moves aside (tidy) have files of their own."""

import numpy as np
import pytest
from single_rank import App, committed, damage, opened, records, shard, take_versions

from hpcckpt.errors import CheckpointError, ConfigError, IncompatibleCheckpointError, UnrecoverableError
from hpcckpt.run.ledger import RestartLedger, ledger_path


def restart(run_dir, app=None, **options):
    """(step loaded, the application's state, the level each rank's shard came from)."""
    app = app or App()
    with opened(run_dir) as ckpt:
        app.attach(ckpt)
        step = ckpt.restart(**options)
        return step, app.state(), ckpt.restored_sources


@pytest.fixture
def written(tmp_path):
    """Versions 1-3 on L1 and L4, and the state at each."""
    return take_versions(tmp_path, [1, 2, 3], "checkpoint.keep_local=3", "checkpoint.keep_pfs=3")


def test_the_newest_version_is_loaded_from_the_cheapest_level(tmp_path, written):
    assert restart(tmp_path) == (3, written[3], ("local",))
    restart_record = records(tmp_path, "restart")[-1]
    assert (restart_record["step"], restart_record["sources"]) == (3, ["local"])


def test_a_version_no_level_delivers_whole_falls_back_to_the_one_before(tmp_path, written):
    damage(shard(tmp_path, "local", 3), "weights")
    damage(shard(tmp_path, "pfs", 3), "field")
    assert restart(tmp_path) == (2, written[2], ("local",))
    assert records(tmp_path, "restart")[-1]["step"] == 2


def test_when_no_version_loads_the_restart_fails_rather_than_start_fresh(tmp_path, written):
    for step in written:
        for level in ("local", "pfs"):
            damage(shard(tmp_path, level, step), "weights")
    with pytest.raises(UnrecoverableError):
        restart(tmp_path)


def test_a_version_failed_in_the_restart_ledger_is_skipped(tmp_path, written):
    RestartLedger(ledger_path(tmp_path)).mark_failed(3, "a wrong result")
    assert restart(tmp_path)[:2] == (2, written[2])


def test_an_explicit_version_is_loaded_and_the_newer_ones_left_be(tmp_path, written):
    assert restart(tmp_path, step=1)[:2] == (1, written[1])
    assert committed(tmp_path) == {"local": [1, 2, 3], "pfs": [1, 2, 3]}
    assert not list((tmp_path / "pfs").glob("*.unusable"))  # evaluating an older version moves nothing aside


@pytest.mark.parametrize("mode, error", [("never", ConfigError), ("resume", ConfigError)])
def test_a_start_that_would_overwrite_or_an_unknown_mode_is_refused(tmp_path, written, mode, error):
    with pytest.raises(error):
        restart(tmp_path, mode=mode)
    assert committed(tmp_path) == {"local": [1, 2, 3], "pfs": [1, 2, 3]}


def test_require_without_a_version_fails_and_auto_starts_fresh(tmp_path):
    with pytest.raises(CheckpointError):
        restart(tmp_path, mode="require")
    assert restart(tmp_path, mode="auto")[0] is None
    assert restart(tmp_path, mode="never")[0] is None


def test_a_version_that_does_not_fit_the_arrays_is_refused_not_loaded(tmp_path, written):
    app = App()
    app.weights = np.zeros((4, 7))  # the model changed
    with pytest.raises(IncompatibleCheckpointError, match="weights"):
        restart(tmp_path, app)
    assert not app.weights.any() and committed(tmp_path)["local"] == [1, 2, 3]
