"""The shape every storage level has (the Level protocol), what one version looks like on its
way into the levels (VersionImage), and what the file-based levels share.

Every level answers the same questions, and one conformance suite holds all four to it
(tests/test_levels.py on one process, tests/test_level_conformance_mpi.py on real ranks):

    store(version)     save side: keep this rank's part of a version, return the bytes stored
    commit(manifest)   make the version loadable from this level (a commit record)
    withdraw(step)     take the commit back (a version some rank could not commit)
    committed_steps()  versions committed here, as this rank sees them; uncommitted_steps():
                       versions with this rank's files and no commit (leftovers to delete)
    manifest(step)     the commit record of a committed version, as this rank reads it here
    holdings(ranks)    step -> the ranks (of `ranks`; all when None) whose shard bytes this rank
                       can supply from here
    serves(held, lacking)  (pure, rank 0 plans with it) given every rank's holdings of one
                       version, indexed by rank, the ranks whose shard this level delivers;
                       `lacking`: the ranks whose own node-local pieces are not all there
    deliver(request)   restore side: this rank's shard of a version as a file to verify, by
                       reading it (L1, L4), fetching it from a peer (L2) or rebuilding it
                       from the group's survivors (L3); collective where `collective`
    protect_again(...) (collective levels) after a loss, the pieces the lost ranks held, made
                       again from the restored shards
    placed_as(manifest) (collective levels) whether that version's pieces sit where this
                       level would put them now (the same partners, groups and parity): a
                       version placed otherwise (other failure domains) is restored through
                       its own record's maps (restore/repartitioned.py)
    remove(step)       delete this rank's files of a version; a level owns its files only
    supplies(lost)     (node-local levels) of the ranks whose node-local files of a version
                       are gone, those it still supplies from the others' (L2, L3)

Levels that keep whole shard files (`keeps_shards`: L1, L4) also answer `shard_path(step,
rank)` and `version_dir(step)`; the stack's first node-local one is where a restore lands the
shards other levels deliver (`LevelStack.landing`: `open_shard_copy`, `write_shard_bytes`, and
`rank_steps`/`stray_steps`/`remove_strays` for every node-local file of a rank). A global level
(not `node_local`) also moves a whole version aside for inspection (`set_aside`).

A level never imports another level, nor anything above levels/: the engine composes them.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from hpcckpt.errors import StorageError
from hpcckpt.format.manifest import Manifest
from hpcckpt.format.shardfile import ShardImage, ShardInfo, plan_shard, write_shard_image
from hpcckpt.io.atomic import AtomicFile, write_bytes_atomically
from hpcckpt.levels.naming import (
    LEVEL_LABELS,
    LEVEL_NUMBERS,
    STAGE_LABELS,
    commit_file_name,
    parity_file_name,
    replicas_held_glob,
    shard_file_name,
)
from hpcckpt.levels.node_places import NodePlaces
from hpcckpt.levels.spares import SpareFiles

# Replicas and parity travel and reach the disk in chunks of this size (checkpoint.chunk_mib):
# no level holds a buffer the size of a shard.
DEFAULT_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class VersionImage:
    """One version of this rank's shard on its way into the levels. `image` is the planned
    shard file (header, table, views of the snapshot's pieces); `file_bytes()` the same file
    as one contiguous buffer, made on first use by the levels that send it (L2, L3);
    `shard_sizes` the file sizes by rank that this rank's levels need (its own, its L3
    group's, the replica sources it holds), agreed before any level stores; `version_bytes`
    what all ranks' files of the version take on disk."""

    step: int
    world_size: int
    shard_sizes: Mapping[int, int]
    file_bytes: Callable[[], np.ndarray]
    image: ShardImage | None = None  # None: the bytes of an existing file (drain copies L1's)
    version_bytes: int = 0


@dataclass
class DeliveryRequest:
    """What a restore asks the levels for, the same on every rank: `needy` ranks lack a
    verified shard of `step`; `shard_sizes` come from the commit record; `lacking` are the
    ranks whose node-local pieces of the version are not all there (an erasure group
    rebuilds them too). `open_copy(size, aligned)` opens where a level writes the shard
    bytes it receives or rebuilds, chunk by chunk as they come (this rank's L1 copy, which
    the restore then reads and verifies: an io/atomic.AtomicFile, published by the level;
    `aligned`: every write starts at an aligned offset), or None when none can be stored
    (said by the restore); the rank still takes its part in the transfer."""

    step: int
    world_size: int
    needy: frozenset[int]
    shard_sizes: tuple[int, ...]
    open_copy: Callable[[int, bool], AtomicFile | None]
    own_shard: Callable[[], np.ndarray] | None = None  # a survivor's verified shard bytes (mapped, not read)
    lacking: frozenset[int] = frozenset()
    warnings: list = field(default_factory=list)


class Level(Protocol):
    name: str  # "local", "partner", "erasure", "pfs" (levels/naming.py)
    label: str  # "L1 local", ... for logs
    number: str  # "L1", ... where a message names the level briefly
    stage_label: str  # "L1 local write", ... what its part of a checkpoint is called in errors
    node_local: bool  # its files live in the node-local directory and share L1's commit record
    keeps_shards: bool  # it keeps whole shard files (shard_path): a restore reads them as they are
    prunes_here: bool  # this rank applies retention to it (each rank its own files, or a coordinator)
    collective: bool  # store() and deliver() are collective over the level's communicator
    # Simultaneous node losses a version on it survives: 0 (a crash only), 1, the parity, or
    # None for any number (a copy off the nodes). The per-level intervals weigh it.
    survives_nodes: int | None
    root: Path

    def prepare(self) -> None: ...
    def store(self, version: VersionImage) -> int: ...
    def commit(self, manifest: Manifest) -> None: ...
    def withdraw(self, step: int) -> None: ...
    def committed_steps(self) -> list[int]: ...
    def uncommitted_steps(self) -> list[int]: ...
    def manifest(self, step: int) -> Manifest: ...
    def holdings(self, ranks: frozenset[int] | None = None) -> dict[int, frozenset[int]]: ...
    def serves(self, held: Sequence[frozenset[int]], lacking: frozenset[int]) -> frozenset[int]: ...
    def deliver(self, request: DeliveryRequest) -> Path | None: ...
    def protect_again(self, step: int, shard: Callable[[], np.ndarray], shard_sizes: Sequence[int],
                      world_size: int) -> None: ...
    def remove(self, step: int) -> None: ...
    def placed_as(self, manifest: Manifest) -> bool: ...


class LevelStack(tuple):
    """The enabled levels in data-flow order (cheapest to restore first), found by name."""

    def level(self, name: str):
        return next((level for level in self if level.name == name), None)

    local = property(lambda self: self.level("local"))
    partner = property(lambda self: self.level("partner"))
    erasure = property(lambda self: self.level("erasure"))
    pfs = property(lambda self: self.level("pfs"))

    @property
    def node_local(self) -> tuple:
        return tuple(level for level in self if level.node_local)

    @property
    def global_levels(self) -> tuple:
        return tuple(level for level in self if not level.node_local)

    def remove_node_local(self, step: int) -> None:
        """This rank's files of a version on every node-local level, each level its own (the
        commit record with L1's), then what levels this job does not run left there."""
        node_local = self.node_local
        for level in node_local:
            level.remove(step)
        if node_local:
            node_local[0].remove_strays(step)  # the levels share the directory: any one scans it

    @property
    def landing(self):
        """The node-local level that keeps this rank's shard file (L1): what the other levels
        deliver lands there, and its files are the rank's node-local copy; None without one."""
        return next((level for level in self if level.node_local and level.keeps_shards), None)


def served_by_holders(held: Sequence[frozenset[int]], lacking: frozenset[int]) -> frozenset[int]:
    """A level that delivers a shard from one copy (a file, a replica): every shard some rank
    holds there."""
    return frozenset().union(*held)


def hold_to_bandwidth(nbytes: int, bytes_per_s: float, started: float) -> None:
    """Sleep until `nbytes` written since `started` (perf_counter) average at most
    `bytes_per_s`, so the next write cannot start before this one's share; 0: no cap."""
    if bytes_per_s > 0:
        remaining = nbytes / bytes_per_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)


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


