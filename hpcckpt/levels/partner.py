"""L2: partner replication. Each rank's shard file is copied, byte for byte, into the
node-local directory of its partner (a rank on another node, from the topology):

    <partner's local_dir>/v<step>/replica-of-r<src>-held-by-r<holder>.hck

A replica is a complete shard file, so it carries the same per-tensor checksums. It survives
the loss of any one node, and of several nodes as long as no rank and its partner are lost
together. All methods are collective over the checkpoint communicator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcckpt.ckpt.direct_io import ReusedBuffers
from hpcckpt.ckpt.shardfile import write_bytes_atomically
from hpcckpt.levels.base import list_version_steps, replica_file_name, version_dir_name
from hpcckpt.levels.messaging import agree_before_exchange, exchange, quiet_allgather
from hpcckpt.levels.spares import SpareFiles

TAG_PROTECT = 201
TAG_FETCH = 202


class PartnerLevel:
    name = "partner"
    label = "L2 partner"

    def __init__(self, root: str | Path, rank: int, partner_of: tuple[int, ...], comm, direct_io: bool = False,
                 spares: SpareFiles | None = None, file_mode: int = 0o666):
        self.root = Path(root)
        self.file_mode = file_mode  # of new files, less the umask (levels/dir_safety.py)
        self.direct_io = direct_io
        self.spares = spares or SpareFiles(self.root, enabled=False)  # retired replicas (levels/spares.py)
        self.rank = rank
        self.partner_of = partner_of
        self.comm = comm
        self.sources = tuple(r for r, holder in enumerate(partner_of) if holder == rank and r != rank)
        self._receive_buffers = ReusedBuffers()

    def replica_path(self, step: int, source: int) -> Path:
        return self.root / version_dir_name(step) / replica_file_name(source, self.rank)

    def held(self, step: int) -> list[int]:
        return [s for s in self.sources if self.replica_path(step, s).is_file()]

    def steps_held(self) -> dict[int, list[int]]:
        return {step: self.held(step) for step in list_version_steps(self.root)}

    def protect(self, step: int, shard, only_missing: bool = False, shard_sizes=None) -> int:
        """(all ranks) Send this rank's shard bytes to its partner; store the replicas it holds.

        `shard`: the bytes (uint8 array), or a callable returning them, called only if this
        rank must send. With `only_missing` (re-protection after a loss) only replicas a holder
        lacks travel. `shard_sizes` (bytes per rank), where the caller has them already, spares
        a checkpoint's protect its collectives: every replica travels then (ignored with
        `only_missing`, which must ask who lacks what). Returns the bytes stored here.
        """
        ask = only_missing or shard_sizes is None
        if ask:
            wanted = [s for s in self.sources if not (only_missing and self.replica_path(step, s).is_file())]
            must_send = self.rank in quiet_allgather(self.comm, wanted)[self.partner_of[self.rank]]
        else:
            wanted = list(self.sources)
            must_send = self.partner_of[self.rank] != self.rank
        failure = None
        try:
            if must_send and callable(shard):
                shard = shard()
        except Exception as exc:  # agreed below, so the others do not wait for this rank's bytes
            failure = exc
        if ask:
            sizes = quiet_allgather(self.comm, int(shard.size) if must_send and failure is None else 0)
        else:
            sizes = shard_sizes
        receives = []
        try:
            # Aligned (written with O_DIRECT) and reused: written out before protect returns.
            receives = [(s, self._receive_buffers.get(s, sizes[s])) for s in wanted]
        except Exception as exc:
            failure = failure or exc
        agree_before_exchange(self.comm, failure, self.label)
        sends = [(self.partner_of[self.rank], shard)] if must_send else []
        exchange(self.comm, sends, receives, TAG_PROTECT)
        if receives:
            (self.root / version_dir_name(step)).mkdir(parents=True, exist_ok=True)
        for source, data in receives:
            path = self.replica_path(step, source)
            write_bytes_atomically(path, memoryview(data), direct=self.direct_io, recycle=self.spares.spare_for(path),
                                   mode=self.file_mode)
        return sum(int(d.size) for _, d in receives)

    def fetch(self, step: int, needy: set[int]) -> np.ndarray | None:
        """(all ranks) Holders send the replicas of `needy` ranks back to them; a needy rank
        gets its shard bytes (unverified) or None when its partner has no replica."""
        offers = {s: self.replica_path(step, s).stat().st_size for s in self.held(step) if s in needy}
        everyone = quiet_allgather(self.comm, offers)
        sends = [(s, np.fromfile(self.replica_path(step, s), dtype=np.uint8)) for s in offers]
        receives = []
        holder = self.partner_of[self.rank]
        if self.rank in needy and self.rank in everyone[holder]:
            receives.append((holder, np.empty(everyone[holder][self.rank], dtype=np.uint8)))
        exchange(self.comm, sends, receives, TAG_FETCH)
        return receives[0][1] if receives else None
