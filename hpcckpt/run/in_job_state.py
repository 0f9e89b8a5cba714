"""What in-job recovery keeps of this process between a dead rank and the next Checkpointer:
the checkpointers open now (a failure abandons them), the finished step each abandoned one
held (the next one of its run goes on from it), the records of each recovery not yet written
(the rank that would have written them may be among the lost), and how many recoveries this
process went through. Below both the facade (ckpt/engine.py) and the recovery
(run/in_job.py), which share it; it imports neither.
"""

from __future__ import annotations

import weakref

_open: "weakref.WeakSet" = weakref.WeakSet()  # the checkpointers of this process not yet closed
# The finished step each abandoned checkpointer held (ckpt/step_commits.py), by run directory;
# None where it held none.
_held: dict = {}
NOT_OFFERED = object()  # no checkpointer of that run was abandoned since its last restart
FILLING = object()  # a spare took a dead rank's place: it holds nothing, the survivors hand it theirs
_unrecorded: list[dict] = []
_recoveries = 0


def opened(checkpointer) -> None:
    _open.add(checkpointer)


def closed(checkpointer) -> None:
    _open.discard(checkpointer)


def is_open(checkpointer) -> bool:
    return checkpointer in _open


def open_checkpointers() -> list:
    return list(_open)


def hold(run_dir, held) -> None:
    """What an abandoned checkpointer of `run_dir` held, for the next one of that run."""
    _held[str(run_dir)] = held


def held_runs() -> list[str]:
    """The run directories whose abandoned checkpointers offered what they held."""
    return sorted(_held)


def forget_held() -> None:
    """A second failure before the restart: only the newest checkpointers count."""
    _held.clear()


def take_held(run_dir) -> object:
    """(restart) What the abandoned checkpointer of `run_dir` held: a HeldStep, None, FILLING
    (a spare in a dead rank's place), or NOT_OFFERED; offered or not alike on every survivor.
    Handed over once."""
    return _held.pop(str(run_dir), NOT_OFFERED)


def record(entry: dict) -> None:
    """A recovery's record for the run's metrics, written by the next Checkpointer's log."""
    _unrecorded.append(entry)


def take_unrecorded() -> list[dict]:
    taken = list(_unrecorded)
    _unrecorded.clear()
    return taken


def count_recovery() -> None:
    global _recoveries
    _recoveries += 1


def recoveries_in_job() -> int:
    return _recoveries
