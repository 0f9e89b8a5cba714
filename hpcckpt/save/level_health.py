"""Which levels are failing, and whether versions are still held somewhere.

A level that cannot take a version (no space, read-only, an I/O error, its directory gone)
does not stop training while another level holds that version: the failure is said once
when the level starts failing and once when it recovers (a warning each, and a metrics
record), and the level is tried again at its next version due. Training stops only when no
level held `max_unprotected` versions in a row.
"""

from __future__ import annotations

import threading

from hpcckpt.errors import StorageError


class LevelHealth:
    def __init__(self, max_unprotected: int, log):
        self.max_unprotected = max_unprotected
        self.log = log
        self.failing: dict[str, tuple[int, str]] = {}  # level label -> (first step failed, why)
        self.unprotected: list[int] = []  # steps in a row that no level holds
        self._lock = threading.Lock()  # L4's own thread reports beside the persist thread

    def failed(self, label: str, step: int, error: Exception | str, held_by: tuple[str, ...],
               ranks: list[int] | None = None) -> None:
        """`label` could not take version `step` (on `ranks` only, where the others' nodes did)."""
        where = (f"version {step} is held by {', '.join(held_by)}" if held_by
                 else f"no level holds version {step}")
        with self._lock:
            first = label not in self.failing
            if first:
                self.failing[label] = (step, str(error))
        if first:
            self._say(f"{error}; {where}; {label} is tried again at its next version due and training "
                                 "goes on", {"event": "level_failing", "level": label, "step": step,
                                             "error": str(error), **({"ranks": ranks} if ranks else {})})
        elif self.log:
            self.log.info(f"{label} still failing at step {step}: {error}; {where}")

    def succeeded(self, label: str, step: int) -> None:
        with self._lock:
            since, _ = self.failing.pop(label, (None, None))
        if since is not None:
            self._say(f"{label} recovered: version {step} is on it again (it failed from step {since} on)",
                      {"event": "level_recovered", "level": label, "step": step, "failing_since": since})

    def version_held(self, step: int, held: bool) -> None:
        """After each checkpoint; raises once `max_unprotected` versions in a row went nowhere."""
        if held:
            self.unprotected.clear()
            return
        self.unprotected.append(step)
        if len(self.unprotected) >= self.max_unprotected:
            with self._lock:
                why = "; ".join(f"{label}: {error}" for label, (_, error) in self.failing.items())
            error = StorageError(
                f"no level could hold versions {self.unprotected} ({len(self.unprotected)} checkpoints in a row, "
                f"resilience.max_unprotected_checkpoints = {self.max_unprotected}): {why}; training stops rather "
                "than run on unprotected. Fix the storage (space, permissions, mounts) and run again: the job "
                "resumes from the newest version a level still holds",
                collective=True)  # every rank counts the same agreed failures
            raise error

    def _say(self, message: str, record: dict) -> None:
        """A warning (rank 0's console) and a metrics record (rank 0 writes it)."""
        if self.log is not None:
            self.log.warning(message)
            self.log.metrics(record)
