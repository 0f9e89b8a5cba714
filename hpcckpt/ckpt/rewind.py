"""Going back in process: a version marked bad is never loaded again, and a rewind restores the
newest version before a step where the run went wrong (a loss that turned NaN or spiked),
without a relaunch, by the same path a restart takes.

A bad version is marked in the restart ledger's "failed" (run/ledger.py), which every restore
skips; once a restore has fallen back past it, its files are set aside (L4) or deleted
(node-local) and the run writes the step again (restore/tidy.py).
"""

from __future__ import annotations

from hpcckpt.cluster.collectives import fold_at_root, on_root
from hpcckpt.run.ledger import RestartLedger, ledger_path


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
