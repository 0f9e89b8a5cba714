"""One checkpoint's snapshot while the application fills it: opened at a step, each protected
array captured as the application finalises it (extraction during backprop), frozen at the
end and handed to the save pipeline. With copies in the background, the copies are queued
and taken behind the step; before_update() then holds the application back only until the
copy of the array it is about to change is taken. ckpt/taking.py drives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hpcckpt.save.save_types import BackgroundCopies, PersistReport, Snapshot
from hpcckpt.ckpt.snapshot import ProtectedArrays
from hpcckpt.errors import CheckpointError


@dataclass
class _Open:
    step: int
    opened: float
    captured: set = field(default_factory=set)
    capture_s: float = 0.0


class SnapshotCapture:
    """The open snapshot (at most one) and the background copies of the last one."""

    def __init__(self, arrays: ProtectedArrays):
        self.arrays = arrays
        self._open: _Open | None = None
        self.copies: BackgroundCopies | None = None

    def is_open_at(self, step: int) -> bool:
        return self._open is not None and self._open.step == step

    @property
    def open_step(self) -> int | None:
        return self._open.step if self._open is not None else None

    def refuse_if_open(self, step: int) -> None:
        if self._open is not None:
            raise CheckpointError(f"begin_checkpoint({step}) while the snapshot of step {self._open.step} is open")

    def open(self, step: int, in_background: bool) -> None:
        self.refuse_if_open(step)
        self._open = _Open(step, time.perf_counter())
        self.copies = BackgroundCopies(PersistReport(step)) if in_background else None

    def capture(self, name: str) -> None:
        pending = self._open
        if pending is None or name in pending.captured:
            return
        if name not in self.arrays.arrays:
            raise CheckpointError(f"capture({name!r}): no protected array has that name; protect() it first")
        started = time.perf_counter()
        self.arrays.take_or_queue(name, self.copies)
        pending.captured.add(name)
        pending.capture_s += time.perf_counter() - started

    def before_update(self, name: str) -> None:
        copies = self.copies
        if copies is None:
            return
        if self.arrays.device_snapshot is not None and self.arrays.on_gpu(name):
            self.arrays.device_snapshot.guard(name)  # the GPU waits, not the host
            return
        event = copies.taken.get(name)
        if event is None or event.is_set():
            return
        started = time.perf_counter()
        if self._open is not None:
            # Changed again before end_checkpoint() (e.g. two updates in one step): the copier
            # has not started, so the copy is taken here, with the value it had at capture().
            self.arrays.copy_piece(name)
            event.set()
        else:
            event.wait()
        copies.report.copy_wait_s += time.perf_counter() - started

    def close(self, ordinal: int, metrics: dict, final: bool, levels: tuple, engine_state: dict,
              table_chain: tuple = ()) -> tuple[Snapshot, PersistReport, float]:
        """Capture whatever is left and freeze the small state (the application's and the
        engine's own) for `levels`: (the snapshot, its report (still filling), when the rest
        of the capture began)."""
        pending = self._open
        if pending is None:
            raise CheckpointError("end_checkpoint() without begin_checkpoint()")
        started = time.perf_counter()
        for name in self.arrays.arrays:
            if name not in pending.captured:
                self.arrays.take_or_queue(name, self.copies)
        snapshot = self.arrays.freeze(pending.step, ordinal, metrics, final, levels, engine_state, table_chain)
        self._open = None
        report = self.copies.report if self.copies is not None else PersistReport(pending.step)
        report.snapshot_s = time.perf_counter() - started
        report.captured_early_s = pending.capture_s
        return snapshot, report, started

    def abandon(self) -> None:
        """A snapshot left open (an exception in the step, a step that diverged) is dropped,
        with the copies queued for it: no copier takes them, so none is waited for."""
        if self._open is not None:
            self.copies = None
        self._open = None

    def copies_done(self) -> None:
        """The copies in the background are over (the pipeline waited for them)."""
        self.copies = None
