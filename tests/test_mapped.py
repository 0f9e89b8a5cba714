"""Files mapped read-only (io/mapped.py), whole files read into the page cache first."""

import os

import numpy as np
import pytest

from hpcckpt.io.mapped import map_readonly, read_into_page_cache, read_into_page_cache_behind


@pytest.mark.parametrize("whole", [False, True])
def test_a_mapping_holds_the_file_s_bytes_read_ahead_or_not(tmp_path, whole):
    path = tmp_path / "shard"
    data = np.random.default_rng(7).integers(0, 256, (3 << 20) + 123, dtype=np.uint8)
    data.tofile(path)
    mapped = map_readonly(path, whole=whole)
    assert not mapped.flags.writeable and mapped.tobytes() == data.tobytes()
    (tmp_path / "empty").write_bytes(b"")
    assert map_readonly(tmp_path / "empty", whole=whole).size == 0


def test_reading_ahead_a_file_that_cannot_be_read_is_left_to_the_read_itself(tmp_path):
    read_into_page_cache(tmp_path / "missing")  # advice only: nothing raised here
    with pytest.raises(FileNotFoundError):
        map_readonly(tmp_path / "missing", whole=True)
    read_into_page_cache(tmp_path)  # a directory: refused at open, said by the read that follows
    os.mkfifo(tmp_path / "fifo")  # no writer: opened without waiting for one, and refused
    read_into_page_cache(tmp_path / "fifo")


def _bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no /proc/self/io (not Linux)")
def test_files_read_ahead_behind_the_caller_are_read_whole_and_one_missing_stops_none(tmp_path):
    """What a survivor starts after ranks died: every file named is read through (the kernel
    counts sendfile's bytes as this process's reads), on a thread that ends on its own; a
    file gone meanwhile is skipped, not an error."""
    first, second = tmp_path / "replica-a", tmp_path / "replica-b"
    first.write_bytes(os.urandom(3 << 20))
    second.write_bytes(os.urandom(2 << 20))
    before = _bytes_read_by_this_process()
    reader = read_into_page_cache_behind([first, tmp_path / "gone", second])
    reader.join(timeout=30)
    assert not reader.is_alive() and reader.daemon
    assert _bytes_read_by_this_process() - before >= (3 << 20) + (2 << 20)
