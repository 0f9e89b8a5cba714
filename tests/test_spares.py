"""Recycled node-local files (levels/spares.py): a retired file is overwritten in place by the
next write of its name, and the result is exactly the file a fresh write makes."""

import os

import numpy as np
import pytest

from hpcckpt.errors import StorageError
from hpcckpt.format.shardfile import read_shard_table, read_tensor, verify_shard
from hpcckpt.io import atomic, direct_io
from hpcckpt.io.atomic import write_bytes_atomically
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.spares import SPARE_DIR_NAME, SpareFiles

MIB = 1 << 20


def _bytes(seed, nbytes):
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("spare_size,new_size", [(3 * MIB, 3 * MIB), (5 * MIB, 3 * MIB + 17), (MIB + 5, 4 * MIB)])
def test_write_over_a_spare_keeps_its_inode_and_holds_only_the_new_bytes(tmp_path, direct, spare_size, new_size):
    if direct and not direct_io.O_DIRECT:
        pytest.skip("this platform has no O_DIRECT")
    spare = tmp_path / "spare.hck"
    spare.write_bytes(_bytes(1, spare_size).tobytes())
    inode = spare.stat().st_ino
    new = direct_io.aligned_empty(new_size)
    new[:] = _bytes(2, new_size)
    target = tmp_path / "v1" / "shard.hck"
    target.parent.mkdir()
    write_bytes_atomically(target, memoryview(new), direct=direct, recycle=spare)
    assert target.read_bytes() == new.tobytes()
    assert target.stat().st_ino == inode
    assert not spare.exists() and not (tmp_path / "v1" / "shard.hck.tmp").exists()


def test_missing_spare_means_a_new_file(tmp_path):
    target = tmp_path / "shard.hck"
    write_bytes_atomically(target, b"fresh", recycle=tmp_path / "no-such-spare")
    assert target.read_bytes() == b"fresh"


def test_a_failed_write_over_a_spare_publishes_nothing_and_raises(tmp_path, monkeypatch):
    spare = tmp_path / "spare.hck"
    spare.write_bytes(b"old" * 1000)

    def full_disk(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "_writev_all", full_disk)
    with pytest.raises(StorageError, match="no space left"):
        write_bytes_atomically(tmp_path / "shard.hck", b"new", recycle=spare)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _level(root, rank, enabled=True):
    level = LocalLevel(root, rank, spares=SpareFiles(root, enabled))
    level.prepare()
    return level


def _remove(level, step):
    """Retention's removal of a node-local version: each node-local level deletes its own
    files (L1 its shard and commit record, L2 the replica it holds for rank 9)."""
    level.remove(step)
    partner_of = tuple(level.rank if r == 9 else r for r in range(10))
    PartnerLevel(level.root, level.rank, partner_of, comm=None, spares=level.spares).remove(step)


def _write(level, step, value):
    info = level.write_shard(step, 2, [("w", np.full(300_000, value, np.float32))], {})
    (level.version_dir(step) / f"replica-of-r00009-held-by-r{level.rank:05d}.hck").write_bytes(b"r" * 100)
    return info


def test_retention_keeps_data_files_as_spares_and_the_next_version_overwrites_them(tmp_path):
    level = _level(tmp_path / "node0", 0)
    _write(level, 4, 4.0)
    retired_inode = level.shard_path(4).stat().st_ino
    level.commit_path(4).write_text("{}")
    _remove(level, 4)
    spares = tmp_path / "node0" / SPARE_DIR_NAME
    assert sorted(p.name for p in spares.iterdir()) == ["replica-of-r00009-held-by-r00000.hck", "shard-r00000.hck"]
    assert not level.version_dir(4).exists()
    assert level.committed_steps() == [] and level.uncommitted_steps() == []
    _write(level, 8, 8.0)
    assert level.shard_path(8).stat().st_ino == retired_inode
    assert not (spares / "shard-r00000.hck").exists()
    assert verify_shard(level.shard_path(8)) == []
    table = read_shard_table(level.shard_path(8))
    assert np.all(read_tensor(str(level.shard_path(8)), table, "w") == 8.0)


def test_ranks_sharing_a_node_directory_recycle_only_their_own_files(tmp_path):
    ranks = [_level(tmp_path / "node0", r) for r in (0, 1)]
    for level in ranks:
        _write(level, 4, float(level.rank))
    inodes = {level.rank: level.shard_path(4).stat().st_ino for level in ranks}
    for level in ranks:
        _remove(level, 4)
    for level in ranks:
        _write(level, 8, 10.0 + level.rank)
        assert level.shard_path(8).stat().st_ino == inodes[level.rank]
        table = read_shard_table(level.shard_path(8))
        assert np.all(read_tensor(str(level.shard_path(8)), table, "w") == 10.0 + level.rank)


def test_recycling_off_deletes_retired_files(tmp_path):
    level = _level(tmp_path / "node0", 0, enabled=False)
    _write(level, 4, 4.0)
    _remove(level, 4)
    assert os.listdir(tmp_path / "node0") == []


