"""Which levels are failing, and when training must stop (save/level_health.py): a failing
level is said once when it starts and once when it recovers; training stops only after
resilience.max_unprotected_checkpoints versions in a row that no level held."""

import pytest

from hpcckpt.errors import StorageError
from hpcckpt.save.level_health import LevelHealth


class Log:
    def __init__(self):
        self.records, self.warnings, self.infos = [], [], []

    def metrics(self, record):
        self.records.append(record)

    def warning(self, message):
        self.warnings.append(message)

    def info(self, message, console=False):
        self.infos.append(message)


@pytest.fixture
def log():
    return Log()


def test_a_level_that_starts_failing_is_said_once_with_a_record(log):
    health = LevelHealth(3, log)
    health.failed("L4 pfs", 20, OSError(28, "No space left on device"), held_by=("L1 local",))
    assert log.records == [{"event": "level_failing", "level": "L4 pfs", "step": 20,
                            "error": "[Errno 28] No space left on device"}]
    assert len(log.warnings) == 1 and health.failing == {"L4 pfs": (20, "[Errno 28] No space left on device")}
    health.failed("L4 pfs", 30, "still full", held_by=("L1 local",))
    assert len(log.records) == 1 and len(log.warnings) == 1  # still failing: the rank log only
    assert health.failing["L4 pfs"][0] == 20  # failing since the first


def test_a_failure_on_some_ranks_names_them(log):
    LevelHealth(3, log).failed("node-local", 20, "read-only", held_by=("L4 pfs",), ranks=[1, 3])
    assert log.records[0]["ranks"] == [1, 3]


def test_a_level_that_recovers_is_said_once_with_when_it_failed(log):
    health = LevelHealth(3, log)
    health.succeeded("L4 pfs", 10)  # never failed: nothing to say
    assert log.records == [] and log.warnings == []
    health.failed("L4 pfs", 20, "full", held_by=())
    health.succeeded("L4 pfs", 40)
    assert log.records[-1] == {"event": "level_recovered", "level": "L4 pfs", "step": 40, "failing_since": 20}
    assert health.failing == {}
    health.succeeded("L4 pfs", 50)
    assert len(log.records) == 2


def test_levels_fail_and_recover_each_on_its_own(log):
    health = LevelHealth(3, log)
    health.failed("L4 pfs", 20, "full", held_by=("L1 local",))
    health.failed("L1 local", 30, "read-only", held_by=())
    health.succeeded("L1 local", 40)
    assert list(health.failing) == ["L4 pfs"]
    assert [r["event"] for r in log.records] == ["level_failing", "level_failing", "level_recovered"]


def test_training_stops_after_max_unprotected_versions_in_a_row(log):
    health = LevelHealth(3, log)
    health.failed("L1 local", 10, "read-only", held_by=())
    health.version_held(10, False)
    health.version_held(20, False)
    with pytest.raises(StorageError) as stopped:
        health.version_held(30, False)
    assert stopped.value.collective  # every rank counts the same agreed failures
    assert health.unprotected == [10, 20, 30]
    assert "[10, 20, 30]" in str(stopped.value) and "read-only" in str(stopped.value)


def test_a_version_held_anywhere_starts_the_count_again(log):
    health = LevelHealth(3, log)
    for step, held in ((10, False), (20, False), (30, True), (40, False), (50, False)):
        health.version_held(step, held)
    assert health.unprotected == [40, 50]


def test_one_unprotected_version_stops_training_when_none_is_allowed(log):
    with pytest.raises(StorageError):
        LevelHealth(1, log).version_held(10, False)


def test_without_a_log_nothing_is_said_and_the_count_still_holds():
    health = LevelHealth(2, None)
    health.failed("L4 pfs", 10, "full", held_by=())
    health.succeeded("L4 pfs", 20)
    health.version_held(30, False)
    with pytest.raises(StorageError):
        health.version_held(40, False)
