"""Which versions the nodes keep in memory: each rank says whether its node has room for the
version within the memory budget, the ranks agree (all or none: a version lives in one place
on every node, and the same place everywhere keeps the restore's reasoning simple), and the
version is placed before any level writes it. A version that does not fit goes to the
node's disk and says so; the next one that fits goes back to memory (levels/node_places.py)."""

from __future__ import annotations

from hpcckpt.levels.node_places import NodePlaces


class MemoryPlacement:
    """(one rank) `places`: the node-local levels' NodePlaces (None without node-local levels);
    `sharers`: the ranks whose versions share this node's directories (this one included)."""

    def __init__(self, places: NodePlaces | None, sharers: int, log):
        self.places = places if places is not None and places.memory is not None else None
        self.sharers = max(1, sharers)
        self.log = log
        self._last_in_memory: bool | None = None
        self._warned = False

    @property
    def active(self) -> bool:
        return self.places is not None

    def room_for(self, shard_bytes: int, node_local_levels: int) -> bool:
        """This rank's view: the node has room for the version in memory. Each node-local
        level keeps about a shard's bytes per rank (L1 the shard, L2 a partner's, L3 at most
        one shard of parity), for every rank of the node."""
        if not self.active or node_local_levels == 0:
            return False
        return self.places.memory_fits(shard_bytes * node_local_levels * self.sharers)

    def place(self, step: int, in_memory: bool) -> None:
        """The agreed place of version `step`, said where it changes."""
        if not self.active:
            return
        self.places.place(step, in_memory)
        changed = self._last_in_memory is not None and in_memory != self._last_in_memory
        self._last_in_memory = in_memory
        if self.log is None:
            return
        self.log.metrics({"event": "version_placed", "step": step, "in_memory": in_memory})
        budget_mb = self.places.budget_bytes / 1e6
        if not in_memory:
            message = (f"version {step} does not fit the memory budget on some node ({budget_mb:.4g} MB per node, "
                       f"storage.memory_budget_mb; {self.places.memory_used() / 1e6:.4g} MB in use here): it goes "
                       f"to {self.places.disk} on the disk, and versions go back to memory when there is room")
            if self._warned:
                self.log.info(message)
            else:
                self._warned = True
                self.log.warning(message + "; raise the budget or keep fewer versions (checkpoint.keep_local) "
                                 "to keep every version in memory")
        elif changed:
            self.log.info(f"version {step} fits the memory budget again: kept in {self.places.memory}")