def test_l4_coordinator_retires_every_ranks_shard_and_each_rank_overwrites_its_own(tmp_path):
    root = tmp_path / "pfs"
    ranks = [PfsLevel(root, r, spares=SpareFiles(root)) for r in (0, 1)]
    for level in ranks:
        level.prepare()
        _write(level, 4, float(level.rank))
    (root / "v000000000004" / "manifest.json").write_text("{}")
    inodes = {level.rank: level.shard_path(4).stat().st_ino for level in ranks}
    ranks[0].remove(4)  # only the coordinator removes L4 versions
    assert sorted(p.name for p in (root / SPARE_DIR_NAME).iterdir()) == ["shard-r00000.hck", "shard-r00001.hck"]
    assert not (root / "v000000000004").exists() and ranks[0].committed_steps() == []
    for level in ranks:
        _write(level, 8, 20.0 + level.rank)
        assert level.shard_path(8).stat().st_ino == inodes[level.rank]
        assert verify_shard(level.shard_path(8)) == []


def test_a_spare_with_other_names_is_not_overwritten(tmp_path):
    """A hard-linked backup of a retired version keeps its bytes: the writer drops the spare."""
    level = _level(tmp_path / "node0", 0)
    _write(level, 4, 4.0)
    backup = tmp_path / "backup.hck"
    os.link(level.shard_path(4), backup)
    kept = backup.read_bytes()
    _remove(level, 4)
    _write(level, 8, 8.0)
    assert backup.read_bytes() == kept and backup.stat().st_nlink == 1
    assert level.shard_path(8).stat().st_ino != backup.stat().st_ino
    assert verify_shard(level.shard_path(8)) == []


def test_a_spare_that_cannot_be_taken_is_a_clear_error_naming_it(tmp_path, monkeypatch):
    spare = tmp_path / "spare.hck"
    spare.write_bytes(b"old")

    def refused(source, destination):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(atomic.os, "rename", refused)
    with pytest.raises(StorageError, match="spare file .*spare.hck.*recycle_files = false"):
        write_bytes_atomically(tmp_path / "shard.hck", b"new", recycle=spare)
    assert spare.read_bytes() == b"old" and not (tmp_path / "shard.hck").exists()


def test_retiring_survives_the_spare_directory_vanishing(tmp_path, monkeypatch):
    level = _level(tmp_path / "node0", 0)
    _write(level, 4, 4.0)
    spares = level.spares
    real_mkdir = type(spares.directory).mkdir
    calls = []

    def mkdir_then_vanish(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        calls.append(self)
        if len(calls) == 1:
            self.rmdir()  # someone cleans up between the mkdir and the rename

    monkeypatch.setattr(type(spares.directory), "mkdir", mkdir_then_vanish)
    spares.retire(level.shard_path(4))
    assert not level.shard_path(4).exists()
    assert (spares.directory / "shard-r00000.hck").exists()


def test_spare_names_tell_the_rank_that_reuses_them():
    from hpcckpt.levels.spares import spare_kind

    assert spare_kind("shard-r00007.hck") == ("shard", 7, None)
    assert spare_kind("parity-r00002.hck") == ("parity", 2, None)
    assert spare_kind("replica-of-r00003-held-by-r00001.hck") == ("replica", 1, 3)
    assert spare_kind("notes.txt") is None and spare_kind("shard-r00007.hck.tmp") is None


def test_prune_deletes_only_spares_the_job_cannot_reuse_and_retire_drops_them(tmp_path):
    spare_dir = tmp_path / SPARE_DIR_NAME
    spare_dir.mkdir()
    names = ["shard-r00000.hck", "shard-r00005.hck", "parity-r00000.hck", "replica-of-r00002-held-by-r00000.hck",
             "replica-of-r00003-held-by-r00000.hck", "notes.txt"]
    for name in names:
        (spare_dir / name).write_bytes(b"x" * 100)
    # This job: rank 0 writes here, with partner (0 holds 2's replica) and no erasure.
    spares = SpareFiles(tmp_path, reusable=lambda kind, writer, source: writer == 0 and kind != "parity"
                        and (kind != "replica" or source == 2))
    assert spares.prune() == (3, 300)
    assert sorted(p.name for p in spare_dir.iterdir()) == ["notes.txt", "replica-of-r00002-held-by-r00000.hck",
                                                           "shard-r00000.hck"]
    retired = tmp_path / "v1" / "shard-r00005.hck"
    retired.parent.mkdir()
    retired.write_bytes(b"y")
    spares.retire(retired)  # no rank of this job would take it: deleted, not kept
    assert not retired.exists() and not (spare_dir / "shard-r00005.hck").exists()
    # Recycling off: every spare a level wrote goes, a foreign file stays.
    assert SpareFiles(tmp_path, enabled=False).prune() == (2, 200)
    assert [p.name for p in spare_dir.iterdir()] == ["notes.txt"]
