"""L1: node-local storage. Each rank writes its shard into its node's directory.

    <local_dir>/v<step>/shard-r<rank>.hck     the shard
    <local_dir>/v<step>/commit-r<rank>.json   this rank's copy of the commit record

Every rank keeps its own copy of the commit record, so a version stays readable from L1 as
long as the rank's node survives, whichever other nodes are lost. A rank only ever creates or
deletes its own files there (ranks of one node share the directory). Retired data files may
stay in <local_dir>/.spare/ for the next checkpoint to overwrite (levels/spares.py).
"""

from __future__ import annotations

from pathlib import Path

from hpcckpt.levels.base import (
    VersionedLevel,
    commit_file_name,
    files_of_rank,
    list_version_steps,
    remove_dir_if_empty,
)


class LocalLevel(VersionedLevel):
    name = "local"
    label = "L1 local"
    config_key = "storage.local_dir"

    def commit_path(self, step: int, rank: int | None = None) -> Path:
        """This rank's copy of the commit record (each rank commits: see the module docstring)."""
        return self.version_dir(step) / commit_file_name(self.rank if rank is None else rank)

    def committed_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root)
                if self.commit_path(s).is_file() and self.shard_path(s).is_file()]

    def uncommitted_steps(self) -> list[int]:
        """Versions where this rank has files but no commit record: its own shard, or only the
        replicas and parity it took for others when its own write failed (those would
        otherwise stay for good, and a full disk is when writes fail)."""
        return [s for s in list_version_steps(self.root)
                if not self.commit_path(s).is_file()
                and any(p.exists() for p in files_of_rank(self.version_dir(s), self.rank))]

    def remove(self, step: int) -> None:
        """Delete this rank's files of a version (its shard, commit record, and the replicas and
        parity it holds for others); the directory goes with the node's last rank. Data files
        become spares for the next checkpoint to overwrite, where recycling is on."""
        directory = self.version_dir(step)
        for path in files_of_rank(directory, self.rank):
            if path.suffix == ".hck":
                self.spares.retire(path)
            else:
                path.unlink(missing_ok=True)
        remove_dir_if_empty(directory)
