"""L2: partner replication. Each rank's shard file is copied, byte for byte, into the
node-local directory of its partner (a rank on another node, from the topology):

    <partner's local_dir>/v<step>/replica-of-r<src>-held-by-r<holder>.hck

A replica is a complete shard file, so it carries the same per-tensor checksums. It survives
the loss of any one node, and of several nodes as long as no rank and its partner are lost
together. store, deliver and protect are collective over the checkpoint communicator.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from hpcckpt.cluster.collectives import agree_before_exchange, exchange, exchange_streamed
from hpcckpt.errors import HpcckptError
from hpcckpt.io.atomic import AtomicFile
from hpcckpt.io.direct_io import ALIGNMENT, ReusedBuffers
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES, DeliveryRequest, NodeLocalFiles, VersionImage, hold_to_bandwidth
from hpcckpt.levels.naming import replica_file_name
from hpcckpt.levels.spares import SpareFiles

TAG_PROTECT = 201
TAG_FETCH = 202
TAG_NUMBERS = 203  # the numbers a rank and its partner tell each other before a transfer


class PartnerLevel(NodeLocalFiles):
    name = "partner"
    survives_nodes = 1  # a replica on another node: one node lost
    collective = True

    def __init__(self, root: str | Path, rank: int, partner_of: tuple[int, ...], comm, direct_io: bool = False,
                 spares: SpareFiles | None = None, file_mode: int = 0o666, bandwidth_mb: float = 0.0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, places=None):
        super().__init__(root, rank, spares, file_mode, bandwidth_mb, places)
        self.direct_io = direct_io
        self.chunk_bytes = max(1, int(chunk_bytes))
        self.partner_of = partner_of
        self.comm = comm
        self.sources = tuple(r for r, holder in enumerate(partner_of) if holder == rank and r != rank)
        self._receive_buffers = ReusedBuffers()

    def prepare(self) -> None:
        pass  # the node-local directory is L1's, which proves it writable

    def replica_path(self, step: int, source: int) -> Path:
        return self.version_dir(step) / replica_file_name(source, self.rank)

    def own_files(self, step: int) -> list[Path]:
        return [self.replica_path(step, s) for s in self.sources]

    def held(self, step: int) -> list[int]:
        return [s for s in self.sources if self.replica_path(step, s).is_file()]

    def holdings(self, ranks: frozenset[int] | None = None) -> dict[int, frozenset[int]]:
        return {step: frozenset(s for s in self.held(step) if ranks is None or s in ranks)
                for step in self.committed_steps()}

    def delivering_files(self, lost: frozenset[int]) -> list[Path]:
        steps = self.committed_steps()
        return [self.replica_path(max(steps), source) for source in self.sources if source in lost] if steps else []

    def protect_again(self, step: int, shard, shard_sizes, world_size: int) -> None:
        """(all ranks) The replicas that lost holders held, sent again from the shards."""
        self.protect(step, shard, only_missing=True)

    def placed_as(self, manifest) -> bool:
        return tuple(manifest.partner_of) == tuple(self.partner_of)

    def supplies(self, lost: frozenset[int]) -> frozenset[int]:
        """Of the ranks whose node-local files of a version are gone (their shard and the
        replicas they hold), those whose partner still holds their replica."""
        return frozenset(rank for rank in lost if self.partner_of[rank] not in lost and self.partner_of[rank] != rank)

    def store(self, version: VersionImage) -> int:
        """(all ranks) This version's replicas: every rank's bytes travel to its partner."""
        started = time.perf_counter()
        stored = self.protect(version.step, version.file_bytes, shard_sizes=version.shard_sizes)
        hold_to_bandwidth(stored, self.bandwidth_bytes, started)
        return stored

    def protect(self, step: int, shard, only_missing: bool = False, shard_sizes=None) -> int:
        """(all ranks) Send this rank's shard bytes to its partner; store the replicas it holds.

        `shard`: the bytes (uint8 array), or a callable returning them, called only if this
        rank must send. With `only_missing` (re-protection after a loss) only replicas a holder
        lacks travel. `shard_sizes` (bytes per rank), where the caller has them already, spares
        a checkpoint's protect its collectives: every replica travels then (ignored with
        `only_missing`, which must ask who lacks what). Returns the bytes stored here.
        """
        ask = only_missing or shard_sizes is None
        holder = self.partner_of[self.rank]
        if ask:
            wanted = [s for s in self.sources if not (only_missing and self.replica_path(step, s).is_file())]
            told = self._tell({s: int(s in wanted) for s in self.sources}, [holder] if holder != self.rank else [])
            must_send = bool(told.get(holder, 0))
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
            sizes = self._tell({holder: int(shard.size) if failure is None else 0} if must_send else {}, wanted)
        else:
            sizes = shard_sizes
        files = {}
        try:
            # Each replica goes to its file chunk by chunk as it arrives, through two reused
            # aligned chunk buffers (O_DIRECT takes them as they are): never a shard-sized buffer.
            for source in wanted:
                path = self.replica_path(step, source)
                path.parent.mkdir(parents=True, exist_ok=True)
                files[source] = AtomicFile(path, sizes[source], direct=self.direct_io and self.chunk_bytes % ALIGNMENT == 0,
                                           recycle=self.spare_for(path), mode=self.file_mode)
            largest = max((sizes[source] for source in wanted), default=0)
            chunk_buffers = [self._receive_buffers.get(("chunk", i), min(self.chunk_bytes, largest)) for i in (0, 1)]
        except Exception as exc:
            failure = failure or exc
        if failure is not None:
            for file in files.values():
                file.discard()
        agree_before_exchange(self.comm, failure, self.stage_label)
        sends = [(self.partner_of[self.rank], shard)] if must_send else []
        receives = [(source, sizes[source], lambda data, offset, file=file: file.pwrite(data, offset))
                    for source, file in files.items()]
        failure = exchange_streamed(self.comm, sends, receives, TAG_PROTECT, self.chunk_bytes,
                                    lambda i: chunk_buffers[i])
        try:
            if failure is not None:
                raise failure
            for file in files.values():
                file.publish()
        except BaseException:
            for file in files.values():
                file.discard()
            raise
        return sum(sizes[source] for source in files)


    def deliver(self, request: DeliveryRequest) -> Path | None:
        """(all ranks) Holders send the replicas of needy ranks back to them, read where they
        lie (mapped); a needy rank whose partner has one writes it, chunk by chunk as it
        arrives, where the restore reads it (unverified: the restore verifies)."""
        step = request.step
        replicas, held = {}, set(self.held(step))
        for source in self.sources:
            if source in request.needy and source in held:
                try:
                    replicas[source] = map_readonly(self.replica_path(step, source))
                except OSError as exc:  # gone or unreadable since: as good as never held
                    request.warnings.append(f"version {step}: the L2 replica of rank {source} on rank {self.rank} "
                                            f"is unreadable: {exc}")
        offers = {source: int(replicas[source].size) if source in replicas else -1
                  for source in self.sources if source in request.needy}
        holder = self.partner_of[self.rank]
        told = self._tell(offers, [holder] if self.rank in request.needy and holder != self.rank else [])
        size = told.get(holder, -1)
        copy = None
        if size >= 0:
            copy = request.open_copy(size, self.chunk_bytes % ALIGNMENT == 0)
        chunk_buffers = [self._receive_buffers.get(("chunk", i), min(self.chunk_bytes, max(size, 1))) for i in (0, 1)]
        receives = [(holder, size, copy.pwrite if copy is not None else (lambda data, offset: None))] \
            if size >= 0 else []
        failure = exchange_streamed(self.comm, [(source, replicas[source]) for source in replicas], receives,
                                    TAG_FETCH, self.chunk_bytes, lambda i: chunk_buffers[i])
        if copy is None:
            return None
        try:
            if failure is not None:
                raise failure
            copy.publish()
        except (HpcckptError, OSError) as exc:
            copy.discard()
            request.warnings.append(f"version {step}: storing the L2 replica from rank {holder} failed: {exc}")
            return None
        return Path(copy.path)

    def _tell(self, numbers: dict[int, int], sources: list[int]) -> dict[int, int]:
        """(point to point) Send each rank in `numbers` its number; receive one from each of
        `sources` (the two sides agree on who talks to whom): O(partners), nothing global."""
        received = {source: np.empty(1, dtype=np.int64) for source in sources}
        sends = [(dest, np.array([number], dtype=np.int64).view(np.uint8)) for dest, number in numbers.items()]
        exchange(self.comm, sends, [(source, buffer.view(np.uint8)) for source, buffer in received.items()],
                 TAG_NUMBERS)
        return {source: int(buffer[0]) for source, buffer in received.items()}
