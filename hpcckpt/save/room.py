"""Making room on a level that ran out of space: which of its own versions it may drop
to fit the new one, and whether dropping them would make it fit.

A level that reports ENOSPC (or EDQUOT) for a version may drop its own older versions and
try once more, but only versions another level holds complete (a node-local version that L4
holds, an L4 version the node-local levels hold), never the newest complete version anywhere,
never the best one by checkpoint.keep_best, never one being copied, never one a version kept
there builds its keyed tables on (its chain, format/keyed_rows.py). It drops the fewest,
oldest first, that make the new version fit by the file system's free space, and nothing
when even all of them would not: a drop that cannot make room would only lose a copy. When
the free space says the version fits already (a quota statvfs cannot see, or space freed in
between), it drops nothing either: there is nothing to measure the drop against.
"""

from __future__ import annotations

import errno
import os
from typing import Callable

from hpcckpt.levels.node_places import allocated_bytes, free_bytes
from hpcckpt.save.retention import best_step
from hpcckpt.cluster.collectives import fold_at_root, on_root
from hpcckpt.errors import HpcckptError

PAGE = 4096
_SPACE_ERRORS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def out_of_space(error: Exception) -> bool:
    """Whether an agreed failure was a full file system or quota on some rank (the ranks' own
    errors travel as text: collectives.describe_failure)."""
    texts = [str(error), *map(str, getattr(error, "failures_by_rank", {}).values())]
    return any(sign in text for text in texts for sign in _SPACE_ERRORS)


def droppable(on_level, held_elsewhere, newest_anywhere: int | None, best: int | None, pinned) -> list[int]:
    """The versions of a level it may drop to make room, oldest first."""
    return sorted(step for step in on_level
                  if step in held_elsewhere and step != newest_anywhere and step != best and step not in pinned)


def how_many_to_drop(free: int, needed: int, sizes: list[int]) -> int | None:
    """The fewest of the droppable versions' `sizes` (oldest first) that, with `free`, hold
    `needed` bytes: 0 when the free space holds them already, None when all would not."""
    if free >= needed:
        return 0
    total = free
    for count, size in enumerate(sizes, 1):
        total += size
        if total >= needed:
            return count
    return None


