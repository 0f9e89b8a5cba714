"""L4: the parallel file system, shared by all ranks.

    <pfs_dir>/v<step>/shard-r<rank>.hck   every rank's shard
    <pfs_dir>/v<step>/manifest.json       the commit record, written last by the coordinator

The flush may be throttled to a bandwidth cap so it does not starve other jobs' I/O.
"""

from __future__ import annotations

import time
from pathlib import Path

from hpcckpt.levels.base import VersionedLevel, hold_to_bandwidth, list_version_steps, remove_tree
from hpcckpt.levels.spares import SpareFiles


class PfsLevel(VersionedLevel):
    name = "pfs"
    label = "L4 pfs"
    config_key = "storage.pfs_dir"

    def __init__(self, root: str | Path, rank: int, bandwidth_mb: float = 0.0, direct_io: bool = False,
                 spares: SpareFiles | None = None):
        super().__init__(root, rank, direct_io, spares)
        self.bandwidth_bytes = bandwidth_mb * 1e6

    def commit_path(self, step: int) -> Path:
        """The one commit record, written by the coordinator (rank 0)."""
        return self.version_dir(step) / "manifest.json"

    def write_image(self, step: int, image):
        started = time.perf_counter()
        info = super().write_image(step, image)
        hold_to_bandwidth(info.size, self.bandwidth_bytes, started)
        return info

    def write_shard_bytes(self, step: int, data) -> None:
        started = time.perf_counter()
        super().write_shard_bytes(step, data)
        hold_to_bandwidth(len(memoryview(data).cast("B")), self.bandwidth_bytes, started)

    def committed_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root) if self.commit_path(s).is_file()]

    def uncommitted_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root) if not self.commit_path(s).is_file()]

    def remove(self, step: int) -> None:
        """(coordinator) Delete a whole version: commit record first, then the shards, which
        become every rank's spares where recycling is on (the coordinator retires them all;
        each rank's next L4 write takes its own)."""
        self.commit_path(step).unlink(missing_ok=True)
        if self.spares.enabled:
            try:
                shards = sorted(self.version_dir(step).glob("shard-r*.hck"))
            except OSError:
                shards = []
            for path in shards:
                self.spares.retire(path)
        remove_tree(self.version_dir(step))
