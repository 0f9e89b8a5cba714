"""A node's versions in memory first, else on its disk (levels/node_places.py)."""

from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.node_places import NodePlaces, file_system_type
from hpcckpt.levels.spares import SpareFiles


def test_a_version_is_found_where_it_is_and_written_where_it_was_placed(tmp_path):
    places = NodePlaces(tmp_path / "disk", tmp_path / "mem", budget_bytes=1 << 20)
    places.place(5, in_memory=True)
    assert places.version_dir(5) == tmp_path / "mem" / "v000000000005"
    places.place(10, in_memory=False)
    assert places.version_dir(10) == tmp_path / "disk" / "v000000000010"
    (tmp_path / "disk" / "v000000000005").mkdir(parents=True)  # found where it is, whatever was placed
    (tmp_path / "mem" / "v000000000010").mkdir(parents=True)
    assert places.version_dir(5) == tmp_path / "disk" / "v000000000005"
    assert places.version_dir(10) == tmp_path / "mem" / "v000000000010"
    (tmp_path / "mem" / "v000000000005").mkdir()  # in both: memory is read first
    assert places.version_dir(5) == tmp_path / "mem" / "v000000000005"
    assert places.steps() == [5, 10]
    # A version never placed (a restore putting a copy back) goes to the disk.
    places.place(20, in_memory=True)
    assert places.version_dir(99).parent == tmp_path / "disk"
    assert not places.in_memory(99)


def test_without_a_memory_directory_every_version_is_on_the_disk(tmp_path):
    places = NodePlaces(tmp_path / "disk")
    places.place(5, in_memory=True)
    assert places.version_dir(5) == tmp_path / "disk" / "v000000000005"
    assert places.roots == (tmp_path / "disk",)
    assert not places.memory_fits(1)


def test_the_budget_counts_what_the_node_keeps_in_memory(tmp_path):
    memory = tmp_path / "mem"
    (memory / "v000000000005").mkdir(parents=True)
    (memory / "v000000000005" / "shard-r00000.hck").write_bytes(b"x" * 100_000)
    used = NodePlaces(tmp_path / "disk", memory).memory_used()
    assert used >= 100_000
    assert NodePlaces(tmp_path / "disk", memory, budget_bytes=used + 50_000).memory_fits(50_000)
    assert not NodePlaces(tmp_path / "disk", memory, budget_bytes=used + 50_000).memory_fits(50_001)


def test_files_in_memory_are_deleted_not_kept_as_spares_on_the_disk(tmp_path):
    places = NodePlaces(tmp_path / "disk", tmp_path / "mem", budget_bytes=1 << 20)
    level = LocalLevel(tmp_path / "disk", 0, spares=SpareFiles(tmp_path / "disk"), places=places)
    places.place(5, in_memory=True)
    path = level.shard_path(5)
    assert path.parent.parent == tmp_path / "mem"
    assert level.spare_for(path) is None
    path.parent.mkdir(parents=True)
    path.write_bytes(b"shard")
    level.retire(path)
    assert not path.exists() and not (tmp_path / "disk" / ".spare" / path.name).exists()
    places.place(10, in_memory=False)
    on_disk = level.shard_path(10)
    assert level.spare_for(on_disk) == tmp_path / "disk" / ".spare" / on_disk.name


def test_the_file_system_type_is_the_longest_mount_above_the_path(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\ntmpfs /dev/shm2 tmpfs rw 0 0\n")
    assert file_system_type("/dev/shm/hpcckpt/node0", str(mounts)) == "tmpfs"
    assert file_system_type("/dev/shmx", str(mounts)) == "ext4"
    assert file_system_type("/work", str(mounts)) == "ext4"
    assert file_system_type("/work", str(tmp_path / "absent")) is None
