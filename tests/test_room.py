"""Making room on a full level (save/room.py): what may be dropped, and how much."""


def test_making_room_drops_only_copies_held_elsewhere_and_only_what_makes_the_version_fit():
    import errno
    import os

    from hpcckpt.save.room import bytes_to_write, droppable, how_many_to_drop, out_of_space
    from hpcckpt.errors import CheckpointError

    # L4 holds 10-40; the node-local levels hold 30, 40 and the new 50: only 30 and 40 are
    # held elsewhere, 50 is the newest anywhere, 40 is the best.
    assert droppable([10, 20, 30, 40], {30, 40, 50}, 50, None, ()) == [30, 40]
    assert droppable([10, 20, 30, 40], {30, 40, 50}, 50, 40, ()) == [30]
    assert droppable([10, 20, 30, 40], {30, 40}, 40, None, {30}) == []  # 40 newest, 30 being copied
    assert how_many_to_drop(free=100, needed=100, sizes=[50]) == 0  # fits: nothing to measure a drop against
    assert how_many_to_drop(free=10, needed=100, sizes=[50, 50, 50]) == 2
    assert how_many_to_drop(free=10, needed=100, sizes=[50, 30]) is None  # all would not do: keep them
    assert bytes_to_write([1, 4096, 4097]) == 4096 * (1 + 1 + 2) + 2 * 4096
    full = CheckpointError("L4 pfs write of step 20 failed on rank(s) [3]: ...",
                           {3: f"OSError: [Errno 28] {os.strerror(errno.ENOSPC)}"})
    assert out_of_space(full)
    assert out_of_space(CheckpointError(f"... {os.strerror(errno.EDQUOT)}"))
    assert not out_of_space(CheckpointError("... failed", {1: f"OSError: {os.strerror(errno.EIO)}"}))
