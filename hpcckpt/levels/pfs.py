"""L4: the parallel file system, shared by all ranks.

    <pfs_dir>/v<step>/shard-r<rank>.hck   every rank's shard
    <pfs_dir>/v<step>/manifest.json       the commit record, written last by the coordinator

The flush may be throttled to a bandwidth cap so it does not starve other jobs' I/O.
"""

from __future__ import annotations

import time
from pathlib import Path

from hpcckpt.ckpt.manifest import Manifest
from hpcckpt.ckpt.shardfile import ShardInfo, write_shard
from hpcckpt.levels.base import (
    ensure_writable_dir,
    list_version_steps,
    remove_tree,
    shard_file_name,
    version_dir_name,
)


class PfsLevel:
    name = "pfs"
    label = "L4 pfs"

    def __init__(self, root: str | Path, rank: int, bandwidth_mb: float = 0.0):
        self.root = Path(root)
        self.rank = rank
        self.bandwidth_bytes = bandwidth_mb * 1e6

    def prepare(self) -> None:
        ensure_writable_dir(self.root, "storage.pfs_dir")

    def version_dir(self, step: int) -> Path:
        return self.root / version_dir_name(step)

    def shard_path(self, step: int, rank: int | None = None) -> Path:
        return self.version_dir(step) / shard_file_name(self.rank if rank is None else rank)

    def commit_path(self, step: int) -> Path:
        return self.version_dir(step) / "manifest.json"

    def write_shard(self, step: int, world_size: int, pieces, extra: dict) -> ShardInfo:
        started = time.perf_counter()
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        info = write_shard(self.shard_path(step), step, self.rank, world_size, pieces, extra)
        if self.bandwidth_bytes > 0:
            # Pace the flush: the next one cannot start before this one's share of the cap.
            floor = info.size / self.bandwidth_bytes
            remaining = floor - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)
        return info

    def commit(self, manifest: Manifest) -> None:
        """(coordinator) Publish the version; only after every rank's shard is durable."""
        manifest.write(self.commit_path(manifest.step))

    def committed_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root) if self.commit_path(s).is_file()]

    def uncommitted_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root) if not self.commit_path(s).is_file()]

    def manifest(self, step: int) -> Manifest:
        return Manifest.read(self.commit_path(step))

    def remove(self, step: int) -> None:
        """(coordinator) Delete a whole version: commit record first, then the shards."""
        self.commit_path(step).unlink(missing_ok=True)
        remove_tree(self.version_dir(step))
