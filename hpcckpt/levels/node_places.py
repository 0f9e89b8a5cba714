"""Where a node keeps its versions: in memory first, on the node's disk when memory is full.

A node-local version (L1's shards, L2's replicas, L3's parity and the commit records) lives
in the memory directory (storage.memory_dir: a RAM file system such as /dev/shm, whose files
outlive a crashed process and go with the node's reboot or loss, as SCR's cache there does)
while the node's versions in memory stay within the budget (storage.memory_budget_mb per
node), else in storage.local_dir on the node's disk. Every rank places a version alike (the
save agrees before anything is written: save/pipeline.py), so each version lives whole in
one place on a node; reads look in memory first. Without a memory directory, every version
is on the disk, as before there was one.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcckpt.levels.naming import list_version_steps, version_dir_name

# File systems whose files are in RAM: fast, and gone with the node.
RAM_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})


class NodePlaces:
    """(one rank) The node-local directories of this run on this rank's node: `disk` always,
    `memory` when configured, with `budget_bytes` for the node's versions there."""

    def __init__(self, disk: str | Path, memory: str | Path | None = None, budget_bytes: int = 0):
        self.disk = Path(disk)
        self.memory = Path(memory) if memory else None
        self.budget_bytes = int(budget_bytes)
        self._placed: dict[int, Path] = {}

    @property
    def roots(self) -> tuple[Path, ...]:
        """Every directory versions may be in, the one read first first."""
        return (self.memory, self.disk) if self.memory is not None else (self.disk,)

    def version_dir(self, step: int) -> Path:
        """The version's directory: where it is on this node, else where it is to be written:
        where the save placed it, and a version it did not place (a restore putting a copy
        back on a node that lost it) on the disk, outside the memory budget's reckoning."""
        name = version_dir_name(step)
        if self.memory is not None:
            for root in self.roots:
                if (root / name).is_dir():
                    return root / name
        return self._placed.get(step, self.disk) / name

    def steps(self) -> list[int]:
        """Steps with a version directory in any of the places, ascending."""
        return sorted(set().union(*(list_version_steps(root) for root in self.roots)))

    def in_memory(self, step: int) -> bool:
        return self.memory is not None and self.version_dir(step).parent == self.memory

    def place(self, step: int, in_memory: bool) -> None:
        """Where the version `step` goes (agreed by every rank before it is written)."""
        root = self.memory if in_memory and self.memory is not None else self.disk
        self._placed[step] = root
        for old in [s for s in self._placed if s < step]:
            del self._placed[old]  # a placed version has its directory by now, or failed

    def memory_used(self) -> int:
        """Bytes the node's versions in memory take (every rank's of the node: the directory
        is the node's)."""
        if self.memory is None:
            return 0
        total = 0
        for step in list_version_steps(self.memory):
            total += allocated_bytes(self.memory / version_dir_name(step))
        return total

    def memory_fits(self, node_bytes: int) -> bool:
        """Whether `node_bytes` more of a version fit the budget and the memory file system
        beside what the node keeps there now."""
        if self.memory is None:
            return False
        return self.memory_used() + node_bytes <= self.budget_bytes and node_bytes <= free_bytes(self.memory)


def allocated_bytes(path: Path) -> int:
    """Blocks a directory tree holds: what deleting it gives back."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in (".", *files):
            try:
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except OSError:
                pass
    return total


def free_bytes(path: Path) -> int:
    """Space an unprivileged writer may still take there (0 when it cannot be measured)."""
    return _statvfs_bytes(path, "f_bavail")


def total_bytes(path: Path) -> int:
    """The size of the file system `path` is on (0 when it cannot be measured)."""
    return _statvfs_bytes(path, "f_blocks")


def _statvfs_bytes(path: Path, blocks_field: str) -> int:
    try:
        stats = os.statvfs(path)
    except OSError:
        return 0
    return getattr(stats, blocks_field) * stats.f_frsize


def file_system_type(path: str | Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system `path` is on (the longest mount point above it), or None
    where the mount table cannot be read."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind
