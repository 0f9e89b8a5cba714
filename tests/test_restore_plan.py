"""Rank 0's restore plan (restore/plan.py) over every rank's holdings, table-driven and without
MPI: which version every rank can load, how, and from which levels of the stack each rank
takes its shard, with every level lost or damaged in turn, partial versions, writings of
other runs and the restart ledger's entries.

The job: 4 ranks on 4 nodes, L1 local, L2 partner (rank r's replica held by rank r+1), L3 one
erasure group of all 4 with parity 1, L4 pfs. Holdings are built as restore/discover.py
builds them from real level objects of rank 0 (what the plan asks of them is pure).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpcckpt.cluster.topology import Topology
from hpcckpt.errors import CheckpointError, ConfigError, StartOverInNewProcesses, UnrecoverableError
from hpcckpt.levels.base import LevelStack
from hpcckpt.levels.erasure import ErasureLevel
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.survey import Writing
from hpcckpt.restore.discover import Holdings
from hpcckpt.restore.plan import plan_restore

RANKS = 4
NODE_OF = (0, 1, 2, 3)
PARTNER_OF = (1, 2, 3, 0)  # rank r's replica is held by PARTNER_OF[r]
GROUP = (0, 1, 2, 3)
ALL = ("local", "partner", "erasure", "pfs")


def stack(names=ALL, tmp="/nonexistent"):
    make = {"local": lambda: LocalLevel(f"{tmp}/local", 0),
            "partner": lambda: PartnerLevel(f"{tmp}/local", 0, PARTNER_OF, None),
            "erasure": lambda: ErasureLevel(f"{tmp}/local", 0, GROUP, None, 1, groups=(GROUP,)),
            "pfs": lambda: PfsLevel(f"{tmp}/pfs", 0)}
    return LevelStack(make[name]() for name in ALL if name in names)


def job(levels=ALL, world_size=RANKS, unrecoverable="stop"):
    geometry = SimpleNamespace(rank=0, world_size=world_size, layout=SimpleNamespace(digest="layout"),
                               topology=Topology(NODE_OF[:world_size]))
    return SimpleNamespace(job=geometry, levels=stack(levels), run=SimpleNamespace(pfs_dir="/pfs"), log=None,
                           failures_per_second=0.0, unrecoverable=unrecoverable)


def writing(world_size=RANKS, identity="run-a", created=1.0):
    return Writing(identity, created, world_size, "run", (tuple(range(world_size)),), 1, "layout")


class Rank:
    """One rank's holdings, built level by level as discovery finds them."""

    def __init__(self, rank: int, node_files: bool = True):
        self.rank = rank
        self.written, self.supplies = {}, {}
        self.node_files = node_files
        self.interrupted = ()

    def has(self, level: str, step: int, w: Writing | None = None, usable: bool = True) -> "Rank":
        w = w or writing()
        self.written.setdefault(level, {})[step] = w
        if usable:
            held = {"local": {self.rank}, "pfs": {self.rank}, "erasure": set(GROUP),
                    "partner": {PARTNER_OF.index(self.rank)}}[level]
            self.supplies.setdefault(level, {})[step] = frozenset(held)
        return self

    def everywhere(self, step: int, levels=ALL, w: Writing | None = None) -> "Rank":
        for level in levels:
            self.has(level, step, w)
        return self

    def holdings(self) -> Holdings:
        return Holdings(self.written, self.supplies, self.node_files, self.interrupted)


def intact(steps=(10, 20), levels=ALL) -> list[Rank]:
    ranks = [Rank(r) for r in range(RANKS)]
    for r in ranks:
        for step in steps:
            r.everywhere(step, levels)
    return ranks


def lose_node(ranks: list[Rank], rank: int, steps=(10, 20), keep_global=True) -> None:
    """The node of `rank` is gone: its node-local directory with it; L4 still holds its shard."""
    lost = Rank(rank, node_files=False)
    for step in steps:
        if keep_global and "pfs" in ranks[rank].written:
            lost.has("pfs", step)
    ranks[rank] = lost


def plan(ranks, levels=ALL, mode="auto", wanted=None, ledger=None, world_size=RANKS, unrecoverable="stop"):
    return plan_restore(job(levels, world_size, unrecoverable), [r.holdings() for r in ranks], mode, wanted, ledger)


def sources_of(answers, step):
    return [answers[rank].get(step) for rank in range(len(answers))]


def test_every_rank_reads_every_level_in_the_stacks_order_when_nothing_is_lost():
    outlook, answers = plan(intact())
    assert [c.step for c in outlook.candidates] == [20, 10]
    assert all(c.route == "same" for c in outlook.candidates)
    assert sources_of(answers, 20) == [ALL] * RANKS
    assert outlook.candidates[0].lacking == {"partner": frozenset(), "erasure": frozenset()}
    assert outlook.candidates[0].whole_on == "pfs"
    assert outlook.nodes_with_files == RANKS


# One node lost, then each level of the stack missing as well: what rank 1 (the lost node's)
# can still read, and whether the version still loads.
@pytest.mark.parametrize("levels, expected", [
    (ALL, ("partner", "erasure", "pfs")),
    (("local", "erasure", "pfs"), ("erasure", "pfs")),
    (("local", "partner", "pfs"), ("partner", "pfs")),
    (("local", "partner", "erasure"), ("partner", "erasure")),
    (("local", "pfs"), ("pfs",)),
    (("local", "partner"), ("partner",)),
    (("local", "erasure"), ("erasure",)),
])
def test_a_lost_node_is_served_by_every_other_level_that_holds_its_shard(levels, expected):
    ranks = intact(levels=levels)
    lose_node(ranks, 1)
    outlook, answers = plan(ranks, levels)
    assert outlook.candidates[0].step == 20 and outlook.candidates[0].route == "same"
    assert answers[1][20] == expected
    assert answers[3][20] == tuple(levels)  # its replica is on rank 0's node: every level
    assert answers[0][20] == tuple(level for level in levels if level != "partner")  # held by rank 1
    if "erasure" in levels:
        assert outlook.candidates[0].lacking["erasure"] == frozenset({1})
    assert outlook.nodes_with_files == RANKS - 1


def test_a_lost_node_without_redundancy_or_l4_leaves_nothing_to_load():
    ranks = intact(levels=("local",))
    lose_node(ranks, 1)
    with pytest.raises(UnrecoverableError, match=r"rank\(s\) \[1\] on node\(s\) \[1\] are on no surviving level"):
        plan(ranks, ("local",))


def test_every_version_lost_starts_over_only_where_allowed_and_only_in_new_processes_after_in_job_recovery():
    ranks = intact(levels=("local",))
    lose_node(ranks, 1)
    with pytest.raises(UnrecoverableError, match='resilience.unrecoverable = "start_over" starts the run again'):
        plan(ranks, ("local",))
    outlook, answers = plan(ranks, ("local",), unrecoverable="start_over")
    assert (outlook.candidates, outlook.lost_everything_up_to) == ((), 20)
    with pytest.raises(StartOverInNewProcesses, match="hold the lost run's state"):
        plan(ranks, ("local",), unrecoverable="relaunch")
    # Only a resuming restart starts over: an explicit version or --restart require still stops.
    for asked in (dict(wanted=20), dict(mode="require")):
        with pytest.raises(UnrecoverableError):
            plan(ranks, ("local",), unrecoverable="start_over", **asked)
    # A version still loadable is loaded, whatever the setting.
    outlook, _ = plan(intact(levels=("local",)), ("local",), unrecoverable="start_over")
    assert outlook.candidates[0].step == 20 and outlook.lost_everything_up_to is None


def test_two_lost_nodes_beat_one_parity_and_the_replica_held_next_to_them():
    ranks = intact()
    lose_node(ranks, 1)
    lose_node(ranks, 2)
    outlook, answers = plan(ranks)
    # Rank 1's replica was on rank 2's node, rank 2's is on rank 3's; the group lost 2 > 1.
    assert answers[1][20] == ("pfs",)
    assert answers[2][20] == ("partner", "pfs")
    assert outlook.candidates[0].lacking["erasure"] == frozenset({1, 2})


def test_two_lost_nodes_without_l4_fall_back_to_nothing_and_say_which_shards_are_gone():
    levels = ("local", "partner", "erasure")
    ranks = intact(levels=levels)
    lose_node(ranks, 1)
    lose_node(ranks, 2)
    with pytest.raises(UnrecoverableError, match=r"rank\(s\) \[1\] on node\(s\) \[1\]"):
        plan(ranks, levels)


@pytest.mark.parametrize("damaged", ["partner", "erasure", "pfs"])
def test_a_level_damaged_on_a_surviving_rank_no_longer_serves_what_it_lost(damaged):
    ranks = intact()
    lose_node(ranks, 1)
    # Rank 2 held rank 1's replica; rank 3 one of the group's parity pieces: each goes in turn,
    # and L4 loses rank 1's file.
    holder = {"partner": 2, "erasure": 3, "pfs": 1}[damaged]
    ranks[holder].supplies.get(damaged, {}).pop(20, None)
    outlook, answers = plan(ranks)
    remaining = tuple(level for level in ("partner", "erasure", "pfs") if level != damaged)
    assert answers[1][20] == remaining
    if damaged == "erasure":  # a member without its parity is one more lost member: 2 > 1
        assert outlook.candidates[0].lacking["erasure"] == frozenset({1, 3})


