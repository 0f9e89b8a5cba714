"""The restart ledger: which version a restart is loading, and which versions made restarts fail.

The rule: a version is charged only for a failure it can have caused, and only when the
evidence says so.
- A restart writes "pending: step V" before it loads V, and clears it once the resumed run
  has proved itself: checkpoint.confirm_after_steps steps, its next checkpoint, or a clean
  end. Work that does not depend on what was loaded clears it too, so its failures are never
  charged: the end-of-run copy to L4 comes after a clean close has confirmed; an error every
  rank agreed on while loading (an incompatible model), a storage or configuration error
  and a stop request confirm on the way out (Checkpointer.close).
- A pending entry found by the next restart is one crash from V: while loading it or right
  after. One crash proves nothing (a node that died under the restart, a kill from outside):
  V is tried again, and only a second consecutive restart from V that crashes marks it
  failed (CRASHES_TO_FAIL). A restart from V that is confirmed clears its count.
- Where the configuration says how often failures come (resilience.mtbf_*_hours, or
  checkpoint.mtbf_hours), consecutive crashes are also weighed against chance: each crashed
  restart lasted at most from its pending entry to the next restart, and failures at that
  rate strike within such a window with probability 1 - exp(-rate * window). V is marked
  failed only once the chance that failures explain all its crashes in a row is below
  CHANCE_EXPLAINED (0.1 %); where failures come every few seconds, a good version is not
  given up because a few restarts in a row met one.
- A crash that lost a node is explained without V: the pending entry records how many
  node-local directories held the run's files when it began, and when the next restart finds
  fewer, that crash is not counted (nodes that die under restarts, one after the other, must
  not mark intact versions failed until none is left).
- A failure the ranks report themselves (mark_failed: e.g. a state that is not finite) marks
  V at once.
A failed version is skipped: restarts fall back to older versions instead of looping on it.

One JSON file, <run.dir>/restarts.json, owned by rank 0 (run.dir is shared by all nodes):

    {"pending": {"step": 300, "since": 1700000000.0},
     "crashes": {"300": 1},
     "chance": {"300": 0.18},
     "failed": {"300": "two restarts from it (the last at 2026-11-23 10:00:00) crashed ..."},
     "set_aside": {"v000000000300.failed": "two restarts from it ... crashed ..."}}

Delete a step's entry under "failed" to let restarts try it again. Once a restart has fallen
back past a failed version, that version's files are set aside (L4) or deleted (node-local) and
the resumed run writes the step again: the entry then moves to "set_aside", for the record,
since it must not keep the new writing of that step from being loaded. A ledger that cannot
be read (cut short, not JSON) is set aside as restarts.json.damaged with a warning: what it
said about failed versions is lost, and restarts go on.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

from hpcckpt.errors import StorageError
from hpcckpt.io.atomic import write_bytes_atomically

LEDGER_NAME = "restarts.json"
CRASHES_TO_FAIL = 2  # consecutive crashed restarts from one version that mark it failed
# ... and below this chance of failures at the stated rate explaining them. A wrong mark costs
# the run a good version (its only one: the job stops), a late one another restart: a low bar.
CHANCE_EXPLAINED = 0.001


class SettledRestart(NamedTuple):
    """What the previous restart's pending entry came to."""

    step: int
    reason: str
    failed: bool  # this crash marked the version failed
    counted: bool  # the crash was counted against the version (False: a node was lost under it)
    crashes: int = 0  # counted crashes from it in a row, this one included


def ledger_path(run_dir) -> Path:
    return Path(run_dir) / LEDGER_NAME


