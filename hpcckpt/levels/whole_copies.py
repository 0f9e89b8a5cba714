"""Which levels hold a whole version, and how many node losses it survives, read from the
files in the directories reachable from one process (the offline inspect and verify, in
tools/catalog.py), not from a live level stack.

L1 holds a version whose every rank committed it; L2 and L3 where it was written to them
and every rank's replica or parity file is there; L4 where its record is complete.
"""

from __future__ import annotations

from pathlib import Path

from hpcckpt.cluster.topology import node_losses_survived
from hpcckpt.errors import HpcckptError, TopologyError
from hpcckpt.format.manifest import Manifest
from hpcckpt.format.shardfile import read_shard_table
from hpcckpt.levels.naming import ERASURE, LOCAL, PARITY_GLOB, PARTNER, PFS, REPLICA_GLOB

# Each node-local redundancy level and the files that make up its copy: one per rank.
_REDUNDANCY_FILES = ((PARTNER, REPLICA_GLOB), (ERASURE, PARITY_GLOB))


def levels_holding_whole(directories: list[Path], manifest: Manifest | None, node_local_complete: bool,
                         pfs_complete: bool) -> tuple[str, ...]:
    """The levels that hold all of a version: `directories` are its node-local version
    directories reachable here, `manifest` its record (None: unreadable)."""
    levels = []
    if node_local_complete:
        levels.append(LOCAL)
        if manifest is not None:
            levels.extend(level for level, pattern in _REDUNDANCY_FILES
                          if level in manifest.levels and _count(directories, pattern) >= manifest.world_size)
    if pfs_complete:
        levels.append(PFS)
    return tuple(levels)


def node_losses_covered(manifest: Manifest, levels: tuple[str, ...], directories: list[Path],
                        configured_geometry: tuple[int, int], by_domain: bool = False) -> int | None:
    """How many simultaneous node losses a version held whole on `levels` survives (None:
    any number, L4 holds it), or with `by_domain` how many failure-domain losses (its record's
    domains); the partner map and groups are those its record lists, else those its parity
    files or `configured_geometry` (group size, parity) make."""
    group_size, parity = 0, 0
    if ERASURE in levels:
        group_size, parity = parity_geometry(directories) or configured_geometry
    recorded = bool(manifest.partner_of or manifest.groups)
    try:
        return node_losses_survived(
            manifest.node_of_rank, partner=PARTNER in levels, pfs=PFS in levels, group_size=group_size,
            parity=manifest.parity if recorded and manifest.groups and ERASURE in levels else parity,
            partner_of=(manifest.partner_of if PARTNER in levels else ()) if recorded else None,
            groups=(manifest.groups if ERASURE in levels else ()) if recorded else None,
            domain_of_rank=manifest.domain_of_rank if by_domain else None)
    except TopologyError:
        return 0


def further_losses_covered(manifest: Manifest, committed: set[int], by_domain: bool = False) -> int:
    """For a node-local version that only the ranks `committed` hold (a node lost, or one that
    could not take it): the further node (or failure-domain) losses its L2 and L3 pieces
    still cover."""
    erasure = ERASURE in manifest.levels and bool(manifest.groups)
    try:
        return node_losses_survived(
            manifest.node_of_rank, partner=PARTNER in manifest.levels,
            partner_of=manifest.partner_of if PARTNER in manifest.levels else (),
            groups=manifest.groups if erasure else (), parity=manifest.parity if erasure else 0,
            missing=set(range(manifest.world_size)) - committed,
            domain_of_rank=manifest.domain_of_rank if by_domain else None) or 0
    except TopologyError:
        return 0


def parity_geometry(directories: list[Path]) -> tuple[int, int] | None:
    """(group size, parity) recorded in the first readable parity file."""
    for directory in directories:
        for path in sorted(directory.glob(PARITY_GLOB)):
            try:
                extra = read_shard_table(path).extra
            except (HpcckptError, OSError):
                continue
            if extra.get("group") and extra.get("parity"):
                return len(extra["group"]), int(extra["parity"])
    return None


def _count(directories: list[Path], pattern: str) -> int:
    return sum(1 for d in directories for _ in d.glob(pattern))