def test_a_version_some_ranks_stopped_writing_before_the_commit_is_skipped_and_written_again():
    # Ranks 0-2 committed their L1 copies of 20; rank 3 wrote its shard and stopped.
    ranks = intact(steps=(10,))
    for r in ranks[:3]:
        r.has("local", 20)
    ranks[3].interrupted = (20,)
    outlook, answers = plan(ranks)
    assert outlook.unfinished == (20,)
    assert [c.step for c in outlook.candidates] == [10]


def test_a_rank_without_any_copy_that_is_not_interrupted_is_damage_not_an_unfinished_version():
    ranks = intact(steps=(10,), levels=("local",))
    for r in ranks[:3]:
        r.everywhere(20, ("local",))
    outlook, _ = plan(ranks, ("local",))
    assert outlook.unfinished == ()
    assert [c.step for c in outlook.candidates] == [10]  # 20 cannot be loaded: the older one is tried


def test_only_the_newest_writing_of_a_step_counts():
    # Rank 3 holds an older run's writing of step 20 (another identity, created earlier):
    # its copies are dropped, and rank 3 takes its shard from the newest writing's levels.
    ranks = intact(steps=(10,))
    newest = writing(identity="run-b", created=2.0)
    for r in ranks[:3]:
        r.everywhere(20, w=newest)
    ranks[3].everywhere(20, w=writing(identity="run-a", created=1.0))
    outlook, answers = plan(ranks)
    assert outlook.candidates[0].step == 20
    # Rank 0 holds its replica of the newest writing, and the group lacks only rank 3's pieces.
    assert answers[3][20] == ("partner", "erasure")
    assert outlook.candidates[0].lacking["erasure"] == frozenset({3})


def test_copies_made_under_another_placement_serve_nobody_as_written():
    # Discovery records what a level supplies only for this job's placement: without them,
    # a lost node is read from L4 alone.
    ranks = intact()
    for r in ranks:
        for level in ("partner", "erasure"):
            r.supplies[level].pop(20)
    lose_node(ranks, 1)
    _, answers = plan(ranks)
    assert answers[1][20] == ("pfs",)


def test_a_version_written_by_another_rank_count_is_repartitioned_from_l4():
    ranks = [Rank(r) for r in range(2)]
    for r in ranks:
        r.has("pfs", 30, writing(world_size=4), usable=False)  # discovery: another rank count
    outlook, answers = plan(ranks, world_size=2)
    candidate = outlook.candidates[0]
    assert (candidate.step, candidate.route, candidate.whole_on) == (30, "repartition", "pfs")
    assert answers == [{}, {}]  # a repartition has no per-rank sources: the plan is in the candidate


class Ledger:
    path = "restarts.json"

    def __init__(self, failed=(), pending=None):
        self._failed = {step: "the restart crashed twice" for step in failed}
        self.pending = pending

    def settle_pending(self, nodes_with_files, failures_per_second=0.0):
        return self.pending

    def failed_steps(self):
        return dict(self._failed)


def test_versions_the_ledger_marks_failed_are_not_candidates():
    outlook, _ = plan(intact(), ledger=Ledger(failed=(20,)))
    assert [c.step for c in outlook.candidates] == [10]
    assert outlook.failed == {20: "the restart crashed twice"}


def test_when_every_loadable_version_is_marked_failed_the_plan_says_so():
    with pytest.raises(UnrecoverableError, match="marked failed after crashed restarts"):
        plan(intact(), ledger=Ledger(failed=(10, 20)))


def test_an_explicit_version_is_the_only_candidate():
    outlook, answers = plan(intact(), wanted=10)
    assert [c.step for c in outlook.candidates] == [10]
    with pytest.raises(UnrecoverableError, match="version 15"):
        plan(intact(), wanted=15)


@pytest.mark.parametrize("mode, stored, outcome", [
    ("auto", False, None),
    ("require", False, CheckpointError),
    ("never", True, ConfigError),
    ("never", False, None),
])
def test_restart_modes(mode, stored, outcome):
    ranks = intact() if stored else [Rank(r, node_files=False) for r in range(RANKS)]
    if outcome is None:
        outlook, _ = plan(ranks, mode=mode)
        assert outlook.candidates == ()
    else:
        with pytest.raises(outcome):
            plan(ranks, mode=mode)
