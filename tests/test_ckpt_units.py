"""Pure pieces of the checkpoint engine: retention, commit record, fault parsing."""

import json

import pytest

from hpcckpt.save.retention import best_step, steps_to_delete
from hpcckpt.errors import ConfigError, FormatError, HpcckptError
from hpcckpt.faults import Fault, parse_fault
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord


def test_retention_keeps_newest_and_best():
    steps = [10, 20, 30, 40, 50]
    assert steps_to_delete(steps, keep=2) == [10, 20, 30]
    metrics = {10: {"val_loss": 0.5}, 20: {"val_loss": 0.1}, 30: {"val_loss": 0.3}}
    assert steps_to_delete(steps, 2, metrics, "val_loss") == [10, 30]
    assert steps_to_delete(steps, 0) == [10, 20, 30, 40]  # never the newest
    assert steps_to_delete([], 3) == []


def test_best_step_direction_follows_metric():
    metrics = {1: {"val_loss": 0.2, "val_accuracy": 0.9}, 2: {"val_loss": 0.1, "val_accuracy": 0.8}}
    assert best_step(metrics, "val_loss") == 2
    assert best_step(metrics, "val_accuracy") == 1
    assert best_step(metrics, "missing") is None


def _manifest():
    layout = plan_layout([TensorSpec("a", "float64", (10, 4)), TensorSpec("b", "int64", ())], 3, 64)
    return Manifest(7, 3, layout, tuple(ShardRecord(r, 100 + r, {"a": f"{r:016x}"}) for r in range(3)),
                    state={"trainer": {"step": 7}}, metrics={"val_loss": 0.25}, node_of_rank=(0, 0, 1),
                    local_dirs=("x", "x", "y"))


def test_manifest_round_trip(tmp_path):
    manifest = _manifest()
    manifest.write(tmp_path / "m.json")
    assert Manifest.read(tmp_path / "m.json") == manifest


def test_manifest_edit_is_detected(tmp_path):
    path = tmp_path / "m.json"
    _manifest().write(path)
    path.write_text(path.read_text().replace("0.25", "0.35"))
    with pytest.raises(FormatError, match="checksum mismatch"):
        Manifest.read(path)


def test_parse_faults():
    assert parse_fault("rank-kill:rank=2:step=10") == Fault("rank-kill", 2, 10, None)
    assert parse_fault("node-loss:node=1:step=5:phase=pfs") == Fault("node-loss", 1, 5, "pfs")
    for bad in ("rank-kill:rank=2", "meteor:rank=1:step=2", "rank-kill:rank=x:step=1",
                "node-loss:node=1:step=2:phase=lunch", "rank-kill:node=1:step=2"):
        with pytest.raises(ConfigError):
            parse_fault(bad)


def test_a_slow_level_takes_its_extra_time_on_its_level_steps_and_ranks(monkeypatch):
    from hpcckpt.faults import FaultInjector

    fault = parse_fault("slow-level:level=pfs:seconds=0.5:step=20:until=30:rank=1")
    assert fault == Fault("slow-level", 1, 20, "pfs", None, 30, seconds=0.5)
    assert parse_fault("slow-level:level=local:seconds=2").until >= 10**12  # every version by default
    slept = []
    monkeypatch.setattr("hpcckpt.faults.time.sleep", slept.append)
    injector = FaultInjector([fault], 1, 0, None)
    for step, level in ((10, "pfs"), (20, "local"), (20, "pfs"), (30, "pfs"), (40, "pfs")):
        injector.storage_fault(step, level)
    assert slept == [0.5, 0.5]
    FaultInjector([fault], 0, 0, None).storage_fault(20, "pfs")  # another rank
    assert slept == [0.5, 0.5]
    for bad in ("slow-level:level=pfs", "slow-level:level=tape:seconds=1", "slow-level:level=pfs:seconds=0",
                "slow-level:level=pfs:seconds=x", "slow-level:level=pfs:seconds=1:step=5:until=4",
                "slow-level:level=pfs:seconds=1:errno=EIO"):
        with pytest.raises(ConfigError, match="slow-level"):
            parse_fault(bad)


def test_levels_due_every_nth_and_always_the_last():
    from hpcckpt.schedule.policy import levels_due

    def due(ordinal, final=False):
        return levels_due(("local", "partner", "erasure", "pfs"), ordinal, final,
                          {"partner": 1, "erasure": 2, "pfs": 3})

    assert due(1) == ("local", "partner")
    assert due(2) == ("local", "partner", "erasure")
    assert due(3) == ("local", "partner", "pfs")
    assert due(6) == ("local", "partner", "erasure", "pfs")
    assert due(5, final=True) == ("local", "partner", "erasure", "pfs")


