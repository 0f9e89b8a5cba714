"""What a restart moves out of the way before the run writes again (restore/tidy.py), on one
real rank: files are never overwritten, so versions newer than the one loaded go (node-local
files deleted, a committed L4 version renamed aside, never deleted), and a fresh start
removes what earlier attempts left unfinished. Through Checkpointer.restart()."""

import json

from single_rank import App, committed, damage, opened, shard, take_versions, version_dir

from hpcckpt.levels.naming import COMMIT_GLOB, PFS_COMMIT_NAME
from hpcckpt.run.ledger import RestartLedger, ledger_path

SETTINGS = ("checkpoint.keep_local=3", "checkpoint.keep_pfs=3")


def resume_and_write(run_dir, steps):
    """Restart, then checkpoint `steps` again. The step loaded."""
    app = App()
    with opened(run_dir, *SETTINGS) as ckpt:
        app.attach(ckpt)
        restored = ckpt.restart()
        for step in steps:
            app.step(step)
            ckpt.checkpoint(step)
            ckpt.wait()
    return restored


def test_versions_newer_than_the_one_loaded_are_deleted_on_l1_and_set_aside_on_l4(tmp_path):
    take_versions(tmp_path, [1, 2, 3], *SETTINGS)
    damage(shard(tmp_path, "local", 3), "weights")
    damage(shard(tmp_path, "pfs", 3), "weights")
    assert resume_and_write(tmp_path, []) == 2
    assert committed(tmp_path) == {"local": [1, 2], "pfs": [1, 2]}
    aside = tmp_path / "pfs" / "v000000000003.unusable"
    assert (aside / PFS_COMMIT_NAME).exists()  # kept for inspection, whole


def test_the_resumed_run_writes_the_steps_moved_aside_again(tmp_path):
    take_versions(tmp_path, [1, 2, 3], *SETTINGS)
    damage(shard(tmp_path, "local", 3), "weights")
    damage(shard(tmp_path, "pfs", 3), "weights")
    assert resume_and_write(tmp_path, [3]) == 2
    assert committed(tmp_path) == {"local": [1, 2, 3], "pfs": [1, 2, 3]}
    assert resume_and_write(tmp_path, []) == 3  # the new writing of step 3 loads


def test_a_failed_version_is_set_aside_with_its_ledger_entry(tmp_path):
    take_versions(tmp_path, [1, 2, 3], *SETTINGS)
    RestartLedger(ledger_path(tmp_path)).mark_failed(3, "a wrong result")
    assert resume_and_write(tmp_path, [3]) == 2
    assert (tmp_path / "pfs" / "v000000000003.failed").is_dir()
    ledger = json.loads(ledger_path(tmp_path).read_text())
    assert ledger["set_aside"] == {"v000000000003.failed": "a wrong result"}
    assert RestartLedger(ledger_path(tmp_path)).failed_steps() == {}  # its new writing may load
    assert resume_and_write(tmp_path, []) == 3


def test_a_fresh_start_removes_what_earlier_attempts_left_unfinished(tmp_path):
    take_versions(tmp_path, [1], *SETTINGS)
    local, pfs = version_dir(tmp_path, "local", 1), version_dir(tmp_path, "pfs", 1)
    for record in (*local.glob(COMMIT_GLOB), pfs / PFS_COMMIT_NAME):
        record.unlink()  # as if the job had died before committing version 1
    assert resume_and_write(tmp_path, [1]) is None  # nothing complete: a fresh start, writing step 1 again
    assert committed(tmp_path) == {"local": [1], "pfs": [1]}

