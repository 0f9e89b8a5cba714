"""Recycled checkpoint files: a retired version's data files are kept as spares, and the next
checkpoint overwrites them in place instead of creating new files.

Retention deletes a version's shard, replica and parity files right after a newer version is
committed, and the next checkpoint writes files of the same names and, nearly always, sizes.
Creating a file and deleting it again are not free: tmpfs allocates and zeroes a page of RAM
per 4 KiB written to a new file and frees them all on unlink; ext4 allocates blocks and, after
an O_DIRECT write past the end of a file, converts its unwritten extents at fsync. Overwriting
a file in place does neither. So a rank moves each of its retired data files into
`<local_dir>/.spare/` (the name unchanged; on L4 the coordinator moves every rank's shard into
`<pfs_dir>/.spare/`), and the next write of that name renames the spare to its temporary name
and overwrites it (PostgreSQL recycles its WAL segments for the same reason): an overwrite costs
a fraction of the CPU of a new file plus an unlink, and is durable sooner
(perf/bench_recycle.py; the numbers are in perf/log/2026-11-23.md).

A spare is never a version: restart, listing and verification only look into version
directories (v<step>), and an interrupted overwrite leaves only a temporary file behind.
Disk use: the peak is what it was (keep + 1 versions, while the newest one is written); in
between, the spares keep it there instead of dropping back to `keep` versions.
`storage.recycle_files = false` deletes retired node-local files instead. A job deletes, when
it starts, the spares it can never reuse (another rank count, placement or partner scheme, a
level or recycling turned off), and retires none of those names: they would hold their space
for good.

A spare is overwritten in place, so whatever still reads the retired file sees the new bytes
(checksums catch it in hpcckpt's readers), and a spare with other names (hard links of a
backup) is never reused. On L4, where users copy and archive versions while a job runs, it is
off unless `storage.pfs_recycle_files` turns it on; there it also saved time only while
training was idle (perf/log/2026-11-23.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from hpcckpt.levels.naming import PARITY_NAME, REPLICA_NAME, SHARD_NAME

SPARE_DIR_NAME = ".spare"


def spare_kind(name: str) -> tuple[str, int, int | None] | None:
    """(kind, rank that writes the file, source rank of a replica) for a data file's name
    (levels/naming.py), in a version directory or as a spare; None for a name no level
    writes. The writer is the rank that reuses it."""
    for kind, pattern in (("shard", SHARD_NAME), ("parity", PARITY_NAME)):
        match = pattern.match(name)
        if match:
            return kind, int(match.group(1)), None
    match = REPLICA_NAME.match(name)
    if match:
        return "replica", int(match.group(2)), int(match.group(1))
    return None


class SpareFiles:
    """The spares of one level's directory. File names carry the rank, and each rank only
    takes spares of its own names, so ranks sharing the directory never collide."""

    def __init__(self, root: str | Path, enabled: bool = True,
                 reusable: Callable[[str, int, int | None], bool] | None = None):
        # Disabled, it is what a level without recycling uses: nothing to overwrite, and
        # retiring deletes. `reusable(kind, writer, source)` (see spare_kind) says which
        # spares this job can take again; the others are deleted, not kept.
        self.directory = Path(root) / SPARE_DIR_NAME
        self.enabled = enabled
        self.reusable = reusable or (lambda kind, writer, source: True)

    def _keeps(self, name: str) -> bool:
        kind = spare_kind(name)
        return self.enabled and (kind is None or self.reusable(*kind))

    def retire(self, path: Path) -> None:
        """Keep `path` as the spare of its name (replacing an older one), or delete it when
        recycling is off. A missing file is not an error: it was never written or is gone."""
        if not self._keeps(path.name):
            path.unlink(missing_ok=True)
            return
        for _ in range(2):
            self.directory.mkdir(exist_ok=True)
            try:
                path.rename(self.directory / path.name)
                return
            except FileNotFoundError:
                if not path.exists():  # never written, or gone with its version
                    return
                # The spare directory went in between (someone cleaned it up): once more.
        path.unlink(missing_ok=True)

    def prune(self) -> tuple[int, int]:
        """Delete the spares this job can never reuse (an earlier run's: of a rank the job
        no longer places here, of a replica pair the partner scheme no longer makes, of a
        level that is off, or any while recycling is off); they would hold their space for
        good. Names no level writes are left alone. Returns (files, bytes) deleted."""
        try:
            names = sorted(p.name for p in self.directory.iterdir())
        except FileNotFoundError:
            return 0, 0
        files = nbytes = 0
        for name in names:
            if spare_kind(name) is None or self._keeps(name):
                continue
            path = self.directory / name
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            files += 1
            nbytes += size
        return files, nbytes

    def spare_for(self, path: Path | str) -> Path | None:
        """Where a spare to overwrite for a file named like `path` would be (it may not exist:
        the writer then creates a new file); None when recycling is off."""
        return self.directory / Path(path).name if self.enabled else None
