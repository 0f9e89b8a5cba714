"""The save's plan and decisions (save/save_plan.py), table-driven and without MPI: which
stages a version takes, how the global levels take it after the node-local stage, and what a
failed stage leads to."""

from __future__ import annotations

import pytest

from hpcckpt.save.save_plan import (
    DEGRADE,
    FAIL,
    HERE,
    NODE_LOCAL_FAILED,
    NODE_LOCAL_OK,
    NODE_LOCAL_PARTIAL,
    NOW_FROM_FILES,
    OWN_PACE,
    RETRY,
    decide,
    partial_version_stands,
    plan_save,
    route_global,
)
from hpcckpt.levels.base import LevelStack
from hpcckpt.levels.erasure import ErasureLevel
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel

STACK = LevelStack([LocalLevel("/n", 0), PartnerLevel("/n", 0, (1, 0), None),
                    ErasureLevel("/n", 0, (0, 1, 2), None, 1), PfsLevel("/p", 0)])
L1, L2, L3, L4 = STACK


def names(levels):
    return [level.name for level in levels]


@pytest.mark.parametrize("due, node_local, global_levels", [
    (STACK, ["local", "partner", "erasure"], ["pfs"]),
    ((L1,), ["local"], []),
    ((L1, L4), ["local"], ["pfs"]),
    ((L4,), [], ["pfs"]),  # a version due on L4 alone (a restart's protect-again) has no node-local stage
    ((), [], []),
])
def test_the_plan_splits_the_levels_due_by_stage_in_the_stacks_order(due, node_local, global_levels):
    plan = plan_save(due)
    assert names(plan.node_local) == node_local and names(plan.global_levels) == global_levels
    assert plan.empty == (not due)


# (levels due, node-local outcome, L4 copies at its own pace, L4 owed, final) ->
# (levels that take it, how, whether the copy in flight finishes first)
@pytest.mark.parametrize("due, outcome, own_pace, owed, final, levels, how, wait", [
    # All well: L4 copies from L1's files behind the run, or now for the last version.
    (STACK, NODE_LOCAL_OK, True, False, False, ["pfs"], OWN_PACE, False),
    (STACK, NODE_LOCAL_OK, True, False, True, ["pfs"], NOW_FROM_FILES, False),
    ((L1,), NODE_LOCAL_OK, True, True, False, [], OWN_PACE, False),  # offered: an owed copy may start
    # No copy at its own pace (unthreaded MPI, storage.pfs_async off): L4 waits in the persist.
    (STACK, NODE_LOCAL_OK, False, False, False, ["pfs"], HERE, False),
    ((L1,), NODE_LOCAL_OK, False, False, False, [], HERE, False),
    ((L4,), NODE_LOCAL_OK, True, False, False, ["pfs"], HERE, False),
    # The node-local stage failed everywhere: every global level, due or not, from the snapshot.
    ((L1, L2), NODE_LOCAL_FAILED, True, False, False, ["pfs"], HERE, True),
    ((L1, L2), NODE_LOCAL_FAILED, False, False, False, ["pfs"], HERE, False),
    # Failed on some ranks: those have no file to copy from, so L4 takes it here when due or owed.
    (STACK, NODE_LOCAL_PARTIAL, True, False, False, ["pfs"], HERE, True),
    ((L1, L2), NODE_LOCAL_PARTIAL, True, True, False, ["pfs"], HERE, True),
    ((L1, L2), NODE_LOCAL_PARTIAL, True, False, False, [], HERE, False),
    (STACK, NODE_LOCAL_PARTIAL, False, False, False, ["pfs"], HERE, False),
])
def test_the_global_levels_route_follows_the_node_local_outcome(due, outcome, own_pace, owed, final, levels, how,
                                                                wait):
    route = route_global(plan_save(due), outcome, STACK.global_levels, own_pace, owed, final)
    assert (names(route.levels), route.how, route.wait_first) == (levels, how, wait)


@pytest.mark.parametrize("storage, out_of_space, room_untried, decision", [
    (False, False, True, FAIL),  # memory, a codec, a file in the way
    (False, True, True, FAIL),
    (True, True, True, RETRY),  # full: drop versions another level holds, then once more
    (True, True, False, DEGRADE),  # full again after making room
    (True, False, True, DEGRADE),  # read-only, I/O error, gone
])
def test_what_a_failed_stage_leads_to(storage, out_of_space, room_untried, decision):
    assert decide(storage, out_of_space, room_untried) == decision


@pytest.mark.parametrize("lost, supplied, stands", [
    ({1}, {1}, True),
    ({1, 2}, {1, 2, 3}, True),
    ({1, 2}, {1}, False),  # rank 2's shard would be on no level
    ({1}, set(), False),
    (set(), set(), False),  # nothing lost: not a partial version
])
def test_a_partial_version_stands_only_while_redundancy_supplies_every_lost_shard(lost, supplied, stands):
    assert partial_version_stands(frozenset(lost), frozenset(supplied)) == stands


def test_the_redundancy_levels_say_which_lost_ranks_they_supply():
    # What the node-local stage asks before a partial version stands (Level.supplies).
    assert L2.supplies(frozenset({1})) == {1}  # rank 1's replica is held by rank 0
    assert L2.supplies(frozenset({0, 1})) == set()  # and rank 0's by rank 1: both gone
    assert L3.supplies(frozenset({2})) == {2}
    assert L3.supplies(frozenset({1, 2})) == set()  # 2 lost > parity 1