def bytes_to_write(file_sizes) -> int:
    """What files of these sizes take on a file system of 4 KiB blocks, with a commit record
    and the version's directory."""
    return sum(-(-int(size) // PAGE) * PAGE for size in file_sizes) + 2 * PAGE


def _chain_members(level, steps) -> set[int]:
    """The versions that versions of `level` build their keyed tables on (their chains, less
    themselves), as this rank reads their records there."""
    members = set()
    for step in steps:
        try:
            members.update(s for s in level.manifest(step).table_chain if s != step)
        except (HpcckptError, OSError):
            pass
    return members


def _not_to_drop(each: list) -> set[int]:
    """(rank 0) From every rank's (version it copies to L4, versions its kept ones build on)."""
    return {copying for copying, _ in each if copying is not None} | set().union(*(chains for _, chains in each))


class RoomMaker:
    """(all ranks) Drops versions for a level that ran out of space, agreed across ranks: the
    same versions everywhere, or none. `remove_node_local(step)` deletes this rank's files of
    a version on every node-local level; `prune(where, action)` runs a deletion that may fail
    on one rank without failing the collective path (the pipeline's retention does both)."""

    def __init__(self, rank: int, node_local: list, global_levels: list, keep_best: str, log,
                 remove_node_local: Callable[[int], None], prune: Callable):
        self.rank = rank
        self.node_local = node_local
        self.global_levels = global_levels
        self.keep_best = keep_best
        self.log = log
        self.remove_node_local = remove_node_local
        self.prune = prune
        # Versions a global level dropped: the end-of-run drain does not put them back.
        self.dropped: dict[str, set[int]] = {}
        self._warned: set[str] = set()

    def on_global(self, level, version, comm) -> bool:
        """(all ranks of comm) A global level ran out of space for `version`: drop its versions
        the node-local levels hold, as few as make it fit. True: dropped some."""
        step = version.step
        node_local = self._node_local_steps(comm)

        def choose() -> list[int]:  # the coordinator measures the shared directory
            committed = level.committed_steps()
            candidates = droppable(committed, node_local, max({step, *node_local, *committed}),
                                   self._best(level, committed), pinned=_chain_members(level, committed))
            count = how_many_to_drop(free_bytes(level.root), version.version_bytes,
                                     [allocated_bytes(level.version_dir(s)) for s in candidates])
            return candidates[:count] if count else []
        try:
            dropped = on_root(comm, f"making room on {level.label}", choose)
        except HpcckptError as exc:
            if self.log:
                self.log.warning(f"cannot make room on {level.label} for version {step}: {exc}")
            return False
        self.dropped.setdefault(level.name, set()).update(dropped)
        for dropped_step in dropped:
            self.prune(level.label, lambda dropped_step=dropped_step: level.remove(dropped_step))
        self._say(level.label, step, dropped, "the node-local levels hold")
        return bool(dropped)

    def on_node_local(self, comm, version, label: str, copying: int | None) -> bool:
        """(all ranks) The node-local levels ran out of space on some node for `version`: drop
        versions L4 holds, the same on every node, as few as make it fit on the node shortest
        of space; never `copying` (L4 copies it from L1 on some rank). True: dropped some."""
        step = version.step
        first = self.node_local[0]
        node_local = self._node_local_steps(comm)
        try:
            on_global = on_root(comm, "listing L4's versions", lambda: {
                s for level in self.global_levels for s in level.committed_steps()})
        except HpcckptError:
            on_global = set()  # then nothing here is held elsewhere: nothing to drop
        chains = _chain_members(first, node_local)
        pinned = fold_at_root(comm, (copying, chains), _not_to_drop)
        # The version being written is complete nowhere yet: the newest complete one stays.
        candidates = droppable(node_local, on_global, max({*node_local, *on_global}, default=None),
                               self._best(first, node_local), pinned)
        newest_here = max(node_local, default=None)
        # This job's previous version on this node is the best guess of what the next takes.
        needed = (allocated_bytes(first.version_dir(newest_here)) if newest_here is not None
                  else 3 * bytes_to_write([version.shard_sizes[self.rank]]))
        # The file system the version goes to (memory or the disk: levels/node_places.py); only
        # versions there give it room, and only those there on every node are dropped anywhere.
        target = first.version_dir(step).parent
        candidates = fold_at_root(comm, [s for s in candidates if first.version_dir(s).parent == target],
                                  lambda lists: [s for s in lists[0] if all(s in other for other in lists)])
        count = how_many_to_drop(free_bytes(target), needed, [allocated_bytes(first.version_dir(s)) for s in candidates])
        # The node shortest of space decides; one that cannot make room stops it everywhere.
        most = fold_at_root(comm, count, lambda counts: None if None in counts else max(counts))
        if not most:
            return False
        dropped = candidates[:most]
        for dropped_step in dropped:
            self.prune("node-local", lambda dropped_step=dropped_step: self.remove_node_local(dropped_step))
        self._say(label, step, dropped, "L4 holds")
        return True

    def _node_local_steps(self, comm) -> set[int]:
        """The versions committed on the node-local levels of every rank."""
        if not self.node_local:
            return set()
        try:
            mine = self.node_local[0].committed_steps()
        except OSError:
            mine = []  # nothing counts as held there: nothing is dropped for it
        return fold_at_root(comm, mine, lambda held: set.intersection(*map(set, held)))

    def _best(self, level, committed) -> int | None:
        """The version retention keeps as the best by checkpoint.keep_best, among `committed`."""
        if not self.keep_best:
            return None
        metrics = {}
        for step in committed:
            try:
                metrics[step] = level.manifest(step).metrics
            except (HpcckptError, OSError):
                pass
        return best_step(metrics, self.keep_best)

    def _say(self, label: str, step: int, dropped: list[int], held_by: str) -> None:
        """One warning per level, then the rank log; a metrics record each time."""
        if not dropped or not self.log:
            return
        message = (f"{label} was out of space for version {step}: dropped version(s) {dropped}, which {held_by}, "
                   "and tried once more")
        if label in self._warned:
            self.log.info(message)
        else:
            self._warned.add(label)
            self.log.warning(f"{message}; while space is short it keeps fewer versions than retention would")
        self.log.metrics({"event": "level_made_room", "level": label, "step": step, "dropped": dropped})