class RestartLedger:
    def __init__(self, path: str | Path, warn=None):
        """`warn(message)`: how a damaged ledger is reported (rank 0's log)."""
        self.path = Path(path)
        self.warn = warn

    def _load(self) -> dict:
        empty = {"pending": None, "crashes": {}, "chance": {}, "failed": {}, "set_aside": {}}
        try:
            record = json.loads(self.path.read_text())
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
            return {"pending": _pending(record.get("pending")), "crashes": dict(record.get("crashes", {})),
                    "chance": dict(record.get("chance", {})), "failed": dict(record.get("failed", {})),
                    "set_aside": dict(record.get("set_aside", {}))}
        except FileNotFoundError:
            return empty
        except (ValueError, TypeError, AttributeError) as exc:
            aside = self._set_aside_damaged()
            if self.warn is not None:
                self.warn(f"the restart ledger {self.path} is damaged ({exc}): set aside as {aside}; which versions "
                          "made restarts crash is forgotten, and restarts go on")
            return empty
        except OSError as exc:
            raise StorageError(f"{self.path}: the restart ledger cannot be read ({exc.strerror or exc}); check "
                               "run.dir's file system") from None

    def _set_aside_damaged(self) -> str:
        aside = self.path.with_name(self.path.name + ".damaged")
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            raise StorageError(f"{self.path}: the restart ledger is damaged and cannot be set aside "
                               f"({exc.strerror or exc}); delete it") from None
        return aside.name

    def _save(self, record: dict) -> None:
        if not any(record[part] for part in ("pending", "crashes", "chance", "failed", "set_aside")):
            self.path.unlink(missing_ok=True)  # nothing to remember: leave no file behind
            return
        write_bytes_atomically(self.path, json.dumps(record, indent=1).encode(), overwrite=True)

    def failed_steps(self) -> dict[int, str]:
        return {int(step): reason for step, reason in self._load()["failed"].items()}

    def settle_pending(self, nodes_with_files: int | None = None, failures_per_second: float = 0.0
                       ) -> SettledRestart | None:
        """A pending entry left by the previous restart is a crash from its version: (step,
        what happened, whether that marked it failed), or None when there is none.
        `nodes_with_files`: how many node-local directories hold the run's files now; fewer
        than when the pending restart began means a node was lost under it: not counted.
        `failures_per_second`: how often the configuration says failures come (0: not said)."""
        record = self._load()
        pending = record["pending"]
        if not pending:
            return None
        step = int(pending["step"])
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(pending.get("since", 0))))
        record["pending"] = None
        before = pending.get("nodes_with_files")
        if nodes_with_files is not None and isinstance(before, int) and nodes_with_files < before:
            self._save(record)
            return SettledRestart(step, f"the restart from it at {since} crashed, and {before - nodes_with_files} "
                                        f"node(s) of {before} lost their node-local files since: not counted "
                                        "against it", failed=False, counted=False)
        crashes = int(record["crashes"].get(str(step), 0)) + 1
        window = max(0.0, time.time() - float(pending.get("since", 0)))
        chance = float(record["chance"].get(str(step), 1.0)) * -math.expm1(-failures_per_second * window)
        failed = crashes >= CRASHES_TO_FAIL and chance < CHANCE_EXPLAINED
        weighed = (f"; failures at the rate configured (one every {1 / failures_per_second:.3g} s) would explain "
                   f"{'them' if crashes > 1 else 'it'} with a chance of {100 * chance:.2g} %"
                   if failures_per_second > 0 else "")
        if crashes > 1:
            reason = (f"{crashes} restarts from it in a row (the last at {since}) crashed while loading or before "
                      f"they were confirmed{weighed}")
        else:
            reason = f"the restart from it at {since} crashed while loading or before it was confirmed{weighed}"
        if failed:
            record["failed"][str(step)] = reason
            record["crashes"].pop(str(step), None)
            record["chance"].pop(str(step), None)
        else:
            record["crashes"][str(step)] = crashes
            record["chance"][str(step)] = chance
        self._save(record)
        return SettledRestart(step, reason, failed=failed, counted=True, crashes=crashes)

    def mark_failed(self, step: int, reason: str) -> None:
        """The ranks found the version bad themselves: no restart loads it again."""
        record = self._load()
        record["failed"][str(step)] = reason
        record["crashes"].pop(str(step), None)
        record["chance"].pop(str(step), None)
        if record["pending"] and int(record["pending"]["step"]) == step:
            record["pending"] = None
        self._save(record)

    def set_aside(self, step: int, where: str) -> None:
        """The failed version of `step` is gone from where restarts look (`where` says what
        became of it): its entry moves from "failed" to "set_aside"."""
        record = self._load()
        reason = record["failed"].pop(str(step), None)
        if reason is not None:
            record["set_aside"][where] = reason
            self._save(record)

    def begin(self, step: int, nodes_with_files: int | None = None) -> None:
        """A restart loads `step` now; `nodes_with_files`: how many node-local directories
        hold the run's files as it begins (see settle_pending)."""
        record = self._load()
        record["pending"] = {"step": step, "since": time.time()}
        if nodes_with_files is not None:
            record["pending"]["nodes_with_files"] = nodes_with_files
        self._save(record)

    def confirm(self) -> None:
        """The restart from the pending version worked (or failed for a reason that is not
        the version's): no crash is counted, and the count of earlier ones goes."""
        record = self._load()
        if record["pending"] is not None:
            record["crashes"].pop(str(record["pending"]["step"]), None)
            record["chance"].pop(str(record["pending"]["step"]), None)
            record["pending"] = None
            self._save(record)


def _pending(value):
    if value is None:
        return None
    if not isinstance(value, dict) or "step" not in value:
        raise ValueError(f"its pending entry {value!r} names no step")
    int(value["step"])
    return value
