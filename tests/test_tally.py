"""What checkpoints cost a run (schedule/tally.py): each checkpoint's blocking time as the
calls that blocked add up to it, the records it writes, each level's newest times, and the
summary (its gather on one real rank). Times are the test's own numbers, never measured."""

import pytest

from hpcckpt.save.flush import FlushStats
from hpcckpt.save.save_types import PersistReport
from hpcckpt.schedule.tally import CheckpointTally


class Log:
    def __init__(self):
        self.records = []

    def metrics(self, record):
        self.records.append(record)

    def info(self, message, console=False):
        pass


class Flush:
    def __init__(self, last_report=None):
        self.last_report = last_report
        self.stats = FlushStats()


def report(step, snapshot_s=0.0, captured_early_s=0.0, copy_wait_s=0.0, durable_s=None, started_s=None):
    return PersistReport(step, snapshot_s=snapshot_s, captured_early_s=captured_early_s, copy_wait_s=copy_wait_s,
                         durable_s=durable_s or {}, started_s=started_s or {})


@pytest.fixture
def log():
    return Log()


def test_a_checkpoint_blocks_for_its_begin_its_captures_and_its_end(log):
    tally = CheckpointTally(log)
    tally.opened(None, blocked=0.25, waited=0.125, flush=None)
    blocked, waited = tally.closed(report(10, snapshot_s=0.5, captured_early_s=0.0625), copies_in_background=False)
    assert (blocked, waited) == (0.25 + 0.5 + 0.0625, 0.125)
    assert tally.blocking == [blocked] and tally.last_checkpoint == 10
    assert log.records == [{"step": 10, "checkpoint_blocking_s": blocked, "checkpoint_captured_during_step_s": 0.0625}]
    # The next checkpoint starts from nothing: begin's time was counted once.
    assert tally.closed(report(20, snapshot_s=0.5), copies_in_background=False) == (0.5, 0.0)


def test_waiting_for_a_background_copy_after_the_step_counts_to_its_checkpoint(log):
    tally = CheckpointTally(log)
    tally.opened(None, 0.0, 0.0, None)
    taken = report(10, snapshot_s=0.25)
    tally.closed(taken, copies_in_background=True)
    taken.copy_wait_s = 0.5  # before_update() waited during the next step
    tally.step_over()
    assert tally.blocking == [0.75]
    assert log.records[-1]["step"] == 10 and log.records[-1]["checkpoint_copy_wait_s"] == 0.5
    tally.step_over()  # only the step right after the checkpoint
    assert tally.blocking == [0.75] and len(log.records) == 2


def test_without_background_copies_the_next_step_adds_nothing(log):
    tally = CheckpointTally(log)
    tally.opened(None, 0.0, 0.0, None)
    tally.closed(report(10, snapshot_s=0.25, copy_wait_s=9.0), copies_in_background=False)
    tally.step_over()
    assert tally.blocking == [0.25] and len(log.records) == 1


def test_the_previous_checkpoint_tells_its_time_until_durable_and_each_levels_times(log):
    tally = CheckpointTally(log)
    previous = report(10, durable_s={"local": 0.5, "pfs": 2.0}, started_s={"pfs": 0.75})
    tally.opened(previous, 0.0, 0.0, flush=None)
    assert tally.previous_durable == 2.0
    assert tally.level_times == {"local": (0.5, 0.5), "pfs": (2.0, 1.25)}  # (until durable, its own writing)


def test_l4_at_its_own_pace_tells_its_newest_copys_times(log):
    tally = CheckpointTally(log)
    copied = report(10, durable_s={"pfs": 3.0}, started_s={"pfs": 1.0})
    tally.note_level_times(report(20, durable_s={"local": 0.25}), Flush(copied))
    assert tally.level_times == {"local": (0.25, 0.25), "pfs": (3.0, 2.0)}
    tally.note_level_times(None, Flush())  # nothing new: the newest times stay
    assert tally.level_times == {"local": (0.25, 0.25), "pfs": (3.0, 2.0)}


def test_a_version_l4_still_copies_is_recorded_durable_once_it_is(log):
    tally = CheckpointTally(log)
    copying = {10}
    tally.durable(report(10, durable_s={"local": 0.5}), still_copying=lambda step: step in copying)
    assert log.records == []
    tally.durable(None, still_copying=lambda step: step in copying)
    assert log.records == []
    copying.clear()
    tally.durable(report(20, durable_s={"local": 0.25}), still_copying=lambda step: step in copying)
    assert log.records == [{"step": 10, "checkpoint_durable_s": {"local": 0.5}},
                           {"step": 20, "checkpoint_durable_s": {"local": 0.25}}]
    tally.durable(report(30), still_copying=lambda step: False)  # no durability times: nothing to record
    assert len(log.records) == 2


def test_the_summary_counts_the_checkpoints_and_sums_the_bytes_of_each_level(log):
    from mpi4py import MPI

    tally = CheckpointTally(log)
    for step, seconds in ((10, 0.25), (20, 0.75), (30, 0.5)):
        tally.opened(None, 0.0, 0.0, None)
        tally.closed(report(step, snapshot_s=seconds), False)
    flush = Flush()
    flush.stats.offered, flush.stats.skipped, flush.stats.copied = 3, 1, [(10, 0.5), (30, 0.25)]
    tally.summarise(MPI.COMM_SELF, ({"local": 3, "pfs": 2}, {"local": 300, "pfs": 100}), ("local", "pfs"), flush,
                    replaced=1)
    summary = log.records[-1]
    assert summary["event"] == "checkpoint_summary" and summary["checkpoints"] == 3
    assert summary["versions_per_level"] == {"local": 3, "pfs": 2} and summary["replaced_before_stored"] == 1
    assert (summary["blocking_median_s"], summary["blocking_max_s"]) == (0.5, 0.75)
    assert summary["bytes_per_level"] == {"local": 300, "pfs": 100}
    assert summary["l4_async"] == {"offered": 3, "skipped": 1, "copied": [10, 30], "lag_s": [0.5, 0.25]}
    assert summary["overhead_pct"] > 0


def test_a_run_without_checkpoints_summarises_to_none(log):
    from mpi4py import MPI

    CheckpointTally(log).summarise(MPI.COMM_SELF, ({}, {}), ("local",), None)
    summary = log.records[-1]
    assert summary["checkpoints"] == 0 and summary["bytes_per_level"] == {"local": 0} and "l4_async" not in summary


def test_byte_counts_are_said_in_the_unit_that_shows_them():
    from hpcckpt.runlog import bytes_text

    assert [bytes_text(n) for n in (0, 512, 28_064, 3_200_000, 2.5e9)] == \
        ["0 bytes", "512 bytes", "28.1 KB", "3.2 MB", "2.5 GB"]


def test_the_progress_bar_is_drawn_only_where_a_person_watches(monkeypatch):
    """Under Open MPI's launcher each rank's stdout is a pty, even with `mpiexec ... > log`:
    the launcher's own stdout tells."""
    import sys

    from hpcckpt.runlog import watched

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert watched(environ={})  # mpich's hydra: the rank's stdout is the launcher's
    ompi = {"OMPI_COMM_WORLD_RANK": "0"}
    assert not watched(environ=ompi, parent_stdout="/tmp/job.log")
    assert not watched(environ=ompi, parent_stdout="pipe:[1234]")
    assert watched(environ=ompi, parent_stdout="/dev/pts/3")
