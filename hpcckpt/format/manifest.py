"""The commit record of a version: written last, atomically; a version without one does not exist.

It holds everything needed to read the version back without the job that wrote it: the step,
the world size, the layout (what each rank stored), every shard's checksums and size, the
small JSON state (step, iterator, RNG), the metrics, where each rank's node-local copy
lives and where its redundancy went, the run that wrote it and the settings it was written
with. A checksum over its own text detects a torn or edited record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from hpcckpt.errors import FormatError
from hpcckpt.format.layout import Layout
from hpcckpt.io.atomic import write_bytes_atomically

MANIFEST_FORMAT = 1


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
    run_id: str = ""  # the run that wrote it (ckpt/run_identity.py); restarts load only their own run's
    settings: dict = field(default_factory=dict)  # the job's settings then (ckpt/settings_record.py)
    # Where its redundancy went: partner_of (rank -> holder of its L2 replica), the L3 groups
    # and their parity, as fitted to the nodes of the job that wrote it; a restart on other
    # nodes or another rank count finds the replicas and rebuilds from the parity with it.
    partner_of: tuple[int, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    parity: int = 0

    @property
    def identity(self) -> str:
        """Which writing of this step it records: the same on every rank's copy and on L4's
        (the shards' sizes and checksums), different when another run wrote the same step."""
        shards = [[s.rank, s.size, sorted(s.checksums.items())] for s in self.shards]
        return xxhash.xxh3_64_hexdigest(json.dumps([self.step, self.world_size, shards]).encode())

    def to_bytes(self) -> bytes:
        body = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "layout": self.layout.to_dict(),
            "shards": [{"rank": s.rank, "size": s.size, "checksums": s.checksums} for s in self.shards],
            "state": self.state,
            "metrics": self.metrics,
            "node_of_rank": list(self.node_of_rank),
            "local_dirs": list(self.local_dirs),
            "local_arrays": list(self.local_arrays),
            "levels": list(self.levels),
            "created": self.created,
            "run_id": self.run_id,
            "settings": self.settings,
            "partner_of": list(self.partner_of),
            "groups": [list(g) for g in self.groups],
            "parity": self.parity,
        }
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"checksum": xxhash.xxh3_64_hexdigest(text.encode()), "body": text}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, origin: str = "<manifest>") -> "Manifest":
        try:
            outer = json.loads(data)
            text = outer["body"]
            if xxhash.xxh3_64_hexdigest(text.encode()) != outer["checksum"]:
                raise FormatError(f"{origin}: commit record checksum mismatch (torn or edited file)")
            body = json.loads(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"{origin}: not a readable commit record ({exc})") from None
        if body.get("format") != MANIFEST_FORMAT:
            raise FormatError(
                f"{origin}: commit record format {body.get('format')!r}; this hpcckpt reads format {MANIFEST_FORMAT}"
            )
        return cls(
            step=int(body["step"]),
            world_size=int(body["world_size"]),
            layout=Layout.from_dict(body["layout"]),
            shards=tuple(ShardRecord(int(s["rank"]), int(s["size"]), dict(s["checksums"])) for s in body["shards"]),
            state=body["state"],
            metrics=body.get("metrics", {}),
            node_of_rank=tuple(body.get("node_of_rank", ())),
            local_dirs=tuple(body.get("local_dirs", ())),
            local_arrays=tuple(body.get("local_arrays", ())),
            levels=tuple(body.get("levels", ())),
            created=float(body.get("created", 0.0)),
            run_id=str(body.get("run_id", "")),
            settings=dict(body.get("settings", {})),
            partner_of=tuple(int(r) for r in body.get("partner_of", ())),
            groups=tuple(tuple(int(r) for r in g) for g in body.get("groups", ())),
            parity=int(body.get("parity", 0)),
        )

    def check_shard_table(self, table, rank: int, origin) -> None:
        """A shard's header and per-tensor checksums are those this record lists for `rank`:
        the file is this writing's shard of that rank (a replica too: it is a byte copy)."""
        if table.step != self.step or table.rank != rank or table.world_size != self.world_size:
            raise FormatError(f"{origin}: shard header says step {table.step}, rank {table.rank} of "
                              f"{table.world_size}; the commit record expects step {self.step}, rank {rank} of "
                              f"{self.world_size}")
        expected = self.shards[rank].checksums
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
