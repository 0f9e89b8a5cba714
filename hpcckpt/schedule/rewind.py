"""Going back in process: a version marked bad is never loaded again, and a rewind restores the
newest version before a step where the run went wrong (a loss that turned NaN or spiked),
without a relaunch, by the same path a restart takes.

A bad version is marked in the restart ledger's "failed" (run/ledger.py), which every restore
skips; once a restore has fallen back past it, its files are set aside (L4) or deleted
(node-local) and the run writes the step again (restore/tidy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcckpt.cluster.collectives import fold_at_root, on_root
from hpcckpt.run.ledger import RestartLedger, ledger_path


@dataclass(frozen=True)
class RewindPlan:
    """Which versions a rewind marks bad, and whether one older is left to restore."""

    bad: tuple[int, ...]  # sorted
    newest_older: int | None  # the version to restore (the restore takes the newest not bad)
    again: int | None  # the version the last rewind restored, which the run diverged from again


def plan_rewind(held: list[int], before: int, rewound_to: int | None) -> RewindPlan:
    """(pure) Every version from step `before` on is bad; when the newest older one is the
    version the last rewind restored (`rewound_to`) and no newer one was taken since, it is
    to blame too, and the rewind goes further back."""
    bad = [step for step in held if step >= before]
    older = [step for step in held if step < before]
    again = older.pop() if older and older[-1] == rewound_to else None
    if again is not None:
        bad.append(again)
    return RewindPlan(tuple(sorted(bad)), older[-1] if older else None, again)


def versions_held(comm, levels) -> list[int]:
    """(all ranks) Every version some level of some rank has committed, in order."""
    mine = sorted({step for level in levels for step in level.committed_steps()})
    return fold_at_root(comm, mine, lambda every: sorted(set().union(*map(set, every))))


def mark_versions_bad(comm, run_dir, steps, reason: str) -> None:
    """(all ranks) No restart or rewind loads these versions again."""
    def mark() -> None:
        ledger = RestartLedger(ledger_path(run_dir))
        for step in steps:
            ledger.mark_failed(step, reason)
    if steps:
        on_root(comm, "marking versions bad in the restart ledger", mark)
