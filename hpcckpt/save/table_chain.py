"""Which versions of a job's keyed tables go whole and which as deltas (every rank alike).

A version's tables go whole (a full version) when no chain is open, after a restore or a
version marked bad (a chain never spans two jobs, two writings of a step, or a bad version),
for the run's final version (the one left for the next job, self-contained), once the open
chain holds `checkpoint.table_full_every` versions, and when this version goes to a
node-local level that some version of the open chain did not reach (a delta is no more
redundant than its chain: with resilience.partner_every = 2, a version with L2 copies does
not build on one without). Otherwise they go as the rows changed since the version before
(a delta), whose chain is the open one plus itself. A version that no level could hold leaves
the chain as it was: the next delta holds its rows too (KeyedTable.settle).
"""

from __future__ import annotations


class TableChain:
    def __init__(self, full_every: int):
        self.full_every = max(1, int(full_every))
        self.chain: tuple[int, ...] = ()  # the chain of the newest version held
        self.levels: frozenset[str] = frozenset()  # the node-local levels every version of it reached
        self._taken: tuple | None = None  # (chain, whole) of the version in flight

    def next(self, step: int, levels_due=(), final: bool = False) -> tuple[int, ...]:
        """The chain of the version of `step` taken now, (step,) for a full version;
        `levels_due`: the node-local levels it goes to."""
        due = frozenset(levels_due)
        whole = final or not self.chain or len(self.chain) >= self.full_every or not due <= self.levels
        self._taken = ((step,) if whole else self.chain + (step,), due if whole else self.levels & due)
        return self._taken[0]

    def settle(self, held: bool) -> None:
        """The version in flight is held by some level (its chain is the open one), or by
        none. (Whether it is held is agreed by every rank; which levels a rank's copy reached
        is not, so the chain counts the levels it was due on.)"""
        if self._taken is not None and held:
            self.chain, self.levels = self._taken
        self._taken = None

    def reset(self) -> None:
        """After a restore, or a version marked bad: the next version goes whole."""
        self.chain, self.levels, self._taken = (), frozenset(), None