def test_fault_attempt_field_limits_the_fault_to_one_attempt(monkeypatch):
    from hpcckpt.faults import FaultInjector

    fault = parse_fault("rank-kill:rank=1:step=20:phase=restore:attempt=2")
    assert fault == Fault("rank-kill", 1, 20, "restore", 2)
    monkeypatch.setenv("HPCCKPT_ATTEMPT", "1")
    assert FaultInjector([fault], 1, 0, None).faults == ()
    monkeypatch.setenv("HPCCKPT_ATTEMPT", "2")
    assert FaultInjector([fault], 1, 0, None).faults == (fault,)
    with pytest.raises(ConfigError, match="attempt must be integers"):
        parse_fault("rank-kill:rank=1:step=20:attempt=x")


def test_restart_ledger_marks_a_version_failed_only_after_two_crashed_restarts_in_a_row(tmp_path):
    from hpcckpt.run.ledger import RestartLedger

    ledger = RestartLedger(tmp_path / "restarts.json")
    assert ledger.settle_pending() is None and ledger.failed_steps() == {}
    ledger.begin(300)
    step, reason, failed, _ = ledger.settle_pending()  # one restart from 300 never confirmed: a node may have died
    assert (step, failed) == (300, False) and "crashed" in reason and ledger.failed_steps() == {}
    ledger.begin(300)
    ledger.confirm()  # the next one from 300 worked: the crash before is forgotten
    ledger.begin(300)
    assert ledger.settle_pending()[2] is False
    ledger.begin(300)
    step, reason, failed, _ = ledger.settle_pending()  # a second crash in a row: failed
    assert failed and reason.startswith("2 restarts from it in a row") and list(ledger.failed_steps()) == [300]
    assert ledger.settle_pending() is None  # settled only once
    ledger.begin(250)
    ledger.confirm()
    assert ledger.settle_pending() is None and list(ledger.failed_steps()) == [300]
    # Its files set aside, version 300 no longer counts as failed: a new writing of step 300
    # must be loadable; the reason stays on record.
    ledger.set_aside(300, "v000000000300.failed")
    assert ledger.failed_steps() == {}
    assert "crashed" in json.loads((tmp_path / "restarts.json").read_text())["set_aside"]["v000000000300.failed"]
    # The ranks' own verdict marks a version at once.
    ledger.begin(400)
    ledger.mark_failed(400, "its loss is not finite")
    assert ledger.failed_steps() == {400: "its loss is not finite"} and ledger.settle_pending() is None


def test_a_damaged_restart_ledger_is_set_aside_with_a_warning_and_restarts_go_on(tmp_path):
    from hpcckpt.run.ledger import RestartLedger

    said = []
    ledger = RestartLedger(tmp_path / "restarts.json", said.append)
    (tmp_path / "restarts.json").write_text('{"pending": {"step": 3')  # cut short
    assert ledger.settle_pending() is None and ledger.failed_steps() == {}
    assert len(said) == 1 and "restarts.json is damaged" in said[0] and "set aside as restarts.json.damaged" in said[0]
    assert (tmp_path / "restarts.json.damaged").read_text() == '{"pending": {"step": 3'
    ledger.begin(20)
    assert json.loads((tmp_path / "restarts.json").read_text())["pending"]["step"] == 20


def test_report_tells_attempts_sources_and_work_lost():
    from hpcckpt.tools.report import summarise

    records = [
        {"event": "restart", "attempt": 1, "step": 0, "sources": []},
        {"step": 50, "checkpoint_blocking_s": 0.002},
        {"step": 100, "checkpoint_blocking_s": 0.004},
        {"event": "restart", "attempt": 2, "step": 100, "sources": ["local", "partner", "erasure", "local"],
         "reached_before": 130, "lost_steps": 30},
        {"step": 150, "checkpoint_blocking_s": 0.003},
        {"event": "checkpoint_summary", "checkpoints": 1, "overhead_pct": 0.5},
        {"step": 150, "final": True, "weights_digest": "ab"},
    ]
    text = "\n".join(summarise(records))
    assert "attempts: 2" in text and "steps done: 150 (finished)" in text
    assert "2 rank(s) from L1 local, 1 rank(s) from L2 partner, 1 rank(s) from L3 erasure" in text
    assert "rebuilt: rank 1: L2 partner, rank 2: L3 erasure" in text
    assert "checkpoints taken: 3" in text and "median 3.0 ms, max 4.0 ms" in text
    assert "work lost to failures: 30 step(s)" in text
    crashed = summarise(records[:-1])
    assert any("not finished" in line for line in crashed)


