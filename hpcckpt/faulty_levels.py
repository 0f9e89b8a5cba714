"""Fault injection around the levels: each level of the stack is wrapped, from outside, in a
level that strikes the injected faults (faults.py) where that level's store and commit would
meet them, so the save pipeline runs the same code with faults as without and never asks
about them.

Where a fault strikes, as a real one would:
- a crash (`phase` = the level's name) just before the level's store, and `phase=commit`
  just before a commit record is written;
- a storage error or a slow store of a level that writes alone (L1, L4) before its write,
  so nothing is written; of a collective level (L2, L3) after its transfers, where its file
  is written, so its peers never wait for a rank whose directory is full;
- a `node-local` storage error on every node-local write of the rank, its commit record
  included.

A run without injected faults keeps its levels unwrapped.
"""

from __future__ import annotations

from hpcckpt.levels.base import LevelStack

_OWN_ATTRIBUTES = ("_level", "_faults")


class FaultyLevel:
    """A level of the stack with injected faults struck around its store and commit; every
    other attribute, read or set, is the wrapped level's."""

    def __init__(self, level, faults):
        object.__setattr__(self, "_level", level)
        object.__setattr__(self, "_faults", faults)

    def __getattr__(self, name):
        return getattr(self._level, name)

    def __setattr__(self, name, value):
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._level, name, value)

    def __repr__(self) -> str:
        return f"FaultyLevel({self._level!r})"

    def store(self, version) -> int:
        level, faults = self._level, self._faults
        faults.strike(version.step, level.name)
        if not level.collective:
            faults.storage_fault(version.step, level.name)
        stored = level.store(version)
        if level.collective:
            faults.storage_fault(version.step, level.name)
        return stored

    def commit(self, manifest) -> None:
        level, faults = self._level, self._faults
        faults.strike(manifest.step, "commit")
        if level.node_local:
            faults.storage_fault(manifest.step, "node-local commit")
        level.commit(manifest)


def with_faults(levels: LevelStack, faults) -> LevelStack:
    """`levels`, each wrapped to strike `faults` (a faults.FaultInjector); as they are when
    none of its faults is for this rank."""
    if not faults.faults:
        return levels
    return LevelStack(FaultyLevel(level, faults) for level in levels)
