"""Timing and the statistics the benchmarks report: medians over repeats (these machines are
shared, so a single measurement can be far off), the papers' definition of checkpoint
overhead, and the orders that make slow phases of a shared machine hit every variant alike."""

from __future__ import annotations

import statistics
import time


def median(values, empty=None):
    """Median of the values that were measured (None and NaN are "not this time"); `empty`
    when none was."""
    values = [v for v in values if v is not None and v == v]
    return float(statistics.median(values)) if values else empty


def paper_delay(times, flags) -> tuple[float | None, float | None]:
    """The checkpoint's delay as the papers define it (CheckFreq, DeepFreeze): the mean time of
    the checkpointed steps and the steps right after them minus the mean of the others, and
    that mean of the others; (None, mean) when either set is empty."""
    hit = {j for i, f in enumerate(flags) if f for j in (i, i + 1) if j < len(flags)}
    with_ckpt = [t for i, t in enumerate(times) if i in hit]
    clean = [t for i, t in enumerate(times) if i not in hit]
    if not with_ckpt or not clean:
        return None, (statistics.fmean(clean) if clean else None)
    base = statistics.fmean(clean)
    return statistics.fmean(with_ckpt) - base, base


def paper_overhead(times, flags) -> tuple[float | None, float | None]:
    """paper_delay as a % of the other steps' mean, and that mean."""
    delay, base = paper_delay(times, flags)
    return (None if delay is None else 100.0 * delay / base), base


def time_median(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `repeats` calls of fn(), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rotated(items, repeat: int) -> list:
    """`items` starting at position `repeat` (mod their number): each goes first in turn."""
    items = list(items)
    k = repeat % len(items)
    return items[k:] + items[:k]


def alternated(items, repeat: int) -> list:
    """`items` in order on even repeats, reversed on odd ones."""
    items = list(items)
    return items if repeat % 2 == 0 else items[::-1]
