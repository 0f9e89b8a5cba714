"""What checkpoints cost one run of an application: the per-checkpoint records in
metrics.jsonl as they happen, and one summary line at the end (how many, blocking median and
max, estimated overhead, versions and bytes per level, what L4 at its own pace copied or skipped).

A checkpoint blocks the application in begin_checkpoint() (waiting for the previous persist),
in capture() during the step, in end_checkpoint(), and later in before_update() while a
background copy is not taken yet: the last comes in after the next step, and is added to the
checkpoint it belongs to.
"""

from __future__ import annotations

import time

import numpy as np

from hpcckpt.cluster.collectives import fold_at_root
from hpcckpt.levels.naming import LEVEL_NUMBERS
from hpcckpt.runlog import bytes_text


class CheckpointTally:
    def __init__(self, log):
        self.log = log
        self.blocking: list[float] = []
        self.started = time.perf_counter()
        self._copies_behind = None  # the report of a snapshot whose copies may still be running
        self._incomplete: list = []  # reports whose L4 copy at its own pace is not over yet
        self.begin_blocked = (0.0, 0.0)  # begin_checkpoint(): (seconds blocked, of them waiting for a persist)
        self.last_checkpoint: int | None = None  # the step of the newest checkpoint taken
        self.previous_durable: float | None = None  # seconds until the previous checkpoint was durable
        self.level_times: dict[str, tuple[float, float]] = {}  # newest (until durable, own writing) by level

    def opened(self, previous, blocked: float, waited: float, flush) -> None:
        """A snapshot was opened after `blocked` seconds (`waited` of them for `previous`,
        the checkpoint that was in flight, now over)."""
        if previous is not None and previous.durable_s:
            self.previous_durable = max(previous.durable_s.values())
        self.note_level_times(previous, flush)
        self.begin_blocked = (blocked, waited)

    def closed(self, report, copies_in_background: bool, inline: float = 0.0) -> tuple[float, float]:
        """The snapshot of `report.step` was handed over (`inline`: seconds its persist ran on
        the caller's thread, where MPI allows no threads): (seconds it blocked in all, of them
        waiting for the previous persist)."""
        blocked, waited = self.begin_blocked
        blocked += report.snapshot_s + report.captured_early_s + inline
        self.begin_blocked = (0.0, 0.0)
        self.last_checkpoint = report.step
        self.taken(report, blocked, copies_in_background)
        return blocked, waited

    def note_level_times(self, report, flush) -> None:
        """Each level's newest (seconds until durable, seconds of its own writing), from a
        finished checkpoint's report and from L4's newest copy at its own pace."""
        for seen in (report, flush.last_report if flush is not None else None):
            for name, durable in (seen.durable_s.items() if seen is not None else ()):
                self.level_times[name] = (durable, durable - seen.started_s.get(name, 0.0))

    def restart_clock(self) -> None:
        """The run's time, for the overhead estimate, counts from here (after its restart)."""
        self.started = time.perf_counter()

    def durable(self, report, still_copying=lambda step: False) -> None:
        """A finished checkpoint's durability times, recorded once complete: a version L4 is
        still copying at its own pace (`still_copying(step)`) waits for a later call."""
        if report is not None and report.durable_s:
            self._incomplete.append(report)
        for done in [r for r in self._incomplete if not still_copying(r.step)]:
            self._incomplete.remove(done)
            if self.log:
                self.log.metrics({"step": done.step, "checkpoint_durable_s": done.durable_s})

    def taken(self, report, blocked: float, copies_in_background: bool) -> None:
        self.blocking.append(blocked)
        self._copies_behind = report if copies_in_background else None
        if self.log:
            self.log.metrics({"step": report.step, "checkpoint_blocking_s": blocked,
                              "checkpoint_captured_during_step_s": report.captured_early_s})

    def step_over(self) -> None:
        """After the step that followed a checkpoint: what its background copies made it wait."""
        behind, self._copies_behind = self._copies_behind, None
        if behind is None:
            return
        self.blocking[-1] += behind.copy_wait_s
        if self.log:
            self.log.metrics({"step": behind.step, "checkpoint_copy_wait_s": behind.copy_wait_s,
                              "checkpoint_background_copy_s": behind.background_copy_s})

    def summarise(self, comm, stored: tuple[dict, dict], levels: tuple[str, ...], flush, replaced: int = 0) -> None:
        """(all ranks) One line per run: how many checkpoints were taken, how many versions
        (and bytes, summed over ranks) each level stored, and what they cost the application.
        `stored`: (level -> versions, level -> bytes) this rank stored; a level's versions are
        those every rank stored. `replaced`: versions no level was due for that a newer one
        replaced before any level took them."""
        seconds = time.perf_counter() - self.started
        versions, nbytes = fold_at_root(comm, stored, lambda everyone: (
            {level: min(v.get(level, 0) for v, _ in everyone) for level in levels},
            {level: sum(b.get(level, 0) for _, b in everyone) for level in levels}))
        if not self.log:
            return
        blocking = np.asarray(self.blocking or [0.0])
        overhead = 100.0 * blocking.sum() / seconds if seconds else 0.0
        kept = ", ".join(f"{LEVEL_NUMBERS[level]} {versions[level]} ({bytes_text(nbytes[level])})" for level in levels)
        instead = f" ({replaced} replaced by a newer one before any level was due)" if replaced else ""
        self.log.info(f"checkpoints: {len(self.blocking)} taken{instead}; versions stored: {kept}; blocking median "
                      f"{1000 * np.median(blocking):.1f} ms, max {1000 * blocking.max():.1f} ms, estimated overhead "
                      f"{overhead:.2f} % of the run's time", console=True)
        if flush is not None and flush.stats.describe():
            self.log.info(flush.stats.describe(), console=True)
        self.log.metrics({"event": "checkpoint_summary", "checkpoints": len(self.blocking),
                          "blocking_median_s": float(np.median(blocking)), "blocking_max_s": float(blocking.max()),
                          "overhead_pct": overhead, "bytes_per_level": nbytes, "versions_per_level": versions,
                          "replaced_before_stored": replaced,
                          **({"l4_async": {"offered": flush.stats.offered, "skipped": flush.stats.skipped,
                                           "copied": [step for step, _ in flush.stats.copied],
                                           "lag_s": [lag for _, lag in flush.stats.copied]}}
                             if flush is not None else {})})