def with_temporaries(paths: list[Path]) -> list[Path]:
    return paths + [Path(str(p) + ".tmp") for p in paths]


class NodeLocalFiles:
    """What the node-local levels (L1-L3) share: version directories under the node-local
    directory, in which each rank's commit record (written once per version, by whichever
    node-local level commits first) makes every node-local file of that rank's version
    loadable. Each level keeps, finds and deletes only its own data files (`own_files`)."""

    node_local = True
    keeps_shards = False
    prunes_here = True  # each rank deletes its own files of the versions retention drops
    serves = staticmethod(served_by_holders)

    def __init__(self, root: str | Path, rank: int, spares: SpareFiles | None, file_mode: int,
                 bandwidth_mb: float, places: NodePlaces | None = None):
        self.root = Path(root)  # on the node's disk
        # Where each version is: in memory within its budget, else under `root`; shared by the
        # node-local levels of a rank, which keep a version in one place.
        self.places = places or NodePlaces(self.root)
        self.rank = rank
        self.file_mode = file_mode  # of new files, less the umask (levels/dir_safety.py)
        # Retired files to overwrite instead of new ones (levels/spares.py); none by default.
        self.spares = spares or SpareFiles(self.root, enabled=False)
        # storage.local_bandwidth_mb: checkpoints leave the disk to the application's own I/O.
        self.bandwidth_bytes = bandwidth_mb * 1e6

    @property
    def label(self) -> str:
        return LEVEL_LABELS[self.name]

    @property
    def number(self) -> str:
        return LEVEL_NUMBERS[self.name]

    @property
    def stage_label(self) -> str:
        return STAGE_LABELS[self.name]

    def version_dir(self, step: int) -> Path:
        return self.places.version_dir(step)

    def spare_for(self, path: Path) -> Path | None:
        """The spare to overwrite for a new file at `path`: spares are on the disk, and a file
        in memory gains nothing from one (nor can it be renamed across file systems)."""
        return None if self._in_memory(path) else self.spares.spare_for(path)

    def retire(self, path: Path) -> None:
        if self._in_memory(path):
            path.unlink(missing_ok=True)
        else:
            self.spares.retire(path)

    def _in_memory(self, path: Path) -> bool:
        memory = self.places.memory
        return memory is not None and Path(path).is_relative_to(memory)

    def commit_path(self, step: int, rank: int | None = None) -> Path:
        """A rank's copy of the commit record (each rank commits: a version stays readable
        from a node as long as the node survives, whichever others are lost)."""
        return self.version_dir(step) / commit_file_name(self.rank if rank is None else rank)

    def own_files(self, step: int) -> list[Path]:
        raise NotImplementedError

    def supplies(self, lost: frozenset[int]) -> frozenset[int]:
        """Of the ranks whose node-local files of a version are gone, those this level still
        supplies from the other ranks' files (a redundancy level); L1 supplies none."""
        return frozenset()

    def has_own_files(self, step: int) -> bool:
        return any(p.is_file() for p in self.own_files(step))

    def delivering_files(self, lost: frozenset[int]) -> list[Path]:
        """This rank's files of this level's newest version from which it would deliver the
        shards of the `lost` ranks (a partner's replica); L1 delivers only its own shard."""
        return []

    def commit(self, manifest: Manifest) -> None:
        """Write this rank's commit record, unless the node-local level that commits first
        (L1, which refuses to overwrite one) already has: one record per rank and version
        covers L1-L3."""
        path = self.commit_path(manifest.step)
        if not path.is_file():
            manifest.for_rank(self.rank).write(path, self.file_mode)

    def withdraw(self, step: int) -> None:
        self.commit_path(step).unlink(missing_ok=True)

    def manifest(self, step: int) -> Manifest:
        return Manifest.read(self.commit_path(step))

    def committed_steps(self) -> list[int]:
        return [s for s in self.places.steps() if self.commit_path(s).is_file() and self.has_own_files(s)]

    def uncommitted_steps(self) -> list[int]:
        """Versions where this rank has files of this level but no commit record (they would
        otherwise stay for good, and a full disk is when writes fail)."""
        return [s for s in self.places.steps()
                if not self.commit_path(s).is_file()
                and any(p.exists() for p in with_temporaries(self.own_files(s)))]

    def remove(self, step: int) -> None:
        """Delete this rank's files of this level in a version (the commit record with L1's;
        data files become spares for the next checkpoint to overwrite, where recycling is
        on); the directory goes with the node's last file."""
        directory = self.version_dir(step)
        for path in with_temporaries(self.own_files(step)):
            if path.suffix == ".hck":
                self.retire(path)
            else:
                path.unlink(missing_ok=True)
        remove_dir_if_empty(directory)

    def rank_files(self, step: int) -> list[Path]:
        """Every file this rank may have in a node-local version, whichever levels wrote it:
        commit record first, then shard, parity and the replicas it holds (levels/naming.py),
        temporaries included."""
        directory = self.version_dir(step)
        paths = with_temporaries([directory / commit_file_name(self.rank), directory / shard_file_name(self.rank),
                                  directory / parity_file_name(self.rank)])
        try:
            held = replicas_held_glob(self.rank)
            paths += sorted(directory.glob(held)) + sorted(directory.glob(held + ".tmp"))
        except OSError:
            pass
        return paths

    def rank_steps(self) -> list[int]:
        """Versions this rank has any node-local file of, committed or not: one scan of the
        directory for all node-local levels."""
        return [s for s in self.places.steps() if any(p.exists() for p in self.rank_files(s))]

    def stray_steps(self) -> list[int]:
        """Versions with files of this rank and no commit record, whichever level wrote them
        (any level of the stack, one this job no longer runs, a former partner's replica):
        the leftovers retention and a fresh start delete."""
        return [s for s in self.rank_steps() if not self.commit_path(s).is_file()]

    def remove_strays(self, step: int) -> None:
        """After each level of the stack removed its own files of a version: what of this rank
        is left there (a level turned off since, a replica for a former partner) goes too,
        or it would hold its space and its directory for good."""
        for path in self.rank_files(step):
            if path.suffix == ".hck":
                self.retire(path)
            else:
                path.unlink(missing_ok=True)
        remove_dir_if_empty(self.version_dir(step))

    def _publish(self, path: Path, data) -> None:
        """A whole file this level received or rebuilt, published atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, memoryview(data), direct=self.direct_io, recycle=self.spare_for(path),
                               mode=self.file_mode)


class ShardFileLevel:
    """What the levels that keep whole shard files (L1, L4) share: this rank's shard of a
    version under <root>/v<step>/, written from the planned image or copied as bytes. Mixed
    into a level class (NodeLocalLevel's or PFS's), which provides what is declared here."""

    keeps_shards = True
    serves = staticmethod(served_by_holders)
    root: Path  # the level's directory
    rank: int
    config_key: str  # the setting naming `root`, for errors (storage.local_dir, storage.pfs_dir)
    direct_io: bool  # shard files written with O_DIRECT (io/direct_io.py)
    spares: SpareFiles  # retired files overwritten instead of new ones (levels/spares.py)
    bandwidth_bytes: float  # bytes/s the level's writes are held to; 0: as fast as they go
    version_dir: Callable[[int], Path]  # <root>/v<step>
    spare_for: Callable[[Path], Path | None]  # the retired file a new one at that path overwrites

    def shard_path(self, step: int, rank: int | None = None) -> Path:
        return self.version_dir(step) / shard_file_name(self.rank if rank is None else rank)

    def prepare(self) -> None:
        ensure_writable_dir(self.root, self.config_key)

    def write_shard(self, step: int, world_size: int, pieces, extra: dict) -> ShardInfo:
        path = self.shard_path(step)
        return self.write_image(step, plan_shard(step, self.rank, world_size, pieces, extra, str(path)))

    def write_image(self, step: int, image: ShardImage) -> ShardInfo:
        """This rank's shard of `step`, from a planned image (shardfile.plan_shard)."""
        started = time.perf_counter()
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        path = self.shard_path(step)
        info = write_shard_image(path, image, direct=self.direct_io, recycle=self.spare_for(path),
                                 mode=self.file_mode)
        hold_to_bandwidth(info.size, self.bandwidth_bytes, started)
        return info

    def write_shard_bytes(self, step: int, data) -> None:
        """A whole shard file copied from another level (its bytes are the original file's);
        a restore putting a copy back is not held to the checkpoints' bandwidth cap."""
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        path = self.shard_path(step)
        write_bytes_atomically(path, memoryview(data), direct=self.direct_io, recycle=self.spare_for(path),
                               mode=self.file_mode)

    def open_shard_copy(self, step: int, size: int, aligned: bool) -> AtomicFile:
        """This rank's shard file of a version, to take the original file's bytes at offsets
        as a restore receives or rebuilds them, published whole; a copy already there (bad:
        the delivered bytes replace it) goes first. `aligned`: every write starts at an
        aligned offset, so O_DIRECT may take them."""
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        path = self.shard_path(step)
        path.unlink(missing_ok=True)
        return AtomicFile(path, size, direct=self.direct_io and aligned, recycle=self.spare_for(path),
                          mode=self.file_mode)

    def store(self, version: VersionImage) -> int:
        if version.image is not None:
            return self.write_image(version.step, version.image).size
        started = time.perf_counter()
        data = version.file_bytes()
        self.write_shard_bytes(version.step, data)
        hold_to_bandwidth(int(data.size), self.bandwidth_bytes, started)
        return int(data.size)

    def deliver(self, request: DeliveryRequest) -> Path | None:
        """This rank's own shard file, where this level has it (read, not copied)."""
        path = self.shard_path(request.step)
        return path if self.rank in request.needy and path.is_file() else None
