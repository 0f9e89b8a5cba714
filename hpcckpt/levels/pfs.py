"""L4: the parallel file system, shared by all ranks.

    <pfs_dir>/v<step>/shard-r<rank>.hck   every rank's shard
    <pfs_dir>/v<step>/manifest.json       the commit record, written last by the coordinator

The flush may be throttled to a bandwidth cap so it does not starve other jobs' I/O.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpcckpt.format.manifest import Manifest
from hpcckpt.levels.base import DeliveryRequest, ShardFileLevel, hold_to_bandwidth, remove_tree
from hpcckpt.levels.naming import (
    LEVEL_LABELS,
    LEVEL_NUMBERS,
    PFS_COMMIT_NAME,
    SHARD_GLOB,
    SHARD_NAME,
    STAGE_LABELS,
    free_aside_name,
    list_version_steps,
    version_dir_name,
)
from hpcckpt.levels.spares import SpareFiles

COORDINATOR = 0  # the rank that writes the commit record and deletes whole versions


def fetch_at_rate(path: Path, bytes_per_s: float, chunk: int = 4 << 20) -> None:
    """Read `path` through at most `bytes_per_s`."""
    started, done = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(chunk):
            done += len(block)
            hold_to_bandwidth(done, bytes_per_s, started)


class PfsLevel(ShardFileLevel):
    name = "pfs"
    survives_nodes = None  # off the nodes: any number of them lost
    label = LEVEL_LABELS["pfs"]
    number = LEVEL_NUMBERS["pfs"]
    stage_label = STAGE_LABELS["pfs"]
    config_key = "storage.pfs_dir"
    node_local = False
    collective = False

    def __init__(self, root: str | Path, rank: int, bandwidth_mb: float = 0.0, direct_io: bool = False,
                 spares: SpareFiles | None = None, file_mode: int = 0o666, read_bandwidth_mb: float = 0.0):
        self.root = Path(root)
        self.rank = rank
        self.direct_io = direct_io
        self.file_mode = file_mode
        self.spares = spares or SpareFiles(self.root, enabled=False)
        self.bandwidth_bytes = bandwidth_mb * 1e6
        self.read_bandwidth_bytes = read_bandwidth_mb * 1e6

    @property
    def prunes_here(self) -> bool:
        return self.rank == COORDINATOR

    def deliver(self, request: DeliveryRequest) -> Path | None:
        """This rank's own shard file; under a read cap its bytes are fetched at that rate
        first (the restore then verifies them from the page cache), as from a PFS that other
        jobs share."""
        path = super().deliver(request)
        if path is not None and self.read_bandwidth_bytes > 0:
            fetch_at_rate(path, self.read_bandwidth_bytes)
        return path

    def version_dir(self, step: int) -> Path:
        return self.root / version_dir_name(step)

    def spare_for(self, path: Path) -> Path | None:
        return self.spares.spare_for(path)

    def commit_path(self, step: int) -> Path:
        """The one commit record, written by the coordinator."""
        return self.version_dir(step) / PFS_COMMIT_NAME

    def commit(self, manifest: Manifest) -> None:
        """(all ranks) The coordinator writes the version's one commit record, after every
        rank's agreed write."""
        if self.rank == COORDINATOR:
            manifest.write(self.commit_path(manifest.step), self.file_mode)

    def withdraw(self, step: int) -> None:
        if self.rank == COORDINATOR:
            self.commit_path(step).unlink(missing_ok=True)

    def manifest(self, step: int) -> Manifest:
        return Manifest.read(self.commit_path(step))

    def set_aside(self, step: int, suffix: str) -> str:
        """(coordinator) Move a whole version out of the way, kept for inspection: restarts,
        retention and the drain no longer see it, and the step can be written again. Returns
        the new directory's name."""
        directory = self.version_dir(step)
        aside = free_aside_name(directory, suffix)
        os.replace(directory, aside)
        return aside.name

    def committed_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root) if self.commit_path(s).is_file()]

    def uncommitted_steps(self) -> list[int]:
        return [s for s in list_version_steps(self.root) if not self.commit_path(s).is_file()]

    def holdings(self, ranks: frozenset[int] | None = None) -> dict[int, frozenset[int]]:
        """Every rank's shard that is there: any rank reads any file of the shared PFS. Asked
        about given ranks (a restart asks each rank about its own), their files are looked
        up one by one instead of listing a directory of every rank's."""
        held = {}
        for step in self.committed_steps():
            if ranks is not None:
                held[step] = frozenset(r for r in ranks if self.shard_path(step, r).is_file())
                continue
            try:
                names = [p.name for p in self.version_dir(step).glob(SHARD_GLOB)]
            except OSError:
                names = []
            held[step] = frozenset(int(m.group(1)) for m in map(SHARD_NAME.match, names) if m)
        return held

    def remove(self, step: int) -> None:
        """(coordinator) Delete a whole version: commit record first, then the shards, which
        become every rank's spares where recycling is on (the coordinator retires them all;
        each rank's next L4 write takes its own). Other ranks: nothing to do."""
        if self.rank != COORDINATOR:
            return
        self.commit_path(step).unlink(missing_ok=True)
        if self.spares.enabled:
            try:
                shards = sorted(self.version_dir(step).glob(SHARD_GLOB))
            except OSError:
                shards = []
            for path in shards:
                self.spares.retire(path)
        remove_tree(self.version_dir(step))
