"""The save pipeline (save/pipeline.py): a version's way into the levels the schedule chose,
retention after it, and what a failing level leads to. levels_due is pure; the rest runs
through a Checkpointer on one real rank (L1 and L4 on real files, storage errors injected
inside the levels as faults.py does), each checkpoint waited for, so no version is skipped
for the machine's speed."""

from types import SimpleNamespace

import numpy as np
import pytest
from single_rank import committed, opened, records

from hpcckpt.errors import StorageError
from hpcckpt.faults import FaultInjector, parse_fault
from hpcckpt.save.pipeline import SavePipeline
from hpcckpt.save.save_types import Snapshot


def snapshot_for(*levels):
    return Snapshot(10, 1, (), {}, {}, False, tuple(levels))


def test_levels_due_are_the_snapshots_in_the_stacks_order():
    stack = [SimpleNamespace(name=name) for name in ("local", "partner", "erasure", "pfs")]
    pipeline = SimpleNamespace(levels=stack)
    due = SavePipeline.levels_due(pipeline, snapshot_for("pfs", "local"))
    assert [level.name for level in due] == ["local", "pfs"]
    assert SavePipeline.levels_due(pipeline, snapshot_for()) == ()
    assert [level.name for level in SavePipeline.levels_due(pipeline, snapshot_for("tape", "erasure"))] == ["erasure"]


def take(run_dir, steps, *settings, faults=(), final_at=None):
    """Checkpoint steps 1..`steps` of a small array, each waited for until durable.
    Returns the versions committed before close() and the summary record."""
    weights = np.arange(100.0)
    injector = FaultInjector([parse_fault(text) for text in faults], 0, 0, None)
    with opened(run_dir, *settings, faults=injector) as ckpt:
        ckpt.protect("weights", weights)
        ckpt.restart()
        for step in range(1, steps + 1):
            weights += 1
            ckpt.checkpoint(step, final=True if step == final_at else None)
            ckpt.wait()
        before_close = committed(run_dir)
    [summary] = records(run_dir, "checkpoint_summary")
    return before_close, summary


@pytest.mark.parametrize("pfs_async", ["true", "false"])
def test_every_version_goes_to_both_levels_and_retention_keeps_the_newest(tmp_path, pfs_async):
    held, summary = take(tmp_path, 5, f"storage.pfs_async={pfs_async}", "checkpoint.keep_local=2",
                         "checkpoint.keep_pfs=3")
    assert held == {"local": [4, 5], "pfs": [3, 4, 5]}
    assert summary["checkpoints"] == 5
    assert summary["bytes_per_level"]["local"] == summary["bytes_per_level"]["pfs"] > 0  # the same five shards


@pytest.mark.parametrize("pfs_async", ["true", "false"])
def test_l4_takes_every_nth_version_and_close_drains_the_newest(tmp_path, pfs_async):
    held, summary = take(tmp_path, 5, "storage.pfs_every=2", f"storage.pfs_async={pfs_async}",
                         "checkpoint.keep_local=2", "checkpoint.keep_pfs=3")
    assert held == {"local": [4, 5], "pfs": [2, 4]}
    assert committed(tmp_path) == {"local": [4, 5], "pfs": [2, 4, 5]}  # close() copied the newest to L4
    stored = summary["bytes_per_level"]
    assert stored["local"] * 3 == stored["pfs"] * 5  # five versions on L1, three on L4 (one drained), one size
    if pfs_async == "true":
        assert summary["l4_async"]["copied"] == [2, 4] and summary["l4_async"]["skipped"] == 0
    else:
        assert "l4_async" not in summary


def test_a_copy_a_killed_job_left_uncommitted_on_l4_does_not_fail_the_drain(tmp_path):
    """A job killed while copying version 5 to L4 leaves its shard there with no commit record;
    the end-of-run drain of version 5 deletes that copy first instead of failing on a shard
    that "already exists" in every attempt."""
    weights = np.arange(100.0)
    with opened(tmp_path, "storage.pfs_every=2", "checkpoint.keep_pfs=3") as ckpt:
        ckpt.protect("weights", weights)
        ckpt.restart()
        for step in range(1, 6):
            weights += 1
            ckpt.checkpoint(step)
            ckpt.wait()
        [pfs] = [level for level in ckpt.levels if level.name == "pfs"]
        leftover = pfs.shard_path(5)
        leftover.parent.mkdir(parents=True)
        leftover.write_bytes(b"half a shard")
    assert committed(tmp_path)["pfs"] == [2, 4, 5]
    assert leftover.read_bytes() != b"half a shard"


def test_the_final_version_goes_to_every_level(tmp_path):
    held, _ = take(tmp_path, 3, "storage.pfs_every=4", final_at=3)
    assert held["pfs"] == [3]


def test_a_failing_l4_leaves_the_versions_on_l1_and_is_said_until_it_recovers(tmp_path):
    # keep_pfs = 2: L4's retention keeps 4 and 5, so close() has nothing to copy from L1.
    held, summary = take(tmp_path, 5, "checkpoint.keep_local=5", "checkpoint.keep_pfs=2",
                         faults=["storage-error:level=pfs:step=2:until=3"])
    assert held == {"local": [1, 2, 3, 4, 5], "pfs": [4, 5]}
    assert summary["l4_async"]["copied"] == [1, 4, 5]
    [failing] = records(tmp_path, "level_failing")
    assert (failing["level"], failing["step"]) == ("L4 pfs", 2)
    [recovered] = records(tmp_path, "level_recovered")
    assert (recovered["level"], recovered["step"], recovered["failing_since"]) == ("L4 pfs", 4, 2)


def test_a_failing_node_local_level_hands_the_version_to_l4_though_l4_was_not_due(tmp_path):
    held, _ = take(tmp_path, 5, "storage.pfs_every=4", "checkpoint.keep_local=5", "checkpoint.keep_pfs=5",
                   faults=["storage-error:level=node-local:step=2"])
    assert held == {"local": [1, 3, 4, 5], "pfs": [2, 4]}
    assert [r["step"] for r in records(tmp_path, "level_failing")] == [2]
    assert [(r["step"], r["failing_since"]) for r in records(tmp_path, "level_recovered")] == [(3, 2)]


def test_training_stops_when_no_level_held_max_unprotected_versions_in_a_row(tmp_path):
    faults = ["storage-error:level=node-local:step=2:until=3", "storage-error:level=pfs:step=2:until=3"]
    with pytest.raises(StorageError, match=r"no level could hold versions \[2, 3\]"):
        take(tmp_path, 5, "resilience.max_unprotected_checkpoints=2", faults=faults)
    assert committed(tmp_path) == {"local": [1], "pfs": [1]}
    assert records(tmp_path, "checkpoint_summary") == []  # not a clean run: nothing summarised
