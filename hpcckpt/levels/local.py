"""L1: node-local storage. Each rank writes its shard into its node's directory.

    <local_dir>/v<step>/shard-r<rank>.hck     the shard
    <local_dir>/v<step>/commit-r<rank>.json   this rank's copy of the commit record (the shard
                                              records a restore from this node needs:
                                              Manifest.for_rank)

Every rank keeps its own copy of the commit record, so a version stays readable from L1 as
long as the rank's node survives, whichever other nodes are lost. A rank only ever creates or
deletes its own files there (ranks of one node share the directory). Retired data files may
stay in <local_dir>/.spare/ for the next checkpoint to overwrite (levels/spares.py).
"""

from __future__ import annotations

from pathlib import Path

from hpcckpt.levels.base import NodeLocalFiles, ShardFileLevel
from hpcckpt.levels.spares import SpareFiles


class LocalLevel(ShardFileLevel, NodeLocalFiles):
    name = "local"
    survives_nodes = 0  # its files are on the node: a crash of the rank only
    config_key = "storage.local_dir"
    collective = False

    def __init__(self, root: str | Path, rank: int, direct_io: bool = False, spares: SpareFiles | None = None,
                 file_mode: int = 0o666, bandwidth_mb: float = 0.0, places=None):
        super().__init__(root, rank, spares, file_mode, bandwidth_mb, places)
        self.direct_io = direct_io  # write shard files with O_DIRECT (io/direct_io.py)

    def commit(self, manifest) -> None:
        """This rank's commit record of the version; an existing one (a stale record of a
        step written again) is refused, never silently kept: no checkpoint file is overwritten."""
        manifest.for_rank(self.rank).write(self.commit_path(manifest.step), self.file_mode)

    def own_files(self, step: int) -> list[Path]:
        # The commit record first, so a half-deleted version never looks complete.
        return [self.commit_path(step), self.shard_path(step)]

    def committed_steps(self) -> list[int]:
        return [s for s in super().committed_steps() if self.shard_path(s).is_file()]

    def holdings(self, ranks: frozenset[int] | None = None) -> dict[int, frozenset[int]]:
        mine = frozenset({self.rank}) if ranks is None or self.rank in ranks else frozenset()
        return {step: mine for step in self.committed_steps()}
