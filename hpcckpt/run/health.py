"""What a version's metrics say about its state, and the check a restore makes of it (pure).

A version is taken with the application's metrics (Checkpointer.checkpoint(step, metrics)).
- A checkpoint whose metrics hold a number that is not finite (a loss that turned NaN) is
  refused: a diverged state is never saved.
- A version whose metrics record a finite `loss` vouches for its floating-point arrays: the
  state that produced a finite loss holds no NaN or inf. A copy restored with NaN or inf
  there was damaged before its checksum was taken (a bit flipped in the snapshot, a replica
  assembled wrong), so the restore fails that copy like a checksum mismatch and falls
  through to another level, then an older version (checkpoint.verify_finite, on by default;
  off for applications whose arrays hold NaN or inf on purpose).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Iterable, Mapping

import numpy as np

VOUCHING_METRIC = "loss"
_CHUNK_ELEMENTS = 1 << 22  # the check's boolean scratch stays small whatever the array's size


def non_finite_metrics(metrics: Mapping | None) -> list[str]:
    """The metrics whose value is a number that is not finite."""
    return [name for name, value in (metrics or {}).items()
            if isinstance(value, Real) and not isinstance(value, bool) and not math.isfinite(value)]


def vouches_finite(metrics: Mapping | None) -> bool:
    value = (metrics or {}).get(VOUCHING_METRIC)
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def first_non_finite(named_arrays: Iterable[tuple[str, np.ndarray]]) -> str | None:
    """The name of the first floating-point array holding NaN or inf, or None."""
    for name, array in named_arrays:
        if not _all_finite(array):
            return name
    return None


def _all_finite(array: np.ndarray) -> bool:
    if array.dtype.kind not in "fc":
        return True
    flat = array.reshape(-1)
    return all(np.isfinite(flat[i:i + _CHUNK_ELEMENTS]).all() for i in range(0, flat.size, _CHUNK_ELEMENTS))
