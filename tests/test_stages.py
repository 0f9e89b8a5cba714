"""The save's stages (save/stages.py): each stage agreed by every rank, a node-local store's
storage failures kept by rank, the first node-local store on the writer thread, what each
level took, and one more try after making room. On one real rank with levels that are
stand-ins (a store that returns or raises); through the whole pipeline in
tests/test_pipeline.py."""

import errno
from types import SimpleNamespace

import pytest

from hpcckpt.cluster.collectives import StorageFailure, describe_failure
from hpcckpt.errors import CheckpointError
from hpcckpt.save.save_types import PersistReport
from hpcckpt.save.stages import RoomOnce, StageRunner, note_failures, once_more_after_making_room
from hpcckpt.save.threads import Worker


class Log:
    def __init__(self):
        self.warnings = []

    def info(self, message, console=False):
        pass

    def warning(self, message):
        self.warnings.append(message)


class Level:
    """A level whose store returns `stored` bytes or raises `error`."""

    def __init__(self, name="local", stored=100, error=None):
        self.name, self.stage_label = name, f"{name} write"
        self.stored, self.error = stored, error
        self.withdrawn, self.removed = [], []

    def store(self, version):
        if self.error is not None:
            raise self.error
        return self.stored

    def withdraw(self, step):
        if self.error is not None:
            raise self.error
        self.withdrawn.append(step)

    def remove(self, step):
        if self.error is not None:
            raise self.error
        self.removed.append(step)


def full():
    return OSError(errno.ENOSPC, "No space left on device")


def out_of_space_everywhere():
    return CheckpointError("L1 local write of step 10 failed", {0: describe_failure(full())})


@pytest.fixture
def runner():
    from mpi4py import MPI

    writer = Worker("test-l1-write")
    runner = StageRunner(MPI.COMM_SELF, Log(), writer)
    yield runner
    writer.stop()


def test_a_stage_returns_its_result_or_fails_on_every_rank_naming_it(runner):
    assert runner.run(10, "shard layout", lambda: 42) == 42

    def broken():
        raise RuntimeError("codec")
    with pytest.raises(CheckpointError, match="shard layout") as failed:
        runner.run(10, "shard layout", broken)
    assert list(failed.value.failures_by_rank) == [0] and "codec" in str(failed.value)


def test_a_node_local_store_keeps_its_storage_failures_by_rank(runner):
    assert runner.per_rank(10, Level(stored=7), version=None) == (7, {})
    stored, failed = runner.per_rank(10, Level(error=full()), version=None)
    assert stored is None and list(failed) == [0] and isinstance(failed[0], StorageFailure)
    with pytest.raises(CheckpointError):  # not the storage's: every rank fails the version
        runner.per_rank(10, Level(error=MemoryError()), version=None)


def test_the_writer_threads_store_is_marked_durable_with_its_bytes(runner):
    report, lacking = PersistReport(10), {}
    writing = runner.start_background(Level("local", stored=4096), version=None)
    runner.finish_background(Level("local"), 10, writing, report, started=writing.finished_at, lacking=lacking)
    assert lacking == {} and "local" in report.durable_s and "l1_write" in report.cpu_s
    assert runner.bytes_stored == {"local": 4096}
    again = runner.start_background(Level("local", stored=4096), version=None)
    runner.finish_background(Level("local"), 11, again, PersistReport(11), 0.0, {})
    assert runner.bytes_stored == {"local": 8192}  # this run's bytes, summed


def test_the_writer_threads_storage_failure_is_noted_and_nothing_marked(runner):
    report, lacking = PersistReport(10), {}
    writing = runner.start_background(Level("local", error=full()), version=None)
    runner.finish_background(Level("local"), 10, writing, report, 0.0, lacking)
    assert list(lacking) == [0] and "local write" in str(lacking[0])
    assert report.durable_s == {} and runner.bytes_stored == {}


def test_the_writer_threads_other_failure_fails_the_version(runner):
    writing = runner.start_background(Level("local", error=RuntimeError("a bug")), version=None)
    with pytest.raises(CheckpointError, match="a bug"):
        runner.finish_background(Level("local"), 10, writing, PersistReport(10), 0.0, {})


