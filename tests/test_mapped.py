"""Files mapped read-only (io/mapped.py), whole files read into the page cache first."""

import os

import numpy as np
import pytest

from hpcckpt.io.mapped import map_readonly, read_into_page_cache


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
