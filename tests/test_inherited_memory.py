"""The snapshot buffer an abandoned checkpointer leaves to the next one of its process, and
the restore's use of the pieces it may still hold."""

import numpy as np
import pytest

from hpcckpt.format.manifest import Manifest
from hpcckpt.format.shardfile import read_shard_table, verified_piece
from hpcckpt.io import direct_io, inherited_memory
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.naming import COMMIT_GLOB
from hpcckpt.repartition.exchange import RepartitionJob
from single_rank import shard, take_versions, version_dir


@pytest.fixture(autouse=True)
def nothing_left_before():
    inherited_memory.take(0)  # lets go of whatever an earlier test left


def test_a_buffer_laid_out_alike_is_taken_as_it_was_left_and_the_rest_let_go():
    kept = direct_io.aligned_empty(3 << 20)
    kept[:] = 7
    other = direct_io.aligned_empty(2 << 20)
    inherited_memory.leave(other, {"w": 0})
    inherited_memory.leave(kept, {"w": 4096, "b": 8192})
    taken, as_left = inherited_memory.take(3 << 20, {"b": 8192, "w": 4096})
    assert taken is kept and as_left and (taken == 7).all()
    assert inherited_memory.take(2 << 20) == (None, False)  # let go with the first take: held no longer


def test_a_buffer_laid_out_otherwise_comes_zero_filled():
    kept = direct_io.aligned_empty(3 << 20)
    kept[:] = 7
    inherited_memory.leave(kept, {"w": 4096})
    taken, as_left = inherited_memory.take(3 << 20, {"w": 8192})
    assert taken is kept and not as_left and not taken.any()


def test_another_size_takes_nothing():
    inherited_memory.leave(np.ones(4096, dtype=np.uint8), {"w": 0})
    assert inherited_memory.take(8192) == (None, False)
    assert inherited_memory.take(4096) == (None, False)


def test_a_populated_buffer_is_aligned_zeroed_and_writable():
    buffer = direct_io.aligned_empty(4 << 20, populate=True)
    assert buffer.ctypes.data % direct_io.ALIGNMENT == 0 and not buffer.any()
    buffer[:] = 1
    assert buffer.sum() == 4 << 20


def _job_over(run_dir, step: int, corrupt: str | None = None):
    """A restore's job over version `step` of a one-rank run, its buffers holding that
    version's pieces as a set-aside checkpointer's buffers would (`corrupt`: one byte of that
    piece changed since)."""
    from mpi4py import MPI

    [record] = version_dir(run_dir, "local", step).glob(COMMIT_GLOB)
    manifest = Manifest.read(record)
    path = shard(run_dir, "local", step)
    table, data = read_shard_table(path), map_readonly(path)
    names = [tl.name for tl in manifest.layout.rank_pieces(0)] + list(manifest.local_arrays)
    buffers = {name: verified_piece(data, table, name).copy() for name in names}
    if corrupt is not None:
        buffers[corrupt][len(buffers[corrupt]) // 2] ^= 0xFF
    return RepartitionJob(MPI.COMM_SELF, manifest, manifest.layout, buffers, manifest.local_arrays, [], None,
                          lambda message: None, pieces_inherited=True), buffers


def test_pieces_left_in_the_buffers_are_used_only_when_every_checksum_matches(tmp_path):
    take_versions(tmp_path, [1, 2])
    job, buffers = _job_over(tmp_path, 2)
    held = job._checked_in_buffers()
    assert held is not None
    assert all(held.piece(name).ctypes.data == buffers[name].ctypes.data for name in buffers)  # in place
    for name in buffers:
        damaged, _ = _job_over(tmp_path, 2, corrupt=name)
        assert damaged._checked_in_buffers() is None, name
    older, _ = _job_over(tmp_path, 1)
    older.manifest = job.manifest  # pieces of version 1 against version 2's checksums
    assert older._checked_in_buffers() is None
