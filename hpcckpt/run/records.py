"""Commit records read by a job's own work, with damage handled the same way by every reader
(the end-of-run drain, retention, making room; the restore has its own discovery, which
follows the same rule).

A record that cannot be read as it was written (DamagedRecordError: cut short, bytes flipped,
not JSON) is not used, and one warning names it. A global level's version whose one record is
damaged is set aside by the level's coordinator (`v<step>.damaged`: kept for inspection,
never loaded, never pruned), so the step can be written there again, from node-local
storage where that holds it (the end-of-run drain). A node-local record is this rank's copy
of its version's record: that copy is not used, and a restart rewrites it from an intact copy
(another rank's record of the same writing, or L4's). A record that cannot be read for
another reason (an I/O error, a format of another hpcckpt) is left as it is: not used now,
and not taken for damage.
"""

from __future__ import annotations

from hpcckpt.errors import DamagedRecordError, HpcckptError
from hpcckpt.format.manifest import Manifest

DAMAGED_SUFFIX = ".damaged"


class RecordReader:
    def __init__(self, rank: int, log=None, repair: bool = True):
        """`repair`: set damaged global versions aside (a job's own work; offline readers
        and read-only jobs only report)."""
        self.rank = rank
        self.log = log
        self.repair = repair
        self._said: set = set()
        self.aside: set = set()  # (level name, step) of the versions this reader set aside

    def manifest(self, level, step: int) -> Manifest | None:
        """`level`'s record of `step`, or None where it cannot be used."""
        try:
            return level.manifest(step)
        except DamagedRecordError as exc:
            self.damaged(level, step, exc)
            return None
        except (HpcckptError, OSError):
            return None

    def damaged(self, level, step: int, exc: BaseException) -> None:
        key = (level.name, step)
        if key in self._said:
            return
        self._said.add(key)
        if level.node_local:
            self._warn(f"{level.label} version {step}: the commit record of rank {self.rank} is damaged ({exc}); "
                       "that copy is not used (a restart rewrites it from an intact copy)")
        elif self.repair and level.prunes_here:
            try:
                aside = level.set_aside(step, DAMAGED_SUFFIX)
            except OSError as error:
                self._warn(f"{level.label} version {step}: its commit record is damaged ({exc}) and the version "
                           f"cannot be set aside ({error.strerror or error}); it is not used")
                return
            self.aside.add(key)
            self._warn(f"{level.label} version {step}: its commit record is damaged ({exc}); the version is set "
                       f"aside as {aside} (kept for inspection, never loaded) and is written there again from "
                       "node-local storage where that holds it")

    def _warn(self, message: str) -> None:
        if self.log is not None:
            self.log.warning(message)
