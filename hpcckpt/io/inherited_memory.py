"""Snapshot memory handed from a checkpointer set aside after ranks died to the survivors'
next one, within one process.

A fresh anonymous mapping faults in every page on its first touch: filling new memory
costs several times the copy itself (the kernel zeroes and maps 4 KiB at a time),
and the first thing a survivor's new checkpointer does with its snapshot buffer is fill it
with the version it restores. The abandoned checkpointer's buffer is the same size whenever
the job kept its size (a spare took the dead rank's place), and its pages are resident.

Only a buffer no thread can still touch is left here (the pipeline's threads stopped), and
what the next checkpointer does not take is let go, so at most one recovery's buffers are
ever held.
"""

from __future__ import annotations

import numpy as np

_left: list[np.ndarray] = []


def leave(buffer: np.ndarray | None) -> None:
    """`buffer` is no longer used by its owner: the next take() of its size may have it."""
    if buffer is not None:
        _left.append(buffer)


def take(nbytes: int) -> np.ndarray | None:
    """A buffer of exactly `nbytes` left here, zero-filled as a new mapping is, or None; what
    is left besides is let go."""
    found = next((buffer for buffer in _left if buffer.nbytes == nbytes), None)
    _left.clear()
    if found is not None:
        found.fill(0)
    return found
