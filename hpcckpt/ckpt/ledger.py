"""The restart ledger: which version a restart is loading, and which versions made one fail.

A restart writes "pending: step V" before it loads V and clears it once the resumed run has
proved itself (its next checkpoint, or checkpoint.confirm_after_steps steps). A pending entry
found by the next restart means the previous one crashed while loading V or right after it:
V is marked failed, and restarts fall back to older versions instead of looping on it.

One JSON file, <run.dir>/restarts.json, owned by rank 0 (run.dir is shared by all nodes):

    {"pending": {"step": 300, "since": 1700000000.0},
     "failed": {"300": "the restart from it at 2026-11-23 10:00:00 crashed before it was confirmed"},
     "set_aside": {"v000000000300.failed": "the restart from it at ... crashed ..."}}

Delete a step's entry under "failed" to let restarts try it again. Once a restart has fallen
back past a failed version, that version's files are set aside (L4) or deleted (node-local) and
the resumed run writes the step again: the entry then moves to "set_aside", for the record,
since it must not keep the new writing of that step from being loaded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpcckpt.errors import StorageError
from hpcckpt.io.atomic import write_bytes_atomically

LEDGER_NAME = "restarts.json"


def ledger_path(run_dir) -> Path:
    return Path(run_dir) / LEDGER_NAME


class RestartLedger:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _load(self) -> dict:
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"pending": None, "failed": {}, "set_aside": {}}
        except (OSError, ValueError) as exc:
            raise StorageError(f"{self.path}: the restart ledger cannot be read ({exc}); fix or delete the file "
                               "(deleting it forgets which versions made restarts fail)") from None
        return {"pending": record.get("pending"), "failed": dict(record.get("failed", {})),
                "set_aside": dict(record.get("set_aside", {}))}

    def _save(self, record: dict) -> None:
        if not record["pending"] and not record["failed"] and not record["set_aside"]:
            self.path.unlink(missing_ok=True)  # nothing to remember: leave no file behind
            return
        write_bytes_atomically(self.path, json.dumps(record, indent=1).encode(), overwrite=True)

    def failed_steps(self) -> dict[int, str]:
        return {int(step): reason for step, reason in self._load()["failed"].items()}

    def settle_pending(self) -> tuple[int, str] | None:
        """A pending entry left by the previous restart: mark its version failed (returned)."""
        record = self._load()
        pending = record["pending"]
        if not pending:
            return None
        step = int(pending["step"])
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(pending.get("since", 0))))
        reason = f"the restart from it at {since} crashed while loading or before it was confirmed"
        record["failed"][str(step)] = reason
        record["pending"] = None
        self._save(record)
        return step, reason

    def set_aside(self, step: int, where: str) -> None:
        """The failed version of `step` is gone from where restarts look (`where` says what
        became of it): its entry moves from "failed" to "set_aside"."""
        record = self._load()
        reason = record["failed"].pop(str(step), None)
        if reason is not None:
            record["set_aside"][where] = reason
            self._save(record)

    def begin(self, step: int) -> None:
        record = self._load()
        record["pending"] = {"step": step, "since": time.time()}
        self._save(record)

    def confirm(self) -> None:
        record = self._load()
        if record["pending"] is not None:
            record["pending"] = None
            self._save(record)