def test_inspect_says_how_far_l4_lags_the_node_local_levels():
    from hpcckpt.tools.catalog import VersionOverview, l4_lag

    def version(step, levels, assembled=""):
        return VersionOverview(step, levels, 4, 1, 1, {}, assembled)

    assert l4_lag([]) == "L4 holds no version yet"
    assert l4_lag([version(10, ("local",))]) == "L4 holds no version yet; node-local levels hold up to step 10"
    assert l4_lag([version(10, ("local", "pfs")), version(20, ("pfs",))]) == \
        "L4 is up to date: it holds the newest version (step 20)"
    # 30 is whole on no level after a node loss but a restart assembles it: it counts as ahead.
    lagging = [version(10, ("pfs",)), version(20, ("local", "partner")), version(30, (), "3 from L1 local")]
    assert l4_lag(lagging) == ("L4 lags: newest there is step 10, 2 newer version(s) only on node-local levels "
                               "(up to step 30, 20 step(s) ahead)")


def test_making_room_drops_only_copies_held_elsewhere_and_only_what_makes_the_version_fit():
    import errno
    import os

    from hpcckpt.save.room import bytes_to_write, droppable, how_many_to_drop, out_of_space
    from hpcckpt.errors import CheckpointError

    # L4 holds 10-40; the node-local levels hold 30, 40 and the new 50: only 30 and 40 are
    # held elsewhere, 50 is the newest anywhere, 40 is the best.
    assert droppable([10, 20, 30, 40], {30, 40, 50}, 50, None, ()) == [30, 40]
    assert droppable([10, 20, 30, 40], {30, 40, 50}, 50, 40, ()) == [30]
    assert droppable([10, 20, 30, 40], {30, 40}, 40, None, {30}) == []  # 40 newest, 30 being copied
    assert how_many_to_drop(free=100, needed=100, sizes=[50]) == 0  # fits: nothing to measure a drop against
    assert how_many_to_drop(free=10, needed=100, sizes=[50, 50, 50]) == 2
    assert how_many_to_drop(free=10, needed=100, sizes=[50, 30]) is None  # all would not do: keep them
    assert bytes_to_write([1, 4096, 4097]) == 4096 * (1 + 1 + 2) + 2 * 4096
    full = CheckpointError("L4 pfs write of step 20 failed on rank(s) [3]: ...",
                           {3: f"OSError: [Errno 28] {os.strerror(errno.ENOSPC)}"})
    assert out_of_space(full)
    assert out_of_space(CheckpointError(f"... {os.strerror(errno.EDQUOT)}"))
    assert not out_of_space(CheckpointError("... failed", {1: f"OSError: {os.strerror(errno.EIO)}"}))


def test_only_storage_failures_degrade_a_level():
    import errno

    from hpcckpt.cluster.collectives import PeerFailure, StorageFailure, describe_failure, is_storage_failure
    from hpcckpt.errors import CheckpointError, StorageError
    from hpcckpt.io.atomic import ShardExistsError

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOENT):
        assert isinstance(describe_failure(OSError(code, "x")), StorageFailure)
    assert isinstance(describe_failure(StorageError("storage.local_dir is not writable")), StorageFailure)
    for other in (OSError(errno.ENOMEM, "x"), MemoryError(), RuntimeError("codec"), ShardExistsError("in the way")):
        failure = describe_failure(other)
        assert isinstance(failure, str) and not isinstance(failure, StorageFailure), other
    # Agreed: every rank's own failure must be the storage's; a peer's report does not count.
    full = describe_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert is_storage_failure(CheckpointError("...", {1: full, 2: PeerFailure("rank 1 failed")}))
    assert not is_storage_failure(CheckpointError("...", {1: full, 3: "MemoryError: "}))
    assert not is_storage_failure(CheckpointError("..."))
    # Agreed again on a larger communicator (an erasure group's failure), it stays the storage's.
    assert isinstance(describe_failure(CheckpointError("L3 ...", {1: full})), StorageFailure)


# Blocks of a global array: what rank 0 checks of every rank's protect() calls (ckpt/snapshot.py)
def _block(name="u", dtype="float64", global_shape=(4, 6), offset=(0, 0), shape=(4, 3), gaps=False):
    return (name, dtype, global_shape, offset, shape, gaps)


def test_blocks_from_every_rank_make_one_layout():
    from hpcckpt.ckpt.snapshot import _block_layouts

    [layout] = _block_layouts([("d", [_block()]), ("d", [_block(offset=(0, 3))])])
    assert layout.boxes == (((0, 4), (0, 3)), ((0, 4), (3, 6))) and not layout.gaps


