"""The file-level half of the conformance suite (zarr's StoreTests style) for the levels that
run on one process (L1, L4); tests/test_level_conformance_mpi.py holds all four levels to
the Level protocol on real ranks."""

import numpy as np
import pytest

from hpcckpt.errors import StorageError
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord
from hpcckpt.format.shardfile import read_shard_table, read_tensor
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.spares import SpareFiles

LEVELS = {
    "local": lambda root, rank: LocalLevel(root, rank),
    "local-recycling": lambda root, rank: LocalLevel(root, rank, spares=SpareFiles(root)),
    "pfs": lambda root, rank: PfsLevel(root, rank),
    "pfs-recycling": lambda root, rank: PfsLevel(root, rank, spares=SpareFiles(root)),
}


def manifest_for(step, infos, world_size=2):
    layout = plan_layout([TensorSpec("w", "float32", (8, 3))], world_size, split_threshold_bytes=1)
    return Manifest(step, world_size, layout, tuple(ShardRecord(r, i.size, i.checksums) for r, i in enumerate(infos)),
                    state={"s": step}, metrics={"val_loss": 1.0 / step})


@pytest.fixture(params=sorted(LEVELS))
def make_level(request, tmp_path):
    def make(rank=0):
        level = LEVELS[request.param](tmp_path / "store", rank)
        level.prepare()
        return level
    return make


def write_version(levels, step):
    infos = [lv.write_shard(step, len(levels), [("w", np.full((4, 3), step + lv.rank, np.float32))], {"node": 0})
             for lv in levels]
    manifest = manifest_for(step, infos, len(levels))
    for lv in levels:
        lv.commit(manifest)  # L4 writes its one record on the coordinator only
    return manifest


def test_written_shard_reads_back(make_level):
    levels = [make_level(0), make_level(1)]
    write_version(levels, 5)
    for lv in levels:
        path = lv.shard_path(5)
        table = read_shard_table(path)
        assert table.step == 5 and table.rank == lv.rank
        assert np.all(read_tensor(str(path), table, "w") == 5 + lv.rank)


def test_only_committed_versions_are_listed(make_level):
    levels = [make_level(0), make_level(1)]
    write_version(levels, 5)
    for lv in levels:
        lv.write_shard(9, 2, [("w", np.zeros((4, 3), np.float32))], {})
    for lv in levels:
        assert lv.committed_steps() == [5]
        assert lv.uncommitted_steps() == [9]
        assert lv.manifest(5).state == {"s": 5}


def test_a_node_local_version_holding_only_copies_for_others_counts_as_uncommitted(tmp_path):
    """A rank whose own write failed may still hold replicas or parity it took for others:
    those files are the partner's and erasure level's leftovers (retention deletes them),
    not another rank's, and each level deletes only its own."""
    from hpcckpt.levels.erasure import ErasureLevel
    from hpcckpt.levels.naming import parity_file_name, replica_file_name
    from hpcckpt.levels.partner import PartnerLevel

    local, other = LocalLevel(tmp_path, 0), LocalLevel(tmp_path, 1)
    partner = PartnerLevel(tmp_path, 0, (1, 0), comm=None)
    erasure = ErasureLevel(tmp_path, 0, (0, 1), group_comm=None, parity=1)
    local.version_dir(4).mkdir(parents=True)
    (local.version_dir(4) / replica_file_name(1, 0)).write_bytes(b"replica of rank 1")
    local.version_dir(6).mkdir(parents=True)
    (local.version_dir(6) / parity_file_name(0)).write_bytes(b"parity")
    assert partner.uncommitted_steps() == [4] and erasure.uncommitted_steps() == [6]
    assert local.uncommitted_steps() == [] and other.uncommitted_steps() == []
    local.remove(4)
    assert partner.uncommitted_steps() == [4]  # L1 leaves L2's file alone
    partner.remove(4)
    erasure.remove(6)
    assert partner.uncommitted_steps() == erasure.uncommitted_steps() == []
    assert not local.version_dir(4).exists() and not local.version_dir(6).exists()


def test_shards_are_never_overwritten(make_level):
    level = make_level(0)
    level.write_shard(3, 1, [("w", np.zeros(2, np.float32))], {})
    with pytest.raises(StorageError):
        level.write_shard(3, 1, [("w", np.ones(2, np.float32))], {})


def test_remove_deletes_a_whole_version_commit_first(make_level):
    levels = [make_level(0), make_level(1)]
    write_version(levels, 5)
    write_version(levels, 10)
    for lv in levels:
        lv.remove(5)  # L4: the coordinator deletes the whole version
    for lv in levels:
        assert lv.committed_steps() == [10]
        assert not lv.shard_path(5).exists()
    assert not levels[0].version_dir(5).exists()


def test_a_version_written_after_a_removal_reads_back(make_level):
    levels = [make_level(0), make_level(1)]
    for step in (5, 10):
        write_version(levels, step)
    for lv in levels:
        lv.remove(5)
    write_version(levels, 15)  # over the spares, where the level recycles
    for lv in levels:
        assert lv.committed_steps() == [10, 15]
        path = lv.shard_path(15)
        assert np.all(read_tensor(str(path), read_shard_table(path), "w") == 15 + lv.rank)


