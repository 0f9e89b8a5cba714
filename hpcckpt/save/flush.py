"""L4 at its own pace (SCR's asynchronous flush): a version committed on the node-local levels
is copied to the global levels from this rank's L1 file on a thread of its own, so a slow PFS
never holds back node-local checkpoints. The snapshot buffers are free once L1-L3 commit;
"at most one checkpoint in flight" is about them, not about L4.

Which versions L4 takes is agreed where every rank runs the same checkpoints in the same
order, on the persist thread: after each node-local commit the ranks agree (one allreduce
of a flag) whether a copy is still running on any of them. If none is, this version is
copied (when L4 is due, or owed); if one is, L4 skips it and is owed, and the next version
committed once the copy is over takes its place: L4 holds the newest complete node-local
version it could take, intermediate ones skipped. The copy's own collectives run on a
communicator of their own, beside the persist thread's.

The final checkpoint, drain, restart and close wait for the copy in flight (`wait`).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hpcckpt.cluster.collectives import quiet_any
from hpcckpt.save.threads import Worker


@dataclass
class FlushStats:
    """What L4 did at its own pace this run, for the summary."""

    offered: int = 0  # versions L4 was due for
    skipped: int = 0  # of those, passed over while a copy ran
    copied: list = field(default_factory=list)  # (step, seconds from node-local commit to L4 durable)
    owed: set = field(default_factory=set)  # versions started as owed, not due: in place of skipped ones

    def describe(self) -> str | None:
        if not self.offered:
            return None
        lags = [lag for _, lag in self.copied]
        lag = f"; durable there {statistics.median(lags):.2f} s (median), {max(lags):.2f} s (max) after " \
              "node-local storage" if lags else ""
        in_place = sum(1 for step, _ in self.copied if step in self.owed)
        newer = f", {in_place} newer one(s) taken in their place" if in_place else ""
        return (f"L4 took {len(self.copied) - in_place} of {self.offered} version(s) due at its own pace "
                f"({self.skipped} skipped while a copy ran{newer}){lag}")


class AsyncFlush:
    """(all ranks) Collective to construct (a communicator of its own). `copy(step, manifest,
    report, started, comm)` copies one committed version to the global levels with agreed
    stages on `comm` and deals with their failures itself; anything it raises is a bug kept
    for the next call on the main thread."""

    def __init__(self, comm, copy: Callable, log, on_start: Callable[[], None] | None = None):
        self.comm = comm.Dup()
        self.copy = copy
        self.log = log
        self.idle = threading.Event()
        self.idle.set()
        self.flushing: int | None = None  # the version being copied: node-local retention keeps it
        self.owed = False
        self.error: BaseException | None = None
        self.stats = FlushStats()
        self.last_report = None  # the report of the newest version copied (its L4 timings)
        self._worker = Worker("hpcckpt-l4", on_start=on_start)

    def offer(self, persist_comm, step: int, manifest, report, started: float, due: bool) -> bool:
        """(all ranks, persist thread, after the node-local commit of `step`) Start copying
        this version when L4 is due or owed and no copy runs on any rank. True: started."""
        if not (due or self.owed):
            return False
        self.stats.offered += due
        busy = quiet_any(persist_comm, not self.idle.is_set())
        if busy:
            self.stats.skipped += due
            self.owed = True
            return False
        self.owed = False
        self.raise_error()
        if not due:
            self.stats.owed.add(step)
        self.idle.clear()
        self.flushing = step
        committed_at = time.perf_counter()
        self._worker.submit(self._run, step, manifest, report, started, committed_at)
        return True

    def _run(self, step: int, manifest, report, started: float, committed_at: float) -> None:
        try:
            self._copy(step, manifest, report, started, committed_at)
        except BaseException as exc:
            self.error = exc
            if self.log:
                self.log.error(f"copying version {step} to L4 failed: {exc}")
        finally:
            self.flushing = None
            self.idle.set()

    def copy_now(self, step: int, manifest, report, started: float) -> None:
        """(all ranks) Copy here and now, after the copy in flight (the final checkpoint)."""
        self.wait()
        self.stats.offered += 1
        self.owed = False
        self._copy(step, manifest, report, started, time.perf_counter())

    def _copy(self, step: int, manifest, report, started: float, committed_at: float) -> None:
        if self.copy(step, manifest, report, started, self.comm):
            self.stats.copied.append((step, time.perf_counter() - committed_at))
            self.last_report = report

    def wait(self) -> None:
        """Until no copy runs on this rank; its unexpected failure is raised here."""
        self.idle.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def stop(self) -> None:
        self.idle.wait()
        self._worker.stop()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
