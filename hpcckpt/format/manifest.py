"""The commit record of a version: written last, atomically; a version without one does not exist.

It holds everything needed to read the version back without the job that wrote it: the step,
the world size, the layout (what each rank stored), every shard's checksums and size, the
small JSON state (step, iterator, RNG), the metrics, where each rank's node-local copy
lives and where its redundancy went, the run that wrote it and the settings it was written
with. A checksum over its own text detects a torn or edited record.

Where each copy lives and what it lists, so no record grows as ranks x ranks: L4's one
record per version lists every shard; a rank's node-local record lists the shards a restore from its node needs: its own,
its erasure group's and those whose L2 replica it holds (`for_rank`), so its size does not
grow with the rank count. A restore or `inspect` rebuilds the whole table from the records
that survive (`with_shards`); `version_id` names the writing whichever part a copy lists.
The per-rank maps (nodes, partners, groups, directories) are stored as the rule they follow
(format/compact.py).

Format 2: {"body": {...}, "checksum": xxh3 of the body's canonical compact JSON}. Format 1
(the body as an escaped JSON string inside the wrapper, every shard in every record) is
still read.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

import xxhash

from hpcckpt.errors import DamagedRecordError, FormatError
from hpcckpt.format.compact import pack_dirs, pack_groups, pack_ints, unpack_dirs, unpack_groups, unpack_ints
from hpcckpt.format.layout import Layout
from hpcckpt.io.atomic import write_bytes_atomically

MANIFEST_FORMAT = 2
READABLE_MANIFEST_FORMATS = (1, 2)


def _canonical(body: dict) -> bytes:
    """The text the checksum covers: sorted keys, no spaces (the same bytes when read back)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def shard_digest(size: int, checksums: dict[str, str]) -> str:
    """One rank's shard in one hash (its size and per-tensor checksums), made by that rank:
    the job's version id is then a hash of these, O(ranks) rather than O(ranks x tensors)."""
    text = f"{size};" + ";".join(f"{name}={checksum}" for name, checksum in sorted(checksums.items()))
    return xxhash.xxh3_64_hexdigest(text.encode())


def version_id_of(step: int, world_size: int, digests) -> str:
    """The identity of one writing of a version, from every rank's shard_digest in rank order."""
    return xxhash.xxh3_64_hexdigest(json.dumps([step, world_size, list(digests)]).encode())


def record_peers(rank: int, partner_of, node_of_rank, groups) -> tuple[list[int], list[int]]:
    """(the ranks whose node-local record lists `rank`'s shard, the ranks whose shards
    `rank`'s record lists), each without `rank` itself. A record lists its own rank's shard,
    its L3 group's, those whose L2 replica it holds, and those whose records it keeps a
    second copy of on another node (_metadata_buddies: a node whose records are unreadable
    still has its shards checked against them): a restore of any of them that relies on
    this node finds their checksums here. O(group) of them, not O(ranks)."""
    buddies = _metadata_buddies(node_of_rank)
    group = next((set(g) for g in groups if rank in g), set())
    holders = set(group)
    if partner_of:
        holders.add(partner_of[rank])
    if buddies:
        holders.add(buddies[rank])
    listed = set(group)
    listed.update(source for source, holder in enumerate(partner_of) if holder == rank)
    listed.update(source for source, buddy in enumerate(buddies) if buddy == rank)
    return sorted(holders - {rank}), sorted(listed - {rank})


def records_listed(world_size: int, partner_of, node_of_rank, groups) -> list[list[int]]:
    """rank -> the ranks whose shard records its node-local copy lists, itself included
    (record_peers' second list, for every rank at once: O(ranks x group), not O(ranks^2))."""
    listed = [{rank} for rank in range(world_size)]
    for group in groups:
        for rank in group:
            listed[rank].update(group)
    for source, holder in enumerate(partner_of):
        listed[holder].add(source)
    for source, buddy in enumerate(_metadata_buddies(node_of_rank)):
        listed[buddy].add(source)
    return [sorted(ranks) for ranks in listed]


