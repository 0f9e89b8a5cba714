"""The snapshot buffer an abandoned checkpointer leaves to the next one of its process."""

import numpy as np
import pytest

from hpcckpt.io import direct_io, inherited_memory


@pytest.fixture(autouse=True)
def nothing_left_before():
    inherited_memory.take(0)  # lets go of whatever an earlier test left


def test_a_buffer_of_the_size_asked_is_taken_zero_filled_and_the_rest_let_go():
    kept = direct_io.aligned_empty(3 << 20)
    kept[:] = 7
    other = direct_io.aligned_empty(2 << 20)
    inherited_memory.leave(other)
    inherited_memory.leave(kept)
    taken = inherited_memory.take(3 << 20)
    assert taken is kept and not taken.any()
    assert inherited_memory.take(2 << 20) is None  # let go with the first take: held no longer


def test_another_size_takes_nothing():
    inherited_memory.leave(np.ones(4096, dtype=np.uint8))
    assert inherited_memory.take(8192) is None
    assert inherited_memory.take(4096) is None
