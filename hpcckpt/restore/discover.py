"""The restore's first step, discover: what every level of the stack holds, as this rank sees
it (each rank, no MPI). Each level is asked the same questions through the level protocol
(levels/base.py): the versions committed there and whose shards it can supply
(`holdings`), and each version's commit record, read once per record (the node-local levels
share one). Rank 0 plans over everyone's answers (restore/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hpcckpt.run.records import RecordReader
from hpcckpt.errors import DamagedRecordError, HpcckptError
from hpcckpt.format.manifest import Manifest
from hpcckpt.levels.naming import list_version_steps
from hpcckpt.levels.spares import SPARE_DIR_NAME
from hpcckpt.levels.survey import NodeLocalView, Writing, survey
from hpcckpt.restore.context import warn


@dataclass(frozen=True)
class Holdings:
    """What one rank can reach, level by level (keyed by Level.name)."""

    # level -> {step: Writing}: the committed versions whose commit record this rank read there
    # (one Writing object per record, so the node-local levels' entries travel once).
    written: dict = field(default_factory=dict)
    # level -> {step: frozenset}: whose shards this rank supplies from there (Level.holdings;
    # a level that is not collective delivers a rank its own shard only, so it is asked about
    # this rank's), for versions this job's rank count wrote, and for a collective level only
    # where the same placement wrote them (replicas and parity follow the placement).
    supplies: dict = field(default_factory=dict)
    # The rank's node-local directory holds version directories (complete or not) or spares:
    # its node survived, even if nothing on it is committed (a lost node's directory is gone).
    node_files: bool = False
    # Steps whose shard this rank wrote but never committed: the job stopped between its shard
    # write and the commit (the only way a rank lacks a record of a version others committed
    # without anything being lost, since the commit follows every rank's agreed write).
    interrupted: tuple = ()
    # step -> what this rank's node-local directory holds of every old rank (levels/survey.py),
    # for a restart onto another rank count or other nodes.
    views: dict = field(default_factory=dict)

    def held(self, level: str, step: int) -> frozenset:
        return self.supplies.get(level, {}).get(step, frozenset())

    def writing(self, level: str, step: int) -> Writing | None:
        return self.written.get(level, {}).get(step)


def discover(ctx, repair: bool) -> Holdings:
    """(each rank) What the levels this rank reaches hold. `repair`: a resuming job, which
    sets a damaged global version aside (an evaluating one leaves the run as it is)."""
    reader = _Records(ctx, repair)
    written, supplies = {}, {}
    for level in ctx.levels:
        asked = None if level.collective else frozenset({ctx.job.rank})
        written[level.name], supplies[level.name] = {}, {}
        for step, ranks in level.holdings(asked).items():
            manifest, writing = reader.read(level, step)
            if manifest is None:
                continue
            written[level.name][step] = writing
            if _usable(ctx, level, manifest):
                supplies[level.name][step] = ranks
    landing = ctx.levels.landing
    interrupted = ()
    if landing is not None:
        interrupted = tuple(s for s in landing.uncommitted_steps() if landing.shard_path(s).is_file())
    return Holdings(written, supplies, _node_files(ctx), interrupted, _survey(ctx, reader.node_local))


def _usable(ctx, level, manifest: Manifest) -> bool:
    """Whether `level`'s holdings of this writing can serve this job's ranks as they are."""
    if manifest.world_size != ctx.job.world_size:
        return False
    if level.collective:
        return (level.name in manifest.levels and manifest.node_of_rank == ctx.job.topology.node_of_rank
                and level.placed_as(manifest))
    return True


class _Records:
    """Each commit record read once: node-local levels share this rank's record of a version,
    a global level has its own. Another run's versions are never loaded, deleted or
    overwritten, and said once."""

    def __init__(self, ctx, repair: bool):
        self.ctx = ctx
        self.damaged = RecordReader(ctx.job.rank, ctx.log, repair)
        self.known: dict = {}  # (node_local, step) -> (Manifest, Writing) or (None, None)
        self.node_local: dict = {}  # step -> this rank's node-local record (the survey reads no other)

    def read(self, level, step: int):
        key = (level.node_local, step)
        if key not in self.known:
            manifest = self._manifest(level, step)
            if manifest is not None and self._foreign(manifest, level.number):
                manifest = None
            self.known[key] = (manifest, Writing.of(manifest) if manifest is not None else None)
            if manifest is not None and level.node_local:
                self.node_local[step] = manifest
        return self.known[key]

    def _manifest(self, level, step: int) -> Manifest | None:
        try:
            return level.manifest(step)
        except DamagedRecordError as exc:
            if level.node_local:
                warn(self.ctx, f"ignoring {level.number} version {step}: {exc}")
            else:  # the global record is the version's only one: set aside by its coordinator
                self.damaged.damaged(level, step, exc)
        except (HpcckptError, OSError) as exc:  # an I/O error too: every rank must reach the allgather
            warn(self.ctx, f"ignoring {level.number} version {step}: {exc}")
        return None

    def _foreign(self, manifest: Manifest, where: str) -> bool:
        ctx = self.ctx
        if manifest.run_id == ctx.run.run_id:
            return False
        writer = f"run {manifest.run_id}" if manifest.run_id else "an hpcckpt without run identities"
        warn(ctx, f"{where} version {manifest.step} was written by {writer}, not by this run ({ctx.run.run_id}): "
                  "left alone")
        return True


def _node_files(ctx) -> bool:
    return any(list_version_steps(root) or (Path(root) / SPARE_DIR_NAME).is_dir() for root in ctx.run.version_roots)


def _survey(ctx, read: dict) -> dict[int, NodeLocalView]:
    """Every old rank's node-local files this rank can read, by step (`read`: the commit records
    discovery read already); another run's are left alone. A version is in one of the node's
    directories (levels/node_places.py): the first that has it, memory first."""
    if not ctx.levels.node_local:
        return {}
    views = {}
    for root in ctx.run.version_roots:
        if Path(root).is_dir():
            for step, view in survey(root, warn=lambda message: warn(ctx, message), known=read).items():
                views.setdefault(step, view)
    return {step: view for step, view in views.items() if view.writing is None or view.writing.run_id == ctx.run.run_id}
