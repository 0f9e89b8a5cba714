"""What a node-local directory holds of every rank, whichever job wrote it.

A restart onto another rank count or other nodes (restore/flow.py, repartition/) cannot ask the
levels of the job that wrote a version: their ranks are gone. It reads the files instead
(names from levels/naming.py): the shards, replicas, parity files and commit records of
every old rank that this directory's node kept. One commit record per version is read to
learn which writing the files belong to (every rank's record of one writing is the same).
No MPI; each rank surveys its own directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.errors import HpcckptError
from hpcckpt.format.compact import pack_groups, unpack_groups
from hpcckpt.format.manifest import Manifest
from hpcckpt.levels.naming import (
    COMMIT_NAME,
    PARITY_NAME,
    REPLICA_NAME,
    SHARD_NAME,
    commit_file_name,
    list_version_steps,
    parity_file_name,
    replica_file_name,
    shard_file_name,
    version_dir_name,
)


@dataclass(frozen=True)
class Writing:
    """Which job wrote a version, from one of its commit records: enough to plan a restore
    over its ranks before the whole record is shared."""

    identity: str  # Manifest.identity: the same on every rank's copy of this writing
    created: float
    world_size: int
    run_id: str
    groups: tuple[tuple[int, ...], ...]  # its L3 groups (old ranks) and their parity
    parity: int
    layout_digest: str = ""  # Layout.digest: a job with another layout re-partitions, even on as many ranks
    table_chain: tuple[int, ...] = ()  # the versions its keyed tables need (format/keyed_rows.py)

    @classmethod
    def of(cls, manifest: Manifest) -> "Writing":
        return cls(manifest.identity, manifest.created, manifest.world_size, manifest.run_id, manifest.groups,
                   manifest.parity, manifest.layout.digest, manifest.table_chain)

    def __reduce__(self):
        # Pickled with its groups as their rule (format/compact.py), O(1) for the usual
        # placements: a writing travels from rank 0 to every rank at a restart.
        return (_unpack_writing, (self.identity, self.created, self.world_size, self.run_id,
                                  pack_groups(self.groups, self.world_size), self.parity, self.layout_digest,
                                  self.table_chain))


def _unpack_writing(identity, created, world_size, run_id, groups, parity, layout_digest, table_chain=()) -> Writing:
    return Writing(identity, created, world_size, run_id, unpack_groups(groups), parity, layout_digest, table_chain)


@dataclass(frozen=True)
class NodeLocalView:
    """One version directory as one rank sees it: which old ranks' files are there."""

    step: int
    directory: str  # the version directory; ranks that see the same one see the same files
    writing: Writing | None  # None: no readable commit record here (the files are checked later)
    commits: frozenset[int]  # old ranks with a commit record here
    shards: frozenset[int]  # old ranks whose L1 shard file is here
    replicas: frozenset[tuple[int, int]]  # (source, holder): L2 replicas here
    parity: frozenset[int]  # old ranks whose L3 parity file is here

    def path_of_shard(self, old_rank: int) -> Path:
        return Path(self.directory) / shard_file_name(old_rank)

    def path_of_replica(self, source: int) -> Path:
        holder = min(h for s, h in self.replicas if s == source)
        return Path(self.directory) / replica_file_name(source, holder)

    def path_of_parity(self, old_rank: int) -> Path:
        return Path(self.directory) / parity_file_name(old_rank)


def survey(root: str | Path, warn=None, known: dict | None = None) -> dict[int, NodeLocalView]:
    """step -> what `root` holds of that version (every version directory, complete or not).
    `known`: step -> a commit record of it the caller already read there (not read again)."""
    known = known or {}
    views = {}
    for step in list_version_steps(root):
        directory = Path(root) / version_dir_name(step)
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        commits, shards, replicas, parity = set(), set(), set(), set()
        for name in names:
            if match := SHARD_NAME.match(name):
                shards.add(int(match.group(1)))
            elif match := REPLICA_NAME.match(name):
                replicas.add((int(match.group(1)), int(match.group(2))))
            elif match := PARITY_NAME.match(name):
                parity.add(int(match.group(1)))
            elif match := COMMIT_NAME.match(name):
                commits.add(int(match.group(1)))
        writing = Writing.of(known[step]) if step in known else None
        for old_rank in sorted(commits) if writing is None else ():
            try:
                writing = Writing.of(Manifest.read(directory / commit_file_name(old_rank)))
                break
            except (HpcckptError, OSError) as exc:
                if warn:
                    warn(f"ignoring an unreadable commit record of version {step} in {directory}: {exc}")
        views[step] = NodeLocalView(step, str(directory), writing, frozenset(commits), frozenset(shards),
                                    frozenset(replicas), frozenset(parity))
    return views
