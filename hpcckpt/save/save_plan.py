"""What one version's save does, decided apart from doing it (pure: no MPI, no I/O, no
threads). The save pipeline (save/pipeline.py) asks these before and after each stage:

plan:    the levels due split into the node-local stage (stored together, committed with one
         record per rank) and the global levels;
route:   after the node-local stage, how the global levels take the version: at their own
         pace from the landing level's files (a copy behind the run, save/flush.py), now from
         those files (the final version), or here from the snapshot (no copy at its own pace,
         or the node-local stage failed on some or all ranks, which then have no file);
decide:  a failed stage makes room and tries once more (out of space, room not yet made),
         degrades to the levels that work (any other storage failure), or fails the
         checkpoint (anything else: memory, a codec, a file in the way); a version some
         ranks' nodes could not take stands while the other ranks' redundancy supplies
         their shards.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRY = "make room and try once more"
DEGRADE = "degrade to the levels that work"
FAIL = "fail the checkpoint"

OWN_PACE = "at its own pace from the landing level's files"
NOW_FROM_FILES = "now, from the landing level's files"
HERE = "here, from the snapshot"

NODE_LOCAL_OK, NODE_LOCAL_PARTIAL, NODE_LOCAL_FAILED = "stored", "stored without some ranks", "failed"


@dataclass(frozen=True)
class SavePlan:
    """The levels due for one version, split by stage, each in the stack's order."""

    node_local: tuple  # stored together; the first (L1) on the writer thread, the others beside it
    global_levels: tuple

    @property
    def empty(self) -> bool:
        return not (self.node_local or self.global_levels)


@dataclass(frozen=True)
class GlobalRoute:
    """How the global levels take a version after the node-local stage."""

    levels: tuple  # the global levels that take it (all of them when nothing else holds it)
    how: str  # OWN_PACE, NOW_FROM_FILES or HERE
    wait_first: bool = False  # the copy at its own pace in flight finishes first (this one goes here)


def plan_save(due) -> SavePlan:
    """The stages of a version due on `due` (levels in stack order)."""
    return SavePlan(tuple(level for level in due if level.node_local),
                    tuple(level for level in due if not level.node_local))


def route_global(plan: SavePlan, outcome: str, all_global: tuple, at_own_pace: bool, owed: bool,
                 final: bool) -> GlobalRoute:
    """The global levels' way to the version. `outcome`: the node-local stage's (NODE_LOCAL_*;
    NODE_LOCAL_OK when none was due); `at_own_pace`: a copy at its own pace runs for this job;
    `owed`: the last version due there has not reached it yet."""
    if outcome == NODE_LOCAL_FAILED:  # nothing else holds it: every global level, due or not
        return GlobalRoute(all_global, HERE, wait_first=at_own_pace)
    if outcome == NODE_LOCAL_PARTIAL:  # some ranks have no file to copy from
        if at_own_pace and (plan.global_levels or owed):
            return GlobalRoute(all_global, HERE, wait_first=True)
        return GlobalRoute(plan.global_levels, HERE)
    if at_own_pace and plan.node_local:
        return GlobalRoute(plan.global_levels, NOW_FROM_FILES if final else OWN_PACE)
    return GlobalRoute(plan.global_levels, HERE)


def decide(storage_failure: bool, out_of_space: bool, room_untried: bool) -> str:
    """What a failed stage leads to (RETRY, DEGRADE or FAIL)."""
    if not storage_failure:
        return FAIL
    if out_of_space and room_untried:
        return RETRY
    return DEGRADE


def partial_version_stands(lost: frozenset, supplied: frozenset) -> bool:
    """A version whose node-local parts are missing on the `lost` ranks stands while the
    redundancy levels due supply every one of their shards from the others' files."""
    return bool(lost) and lost <= supplied