def test_mark_counts_bytes_by_level_and_times_from_the_start(runner):
    report = PersistReport(10)
    runner.mark(report, 10, "pfs", started=1.0, nbytes=10, finished=3.5)
    runner.mark(report, 11, "pfs", started=1.0, nbytes=5, finished=2.0)
    assert report.durable_s == {"pfs": 1.0} and runner.bytes_stored == {"pfs": 15}


def test_a_version_not_committed_everywhere_is_withdrawn_where_it_was(runner):
    first, second = Level("local"), Level("partner")
    runner.withdraw(10, [first, second])
    assert first.withdrawn == [10] and second.withdrawn == [10]
    failing, after = Level("local", error=OSError(errno.EIO, "I/O error")), Level("partner")
    runner.withdraw(11, [failing, after])  # said, and the rest left: a restart will not use it anyway
    assert after.withdrawn == [] and len(runner.log.warnings) == 1


def test_a_partial_global_copy_is_dropped_and_a_failure_to_is_only_said(runner):
    level = Level("pfs")
    level.label = "L4 pfs"
    runner.drop_partial(level, 10)
    assert level.removed == [10]
    stuck = Level("pfs", error=OSError(errno.EIO, "I/O error"))
    stuck.label = "L4 pfs"
    runner.drop_partial(stuck, 10)
    assert len(runner.log.warnings) == 1


def test_failures_noted_keep_each_ranks_first():
    lacking = {}
    note_failures(lacking, {1: "full", 3: "read-only"}, "L1 local write")
    note_failures(lacking, {1: "gone"}, "node-local commit")
    assert sorted(lacking) == [1, 3] and str(lacking[1]) == "L1 local write: full"
    assert all(isinstance(why, StorageFailure) for why in lacking.values())


def test_room_is_made_at_most_once_per_version():
    calls = []
    room = RoomOnce(lambda: calls.append(1) or 1)
    assert not room.tried
    assert room() is True and room() is True and calls == [1] and room.tried


def counting(results):
    """An attempt that raises or returns each of `results` in turn."""
    made = SimpleNamespace(attempts=0)

    def attempt():
        made.attempts += 1
        result = results[made.attempts - 1]
        if isinstance(result, BaseException):
            raise result
        return result
    made.attempt = attempt
    return made


def test_out_of_space_makes_room_and_tries_once_more():
    stage = counting([out_of_space_everywhere(), "stored"])
    rooms = []
    assert once_more_after_making_room(stage.attempt, lambda: rooms.append(1) or True) == "stored"
    assert stage.attempts == 2 and rooms == [1]


def test_no_room_made_raises_the_first_failure():
    first = out_of_space_everywhere()
    stage = counting([first, "stored"])
    with pytest.raises(CheckpointError) as failed:
        once_more_after_making_room(stage.attempt, lambda: False)
    assert failed.value is first and stage.attempts == 1


def test_a_second_failure_after_making_room_is_raised():
    second = out_of_space_everywhere()
    stage = counting([out_of_space_everywhere(), second])
    with pytest.raises(CheckpointError) as failed:
        once_more_after_making_room(stage.attempt, lambda: True)
    assert failed.value is second and stage.attempts == 2


@pytest.mark.parametrize("failure", [
    CheckpointError("L1 local write failed", {0: describe_failure(OSError(errno.EIO, "I/O error"))}),
    CheckpointError("L1 local write failed", {0: "MemoryError: "}),
])
def test_only_running_out_of_space_makes_room(failure):
    stage = counting([failure, "stored"])
    rooms = []
    with pytest.raises(CheckpointError):
        once_more_after_making_room(stage.attempt, lambda: rooms.append(1) or True)
    assert rooms == [] and stage.attempts == 1


def test_a_worker_keeps_no_reference_to_a_finished_jobs_arguments():
    # The application's arrays protected by value are judged let go by their references: a
    # worker waiting for its next job must not hold the last one's arguments.
    import threading
    import weakref

    class Held:
        pass

    worker, done = Worker("test-worker"), threading.Event()
    held = Held()
    gone = weakref.ref(held)
    worker.submit(lambda item, event: event.set(), held, done)
    assert done.wait(10)
    del held
    for _ in range(100):  # the worker drops them right after the job returns
        if gone() is None:
            break
        threading.Event().wait(0.01)
    released = gone() is None
    worker.stop()
    assert released
