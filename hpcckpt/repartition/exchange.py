"""Carry out a RepartitionPlan (all ranks, collectively): read, rebuild, move, verify.

    read:     each provider maps the old shard files the plan gives it (L1 files, L2
              replicas) and verifies them whole against the commit record; parity pieces
              are verified each against its own checksum. A rank whose snapshot buffers may
              still hold its own old shard's pieces (a survivor of ranks that died, on as many
              ranks and the same layout) checks them there against the commit record instead
              of reading its file: they are then its new pieces already, with nothing to place
    rebuild:  the blocks a group rebuild needs travel to its decoder in rounds of chunks
              (levels/rebuild_rounds.py); the decoder writes the lost members' shards into
              unnamed scratch files beside its node-local versions and verifies them
    move:     every new rank's pieces are cut from the old pieces they overlap
              (format/layout.py's read_requests): providers send the byte ranges, one
              message per (provider, new rank); ranges of L4 shards are read by the new rank
              itself, whole piece by whole piece so each is verified
    agree:    after each stage every rank says which sources turned out bad; if any did, the
              plan is made again without them (the same on every rank) and run again

Every byte loaded was verified against the commit record's checksums: a rebuilt shard and a
replica as much as an L1 file. Sizes: every rank plans from the same survey, one view per
node, which rank 0 broadcasts (O(ranks) to each rank: the one place where metadata still
reaches every rank whole, and only on a restart onto another rank count or placement; see
cluster/collectives.py); the bad sources are folded at rank 0 each round; shard bytes move
once, from provider to the rank that needs them.
Memory: old shard files, parity files and rebuilt shards are mapped, not read into
buffers, so their pages are the page cache's; a rank's own memory is its new pieces (its
snapshot buffers), a rebuild's chunks, and the staging of byte ranges that are not
contiguous in its new pieces (block arrays cut differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from hpcckpt.cluster.collectives import (
    agree_before_exchange,
    describe_failure,
    exchange,
    fold_at_root,
    raise_if_any_failed,
)
from hpcckpt.codec import ErasureCode
from hpcckpt.errors import HpcckptError
from hpcckpt.format.layout import Layout, destination, place_from_piece, place_read, read_requests, request_payload
from hpcckpt.format.manifest import Manifest
from hpcckpt.format.rank_state import RANK_STATE_PIECE
from hpcckpt.format.shardfile import read_shard_table, shard_table_of_bytes, verified_piece
from hpcckpt.io.direct_io import ReusedBuffers
from hpcckpt.io.mapped import ScratchFile, map_readonly
from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES
from hpcckpt.levels.naming import ERASURE, PFS
from hpcckpt.levels.rebuild_rounds import SurvivingBlock, WantedBlock, rebuild_in_rounds, segment_reader, segment_writer
from hpcckpt.levels.stripes import segment_length, stripe_plan
from hpcckpt.repartition.plan import RepartitionPlan, plan_repartition

TAG_BLOCKS = 401
TAG_RANGES = 402
MAX_ROUNDS = 16  # each round excludes at least one bad source; more than this is a broken storage


@dataclass(frozen=True)
class Repartitioned:
    """What a repartitioning restore produced on this rank."""

    pieces: dict  # name -> this rank's piece under the new layout (in its snapshot buffer)
    plan: RepartitionPlan  # the plan that worked
    bytes_read: int  # shard bytes this rank read from files (node-local and L4)
    bytes_received: int  # bytes other ranks sent it (rebuild blocks and its pieces' ranges)
    in_buffers: bool = False  # its own old shard was checked in its snapshot buffers, not read


@dataclass
class _Held:
    """An old shard file, mapped and verified whole."""

    table: object
    data: np.ndarray

    def piece(self, name: str) -> np.ndarray:
        entry = self.table.entry(name)
        return self.data[entry.offset:entry.offset + entry.nbytes]


@dataclass
class _InBuffers:
    """This rank's own old shard, checked where it lies: in its snapshot buffers, which are
    its new pieces too (the same rank count and layout)."""

    buffers: dict

    def piece(self, name: str) -> np.ndarray:
        return self.buffers[name].reshape(-1).view(np.uint8)


class RepartitionJob:
    """(all ranks) One attempt to load `manifest`'s version onto this job's ranks and layout."""

    def __init__(self, comm, manifest: Manifest, layout: Layout, buffers: dict, local_array_names: tuple,
                 views: list, pfs_shard_path, warn, scratch_dir: str | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify=None, pieces_inherited: bool = False):
        """`verify(name)`: which pieces of an old shard are checked (and so read) when it is
        loaded whole; all by default. A shard rebuilt from parity is checked whole.
        `pieces_inherited`: `buffers` may still hold this rank's pieces of the version
        (restore/context.py's RestoreTargets), which are checked before the file is read."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.manifest = manifest
        self.layout = layout
        self.buffers = buffers
        self.local_array_names = tuple(local_array_names)
        self.views = views
        self.pfs_shard_path = pfs_shard_path  # old rank -> its L4 shard file, or None without L4
        self.warn = warn
        self.scratch_dir = scratch_dir  # where a decoder keeps the shards it rebuilds (node-local)
        self.chunk_bytes = chunk_bytes
        self.verify = verify or (lambda name: True)
        self._verify_all = verify is None
        self._rebuild_buffers = ReusedBuffers()
        self.bytes_read = 0
        self.bytes_received = 0
        self.pieces_inherited = pieces_inherited
        self.in_buffers = False

    def run(self, writing, pfs_holds: bool, move=None) -> Repartitioned | RepartitionPlan:
        """The pieces, or the last plan (incomplete: its `missing` old ranks have no good source).
        `move(plan, held) -> (result, bad sources)` replaces the move stage (a keyed table's
        rows, restore/tables.py): `held` maps the old ranks this rank provides to their
        verified shards; its result is returned as the pieces."""
        move = move or self._move
        excluded: set = set()
        for _ in range(MAX_ROUNDS):
            plan = plan_repartition(self.manifest.step, writing, self.views, pfs_holds, frozenset(excluded))
            if not plan.complete:
                return plan
            (held, parity), bad = self._stage("reading", plan, lambda: self._read(plan))
            if self._agree_bad(bad, excluded):
                continue
            _, bad = self._stage("rebuilding", plan, lambda: (None, self._rebuild(plan, held, parity)))
            if self._agree_bad(bad, excluded):
                continue
            pieces, bad = self._stage("moving", plan, lambda: move(plan, held))
            if self._agree_bad(bad, excluded):
                continue
            return Repartitioned(pieces, plan, self.bytes_read, self.bytes_received, self.in_buffers)
        return plan

    def _stage(self, label: str, plan: RepartitionPlan, fn):
        """(all ranks) fn() -> (result, bad sources). A bad source is planned around; any other
        failure (out of memory, a bug) ends the restore with the same error on every rank,
        rather than leaving the others waiting in the next exchange."""
        failure, result, bad = None, None, set()
        try:
            result, bad = fn()
        except Exception as exc:
            failure = describe_failure(exc)
        raise_if_any_failed(self.comm, f"{label} the old shards", failure, step=plan.step)
        return result, bad

    def _agree_bad(self, bad: set, excluded: set) -> bool:
        """(all ranks) Add every rank's bad sources to `excluded`; True if there were any."""
        everyone = fold_at_root(self.comm, bad, lambda each: set().union(*each))
        excluded |= everyone
        return bool(everyone)

    # -- read ----------------------------------------------------------------------------
    def _read(self, plan: RepartitionPlan):
        held, parity, bad = {}, {}, set()
        for source in plan.reads_of(self.rank):
            if source.old_rank == self.rank and self._own_shard_may_be_in_buffers(plan):
                in_buffers = self._checked_in_buffers()
                self.in_buffers = in_buffers is not None
                if in_buffers is not None:
                    held[source.old_rank] = in_buffers
                    continue
            try:
                held[source.old_rank] = self._load_shard(Path(source.path), source.old_rank)
            except (HpcckptError, OSError) as exc:
                self.warn(f"version {plan.step}: the {source.level} copy of old rank {source.old_rank}'s shard is "
                          f"unusable: {exc}")
                bad.add((source.level, source.old_rank))
        for rebuild in plan.rebuilds:
            for block in rebuild.blocks:
                if block.provider != self.rank or block.path is None or (block.member, block.stripe, block.block) in parity:
                    continue
                try:
                    parity[(block.member, block.stripe, block.block)] = self._parity_piece(rebuild, block)
                except (HpcckptError, OSError, KeyError) as exc:
                    self.warn(f"version {plan.step}: the L3 parity of old rank {block.member} is unusable: {exc}")
                    bad.add(("parity", block.member))
        return (held, parity), bad

    def _own_shard_may_be_in_buffers(self, plan: RepartitionPlan) -> bool:
        """Whether this rank's snapshot buffers may hold its own old shard's pieces where its
        new pieces go: inherited as they were, the same rank count and layout (each new
        piece is the same rank's old one), and no rebuild that reads the old shard as a file."""
        if not (self.pieces_inherited and self.manifest.world_size == self.world_size
                and self.manifest.layout == self.layout):
            return False
        if any(block.provider == self.rank and block.member == self.rank
               for rebuild in plan.rebuilds for block in rebuild.blocks):
            return False
        return all(request.old_rank == self.rank for request in read_requests(self.manifest.layout, self.layout,
                                                                                self.rank))

    def _checked_in_buffers(self) -> _InBuffers | None:
        """This rank's old shard in its snapshot buffers, if every piece there has the
        checksum the commit record lists (else the file is read; nothing is placed twice)."""
        expected = dict(self.manifest.shard(self.rank).checksums)
        expected.pop(RANK_STATE_PIECE, None)  # read on its own (restore/rank_states.py)
        names = [tl.name for tl in self.layout.rank_pieces(self.rank)] + list(self.local_array_names)
        if set(expected) != set(names) or any(name not in self.buffers for name in names):
            return None
        held = _InBuffers(self.buffers)
        for name in names:
            if xxhash.xxh3_64_hexdigest(held.piece(name)) != expected[name]:
                return None
        return held

    def _load_shard(self, path: Path, old_rank: int) -> _Held:
        data = map_readonly(path, whole=self._verify_all)
        held = self._verified(data, old_rank, str(path), self.verify)
        self.bytes_read += int(data.size) if self._verify_all else \
            sum(e.nbytes for e in held.table.entries if self.verify(e.name))
        return held

    def _verified(self, data: np.ndarray, old_rank: int, origin: str, verify=lambda name: True) -> _Held:
        table = shard_table_of_bytes(data, origin)
        self.manifest.check_shard_table(table, old_rank, origin)
        for name in table.names:
            if verify(name):
                verified_piece(data, table, name)
        return _Held(table, data)

    def _parity_piece(self, rebuild, block) -> np.ndarray:
        table = read_shard_table(block.path)
        extra = table.extra
        members = list(rebuild.members)
        expected = self._segment(rebuild)
        if extra.get("group") != members or extra.get("parity") != rebuild.parity or extra.get("segment") != expected:
            raise HpcckptError(f"{block.path} was cut for group {extra.get('group')} with parity "
                               f"{extra.get('parity')}, not for group {members} with parity {rebuild.parity}")
        piece = verified_piece(map_readonly(block.path), table, f"stripe{block.stripe}.block{block.block}")
        self.bytes_read += int(piece.nbytes)
        return piece

    def _segment(self, rebuild) -> int:
        sizes = [self.manifest.shard(m).size for m in rebuild.members]
        return segment_length(sizes, len(rebuild.members), rebuild.parity)

    # -- rebuild -------------------------------------------------------------------------
    def _rebuild(self, plan: RepartitionPlan, held: dict, parity: dict) -> set:
        """Every group rebuild of the plan, one after the other, in rounds of chunks: its
        providers send their blocks' chunks, its decoder decodes the lost members' data
        segments into scratch files, then maps and verifies each rebuilt shard."""
        if not plan.rebuilds:
            return set()
        scratch, failure = {}, None
        try:
            for rebuild in plan.rebuilds:
                if rebuild.decoder == self.rank:
                    for old_rank in rebuild.lost:
                        scratch[old_rank] = ScratchFile(self.scratch_dir, self.manifest.shard(old_rank).size)
        except Exception as exc:
            failure = exc
        try:
            agree_before_exchange(self.comm, failure, "L3 rebuild")
            bad = set()
            for rebuild in plan.rebuilds:
                bad |= self._rebuild_group(plan, rebuild, held, parity, scratch)
            return bad
        finally:
            for file in scratch.values():
                file.close()

    def _rebuild_group(self, plan: RepartitionPlan, rebuild, held: dict, parity: dict, scratch: dict) -> set:
        k = len(rebuild.members) - rebuild.parity
        segment = self._segment(rebuild)
        stripes = stripe_plan(len(rebuild.members), rebuild.parity)
        decoding = rebuild.decoder == self.rank
        sources = [SurvivingBlock(block.stripe, block.block, block.provider,
                                  self._block_reader(block, stripes, segment, k, held, parity)
                                  if block.provider == self.rank else None)
                   for block in rebuild.blocks]
        targets = []
        for stripe in stripes:
            for old_rank in rebuild.lost:
                index = rebuild.members.index(old_rank)
                if index in stripe.contributors:
                    block = stripe.contributors.index(index)
                    write = segment_writer(scratch[old_rank], stripe.segments[block] * segment,
                                           scratch[old_rank].size) if decoding else None
                    targets.append(WantedBlock(stripe.index, block, write))
        failure = rebuild_in_rounds(self.comm, ErasureCode(k, rebuild.parity), rebuild.decoder, segment,
                                    self.chunk_bytes, sources, targets, self._rebuild_buffers, TAG_BLOCKS)
        if failure is not None:
            self.warn(f"version {plan.step}: the L3 rebuild of group {list(rebuild.members)} failed on this rank: "
                      f"{failure}")
            return {(ERASURE, m) for m in rebuild.lost} if decoding else set()
        bad = set()
        if decoding:
            self.bytes_received += segment * sum(1 for block in rebuild.blocks if block.provider != self.rank)
        for old_rank in rebuild.lost if decoding else ():
            file = scratch.pop(old_rank)
            try:
                held[old_rank] = self._verified(file.mapped(), old_rank, f"old rank {old_rank}'s shard rebuilt from L3")
            except HpcckptError as exc:
                self.warn(f"version {plan.step}: the L3 rebuild of old rank {old_rank} is unusable: {exc}")
                bad.add((ERASURE, old_rank))
        return bad

    def _block_reader(self, block, stripes, segment: int, k: int, held: dict, parity: dict):
        """The provider's chunks of one block: a data segment of an old shard it holds
        (zero-padded past the shard's end) or a parity piece it read."""
        if block.block >= k:
            piece = parity[(block.member, block.stripe, block.block)]
            return lambda start, length: piece[start:start + length]
        return segment_reader(held[block.member].data, stripes[block.stripe].segments[block.block] * segment)

    # -- move ----------------------------------------------------------------------------
    def _move(self, plan: RepartitionPlan, held: dict):
        """Providers send each byte range as it lies in the old piece (no gathering copy where
        it is contiguous there); a new rank receives it straight into its piece where it is
        contiguous there.
        Both sides walk read_requests in the same order, which is the order MPI matches the
        messages of one sender in."""
        old = self.manifest.layout
        pieces = {tl.name: self.buffers[tl.name] for tl in self.layout.rank_pieces(self.rank)}
        sends, receives, staged, failure = [], [], [], None
        try:
            self._sends(plan, held, sends)
            self._post_receives(plan, pieces, receives, staged)
        except Exception as exc:
            failure = exc
        agree_before_exchange(self.comm, failure, "moving the byte ranges")
        exchange(self.comm, sends, receives, TAG_RANGES)
        for request, data in staged:
            place_read(pieces[request.name], request, data, old, self.layout, self.rank)
        return self._place_own_and_l4(plan, held, pieces)

    def _sends(self, plan: RepartitionPlan, held: dict, sends: list) -> None:
        """The byte ranges this rank provides to the others, as views of the old pieces."""
        old = self.manifest.layout
        same_ranks = self.manifest.world_size == self.world_size
        for consumer in range(self.world_size):
            if consumer == self.rank:
                continue
            for request in read_requests(old, self.layout, consumer):
                if plan.sources[request.old_rank].provider == self.rank and request.nbytes:
                    sends.append((consumer, request_payload(held[request.old_rank].piece(request.name), request, old)))
            if same_ranks and plan.sources[consumer].provider == self.rank:  # per-rank arrays go whole
                sends += [(consumer, held[consumer].piece(name)) for name in self.local_array_names]

    def _post_receives(self, plan: RepartitionPlan, pieces: dict, receives: list, staged: list) -> None:
        """Where each range from another rank lands: its rows in the new piece, or a staging
        buffer where they are not contiguous there (placed after the exchange)."""
        old = self.manifest.layout
        same_ranks = self.manifest.world_size == self.world_size
        for request in read_requests(old, self.layout, self.rank):
            provider = plan.sources[request.old_rank].provider
            if provider in (None, self.rank) or not request.nbytes:
                continue
            target = destination(pieces[request.name], request, self.layout, self.rank)
            if target is None:
                target = np.empty(request.nbytes, dtype=np.uint8)
                staged.append((request, target))
            receives.append((provider, target))
            self.bytes_received += request.nbytes
        provider = plan.sources[self.rank].provider if same_ranks else None
        if provider not in (None, self.rank):
            for name in self.local_array_names:
                receives.append((provider, self.buffers[name].reshape(-1).view(np.uint8)))
                self.bytes_received += self.buffers[name].nbytes

    def _place_own_and_l4(self, plan: RepartitionPlan, held: dict, pieces: dict):
        """The ranges this rank provides to itself, and those only L4 holds (read here)."""
        old = self.manifest.layout
        from_l4 = OldPieceReader(self.manifest, self.pfs_shard_path)
        bad = set()
        try:
            for request in read_requests(old, self.layout, self.rank):
                provider = plan.sources[request.old_rank].provider
                if provider is None:
                    piece = from_l4.piece(request.old_rank, request.name)
                elif provider == self.rank and isinstance(held[request.old_rank], _InBuffers):
                    continue  # in place already
                elif provider == self.rank:
                    piece = held[request.old_rank].piece(request.name)
                else:
                    continue
                place_from_piece(pieces[request.name], request, piece, old, self.layout, self.rank)
            if self.manifest.world_size == self.world_size:
                provider = plan.sources[self.rank].provider
                for name in self.local_array_names:
                    target = self.buffers[name].reshape(-1).view(np.uint8)
                    if provider is None:
                        target[:] = from_l4.piece(self.rank, name)
                    elif provider == self.rank and not isinstance(held[self.rank], _InBuffers):
                        target[:] = held[self.rank].piece(name)
                    pieces[name] = self.buffers[name]
        except (HpcckptError, OSError) as exc:
            self.warn(f"version {plan.step}: old rank {from_l4.current}'s L4 shard is unusable: {exc}")
            bad.add((PFS, from_l4.current))
        finally:
            from_l4.close()
            self.bytes_read += from_l4.bytes_read
        return pieces, bad


class OldPieceReader:
    """Pieces of old shard files on a shared path (L4), each verified whole against its
    checksum and the commit record (a byte range read alone could not be verified), as a
    view of the mapped file: its pages are the page cache's, read once by the checksum and
    again, if the kernel dropped them meanwhile, by the copy into the new piece. The last
    piece asked for is kept verified (requests come grouped by tensor). `path_of(old rank)`
    names the file; `bytes_read` and `paths` say what was read."""

    def __init__(self, manifest: Manifest, path_of):
        self.manifest = manifest
        self.path_of = path_of
        self.tables, self.files = {}, {}
        self.current = None  # the old rank last asked for (named when its file is bad)
        self.bytes_read = 0
        self._key, self._piece = None, None

    @property
    def paths(self) -> list:
        return [self.path_of(old_rank) for old_rank in sorted(self.files)]

    def piece(self, old_rank: int, name: str) -> np.ndarray:
        self.current = old_rank
        if self._key == (old_rank, name):
            return self._piece
        if old_rank not in self.tables:
            path = self.path_of(old_rank)
            table = read_shard_table(path)
            self.manifest.check_shard_table(table, old_rank, path)
            self.tables[old_rank] = table
            self.files[old_rank] = map_readonly(path)
        piece = verified_piece(self.files[old_rank], self.tables[old_rank], name)
        self.bytes_read += int(piece.nbytes)
        self._key, self._piece = (old_rank, name), piece
        return self._piece

    def close(self) -> None:
        self.files.clear()  # the mappings go with the last view of them
        self._key, self._piece = None, None
