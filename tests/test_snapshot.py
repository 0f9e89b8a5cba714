"""What rank 0 checks of every rank's protected block arrays (ckpt/snapshot.py), without MPI."""

import pytest


# Blocks of a global array: what rank 0 checks of every rank's protect() calls (ckpt/snapshot.py)
def _block(name="u", dtype="float64", global_shape=(4, 6), offset=(0, 0), shape=(4, 3), gaps=False):
    return (name, dtype, global_shape, offset, shape, gaps)


def test_blocks_from_every_rank_make_one_layout():
    from hpcckpt.ckpt.snapshot import _block_layouts

    [layout] = _block_layouts([("d", [_block()]), ("d", [_block(offset=(0, 3))])])
    assert layout.boxes == (((0, 4), (0, 3)), ((0, 4), (3, 6))) and not layout.gaps


@pytest.mark.parametrize("everyone, message", [
    ([("d", [_block()]), ("e", [_block(offset=(0, 3))])],
     "the ranks protected different arrays or registered different state (names, kinds, dtypes, shapes, per_rank): ranks 0 vs ranks 1"),
    ([("d", [_block()]), ("d", [])], "the ranks protected different block arrays: rank 0 ['u'], rank 1 []"),
    ([("d", [_block()]), ("d", [_block(dtype="float32", offset=(0, 3))])],
     "array 'u': the ranks give different values of dtype: float32 (ranks 1), float64 (ranks 0)"),
    ([("d", [_block()]), ("d", [_block(global_shape=(4, 7), offset=(0, 3))])], "different values of global_shape: (4, 6) (ranks 0), (4, 7) (ranks 1)"),
    ([("d", [_block()]), ("d", [_block(offset=(0, 3), gaps=True)])], "different values of allow_gaps: False (ranks 0), True (ranks 1)"),
    ([("d", [_block()]), ("d", [_block(offset=(3,))])],
     "rank 1's block of shape (4, 3) at offset (3,) does not have the 2 dimensions"),
    ([("d", [_block()]), ("d", [_block(offset=(0, 2))])], "the blocks of ranks 0 and 1 overlap in [0:4, 2:3]"),
    ([("d", [_block(dtype="object")]), ("d", [_block(dtype="object", offset=(0, 3))])], "holds Python objects"),
])
def test_blocks_that_do_not_fit_are_named(everyone, message):
    """Bad input (exit 2), not a checkpoint that cannot be loaded."""
    from hpcckpt.ckpt.snapshot import _block_layouts
    from hpcckpt.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        _block_layouts(everyone)
    assert message in str(caught.value), str(caught.value)
