"""L3: Reed-Solomon erasure coding across the nodes of a group (see stripes.py for where
every piece lives). Each member stores its parity pieces in one file, a shard-format file
whose tensors are the pieces, so every piece carries its own checksum:

    <local_dir>/v<step>/parity-r<rank>.hck

Encode work is shared: member t gathers stripe t's k data segments, encodes its p parity
pieces and keeps or forwards them. Traffic runs on the group's own communicator, never
interleaved with training collectives. store, deliver, protect and rebuild are collective
over the group.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from hpcckpt.cluster.collectives import agree_before_exchange, post_exchange, quiet_allgather, wait_all
from hpcckpt.codec import ErasureCode
from hpcckpt.errors import HpcckptError
from hpcckpt.format.shardfile import ShardFileWriter, read_shard_table, verified_piece
from hpcckpt.io.direct_io import ReusedBuffers
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES, DeliveryRequest, NodeLocalFiles, VersionImage, hold_to_bandwidth
from hpcckpt.levels.naming import parity_file_name
from hpcckpt.levels.rebuild_rounds import (
    SurvivingBlock,
    WantedBlock,
    padded_chunk,
    rebuild_in_rounds,
    segment_reader,
    segment_writer,
)
from hpcckpt.levels.spares import SpareFiles
from hpcckpt.levels.stripes import recovery_sources, segment_length, stripe_plan

TAG_GATHER = 301
TAG_PARITY = 302
TAG_REBUILD = 1000


def _piece_name(stripe: int, block: int) -> str:
    return f"stripe{stripe}.block{block}"


class ErasureLevel(NodeLocalFiles):
    name = "erasure"
    collective = True

    def __init__(self, root: str | Path, rank: int, members: tuple[int, ...], group_comm, parity: int,
                 direct_io: bool = False, spares: SpareFiles | None = None, file_mode: int = 0o666,
                 bandwidth_mb: float = 0.0, groups: tuple[tuple[int, ...], ...] | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, places=None):
        super().__init__(root, rank, spares, file_mode, bandwidth_mb, places)
        self.direct_io = direct_io  # write parity files with O_DIRECT (io/direct_io.py)
        self.chunk_bytes = max(1, int(chunk_bytes))
        self._zeros = None  # what the shard's padding past its end sends
        self.members = tuple(members)
        self.groups = tuple(tuple(g) for g in groups) if groups else (self.members,)  # every group of the job
        self.me = self.members.index(rank)
        self.comm = group_comm  # ranks ordered as `members`
        self.n = len(self.members)
        self.p = parity
        self.k = self.n - parity
        self.code = ErasureCode(self.k, self.p)
        self.stripes = stripe_plan(self.n, self.p)
        self._receive_buffers = ReusedBuffers()

    def prepare(self) -> None:
        pass  # the node-local directory is L1's, which proves it writable

    @property
    def survives_nodes(self) -> int:
        """The placement puts a group's members on distinct nodes (cluster/topology.py's
        fit_redundancy): any `parity` of them may go."""
        return self.p

    def parity_path(self, step: int) -> Path:
        return self.version_dir(step) / parity_file_name(self.rank)

    def own_files(self, step: int) -> list[Path]:
        return [self.parity_path(step)]

    def holdings(self, ranks: frozenset[int] | None = None) -> dict[int, frozenset[int]]:
        """Steps whose parity pieces this member holds, cut for this group: with p-1 other
        members' pieces, any member's shard can be rebuilt."""
        members = frozenset(m for m in self.members if ranks is None or m in ranks)
        return {step: members for step in self.committed_steps() if self.has_parity(step)}

    def placed_as(self, manifest) -> bool:
        return tuple(map(tuple, manifest.groups)) == self.groups and manifest.parity == self.p

    def serves(self, held, lacking: frozenset[int]) -> frozenset[int]:
        """Every member of a group that lacks at most `parity` members' pieces (shard or
        parity) while some member holds parity of the version: the others' pieces rebuild any
        of them."""
        return frozenset(rank for group in self.groups
                         if len(lacking.intersection(group)) <= self.p and any(held[m] for m in group)
                         for rank in group)

    def protect_again(self, step: int, shard, shard_sizes, world_size: int) -> None:
        """(group) The parity pieces that lost members held, encoded again from the shards."""
        self.protect(step, shard, list(shard_sizes), world_size, only_missing=True)

    def supplies(self, lost: frozenset[int]) -> frozenset[int]:
        """Of the ranks whose node-local files of a version are gone (shard and parity), those
        their groups rebuild from the others': every lost member of a group that lost at
        most `parity`."""
        return frozenset(rank for group in self.groups if len(lost & set(group)) <= self.p
                         for rank in lost & set(group))

    def store(self, version: VersionImage) -> int:
        """(group) This version's parity pieces."""
        started = time.perf_counter()
        stored = self.protect(version.step, version.file_bytes, version.shard_sizes, version.world_size)
        hold_to_bandwidth(stored, self.bandwidth_bytes, started)
        return stored

    def has_parity(self, step: int) -> bool:
        """This member holds a parity file of `step` made by this group: the same members and
        parity count (a job restarted with another resilience.group_size or parity cannot
        decode pieces cut for another geometry, and must not try)."""
        path = self.parity_path(step)
        if not path.is_file():
            return False
        try:
            extra = read_shard_table(path).extra
        except (HpcckptError, OSError):
            return False  # unreadable: as good as missing, and replaced when protected again
        return extra.get("group") == list(self.members) and extra.get("parity") == self.p

    def _segment(self, shard_sizes) -> int:
        return segment_length([shard_sizes[m] for m in self.members], self.n, self.p)

    def protect(self, step: int, shard: np.ndarray, shard_sizes, world_size: int,
                only_missing: bool = False) -> int:
        """(group) Encode the group's shards; store this member's parity pieces.

        `shard_sizes` are every rank's shard sizes (the same list on all ranks); `shard` is this
        rank's bytes or a callable returning them, called only when they are needed. With
        `only_missing`, stripes are encoded only for holders that lack their parity file.
        Returns the parity bytes stored here.

        The segments go in rounds of `chunk_bytes` (no rank holds a buffer the size of a shard):
        in each round, contributors send the next chunk of their data segment of stripe t to
        its gatherer, member t, which encodes p parity chunks, keeps one and forwards the
        others; every holder writes its chunks to its parity file as they come. Every buffer
        is chunk-sized and reused.
        """
        segment = self._segment(shard_sizes)
        if only_missing:
            needs = quiet_allgather(self.comm, not self.has_parity(step))
        else:
            needs = [True] * len(self.members)
        if not any(needs):
            return 0
        stripe_needed = [any(needs[h] for h in s.holders) for s in self.stripes]
        chunk = min(self.chunk_bytes, segment)
        # Everything that can fail on this member alone (reading its shard, opening its file,
        # allocating) happens before the first round; a failure in a round (encoding, the
        # disk) is kept and raised after the last one: the others wait for this member's part.
        failure, writer = None, None
        try:
            shard = shard() if callable(shard) else shard
            if needs[self.me]:
                writer = self._parity_writer(step, segment, world_size, replace=only_missing)
            self._round_buffers(chunk, stripe_needed, needs)
        except Exception as exc:
            failure = exc
            if writer is not None:
                writer.discard()
        agree_before_exchange(self.comm, failure, self.stage_label)
        failure = self._rounds(shard, segment, chunk, stripe_needed, needs, writer)
        if writer is None:
            return 0
        if failure is not None:
            writer.discard()
            raise failure
        writer.finish()
        return len(self._mine()) * segment

    def _mine(self) -> list[tuple[int, int]]:
        """(stripe, block) of every parity piece this member holds."""
        return [(stripe.index, stripe.block_of_member(self.me)) for stripe in self.stripes if self.me in stripe.holders]

    def _parity_writer(self, step: int, segment: int, world_size: int, replace: bool) -> ShardFileWriter:
        """This member's parity file, opened to take its pieces chunk by chunk; with `replace`,
        one already there (damaged, or cut for another group geometry: see has_parity) gives
        way, since files are never overwritten in place."""
        self.version_dir(step).mkdir(parents=True, exist_ok=True)
        path = self.parity_path(step)
        if replace:
            path.unlink(missing_ok=True)
        pieces = sorted((_piece_name(t, b), np.uint8, (segment,)) for t, b in self._mine())
        return ShardFileWriter(path, step, self.rank, world_size, pieces, self._parity_extra(segment),
                               chunk_bytes=self.chunk_bytes, direct=self.direct_io,
                               recycle=self.spare_for(path), mode=self.file_mode)

    def _parity_extra(self, segment: int) -> dict:
        return {"group": list(self.members), "parity": self.p, "segment": segment}

    def _buffer(self, role, length: int) -> np.ndarray:
        return self._receive_buffers.get(role, length)

    def _round_buffers(self, chunk: int, stripe_needed, needs) -> None:
        """Allocate the chunk buffers of a round now, where a failure is agreed before any transfer."""
        own = self.stripes[self.me]
        if stripe_needed[self.me]:
            for j in own.contributors:
                self._buffer(("data", j), chunk)
            for h in range(self.p):
                self._buffer(("encoded", h), chunk)
        for stripe in self.stripes:
            if self.me in stripe.holders[1:] and needs[self.me]:
                self._buffer(("parity", stripe.index), chunk)
        if any(stripe_needed[t.index] and self.me in t.contributors for t in self.stripes):
            self._buffer("tail", chunk)

    def _rounds(self, shard: np.ndarray, segment: int, chunk: int, stripe_needed, needs, writer
                ) -> BaseException | None:
        """(group) Every round: bytes [start, start + chunk) of every stripe's segments,
        gathered, encoded, forwarded, written. The next round's gather travels while this
        round's parity is written, and this member's own parity chunk is written while the
        others travel to their holders: the disk and the network overlap, in the same buffers.
        Returns the first failure on this member (kept, not raised: the rounds go on)."""
        own = self.stripes[self.me]
        starts = list(range(0, segment, chunk))
        failure = None
        gathering = self._post_gather(shard, segment, 0, min(chunk, segment), stripe_needed)
        for index, start in enumerate(starts):
            length = min(chunk, segment - start)
            requests, gathered = gathering
            wait_all(requests)
            sends, kept = [], []
            if stripe_needed[self.me]:
                encoded = [self._buffer(("encoded", h), length) for h in range(self.p)]
                try:
                    parity = self.code.encode(gathered, out=encoded)
                except Exception as exc:  # noqa: BLE001 (said after the last round; the holders still get chunks)
                    failure, parity = failure or exc, encoded
                kept = [(_piece_name(self.me, self.k), parity[0])] if needs[self.me] else []
                sends = [(own.holders[h], parity[h]) for h in range(1, self.p) if needs[own.holders[h]]]
            received = [(_piece_name(t.index, t.block_of_member(self.me)), t.holders[0],
                         self._buffer(("parity", t.index), length))
                        for t in self.stripes if self.me in t.holders[1:] and needs[self.me]]
            forwarding = post_exchange(self.comm, sends, [(source, buffer) for _, source, buffer in received],
                                       TAG_PARITY)
            failure = self._write(writer, kept, failure)
            wait_all(forwarding)
            if index + 1 < len(starts):
                following = starts[index + 1]
                gathering = self._post_gather(shard, segment, following, min(chunk, segment - following),
                                              stripe_needed)
            failure = self._write(writer, [(name, buffer) for name, _, buffer in received], failure)
        return failure

    def _post_gather(self, shard: np.ndarray, segment: int, start: int, length: int, stripe_needed):
        """(requests, the gathered chunks) of one round's gather: each contributor's chunk of
        its data segment of stripe t to t's gatherer, member t."""
        own = self.stripes[self.me]
        sends = []
        for stripe in self.stripes:
            if stripe_needed[stripe.index] and self.me in stripe.contributors:
                seg = stripe.segments[stripe.contributors.index(self.me)]
                sends.append((stripe.holders[0], self._data_chunk(shard, seg * segment + start, length)))
        gathered = [(j, self._buffer(("data", j), length)) for j in own.contributors] if stripe_needed[self.me] else []
        return post_exchange(self.comm, sends, gathered, TAG_GATHER), [buffer for _, buffer in gathered]

    @staticmethod
    def _write(writer, pieces: list, failure: BaseException | None) -> BaseException | None:
        if writer is None or failure is not None:
            return failure
        try:
            for name, data in pieces:
                writer.write(name, data)
        except Exception as exc:  # noqa: BLE001 (kept: the rounds go on, raised after the last)
            return exc
        return None

    def _data_chunk(self, shard: np.ndarray, position: int, length: int) -> np.ndarray:
        """Bytes [position, position + length) of this member's shard, zero-padded past its
        end: a view; the one chunk of a round that the end cuts, in a reused buffer; zeros
        (never written, so the kernel's zero page: no memory) past the end."""
        if self._zeros is None or self._zeros.size < length:
            self._zeros = np.zeros(length, dtype=np.uint8)
        return padded_chunk(shard, position, length, tail=self._buffer("tail", length), zeros=self._zeros)

    def deliver(self, request: DeliveryRequest) -> Path | None:
        """(group) Members of this group that are needy get their shard rebuilt from the
        survivors' verified pieces, written chunk by chunk where the restore reads it;
        lost members also store their parity file again. Nothing happens when no member is
        needy, or when more than p members lack pieces (then the group cannot help)."""
        step = request.step
        members = set(self.members)
        lost_ranks = (set(request.lacking) | set(request.needy)) & members
        if not (request.needy & members) or len(lost_ranks) > self.p:
            return None
        # A survivor's parity pieces and shard are checked before the group relies on them: a
        # bad piece makes its holder one more lost member rather than a wrong rebuild, and a
        # survivor failing mid-exchange would leave the others waiting for its pieces.
        parity_pieces, shard = None, None
        if self.rank not in lost_ranks:
            try:
                parity_pieces = self.read_parity(step)
                shard = request.own_shard()
            except (HpcckptError, OSError) as exc:
                parity_pieces = None
                request.warnings.append(f"version {step}: L3 parity or shard of rank {self.rank} unusable: {exc}")
        ready = quiet_allgather(self.comm, parity_pieces is not None or self.rank in lost_ranks)
        lost_ranks |= {r for r, ok in zip(self.members, ready) if not ok}
        if len(lost_ranks) > self.p:
            request.warnings.append(f"version {step}: group {self.members} lost {sorted(lost_ranks)}, "
                                    "more than L3 survives")
            return None
        lost = frozenset(self.members.index(r) for r in lost_ranks)
        # The rebuilt shard lands at each data segment's offset, which need not be aligned.
        copy = request.open_copy(request.shard_sizes[self.rank], False) if self.rank in request.needy else None
        try:
            self.rebuild(step, lost, None if self.rank in lost_ranks else shard, parity_pieces,
                         request.shard_sizes, request.world_size, copy)
            if copy is None:
                return None
            copy.publish()
        except (HpcckptError, OSError, ValueError) as exc:
            if copy is not None:
                copy.discard()
            request.warnings.append(f"version {step}: L3 rebuild in group {self.members} failed: {exc}")
            return None
        return Path(copy.path)

    def read_parity(self, step: int) -> dict[str, np.ndarray]:
        """This member's parity pieces of `step`, each checked against its checksum: views of
        the mapped file, which the rebuild's rounds read a chunk at a time."""
        path = self.parity_path(step)
        table = read_shard_table(path)
        data = map_readonly(path)
        return {name: verified_piece(data, table, name) for name in table.names}

    def rebuild(self, step: int, lost: frozenset[int], shard: np.ndarray | None, parity: dict | None,
                shard_sizes, world_size: int, copy=None) -> None:
        """(group) Rebuild the shards and parity pieces of the `lost` members (member indices,
        at most p of them) from the survivors' pieces, one lost member after the other, in
        rounds of chunks (levels/rebuild_rounds.py). A lost member writes its shard's bytes
        into `copy` (a file taking them at offsets, published by the caller; None: not
        wanted) and stores its parity file again.

        Survivors pass their verified shard bytes and parity pieces (from read_parity).
        """
        if not lost:
            return
        if len(lost) > self.p:
            raise ValueError(f"{len(lost)} members lost, the code survives {self.p}")
        segment = self._segment(shard_sizes)
        failure, writer = None, None
        # A restart's rounds have chunk buffers of their own, given back once it is over: the
        # checkpoints' buffers (kept) are other roles, and 2 k chunks more would stay for good.
        buffers = ReusedBuffers()
        if self.me in lost:
            # A member counted lost for a damaged shard or parity file still has that file:
            # the pieces rebuilt from the survivors replace it.
            try:
                writer = self._parity_writer(step, segment, world_size, replace=True)
            except Exception as exc:  # noqa: BLE001 (raised after the rounds, which the survivors run)
                failure = exc
        sources = [SurvivingBlock(stripe.index, block, stripe.member_of_block(block),
                                  self._block_reader(stripe, block, shard, parity, segment)
                                  if stripe.member_of_block(block) == self.me else None)
                   for stripe in self.stripes for block in recovery_sources(stripe, lost, self.k)]
        for decoder in sorted(lost):
            targets = [WantedBlock(stripe.index, stripe.block_of_member(decoder),
                                   self._block_writer(stripe, stripe.block_of_member(decoder), segment, copy, writer,
                                                      shard_sizes[self.rank]) if decoder == self.me else None)
                       for stripe in self.stripes]
            failed = rebuild_in_rounds(self.comm, self.code, decoder, segment, self.chunk_bytes, sources, targets,
                                       buffers, TAG_REBUILD)
            failure = failure or failed
        if failure is not None:
            if writer is not None:
                writer.discard()
            raise failure
        if writer is not None:
            writer.finish()

    def _block_reader(self, stripe, block: int, shard: np.ndarray, parity: dict, segment: int):
        """A survivor's chunks of one of its blocks: its data segment (zero-padded past the
        shard's end) or its parity piece."""
        if block < self.k:
            return segment_reader(shard, stripe.segments[block] * segment)
        piece = parity[_piece_name(stripe.index, block)]
        return lambda start, length: piece[start:start + length]

    def _block_writer(self, stripe, block: int, segment: int, copy, writer, shard_size: int):
        """Where a lost member's rebuilt chunks of one block go: its shard's bytes into
        `copy`, its parity piece into `writer`."""
        if block < self.k:
            return segment_writer(copy, stripe.segments[block] * segment, shard_size)
        name = _piece_name(stripe.index, block)
        return lambda chunk, start: writer.write(name, chunk) if writer is not None else None
