"""Injected faults strike inside the wrapped levels, where a real failure would: before a write
that a level does alone, after a collective level's transfers, on every node-local write."""

import errno
from dataclasses import dataclass

import pytest

from hpcckpt.faults import NO_FAULTS, FaultInjector, parse_fault
from hpcckpt.faulty_levels import FaultyLevel, with_faults
from hpcckpt.levels.base import LevelStack


@dataclass
class Stepped:
    step: int


class RecordingLevel:
    def __init__(self, name, collective=False, node_local=True):
        self.name, self.collective, self.node_local = name, collective, node_local
        self.calls = []
        self.keeps_shards = name == "local"
        self.comm = "group"

    def store(self, version):
        self.calls.append(("store", version.step))
        return 7

    def commit(self, manifest):
        self.calls.append(("commit", manifest.step))

    def shard_path(self, step):
        return f"/x/{self.name}/{step}"


def faulty(level, *faults, rank=0):
    return FaultyLevel(level, FaultInjector([parse_fault(f) for f in faults], rank, 0, None))


@pytest.mark.parametrize("name, collective, written_before_the_error", [
    ("local", False, False),   # writes alone: the error comes before anything is written
    ("pfs", False, False),
    ("partner", True, True),   # collective: after its transfers, so no peer waits on this rank
    ("erasure", True, True),
])
def test_a_storage_error_strikes_where_the_level_writes(name, collective, written_before_the_error):
    inner = RecordingLevel(name, collective, node_local=name != "pfs")
    level = faulty(inner, f"storage-error:level={name}:step=10:until=20:errno=EIO")
    assert level.store(Stepped(5)) == 7
    with pytest.raises(OSError) as raised:
        level.store(Stepped(10))
    assert raised.value.errno == errno.EIO and "injected storage-error at step 10" in str(raised.value)
    assert (("store", 10) in inner.calls) is written_before_the_error
    assert level.store(Stepped(21)) == 7


def test_a_storage_error_of_another_rank_or_level_passes_by():
    inner = RecordingLevel("local")
    assert faulty(inner, "storage-error:level=local:step=10:rank=1", rank=0).store(Stepped(10)) == 7
    assert faulty(inner, "storage-error:level=pfs:step=10").store(Stepped(10)) == 7
    assert inner.calls == [("store", 10), ("store", 10)]


def test_a_node_local_error_fails_every_node_local_write_and_the_commit_record_only():
    fault = "storage-error:level=node-local:step=10"
    for name in ("local", "partner", "erasure"):
        with pytest.raises(OSError):
            faulty(RecordingLevel(name, collective=name != "local"), fault).store(Stepped(10))
    node_local = RecordingLevel("local")
    with pytest.raises(OSError):
        faulty(node_local, fault).commit(Stepped(10))
    assert node_local.calls == []
    pfs = RecordingLevel("pfs", node_local=False)
    level = faulty(pfs, fault)
    level.store(Stepped(10))
    level.commit(Stepped(10))
    assert pfs.calls == [("store", 10), ("commit", 10)]


def test_everything_but_store_and_commit_is_the_wrapped_levels_own():
    inner = RecordingLevel("erasure", collective=True)
    level = faulty(inner, "storage-error:level=erasure:step=3")
    assert level.shard_path(4) == "/x/erasure/4" and level.name == "erasure" and level.collective
    level.comm = None  # as JobStorage.close() frees the group's communicator
    assert inner.comm is None


def test_a_rank_without_faults_keeps_its_levels_unwrapped():
    stack = LevelStack([RecordingLevel("local"), RecordingLevel("pfs", node_local=False)])
    assert with_faults(stack, NO_FAULTS) is stack
    other_rank = FaultInjector([parse_fault("rank-kill:rank=3:step=5:phase=local")], 0, 0, None)
    assert with_faults(stack, other_rank) is stack
    mine = FaultInjector([parse_fault("rank-kill:rank=0:step=5:phase=local")], 0, 0, None)
    wrapped = with_faults(stack, mine)
    assert isinstance(wrapped, LevelStack) and [level.name for level in wrapped] == ["local", "pfs"]
    assert all(isinstance(level, FaultyLevel) for level in wrapped)
    assert wrapped.landing is wrapped[0]
