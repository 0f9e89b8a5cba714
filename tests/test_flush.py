"""L4 at its own pace (save/flush.py): a version is copied on L4's thread when due or owed and
no copy runs; one offered while a copy runs is skipped and owed, and the next version takes
its place; the final version waits for the copy in flight and goes now. On one real rank with
a copy that the test holds and releases (events, never sleeps); through the whole pipeline
in tests/test_pipeline.py."""

import threading

import pytest

from hpcckpt.save.flush import AsyncFlush, FlushStats
from hpcckpt.save.save_types import PersistReport


class Copier:
    """L4's copy of a version, held until the test releases it; True: L4 took the version."""

    def __init__(self):
        self.entered, self.copied, self.started = [], [], threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.result, self.error = True, None

    def __call__(self, step, manifest, report, started, comm):
        self.entered.append(step)
        self.started.set()
        self.release.wait()
        if self.error is not None:
            raise self.error
        self.copied.append(step)
        return self.result


@pytest.fixture
def world():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.fixture
def copier():
    return Copier()


@pytest.fixture
def flush(world, copier):
    flush = AsyncFlush(world, copier, None)
    yield flush
    copier.release.set()
    flush.stop()


def offer(flush, world, step, due=True):
    return flush.offer(world, step, None, PersistReport(step), 0.0, due=due)


def test_a_version_due_is_copied_on_l4s_thread(flush, world, copier):
    assert offer(flush, world, 10)
    flush.wait()
    assert copier.copied == [10] and flush.flushing is None
    assert flush.stats.offered == 1 and [step for step, _ in flush.stats.copied] == [10]
    assert flush.last_report.step == 10


def test_a_version_not_due_nor_owed_is_not_offered(flush, world, copier):
    assert not offer(flush, world, 10, due=False)
    assert copier.copied == [] and flush.stats.offered == 0


def test_a_version_offered_while_a_copy_runs_is_skipped_and_the_next_takes_its_place(flush, world, copier):
    copier.release.clear()
    assert offer(flush, world, 10)
    copier.started.wait()
    assert flush.flushing == 10  # node-local retention keeps the version being copied
    assert not offer(flush, world, 20)
    assert flush.owed and (flush.stats.offered, flush.stats.skipped) == (2, 1)
    copier.release.set()
    flush.wait()
    assert offer(flush, world, 30, due=False)  # not due, but owed: the newest version goes
    flush.wait()
    assert copier.copied == [10, 30] and not flush.owed
    assert (flush.stats.offered, flush.stats.skipped) == (2, 1)  # owed, not due: not counted as offered
    # The summary counts the due versions L4 took apart from the newer one it took instead.
    assert flush.stats.describe().startswith("L4 took 1 of 2 version(s) due at its own pace (1 skipped while a "
                                              "copy ran, 1 newer one(s) taken in their place)")


def test_the_final_version_waits_for_the_copy_in_flight_and_goes_now(flush, world, copier):
    copier.release.clear()
    offer(flush, world, 10)
    copier.started.wait()
    done = threading.Event()

    def final():
        flush.copy_now(20, None, PersistReport(20), 0.0)
        done.set()
    thread = threading.Thread(target=final)
    thread.start()
    # Held behind the copy of 10: the copy of 20 has not begun (a wrong flush would begin it
    # within this grace; a right one never does, however slow the machine).
    assert not done.wait(0.1) and copier.entered == [10]
    copier.release.set()
    thread.join()
    assert copier.copied == [10, 20] and flush.stats.offered == 2


def test_a_copy_l4_did_not_take_is_not_counted_as_copied(flush, world, copier):
    copier.result = False  # the copy dealt with its failure itself (the level is failing)
    offer(flush, world, 10)
    flush.wait()
    assert flush.stats.copied == [] and flush.last_report is None


def test_an_unexpected_failure_of_the_copy_is_raised_once_at_the_next_wait(flush, world, copier):
    copier.error = RuntimeError("a bug in the copy")
    offer(flush, world, 10)
    with pytest.raises(RuntimeError, match="a bug in the copy"):
        flush.wait()
    flush.wait()  # raised once
    assert flush.flushing is None


def test_an_unexpected_failure_is_raised_at_the_next_offer(flush, world, copier):
    copier.error = RuntimeError("a bug in the copy")
    offer(flush, world, 10)
    flush.idle.wait()
    with pytest.raises(RuntimeError, match="a bug in the copy"):
        offer(flush, world, 20)


def test_the_summary_line_is_said_only_once_l4_was_due():
    assert FlushStats().describe() is None  # L4 was never due at its own pace: no line
    assert FlushStats(offered=3, skipped=1, copied=[(10, 0.5), (30, 1.5)]).describe() is not None
