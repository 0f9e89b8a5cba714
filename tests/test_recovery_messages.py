"""The one line a failed recovery prints: it must tell a lost node from a rank that was still writing."""

from types import SimpleNamespace

from hpcckpt.cluster.topology import Topology
from hpcckpt.levels.base import LevelStack
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.survey import Writing
from hpcckpt.restore.discover import Holdings
from hpcckpt.restore.plan import _missing_message

WRITING = Writing("run-a", 1.0, 4, "run", ((0, 1, 2, 3),), 1, "layout")


class _Ranks:
    """Holdings by rank, as discovery lists them: committed L1 versions live in version
    directories, so their node holds files."""

    def __init__(self):
        self.next_rank = 0

    def __call__(self, local=()):
        rank, self.next_rank = self.next_rank, self.next_rank + 1
        return Holdings(written={"local": {step: WRITING for step in local}},
                        supplies={"local": {step: frozenset({rank}) for step in local}}, node_files=bool(local))


def job(node_of_rank):
    geometry = SimpleNamespace(world_size=len(node_of_rank), topology=Topology(tuple(node_of_rank)))
    return SimpleNamespace(job=geometry, levels=LevelStack([LocalLevel("/nonexistent", 0)]))


def test_lost_nodes_and_an_unfinished_rank_on_a_surviving_node_are_named_apart():
    # Nodes 1 and 0 of 2 nodes x 2 ranks: node 1 is gone; on node 0, rank 0 finished version 8
    # and rank 1 only had version 4 when the job stopped.
    holdings = _Ranks()
    everyone = [holdings((4, 8)), holdings((4,)), holdings(), holdings()]
    message = _missing_message(job([0, 0, 1, 1]), everyone, 8)
    assert "the shards of rank(s) [2, 3] on node(s) [1] are on no surviving level" in message
    assert "rank(s) [1] on surviving node(s) [0] hold no copy of it" in message
    assert "restart from an older version" in message


def test_only_lost_nodes_name_no_unfinished_rank():
    holdings = _Ranks()
    everyone = [holdings((8,)), holdings((8,)), holdings(), holdings()]
    message = _missing_message(job([0, 0, 1, 1]), everyone, 8)
    assert "rank(s) [2, 3] on node(s) [1]" in message and "surviving node" not in message


def test_a_node_with_only_uncommitted_files_counts_as_surviving():
    # The job died in its first checkpoint: node 0 holds only half-written files, node 1 is gone.
    started = Holdings(node_files=True)
    holdings = _Ranks()
    everyone = [started, started, holdings(), holdings()]
    message = _missing_message(job([0, 0, 1, 1]), everyone, 4)
    assert "rank(s) [2, 3] on node(s) [1] are on no surviving level" in message
    assert "rank(s) [0, 1] on surviving node(s) [0] hold no copy" in message
