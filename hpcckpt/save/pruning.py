"""Retention applied to the storage after each version (the rules are save/retention.py's,
pure): which committed versions and leftovers of each level go, and the deleting itself, on
each rank's own part of the storage. A failure here loses nothing and stops nothing."""

from __future__ import annotations

from typing import Callable

from hpcckpt.save.retention import newest_known_good, newest_redundant_versions, versions_to_delete
from hpcckpt.errors import HpcckptError
from hpcckpt.format.manifest import Manifest


class Pruner:
    """(each rank) Deletes the versions retention drops. The node-local levels share version
    directories, so they keep and drop versions together, decided by the first (L1's commit
    records); each deletes its own files. `pinned()`: versions not to delete now (the one L4
    is copying at its own pace)."""

    def __init__(self, levels, settings, records, log, pinned: Callable[[], set] = set,
                 chains_matter: Callable[[], bool] = lambda: False):
        self.levels = levels
        self.node_local = levels.node_local
        self.global_levels = levels.global_levels
        self.keep = settings.keep
        self.keep_best = settings.keep_best
        self.keep_known_good = settings.keep_known_good
        self.records = records
        self.log = log
        self.pinned = pinned
        self.chains_matter = chains_matter  # the job protects keyed tables: kept versions keep their chains
        # Versions the node-local levels committed while this rank's node could not take its
        # part: they count toward its node-local retention as on the other ranks, or it would
        # keep an older version there that no other rank keeps.
        self.committed_without_me: set[int] = set()

    def apply(self, newest: int, global_too: bool = True) -> None:
        """Delete old whole versions; uncommitted leftovers older than `newest` go too."""
        if self.node_local:
            self.prune("node-local", lambda: self._prune_node_local(newest))
        if global_too:
            self.prune_global(newest)

    def _prune_node_local(self, newest: int) -> None:
        first = self.node_local[0]
        # Every node-local level's uncommitted files, and those of levels this job does not
        # run, in one scan of the directory.
        steps = self.deletable(first, self.keep["node_local"], newest, set(first.stray_steps()), pin_redundant=True,
                               pinned=self.pinned(), also_committed=self.committed_without_me)
        for step in steps:
            self.remove_node_local(step)
            self.committed_without_me.discard(step)

    def prune_global(self, newest: int) -> None:
        for level in self.global_levels:
            if level.prunes_here:
                self.prune(level.label, lambda level=level: [level.remove(step) for step in self.deletable(
                    level, self.keep["global"], newest)])

    def remove_node_local(self, step: int) -> None:
        self.levels.remove_node_local(step)

    def prune(self, where: str, prune: Callable[[], object]) -> None:
        """Retention on one rank's part of the storage. Its failure (a directory gone, an I/O
        error) loses nothing and stops nothing, and on one rank alone it must not fail a
        collective path: logged, and retention runs again at the next checkpoint."""
        try:
            prune()
        except (OSError, HpcckptError) as exc:
            if self.log:
                self.log.warning(f"retention on {where} storage failed: {exc}; older versions stay until the next "
                                 "checkpoint's retention")

    def deletable(self, level, keep: int, newest: int, leftovers: set[int] | None = None,
                  pin_redundant: bool = False, pinned=(), also_committed=()) -> list[int]:
        """The versions of `level` retention drops now, and its leftovers older than `newest`."""
        committed = sorted(set(level.committed_steps()) | set(also_committed))
        manifests: dict[int, Manifest | None] = {}

        def manifest(step: int) -> Manifest | None:  # each commit record read once per retention
            if step not in manifests:  # None: none here (committed_without_me), or damaged
                manifests[step] = self.records.manifest(level, step)
            return manifests[step]

        if not level.node_local:  # its one record per version: a damaged one sets the version aside
            committed = [s for s in committed if manifest(s) is not None or (level.name, s) not in self.records.aside]
        metrics = {}
        if self.keep_best:
            metrics = {s: manifest(s).metrics for s in committed if manifest(s) is not None}
        chains = {}
        if self.chains_matter():
            chains = {s: manifest(s).table_chain for s in committed if manifest(s) is not None}
        pinned = {step for step in pinned if step is not None}
        if self.keep_known_good:
            pinned |= newest_known_good(committed)
        if pin_redundant:
            pinned |= self._newest_redundant(committed, manifest)
        if leftovers is None:
            leftovers = set(level.uncommitted_steps())
        return versions_to_delete(committed, sorted(leftovers), newest, keep, metrics, self.keep_best, pinned, chains)

    def _newest_redundant(self, committed: list[int], manifest) -> set[int]:
        """The newest version each redundancy level holds stays, whatever the count says."""
        redundant = {level.name for level in self.node_local[1:]}
        if not redundant:
            return set()
        levels_by_step: dict[int, tuple] = {}
        for step in sorted(committed, reverse=True):  # newest first, read until each is found
            levels_by_step[step] = manifest(step).levels if manifest(step) is not None else ()
            if redundant <= {name for names in levels_by_step.values() for name in names}:
                break
        return set(newest_redundant_versions(levels_by_step, redundant))