def test_unusable_root_is_a_clear_storage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for name, make in LEVELS.items():
        with pytest.raises(StorageError, match="not usable"):
            make(blocker / "sub", 0).prepare()


def test_pfs_flush_respects_bandwidth_cap(tmp_path):
    import time

    level = PfsLevel(tmp_path / "pfs", 0, bandwidth_mb=2.0)
    level.prepare()
    started = time.perf_counter()
    level.write_shard(1, 1, [("w", np.zeros(250_000, np.uint8))], {})
    assert time.perf_counter() - started >= 0.12  # 0.25 MB at 2 MB/s


def test_pfs_restore_read_respects_its_read_cap(tmp_path):
    import time

    from hpcckpt.levels.base import DeliveryRequest

    capped = PfsLevel(tmp_path / "pfs", 0, read_bandwidth_mb=2.0)
    capped.prepare()
    capped.write_shard(1, 1, [("w", np.zeros(250_000, np.uint8))], {})
    request = DeliveryRequest(1, 1, frozenset({0}), (), lambda size, aligned: None)
    started = time.perf_counter()
    assert capped.deliver(request) == capped.shard_path(1)
    assert time.perf_counter() - started >= 0.12  # 0.25 MB at 2 MB/s
    assert capped.deliver(DeliveryRequest(1, 1, frozenset(), (), lambda size, aligned: None)) is None


def test_files_of_a_level_the_job_no_longer_runs_are_swept_with_their_version(tmp_path):
    """A run resumed with erasure (or partner) turned off: the parity and replicas its versions
    still hold belong to no level of the stack, yet must go with the version, or they keep
    their space and their directory for good."""
    from hpcckpt.levels.naming import parity_file_name, replica_file_name

    local = LocalLevel(tmp_path, 0)
    local.prepare()
    write_version([local], 4)
    (local.version_dir(4) / parity_file_name(0)).write_bytes(b"parity of an earlier job")
    local.version_dir(6).mkdir()
    (local.version_dir(6) / replica_file_name(3, 0)).write_bytes(b"replica for a former partner")
    assert local.stray_steps() == [6] and local.uncommitted_steps() == []
    local.remove(4)
    assert (local.version_dir(4) / parity_file_name(0)).exists()  # L1 deletes its own files only
    local.remove_strays(4)
    local.remove_strays(6)
    assert not local.version_dir(4).exists() and not local.version_dir(6).exists()
    assert local.stray_steps() == []


def test_redundancy_levels_say_which_missing_ranks_they_still_supply(tmp_path):
    """A version stands with some ranks' node-local files missing (their node full or
    read-only) only while L2 or L3 supplies those ranks from the other nodes' files."""
    from hpcckpt.levels.erasure import ErasureLevel
    from hpcckpt.levels.partner import PartnerLevel

    partner = PartnerLevel(tmp_path, 0, (1, 2, 3, 0), comm=None)  # rank r's replica on rank r+1
    assert partner.supplies(frozenset({2})) == {2}
    assert partner.supplies(frozenset({1, 2})) == {2}  # rank 1's holder is missing too
    assert partner.supplies(frozenset({0, 1, 2, 3})) == frozenset()
    assert PartnerLevel(tmp_path, 0, (0,), comm=None).supplies(frozenset({0})) == frozenset()  # one node: no partner
    groups = ((0, 1, 2, 3), (4, 5, 6, 7))
    erasure = ErasureLevel(tmp_path, 0, groups[0], group_comm=None, parity=2, groups=groups)
    assert erasure.supplies(frozenset({1, 2, 5})) == {1, 2, 5}
    assert erasure.supplies(frozenset({1, 2, 3, 5})) == {5}  # three of a group lost, parity 2
    assert LocalLevel(tmp_path, 0).supplies(frozenset({0})) == frozenset()


def test_a_survivor_names_the_replicas_it_will_deliver_for_the_lost_ranks_newest_version(tmp_path):
    """What a survivor reads ahead after ranks died: its replicas of the lost ranks' shards in
    the newest committed version, none of a rank that is alive, nothing where no version
    is committed; L1 delivers no other rank's shard."""
    from hpcckpt.levels.naming import replica_file_name
    from hpcckpt.levels.partner import PartnerLevel

    partner = PartnerLevel(tmp_path, 1, (1, 2, 1, 0), comm=None)  # rank 1 holds ranks 0's and 2's replicas
    local = LocalLevel(tmp_path, 1)
    assert partner.delivering_files(frozenset({0})) == []  # nothing committed yet
    for step in (4, 8, 12):
        info = local.write_shard(step, 4, [("w", np.zeros(3, np.float32))], {})
        for source in (0, 2):
            (local.version_dir(step) / replica_file_name(source, 1)).write_bytes(b"replica")
        if step != 12:  # 12 is in flight: no commit record
            local.commit(manifest_for(step, [info] * 4, 4))
    replica = lambda source: local.version_dir(8) / replica_file_name(source, 1)  # noqa: E731
    assert partner.delivering_files(frozenset({0, 3})) == [replica(0)]
    assert partner.delivering_files(frozenset({0, 2})) == [replica(0), replica(2)]
    assert partner.delivering_files(frozenset({3})) == []  # rank 3's replica is held elsewhere
    assert local.delivering_files(frozenset({0})) == []