@pytest.mark.parametrize("everyone, message", [
    ([("d", [_block()]), ("e", [_block(offset=(0, 3))])],
     "the ranks protected different arrays (names, kinds, dtypes or shapes): ranks 0 vs ranks 1"),
    ([("d", [_block()]), ("d", [])], "the ranks protected different block arrays: rank 0 ['u'], rank 1 []"),
    ([("d", [_block()]), ("d", [_block(dtype="float32", offset=(0, 3))])],
     "array 'u': the ranks give different values of dtype: float32 (ranks 1), float64 (ranks 0)"),
    ([("d", [_block()]), ("d", [_block(global_shape=(4, 7), offset=(0, 3))])], "different values of global_shape: (4, 6) (ranks 0), (4, 7) (ranks 1)"),
    ([("d", [_block()]), ("d", [_block(offset=(0, 3), gaps=True)])], "different values of allow_gaps: False (ranks 0), True (ranks 1)"),
    ([("d", [_block()]), ("d", [_block(offset=(3,))])],
     "rank 1's block of shape (4, 3) at offset (3,) does not have the 2 dimensions"),
    ([("d", [_block()]), ("d", [_block(offset=(0, 2))])], "the blocks of ranks 0 and 1 overlap in [0:4, 2:3]"),
    ([("d", [_block(dtype="object")]), ("d", [_block(dtype="object", offset=(0, 3))])], "holds Python objects"),
])
def test_blocks_that_do_not_fit_are_named(everyone, message):
    """Bad input (exit 2), not a checkpoint that cannot be loaded."""
    from hpcckpt.ckpt.snapshot import _block_layouts
    from hpcckpt.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        _block_layouts(everyone)
    assert message in str(caught.value), str(caught.value)


def test_the_memory_forecast_counts_the_snapshot_and_every_levels_chunks():
    from types import SimpleNamespace

    from hpcckpt.ckpt.memory_forecast import BOUNCE_BYTES, WRITING_THREADS, RankNeed, describe, rank_need, short_nodes

    erasure = SimpleNamespace(n=4, p=2, k=2)
    mib = 1 << 20
    levels = SimpleNamespace(partner=object(), erasure=erasure)
    need = rank_need(256 * mib, levels, 8 * mib)
    # L2: 2 chunks; L3: group size + parity chunks; the writing threads' bounce buffers
    assert need == RankNeed(256 * mib, 2 * 8 * mib + 6 * 8 * mib + WRITING_THREADS * BOUNCE_BYTES)
    small = rank_need(3 * mib, levels, 8 * mib)  # chunks no larger than what travels
    assert small.chunks == 2 * 3 * mib + 6 * (3 * mib // 2) + WRITING_THREADS * BOUNCE_BYTES
    # Group 8, parity 2: a restart's rebuild holds 2 k = 12 chunks, more than a checkpoint's 10.
    wide = rank_need(256 * mib, SimpleNamespace(partner=None, erasure=SimpleNamespace(n=8, p=2, k=6)), 8 * mib)
    assert wide.chunks == 12 * 8 * mib + WRITING_THREADS * BOUNCE_BYTES
    local_only = rank_need(256 * mib, SimpleNamespace(partner=None, erasure=None), 8 * mib)
    assert local_only.chunks == WRITING_THREADS * BOUNCE_BYTES
    everyone = [(0, need, 1 << 40), (1, need, 350 * mib), (1, small, 500 * mib), (2, need, None)]  # None: unknown
    [(node, ranks, needed, available, largest)] = short_nodes(everyone)
    assert (node, ranks, needed, available, largest) == (1, 2, need.total + small.total, 350 * mib, need)
    assert describe(short_nodes(everyone)).startswith(
        f"checkpointing will need {(need.total + small.total) / (1 << 30):.2f} GiB of host memory on node 1: "
        "2 rank(s), each up to 0.25 GiB of snapshot and 0.078 GiB of chunk buffers, but the node has 0.34 GiB")


def test_a_crashed_restart_under_which_a_node_was_lost_is_not_counted_against_its_version(tmp_path):
    from hpcckpt.run.ledger import RestartLedger

    ledger = RestartLedger(tmp_path / "restarts.json")
    for nodes in (4, 3, 2):  # nodes dying under restarts one after the other
        ledger.begin(300, nodes_with_files=nodes)
        settled = ledger.settle_pending(nodes_with_files=nodes - 1)
        assert (settled.step, settled.failed, settled.counted) == (300, False, False)
        assert "1 node(s) of" in settled.reason and "not counted" in settled.reason
    assert ledger.failed_steps() == {}
    # As many nodes with files as before: the crash is the version's to answer for, twice.
    ledger.begin(300, nodes_with_files=3)
    assert ledger.settle_pending(nodes_with_files=3).counted
    ledger.begin(300, nodes_with_files=3)
    assert ledger.settle_pending(nodes_with_files=4).failed  # a node more (a spare) explains nothing
    assert list(ledger.failed_steps()) == [300]
