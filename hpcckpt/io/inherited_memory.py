"""Snapshot memory handed from a checkpointer set aside after ranks died to the survivors'
next one, within one process.

A fresh anonymous mapping faults in every page on its first touch: filling new memory
costs several times the copy itself (the kernel zeroes and maps 4 KiB at a time),
and the first thing a survivor's new checkpointer does with its snapshot buffer is fill it
with the version it restores. The abandoned checkpointer's buffer is the same size whenever
the job kept its size (a spare took the dead rank's place), and its pages are resident.

Where the next checkpointer lays its pieces out at the same offsets, the buffer is handed
over as it is: it may still hold this rank's pieces of the last version taken before the
ranks died, which the restore then checks against that version's checksums and loads in place
rather than reading the node-local file (repartition/exchange.py). Otherwise it is
zero-filled, as a new mapping is.

Only a buffer no thread can still touch is left here (the pipeline's threads stopped), and
what the next checkpointer does not take is let go, so at most one recovery's buffers are
ever held.
"""

from __future__ import annotations

import numpy as np

_left: list[tuple[np.ndarray, dict]] = []  # (buffer, {piece name: its offset there})


def leave(buffer: np.ndarray | None, offsets: dict | None = None) -> None:
    """`buffer` is no longer used by its owner, whose pieces lay at `offsets` in it: the next
    take() of its size may have it."""
    if buffer is not None:
        _left.append((buffer, dict(offsets or {})))


def take(nbytes: int, offsets: dict | None = None) -> tuple[np.ndarray | None, bool]:
    """(a buffer of exactly `nbytes` left here, or None; whether it comes as it was left,
    its pieces at the same `offsets`). A buffer whose pieces lay elsewhere comes zero-filled,
    as a new mapping does. What is left besides is let go."""
    found = next(((buffer, left_at) for buffer, left_at in _left if buffer.nbytes == nbytes), None)
    _left.clear()
    if found is None:
        return None, False
    buffer, left_at = found
    as_left = bool(offsets) and left_at == dict(offsets)
    if not as_left:
        buffer.fill(0)
    return buffer, as_left
