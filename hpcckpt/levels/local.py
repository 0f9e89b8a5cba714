"""L1: node-local storage. Each rank writes its shard into its node's directory.

    <local_dir>/v<step>/shard-r<rank>.hck     the shard
    <local_dir>/v<step>/commit-r<rank>.json   this rank's copy of the commit record

Every rank keeps its own copy of the commit record, so a version stays readable from L1 as
long as the rank's node survives, whichever other nodes are lost. A rank only ever creates or
deletes its own files there (ranks of one node share the directory).
"""

from __future__ import annotations

from pathlib import Path

from hpcckpt.ckpt.manifest import Manifest
from hpcckpt.ckpt.shardfile import ShardInfo, write_shard
from hpcckpt.levels.base import (
    commit_file_name,
    ensure_writable_dir,
    files_of_rank,
    list_version_steps,
    remove_dir_if_empty,
    shard_file_name,
    version_dir_name,
)


class LocalLevel:
    name = "local"
    label = "L1 local"

    def __init__(self, root: str | Path, rank: int):
        self.root = Path(root)
        self.rank = rank

    def prepare(self) -> None:
        ensure_writable_dir(self.root, "storage.local_dir")

    def version_dir(self, step: int) -> Path:
        return self.root / version_dir_name(step)

    def shard_path(self, step: int, rank: int | None = None) -> Path:
        return self.version_dir(step) / shard_file_name(self.rank if rank is None else rank)

    def commit_path(self, step: int, rank: int | None = None) -> Path:
        return self.version_dir(step) / commit_file_name(self.rank if rank is None else rank)

    def write_shard(self, step: int, world_size: int, pieces, extra: dict) -> ShardInfo:
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        return write_shard(self.shard_path(step), step, self.rank, world_size, pieces, extra)

    def commit(self, manifest: Manifest) -> None:
        """(each rank) Record that the version is complete on every rank."""
        manifest.write(self.commit_path(manifest.step))

    def committed_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root)
                if self.commit_path(s).is_file() and self.shard_path(s).is_file()]

    def uncommitted_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root)
                if not self.commit_path(s).is_file() and self.shard_path(s).exists()]

    def manifest(self, step: int) -> Manifest:
        return Manifest.read(self.commit_path(step))

    def write_shard_bytes(self, step: int, data) -> None:
        """Put back a shard rebuilt from another level (its bytes are the original file's)."""
        from hpcckpt.ckpt.shardfile import write_bytes_atomically

        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(self.shard_path(step), memoryview(data))

    def remove(self, step: int) -> None:
        """Delete this rank's files of a version (its shard, commit record, and the replicas and
        parity it holds for others); the directory goes with the node's last rank."""
        directory = self.version_dir(step)
        for path in files_of_rank(directory, self.rank):
            path.unlink(missing_ok=True)
        remove_dir_if_empty(directory)
