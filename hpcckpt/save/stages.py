"""Running the save's stages on this rank, each agreed by every rank (cluster/collectives.py),
so a failure anywhere stops the version everywhere before its commit: a stage run here, one
level's store with its storage failures by rank, the first node-local store on the writer
thread, and the bookkeeping of what each level took. Injected faults strike inside the
levels (faulty_levels.py wraps them), never here."""

from __future__ import annotations

import threading
import time
from typing import Callable

from hpcckpt.save.room import out_of_space
from hpcckpt.save.save_plan import RETRY, decide
from hpcckpt.cluster.collectives import StorageFailure, agree, agree_per_rank, is_storage_failure
from hpcckpt.errors import CheckpointError


class BackgroundWrite:
    """One level's store on the writer thread (L1's file), while the other node-local levels
    send and encode the same bytes: durable on L1-L3 after the disk's time for the files
    rather than after the disk's time plus the transfers and the encoding."""

    def __init__(self):
        self.done = threading.Event()
        self.error = None
        self.stored = 0
        self.finished_at = 0.0
        self.cpu_s = 0.0


class RoomOnce:
    """Making room for one version (save/room.py), at most once: later calls answer as the
    first did."""

    def __init__(self, make_room: Callable[[], bool]):
        self._make_room = make_room
        self.result: bool | None = None

    @property
    def tried(self) -> bool:
        return self.result is not None

    def __call__(self) -> bool:
        if self.result is None:
            self.result = bool(self._make_room())
        return self.result


def note_failures(lacking: dict, failed: dict, where: str) -> None:
    """A stage's storage failures by rank, the first one of each rank kept, saying where."""
    for rank, why in failed.items():
        lacking.setdefault(rank, StorageFailure(f"{where}: {why}"))


def once_more_after_making_room(attempt: Callable, make_room: Callable[[], bool]):
    """(all ranks) `attempt()`, and once more if it ran out of space on some rank and
    `make_room()` dropped versions (save/room.py); its last error otherwise."""
    try:
        return attempt()
    except CheckpointError as exc:
        if decide(is_storage_failure(exc), out_of_space(exc), room_untried=True) != RETRY or not make_room():
            raise
    return attempt()


class StageRunner:
    """(all ranks) Runs stages and agrees on them; `writer` is the thread the first
    node-local store runs on. `bytes_stored`, `versions_stored`: level -> bytes and versions
    this rank stored there, this run."""

    def __init__(self, comm, log, writer):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.log = log
        self.writer = writer
        self.bytes_stored: dict[str, int] = {}
        self.versions_stored: dict[str, int] = {}

    def run(self, step: int, label: str, action, comm=None):
        """One stage of the persist; a failure on any rank fails it on all."""
        return agree(self.comm if comm is None else comm, label, action, step=step)

    def per_rank(self, step: int, level, version) -> tuple[int | None, dict]:
        """One node-local level's store, its storage failures by rank."""
        return agree_per_rank(self.comm, level.stage_label, lambda: level.store(version), step=step)

    def start_background(self, level, version) -> BackgroundWrite:
        writing = BackgroundWrite()

        def write():
            cpu_started = time.thread_time()
            try:
                writing.stored = level.store(version)
            except Exception as exc:  # agreed by every rank like any stage's error, never lost
                writing.error = exc
            finally:
                writing.finished_at = time.perf_counter()
                writing.cpu_s = time.thread_time() - cpu_started
                writing.done.set()

        self.writer.submit(write)
        return writing

    def finish_background(self, level, step: int, writing: BackgroundWrite, report, started: float,
                          lacking: dict) -> None:
        """Wait for the writer thread's store and agree on it."""
        writing.done.wait()
        report.cpu_s["l1_write"] = writing.cpu_s

        def outcome():
            if writing.error is not None:
                raise writing.error
        _, failed = agree_per_rank(self.comm, level.stage_label, outcome, step=step)
        note_failures(lacking, failed, level.stage_label)
        if self.rank not in failed:
            self.mark(report, step, level.name, started, writing.stored, finished=writing.finished_at)

    def mark(self, report, step: int, level: str, started: float, nbytes: int, finished: float | None = None) -> None:
        report.durable_s[level] = (finished or time.perf_counter()) - started
        self.note_stored(level, nbytes)
        if self.log:
            self.log.info(f"step {step}: {level} done after {report.durable_s[level]:.3f} s "
                          f"({nbytes} bytes stored by this rank)")

    def note_stored(self, level: str, nbytes: int) -> None:
        """This rank stored one more version on `level`, `nbytes` of it."""
        self.bytes_stored[level] = self.bytes_stored.get(level, 0) + int(nbytes)
        self.versions_stored[level] = self.versions_stored.get(level, 0) + 1

    def withdraw(self, step: int, levels) -> None:
        """A version some rank could not commit is committed nowhere: the ranks that did drop
        their record, or their retention would count it and delete an older complete one."""
        for level in levels:
            try:
                level.withdraw(step)
            except OSError as exc:
                if self.log:
                    self.log.warning(f"step {step}: cannot withdraw this rank's commit record of the failed "
                                     f"version: {exc.strerror or exc}; a restart will not use it, as other ranks "
                                     "lack theirs")
                return

    def drop_partial(self, level, step: int) -> None:
        """What a failed global level wrote of a version goes (its coordinator deletes the
        directory once every rank's attempt is over: the failure was agreed)."""
        try:
            level.remove(step)
        except OSError as exc:
            if self.log:
                self.log.warning(f"cannot remove the partial {level.label} copy of step {step}: "
                                 f"{exc.strerror or exc}; it has no commit record, so no restart loads it")
