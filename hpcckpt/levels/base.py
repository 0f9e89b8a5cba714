"""What every storage level shares: version directories named by step, shard names, listing.

A level never imports another level; the engine composes them. Each level answers the same
questions (write a shard, commit, which versions are committed here, where a shard is,
remove a version), and one conformance suite (tests/test_levels.py) holds them all to it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import time
from pathlib import Path

from hpcckpt.ckpt.manifest import Manifest
from hpcckpt.ckpt.shardfile import ShardImage, ShardInfo, plan_shard, write_shard_image
from hpcckpt.errors import StorageError
from hpcckpt.levels.spares import SpareFiles

_VERSION_DIR = re.compile(r"^v(\d{12})$")


def hold_to_bandwidth(nbytes: int, bytes_per_s: float, started: float) -> None:
    """Sleep until `nbytes` written since `started` (perf_counter) average at most
    `bytes_per_s`, so the next write cannot start before this one's share; 0: no cap."""
    if bytes_per_s > 0:
        remaining = nbytes / bytes_per_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)


def version_dir_name(step: int) -> str:
    return f"v{step:012d}"


def shard_file_name(rank: int) -> str:
    return f"shard-r{rank:05d}.hck"


def replica_file_name(source_rank: int, holder_rank: int) -> str:
    return f"replica-of-r{source_rank:05d}-held-by-r{holder_rank:05d}.hck"


def parity_file_name(rank: int) -> str:
    return f"parity-r{rank:05d}.hck"


def commit_file_name(rank: int) -> str:
    return f"commit-r{rank:05d}.json"


def files_of_rank(version_dir: Path, rank: int) -> list[Path]:
    """Every file a rank owns in a node-local version directory, commit record first (so a
    half-deleted version never looks complete), temporaries included."""
    names = [commit_file_name(rank), shard_file_name(rank), parity_file_name(rank)]
    paths = [version_dir / n for n in names]
    try:
        paths += sorted(version_dir.glob(f"replica-of-r*-held-by-r{rank:05d}.hck"))
    except OSError:
        pass
    return paths + [Path(str(p) + ".tmp") for p in paths]


def list_version_steps(root: Path) -> list[int]:
    """Steps that have a version directory under `root` (complete or not), ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, names) if m)


def ensure_writable_dir(path: Path, what: str) -> None:
    """Create `path` if needed and prove a file can be written there; clear error otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            reason = "no space left on device"
        raise StorageError(f"{what} {str(path)!r} is not usable: {reason}; point it at a writable directory") from None


def remove_tree(path: Path) -> None:
    """Delete a version directory; a concurrent delete by another rank is not an error."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass


def remove_dir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


class VersionedLevel:
    """What the file-based levels share: one directory per version under `root`, this rank's
    shard in it, and a commit record whose place each level defines (commit_path)."""

    name = ""
    label = ""
    config_key = ""  # the setting that names `root`, for error messages

    def __init__(self, root: str | Path, rank: int, direct_io: bool = False, spares: SpareFiles | None = None,
                 file_mode: int = 0o666):
        self.root = Path(root)
        self.file_mode = file_mode  # of new files, less the umask (levels/dir_safety.py)
        self.rank = rank
        self.direct_io = direct_io  # write shard files with O_DIRECT (ckpt/direct_io.py)
        # Retired files to overwrite instead of new ones (levels/spares.py); none by default.
        self.spares = spares or SpareFiles(self.root, enabled=False)

    def prepare(self) -> None:
        ensure_writable_dir(self.root, self.config_key)

    def version_dir(self, step: int) -> Path:
        return self.root / version_dir_name(step)

    def shard_path(self, step: int, rank: int | None = None) -> Path:
        return self.version_dir(step) / shard_file_name(self.rank if rank is None else rank)

    def commit_path(self, step: int) -> Path:
        raise NotImplementedError

    def write_shard(self, step: int, world_size: int, pieces, extra: dict) -> ShardInfo:
        path = self.shard_path(step)
        return self.write_image(step, plan_shard(step, self.rank, world_size, pieces, extra, str(path)))

    def write_image(self, step: int, image: ShardImage) -> ShardInfo:
        """This rank's shard of `step`, from a planned image (shardfile.plan_shard)."""
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        path = self.shard_path(step)
        return write_shard_image(path, image, direct=self.direct_io, recycle=self.spares.spare_for(path),
                                 mode=self.file_mode)

    def write_shard_bytes(self, step: int, data) -> None:
        """A whole shard file copied from another level (its bytes are the original file's)."""
        from hpcckpt.ckpt.shardfile import write_bytes_atomically

        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        path = self.shard_path(step)
        write_bytes_atomically(path, memoryview(data), direct=self.direct_io, recycle=self.spares.spare_for(path),
                               mode=self.file_mode)

    def commit(self, manifest: Manifest) -> None:
        manifest.write(self.commit_path(manifest.step), self.file_mode)

    def manifest(self, step: int) -> Manifest:
        return Manifest.read(self.commit_path(step))
