"""Which versions of a job's keyed tables go whole and which as deltas (every rank alike).

A version's tables go whole (a full version) when no chain is open, after a restore (a chain
never spans two jobs, or two writings of a step), and once the open chain holds
`checkpoint.table_full_every` versions; otherwise as the rows changed since the version
before (a delta), whose chain is the open one plus itself. A version that no level could hold
leaves the chain as it was: the next delta holds its rows too (KeyedTable.settle).
"""

from __future__ import annotations


class TableChain:
    def __init__(self, full_every: int):
        self.full_every = max(1, int(full_every))
        self.chain: tuple[int, ...] = ()  # the chain of the newest version held
        self._taken: tuple[int, ...] | None = None  # the chain of the version in flight

    def next(self, step: int) -> tuple[int, ...]:
        """The chain of the version of `step` taken now: (step,) for a full version."""
        full = not self.chain or len(self.chain) >= self.full_every
        self._taken = (step,) if full else self.chain + (step,)
        return self._taken

    def settle(self, held: bool) -> None:
        """The version in flight is held by some level (its chain is the open one), or not."""
        if self._taken is not None and held:
            self.chain = self._taken
        self._taken = None

    def reset(self) -> None:
        """After a restore: the next version goes whole."""
        self.chain, self._taken = (), None