def _metadata_buddies(node_of_rank) -> list[int]:
    """rank -> the rank on the next node (by node number, the same position among its node's
    ranks, wrapping) whose node-local record also lists this rank's shard; itself on one node."""
    on_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        on_node.setdefault(node, []).append(rank)
    nodes = sorted(on_node)
    following = {node: on_node[nodes[(i + 1) % len(nodes)]] for i, node in enumerate(nodes)}
    return [following[node][on_node[node].index(rank) % len(following[node])]
            for rank, node in enumerate(node_of_rank)]


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    size: int
    checksums: dict[str, str]


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    layout: Layout
    shards: tuple[ShardRecord, ...]
    state: dict
    metrics: dict = field(default_factory=dict)
    node_of_rank: tuple[int, ...] = ()
    local_dirs: tuple[str, ...] = ()
    local_arrays: tuple[str, ...] = ()  # per-rank (not replicated) arrays, stored whole by each rank
    levels: tuple[str, ...] = ()  # the levels this version was written to
    created: float = 0.0
    run_id: str = ""  # the run that wrote it (run/run_identity.py); restarts load only their own run's
    settings: dict = field(default_factory=dict)  # the job's settings then (run/settings_record.py)
    # Where its redundancy went: partner_of (rank -> holder of its L2 replica), the L3 groups
    # and their parity, as fitted to the nodes of the job that wrote it; a restart on other
    # nodes or another rank count finds the replicas and rebuilds from the parity with it.
    partner_of: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    parity: int = 0
    version_id: str = ""  # the identity of the whole table, kept where a copy lists part of it
    # The failure domains its redundancy was placed across (cluster/domains.py): rank -> its
    # domain's number and the domains' names; empty where every node was a domain of its own.
    domain_of_rank: tuple[int, ...] = ()
    domain_names: tuple[str, ...] = ()
    # Keyed tables (format/keyed_rows.py): name -> {"dim", "dtype", "hash"}, and the versions
    # its tables need, oldest first (a full version and the deltas after it, ending here).
    tables: dict = field(default_factory=dict)
    table_chain: tuple[int, ...] = ()

    @property
    def identity(self) -> str:
        """Which writing of this step it records: the same on every rank's copy and on L4's
        (a hash of every shard's size and checksums), different when another run wrote the
        same step."""
        if self.version_id:
            return self.version_id
        shards = [[s.rank, s.size, sorted(s.checksums.items())] for s in self.shards]
        return xxhash.xxh3_64_hexdigest(json.dumps([self.step, self.world_size, shards]).encode())

    @functools.cached_property
    def _by_rank(self) -> dict[int, ShardRecord]:
        return {record.rank: record for record in self.shards}

    @property
    def lists_every_shard(self) -> bool:
        return len(self.shards) == self.world_size

    def shard(self, rank: int) -> ShardRecord:
        """The record of `rank`'s shard; an error naming what is missing where this copy does
        not list it (a node-local record lists its node's part of the table)."""
        record = self._by_rank.get(rank)
        if record is not None:
            return record
        raise FormatError(f"the commit record of step {self.step} does not list rank {rank}'s shard (this copy "
                          f"lists ranks {[r.rank for r in self.shards][:8]}...; L4's or another node's lists it)")

    def listed(self, ranks) -> list[ShardRecord]:
        """The records of those of `ranks` that this table lists."""
        return [self._by_rank[rank] for rank in ranks if rank in self._by_rank]

    def shard_sizes(self) -> tuple[int, ...]:
        """Every rank's shard size, 0 where this table does not list it (a shard no surviving
        record lists cannot be delivered either)."""
        sizes = [0] * self.world_size
        for record in self.shards:
            sizes[record.rank] = record.size
        return tuple(sizes)

    def record_ranks(self, rank: int) -> list[int]:
        """The ranks whose shard records `rank`'s node-local copy carries (record_peers)."""
        return sorted({rank, *record_peers(rank, self.partner_of, self.node_of_rank, self.groups)[1]})

    def for_rank(self, rank: int) -> "Manifest":
        """This version's record as `rank` keeps it on its node (see record_ranks)."""
        wanted = set(self.record_ranks(rank))
        # The other ranks' directories are L4's record's to list ("" here): a node keeps its part.
        dirs = tuple(d if r in wanted else "" for r, d in enumerate(self.local_dirs))
        return replace(self, shards=tuple(r for r in self.shards if r.rank in wanted), local_dirs=dirs,
                       version_id=self.identity)

    def with_shards(self, records: Iterable[ShardRecord]) -> "Manifest":
        """This record with `records` of the same writing added: the table rebuilt from the
        copies that survive."""
        by_rank = {r.rank: r for r in self.shards}
        for record in records:
            by_rank.setdefault(record.rank, record)
        return replace(self, shards=tuple(by_rank[r] for r in sorted(by_rank)), version_id=self.identity)

    def to_bytes(self) -> bytes:
        body = {
            "format": MANIFEST_FORMAT,
            "version_id": self.version_id,  # "" where the record lists every shard: identity hashes them
            "step": self.step,
            "world_size": self.world_size,
            "layout": self.layout.to_dict(),
            "shards": [{"rank": s.rank, "size": s.size, "checksums": s.checksums} for s in self.shards],
            "state": self.state,
            "metrics": self.metrics,
            "node_of_rank": pack_ints(self.node_of_rank),
            "local_dirs": pack_dirs(self.local_dirs, self.node_of_rank),
            "local_arrays": list(self.local_arrays),
            "levels": list(self.levels),
            "created": self.created,
            "run_id": self.run_id,
            "settings": self.settings,
            "partner_of": pack_ints(self.partner_of),
            "groups": pack_groups(self.groups, self.world_size),
            "parity": self.parity,
        }
        if self.domain_of_rank:
            body["domains"] = {"of_rank": pack_ints(self.domain_of_rank), "names": list(self.domain_names)}
        if self.tables:
            body["tables"] = {"specs": self.tables, "chain": list(self.table_chain)}
        text = _canonical(body)
        return b'{"body":' + text + b',"checksum":"' + xxhash.xxh3_64_hexdigest(text).encode() + b'"}'

    @classmethod
    def from_bytes(cls, data: bytes, origin: str = "<manifest>") -> "Manifest":
        try:
            outer = json.loads(data)
            if isinstance(outer["body"], str):  # format 1: the body as an escaped string
                text = outer["body"].encode()
            else:
                text = _canonical(outer["body"])
            if xxhash.xxh3_64_hexdigest(text) != outer["checksum"]:
                raise DamagedRecordError(f"{origin}: commit record checksum mismatch (torn or edited file)")
            body = json.loads(text)
        except DamagedRecordError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedRecordError(f"{origin}: not a readable commit record ({exc})") from None
        if body.get("format") not in READABLE_MANIFEST_FORMATS:
            raise FormatError(
                f"{origin}: commit record format {body.get('format')!r}; this hpcckpt reads formats "
                f"{', '.join(map(str, READABLE_MANIFEST_FORMATS))}: use the hpcckpt that wrote it"
            )
        node_of_rank = tuple(unpack_ints(body.get("node_of_rank", [])))
        return cls(
            step=int(body["step"]),
            world_size=int(body["world_size"]),
            layout=Layout.from_dict(body["layout"]),
            shards=tuple(ShardRecord(int(s["rank"]), int(s["size"]), dict(s["checksums"])) for s in body["shards"]),
            state=body["state"],
            metrics=body.get("metrics", {}),
            node_of_rank=node_of_rank,
            local_dirs=tuple(unpack_dirs(body.get("local_dirs", []), node_of_rank)),
            local_arrays=tuple(body.get("local_arrays", ())),
            levels=tuple(body.get("levels", ())),
            created=float(body.get("created", 0.0)),
            run_id=str(body.get("run_id", "")),
            settings=dict(body.get("settings", {})),
            partner_of=tuple(unpack_ints(body.get("partner_of", []))),
            groups=unpack_groups(body.get("groups", [])),
            parity=int(body.get("parity", 0)),
            version_id=str(body.get("version_id", "")),
            domain_of_rank=tuple(unpack_ints(body["domains"]["of_rank"])) if "domains" in body else (),
            domain_names=tuple(body["domains"]["names"]) if "domains" in body else (),
            tables=dict(body["tables"]["specs"]) if "tables" in body else {},
            table_chain=tuple(int(s) for s in body["tables"]["chain"]) if "tables" in body else (),
        )

    def check_shard_table(self, table, rank: int, origin) -> None:
        """A shard's header and per-tensor checksums are those this record lists for `rank`:
        the file is this writing's shard of that rank (a replica too: it is a byte copy)."""
        if table.step != self.step or table.rank != rank or table.world_size != self.world_size:
            raise FormatError(f"{origin}: shard header says step {table.step}, rank {table.rank} of "
                              f"{table.world_size}; the commit record expects step {self.step}, rank {rank} of "
                              f"{self.world_size}")
        expected = self.shard(rank).checksums
        for entry in table.entries:
            if expected.get(entry.name) != entry.checksum:
                raise FormatError(f"{origin}: tensor {entry.name!r} checksum differs from the commit record")
        missing = sorted(set(expected) - set(table.names))
        if missing:
            raise FormatError(f"{origin}: tensor(s) {missing} of the commit record are not in the shard")

    def write(self, path: Path, mode: int = 0o666) -> None:
        write_bytes_atomically(path, self.to_bytes(), mode=mode)

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        return cls.from_bytes(Path(path).read_bytes(), str(path))
