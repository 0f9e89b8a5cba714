"""The restore flow: discover -> agree -> fetch -> verify -> load (all ranks, collectively).

discover: every rank lists the versions committed on the levels it can reach.
agree:    rank 0 gathers what every rank holds and decides (recovery_plan.py): the newest
          version for which every rank has a source wins; each rank is told its own sources.
fetch:    each rank reads only its own shard, from the cheapest level that holds it: its own
          L1 file, else what the redundancy levels deliver (levels/base.py: a partner's
          replica, an erasure rebuild, each collective over its peers), else L4; on
          another rank count or layout, the byte ranges of the old shards that its new
          pieces need, from wherever they survived (repartition/). Files it only passes on
          are mapped, not read into buffers, and what travels goes in chunks.
verify:   checksums per tensor; a mismatch makes that source missing and the rank falls
          through to the next level; if a rank has no good source left, the whole job drops
          that version and agrees on the next older one.
load:     pieces are exchanged with allgather so every rank holds the full replicated
          tensors, written in place into the protected arrays (recovery_load.py); the
          RestoreResult carries the registered state, which the engine sets last.

The engine hands over a frozen RestoreContext and gets a frozen RestoreResult back; nothing
here reads or writes the engine itself.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hpcckpt.ckpt.ledger import RestartLedger, ledger_path
from hpcckpt.ckpt.records import RecordReader
from hpcckpt.ckpt.run_identity import RunIdentity, read_run_identity
from hpcckpt.ckpt.settings_record import changed_settings
from hpcckpt.cluster.collectives import (
    agree,
    allgather_compact,
    decide_at_root,
    failing_ranks,
    first_of_each,
    fold_at_root,
    on_root,
    quiet_any,
    quiet_barrier,
    quiet_bcast,
    quiet_gather,
    quiet_scatter,
)
from hpcckpt.errors import (
    CheckpointError,
    ConfigError,
    DamagedRecordError,
    HpcckptError,
    IncompatibleCheckpointError,
    UnrecoverableError,
)
from hpcckpt.format.layout import Layout, place_from_piece, read_requests
from hpcckpt.format.manifest import Manifest, records_listed
from hpcckpt.format.shardfile import read_shard_table, read_tensor
from hpcckpt.io.mapped import map_readonly
from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES, DeliveryRequest, LevelStack, remove_tree
from hpcckpt.levels.naming import LEVEL_LABELS, PFS_COMMIT_NAME, commit_file_name, list_version_steps, version_dir_name
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.spares import SPARE_DIR_NAME
from hpcckpt.levels.survey import NodeLocalView, Writing, survey
from hpcckpt.recovery_load import assemble, keep_what_gaps_leave, write_in_place
from hpcckpt.recovery_plan import Candidate, Holdings, plan_restore
from hpcckpt.repartition.exchange import OldPieceReader, RepartitionJob
from hpcckpt.repartition.plan import RepartitionPlan

RESTART_MODES = ("auto", "require", "never")
_RANK0_WORK = "rank 0's storage work"  # what an OSError in the ledger's upkeep on rank 0 is called


@dataclass(frozen=True)
class RestoreContext:
    """What a restore reads and fills, handed over by the engine: the job's shape and level
    stack, the layout, this rank's snapshot buffers (its pieces land there, read and
    verified) and the protected arrays (written in place, all ranks' pieces assembled)."""

    comm: object
    rank: int
    world_size: int
    node: int
    topology: object
    levels: LevelStack
    partner_of: tuple
    groups: tuple
    parity: int
    layout: Layout
    local_array_names: tuple
    buffers: dict  # name -> this rank's snapshot buffer of the array
    targets: dict  # name -> the protected array, filled in place
    run_id: str
    settings: dict  # the job's settings now, to say what changed since a version was written
    run_dir: str
    pfs_dir: str
    local_dir: str
    log: object
    faults: object
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # what a rebuild moves and decodes at a time (checkpoint.chunk_mib)
    # Sets the registered state of the version being loaded: the engine's, called after the
    # arrays are filled and before anything newer is moved out of the way.
    apply_state: object = None

    local = property(lambda self: self.levels.local)
    partner = property(lambda self: self.levels.partner)
    erasure = property(lambda self: self.levels.erasure)
    pfs = property(lambda self: self.levels.pfs)


@dataclass(frozen=True)
class RestoreResult:
    """What a restore loaded: the engine sets the registered state and its own counters."""

    step: int
    sources: tuple  # the level each rank's shard came from (each OLD rank's, when repartitioned)
    state: dict  # the version's registered state, by name (already set through ctx.apply_state)
    unconfirmed: object = None  # the restart ledger, until the resumed run proves itself
    # A version loaded over another job's shards: the levels to write it to again at once,
    # under this job's geometry (the engine does, after the old geometry's files are gone).
    protect_again: tuple = ()
    geometry_changed: bool = False  # written by another rank count or placement: older node-local versions go too
    metrics: dict = field(default_factory=dict)  # the version's metrics, written again with it
    traffic: tuple = ()  # repartitioned: (shard bytes this rank read from files, bytes it received)


def _node_files(ctx) -> bool:
    root = Path(ctx.local_dir)
    return bool(list_version_steps(root)) or (root / SPARE_DIR_NAME).is_dir()


def _foreign(ctx, manifest: Manifest, label: str) -> bool:
    """A version another run wrote (a copied directory, a PFS directory two runs were pointed
    at): never loaded, deleted or overwritten; said once per version."""
    if manifest.run_id == ctx.run_id:
        return False
    writer = f"run {manifest.run_id}" if manifest.run_id else "an hpcckpt without run identities"
    _warn(ctx, f"{label} version {manifest.step} was written by {writer}, not by this run "
                f"({ctx.run_id}): left alone")
    return True


def _discover(ctx, repair: bool) -> Holdings:
    """(each rank) What the levels this rank reaches hold. `repair`: a resuming job, which
    sets a damaged L4 version aside (an evaluating one leaves the run as it is)."""
    local, replicas, parity, pfs, local_writings, pfs_writings, pfs_geometry = {}, {}, [], {}, {}, {}, {}
    read = {}  # step -> this rank's own commit record, read once for discovery and the survey
    if ctx.local is not None:
        for step in ctx.local.committed_steps():
            try:
                manifest = ctx.local.manifest(step)
            except (HpcckptError, OSError) as exc:  # an I/O error too: every rank must reach the allgather
                _warn(ctx, f"ignoring L1 version {step}: {exc}")
                continue
            if _foreign(ctx, manifest, "L1"):
                continue
            local[step] = manifest.world_size
            local_writings[step] = (manifest.identity, manifest.created)
            read[step] = manifest
            # Replicas and parity follow the placement that wrote them; only the same one can use them.
            if manifest.world_size == ctx.world_size and manifest.node_of_rank == ctx.topology.node_of_rank:
                if ctx.partner is not None and "partner" in manifest.levels:
                    replicas[step] = tuple(ctx.partner.held(step))
                if ctx.erasure is not None and "erasure" in manifest.levels and ctx.erasure.has_parity(step):
                    parity.append(step)
    if ctx.pfs is not None:
        records = RecordReader(ctx.rank, ctx.log, repair)
        for step in ctx.pfs.committed_steps():
            try:
                manifest = ctx.pfs.manifest(step)
            except DamagedRecordError as exc:  # set aside by rank 0 (ckpt/records.py); the others ignore it
                records.damaged(ctx.pfs, step, exc)
                continue
            except (HpcckptError, OSError) as exc:
                _warn(ctx, f"ignoring L4 version {step}: {exc}")
                continue
            if _foreign(ctx, manifest, "L4"):
                continue
            pfs[step] = manifest.world_size
            pfs_writings[step] = (manifest.identity, manifest.created)
            pfs_geometry[step] = Writing.of(manifest)
    interrupted = ()
    if ctx.local is not None:
        interrupted = tuple(s for s in ctx.local.uncommitted_steps() if ctx.local.shard_path(s).is_file())
    return Holdings(local, replicas, tuple(parity), pfs, _node_files(ctx), local_writings, pfs_writings,
                    interrupted, _survey(ctx, read), pfs_geometry)


def _survey(ctx, read: dict) -> dict[int, NodeLocalView]:
    """Every old rank's node-local files this rank can read, by step (`read`: the commit records
    discovery read already); another run's are left alone."""
    if not ctx.levels.node_local or not Path(ctx.local_dir).is_dir():
        return {}
    views = survey(ctx.local_dir, warn=lambda message: _warn(ctx, message), known=read)
    return {step: view for step, view in views.items() if view.writing is None or view.writing.run_id == ctx.run_id}


def restore(ctx: RestoreContext, mode: str = "auto", wanted: int | None = None) -> RestoreResult | None:
    """(all ranks) The newest version every rank can load, loaded into ctx's arrays: its step,
    where each rank's shard came from and its registered state; None for a fresh start."""
    if mode not in RESTART_MODES:
        raise ConfigError(f"--restart {mode!r}: use one of {', '.join(RESTART_MODES)}")
    mine = _discover(ctx, repair=wanted is None)
    # An explicit version (evaluate) is read as asked; a resuming job skips versions whose
    # restart crashed and records the one it tries, so a crash while loading is not repeated.
    ledger = RestartLedger(ledger_path(ctx.run_dir), lambda message: _warn(ctx, message)) if wanted is None else None
    outlook, my_sources = decide_at_root(ctx.comm, _RANK0_WORK, mine,
                                         lambda everyone: plan_restore(ctx, everyone, mode, wanted, ledger))
    if not outlook.candidates:
        _clear_unfinished(ctx, list(outlook.unfinished))
        return None
    for candidate in outlook.candidates:
        step = candidate.step
        if ledger is not None:
            on_root(ctx.comm, _RANK0_WORK, lambda: ledger.begin(step, outlook.nodes_with_files))
        ctx.faults.strike(step, "restore")
        try:
            loaded = _try_restore(ctx, candidate, mine, my_sources.get(step, ()), repair=wanted is None)
        except HpcckptError as exc:
            # A clean error every rank agreed on (e.g. an incompatible model) is not a crash:
            # the version is not to blame. Any other failure ends the job like a crash.
            if ledger is not None and exc.collective:
                on_root(ctx.comm, _RANK0_WORK, ledger.confirm)
            raise
        if loaded is not None:
            if wanted is None:  # a resuming job; evaluating an older version must leave newer ones be
                _clear_newer(ctx, step, outlook.failed, ledger)
                return replace(loaded, unconfirmed=ledger)
            return loaded
    if ledger is not None:
        on_root(ctx.comm, _RANK0_WORK, ledger.confirm)  # nothing was loaded, so nothing can have crashed on it
    raise UnrecoverableError(
        f"no checkpoint version could be loaded: every candidate ({[c.step for c in outlook.candidates]}) failed "
        "verification; see the rank logs for the pieces that were bad", collective=True)


def _shared_manifest(ctx, step: int, mine: Holdings, whole: bool) -> Manifest | None:
    """(all ranks) The commit record of `step`: read locally where possible, else sent by a
    rank that has it (a rank on a replacement node has no local copy); with the shard records
    this rank needs (_table_for_this_rank)."""
    manifest = None
    for level, holds in ((ctx.local, step in mine.local), (ctx.pfs, step in mine.pfs)):
        if manifest is None and level is not None and holds:
            try:
                manifest = level.manifest(step)
            except HpcckptError:
                manifest = None
    view = mine.views.get(step)
    if manifest is None and view is not None and view.commits:
        try:  # another rank's record of the same writing, left on this node
            manifest = Manifest.read(Path(view.directory) / commit_file_name(min(view.commits)))
        except (HpcckptError, OSError):
            manifest = None
    # The first rank that read one shares it (with several pieces of one table, any will do).
    root = fold_at_root(ctx.comm, manifest is not None, lambda have: have.index(True) if any(have) else None)
    if root is None:
        return None
    data = quiet_bcast(ctx.comm, manifest.to_bytes() if ctx.rank == root else None, root=root)
    shared = manifest or Manifest.from_bytes(data, f"commit record of step {step} from rank {root}")
    return _table_for_this_rank(ctx, shared, manifest, whole)


def _table_for_this_rank(ctx, shared: Manifest, mine: Manifest | None, whole: bool) -> Manifest:
    """(all ranks) The version's record with the shards listed that this rank's restore
    reads: node-local copies list their node's part (Manifest.for_rank), so rank 0 gathers
    what each rank read (O(group) records each) and hands each rank back what its own
    node-local copy lists (its shard, its group's, the replicas it held: O(group)), or, to
    re-partition (`whole`), the table of every shard. Every shard a node-local level can
    deliver is listed by a surviving copy: its own rank's, its replica holder's or its group's;
    the others, L4's record lists."""
    if not quiet_any(ctx.comm, not shared.lists_every_shard):
        return shared
    records = mine.shards if mine is not None and mine.identity == shared.identity else ()
    gathered = quiet_gather(ctx.comm, records, root=0)
    table = None
    if gathered is not None:
        table = shared.with_shards(r for part in gathered for r in part)
        if not table.lists_every_shard:
            # Nodes next to each other lost: no surviving node-local copy lists some shards,
            # which L4 then delivers. Its one record lists them all.
            table = table.with_shards(_l4_records(ctx, shared))
    if whole:
        return shared.with_shards(quiet_bcast(ctx.comm, table.shards if table is not None else None, root=0))
    parts = None
    if table is not None:
        wanted = records_listed(shared.world_size, shared.partner_of, shared.node_of_rank, shared.groups)
        parts = [table.listed(wanted[rank]) for rank in range(ctx.world_size)]
    return shared.with_shards(quiet_scatter(ctx.comm, parts, root=0))


def _l4_records(ctx, shared: Manifest) -> tuple:
    """(rank 0) The shard records of L4's commit record of the same writing, if L4 has one."""
    if ctx.pfs is None or shared.step not in ctx.pfs.committed_steps():
        return ()
    try:
        record = ctx.pfs.manifest(shared.step)
    except (HpcckptError, OSError) as exc:
        _warn(ctx, f"L4's commit record of version {shared.step} is unreadable: {exc}")
        return ()
    return record.shards if record.identity == shared.identity else ()


def _try_restore(ctx, candidate: Candidate, mine: Holdings, my_sources: tuple, repair: bool = True
                 ) -> RestoreResult | None:
    """(all ranks) Get every rank's shard of the candidate version from the cheapest source,
    verify, load. With `repair` (a resuming job), copies that were missing or bad on
    node-local levels are put back; reading an explicit version (evaluate) writes nothing."""
    comm = ctx.comm
    step = candidate.step
    manifest = _shared_manifest(ctx, step, mine, whole=candidate.route == "repartition")
    if manifest is None:
        return None
    agree(comm, f"checking version {step} against this job", lambda: _check_compatible(ctx, manifest),
          error_type=IncompatibleCheckpointError)
    if candidate.route == "repartition":
        return _try_repartition(ctx, manifest, candidate, repair)

    pieces, source = None, None
    if "local" in my_sources:
        pieces = _attempt(ctx, ctx.local, manifest)
        source = "local" if pieces is not None else None
    needy = failing_ranks(comm, pieces is not None)
    lost_initially = set(needy)
    pieces, source, needy = _from_redundancy(ctx, manifest, candidate.lacking, needy, pieces, source)
    if needy and ctx.rank in needy and "pfs" in my_sources:
        if ctx.local is not None and manifest.world_size == ctx.world_size and manifest.layout == ctx.layout:
            # Same layout: read and verify from L4, then put the same file back as this rank's
            # L1 copy (from the page cache; no second verification read).
            pieces = _attempt(ctx, ctx.pfs, manifest)
            if pieces is not None and repair:
                _restore_local_copy(ctx, step)
        else:
            pieces = _attempt(ctx, ctx.pfs, manifest)
        source = "pfs" if pieces is not None else None
    outcomes = allgather_compact(comm, source)
    failed = [r for r, s in enumerate(outcomes) if s is None]
    if failed:
        if ctx.rank == 0:
            _warn(ctx, f"version {step} cannot be loaded on rank(s) {failed}; trying an older one")
        return None
    if repair and lost_initially and ctx.local is not None and manifest.world_size == ctx.world_size:
        _reprotect(ctx, manifest)
    _load(ctx, manifest, pieces)
    _log_restored(ctx, step, source, outcomes)
    _log_changed_settings(ctx, manifest)
    return RestoreResult(step, tuple(outcomes), manifest.state)


def _try_repartition(ctx, manifest: Manifest, candidate: Candidate, repair: bool) -> RestoreResult | None:
    """(all ranks) Load a version over the old job's shards, wherever they survived: each from
    its cheapest surviving level, lost ones rebuilt from L3 parity, L4 only for what no
    node-local level holds (repartition/). A resuming job then writes the version again under
    this job's geometry (RestoreResult.protect_again), so a second loss is survived at once."""
    step = manifest.step
    pfs_holds = candidate.pfs_holds
    keep_what_gaps_leave(ctx, manifest.layout, ctx.layout)
    job = RepartitionJob(ctx.comm, manifest, ctx.layout, ctx.buffers, ctx.local_array_names, candidate.views,
                         (lambda old_rank: ctx.pfs.shard_path(step, old_rank)) if ctx.pfs is not None else None,
                         lambda message: _warn(ctx, message), scratch_dir=ctx.local_dir, chunk_bytes=ctx.chunk_bytes)
    outcome = job.run(candidate.writing, pfs_holds)
    if isinstance(outcome, RepartitionPlan):
        if ctx.rank == 0:
            _warn(ctx, f"version {step} cannot be assembled: old rank(s) {list(outcome.missing)} have no usable "
                        "copy left; trying an older one")
        return None
    _load(ctx, manifest, outcome.pieces)
    plan = outcome.plan
    most_read, most_received = fold_at_root(ctx.comm, (outcome.bytes_read, outcome.bytes_received),
                                            lambda moved: tuple(map(max, zip(*moved))))
    if ctx.log:
        ctx.log.info(f"restored version {step}, written by {manifest.world_size} rank(s), onto {ctx.world_size}: "
                     f"old shards {plan.summary()}; this rank read {outcome.bytes_read} and received "
                     f"{outcome.bytes_received} bytes", console=False)
        if ctx.rank == 0:
            ctx.log.info(f"restored version {step} (written by {manifest.world_size} ranks) onto {ctx.world_size} "
                         f"rank(s): old shards {plan.summary()}; at most {most_read / 1e6:.1f} MB read and "
                         f"{most_received / 1e6:.1f} MB received by one rank", console=True)
    if manifest.world_size == ctx.world_size:  # rank r's shard is old rank r's: said as any restore says it
        _log_restored(ctx, step, plan.sources[ctx.rank].level, [s.level for s in plan.sources])
    _log_changed_settings(ctx, manifest)
    levels = ()
    if repair:
        levels = tuple(level.name for level in ctx.levels if level.node_local or not pfs_holds)
    changed = manifest.world_size != ctx.world_size or tuple(manifest.node_of_rank) != ctx.topology.node_of_rank
    return RestoreResult(step, tuple(s.level for s in plan.sources), manifest.state, protect_again=levels,
                         metrics=manifest.metrics, geometry_changed=changed,
                         traffic=(outcome.bytes_read, outcome.bytes_received))


def _from_redundancy(ctx, manifest: Manifest, lacking: frozenset, needy: set[int], pieces, source):
    """(all ranks) The redundancy levels, cheapest first, each collective over its peers:
    holders send replicas, groups rebuild from survivors; what a needy rank gets becomes its
    L1 copy again and is verified there. Returns (pieces, source, the ranks still needy)."""
    step = manifest.step
    sizes = manifest.shard_sizes()
    for level in ctx.levels:
        if not (needy and level.collective):
            continue
        request = DeliveryRequest(step, ctx.world_size, frozenset(needy), sizes,
                                  open_copy=lambda size, aligned, level=level: _open_copy(ctx, step, size, aligned,
                                                                                          level.label),
                                  own_shard=lambda: _shard_bytes(ctx, step), lacking=lacking)
        path = level.deliver(request)
        for warning in request.warnings:
            _warn(ctx, warning)
        if path is not None:
            pieces = _attempt(ctx, ctx.local, manifest)
            if pieces is None:
                path.unlink(missing_ok=True)  # a bad copy (checksum) counts as missing
            source = level.name if pieces is not None else None
        needy = failing_ranks(ctx.comm, pieces is not None)
    return pieces, source, needy


def _log_restored(ctx, step: int, source: str, outcomes) -> None:
    if ctx.log:
        ctx.log.info(f"restored version {step} from {LEVEL_LABELS[source]} (rank {ctx.rank}, node {ctx.node})")
        counts = Counter(outcomes)
        summary = ", ".join(f"{counts[s]} rank(s) from {label}" for s, label in LEVEL_LABELS.items() if s in counts)
        ctx.log.info(f"restored version {step}: {summary}", console=True)


def _log_changed_settings(ctx, manifest: Manifest) -> None:
    """(rank 0) What differs from the settings the version was written with, said once."""
    if ctx.rank != 0 or ctx.log is None:
        return
    changes = changed_settings(manifest.settings, ctx.settings, manifest.world_size, ctx.world_size)
    if not changes:
        return
    ctx.log.info(f"settings changed since version {manifest.step} was written: "
                  + "; ".join(str(c) for c in changes), console=True)
    meaning = [c for c in changes if c.changes_meaning]
    if meaning:
        ctx.log.warning(f"these changes alter what the restored state means (model, data, order or batch, "
                         f"seed, rank count): {'; '.join(str(c) for c in meaning)}; the run goes on from version "
                         f"{manifest.step}, but it is no longer the run that was checkpointed (a new run.dir with "
                         "--init-from starts a new one)")


def _attempt(ctx, level, manifest: Manifest):
    """Read and verify this rank's pieces from one level; None (logged) when they are bad."""
    try:
        return _fetch(ctx, level, manifest)
    except (HpcckptError, OSError) as exc:
        _warn(ctx, f"version {manifest.step} from {level.label} unusable on rank {ctx.rank}: {exc}; "
                    "trying the next level")
        return None


def _restore_local_copy(ctx, step: int) -> None:
    """Copy this rank's verified L4 shard back to L1 (mapped: from the page cache the
    verification filled, with no shard-sized buffer); a failure only costs the local copy."""
    try:
        ctx.local.shard_path(step).unlink(missing_ok=True)
        ctx.local.write_shard_bytes(step, map_readonly(ctx.pfs.shard_path(step, ctx.rank)))
    except (HpcckptError, OSError) as exc:
        _warn(ctx, f"version {step}: could not put the L1 copy back from L4: {exc}")


def _open_copy(ctx, step: int, size: int, aligned: bool, what: str):
    """This rank's L1 copy of a version, opened to take the shard bytes a level delivers
    (a replica, a rebuild) as they arrive; it is read and verified as usual afterwards. None
    when it cannot be stored (said)."""
    try:
        return ctx.local.open_shard_copy(step, size, aligned)
    except (HpcckptError, OSError) as exc:
        _warn(ctx, f"version {step}: cannot store the shard from {what}: {exc}")
        return None


def _shard_bytes(ctx, step: int) -> np.ndarray:
    """This rank's verified L1 shard, mapped: what a survivor sends of it (a rebuild's
    segments, a replica protected again) is read from the page cache as it goes."""
    return map_readonly(ctx.local.shard_path(step))


class _LazyShard:
    """This rank's L1 shard, mapped on first use: re-protection after a loss needs it only
    on ranks that send something, and most send nothing."""

    def __init__(self, ctx, step: int):
        self._ckpt, self._step, self._data = ctx, step, None

    def __call__(self) -> np.ndarray:
        if self._data is None:
            self._data = _shard_bytes(self._ckpt, self._step)
        return self._data


def _reprotect(ctx, manifest: Manifest) -> None:
    """(all ranks) After a loss, put back what the lost ranks held: replicas, parity pieces
    and commit records, so the version survives the next failure right away. The version is
    restored either way, so a failure here is a warning: the next checkpoint protects the run."""
    step = manifest.step
    shard = _LazyShard(ctx, step)  # mapped only by ranks that have something to send
    sizes = list(manifest.shard_sizes())
    stages = []
    if ctx.partner is not None and "partner" in manifest.levels:
        stages.append(("L2 partner copy", lambda: ctx.partner.protect(step, shard, only_missing=True)))
    if ctx.erasure is not None and "erasure" in manifest.levels:
        stages.append(("L3 erasure coding",
                       lambda: ctx.erasure.protect(step, shard, sizes, ctx.world_size, only_missing=True)))
    stages.append(("commit record", lambda: ctx.local.commit_path(step).exists() or ctx.local.commit(manifest)))
    for label, action in stages:
        # Agreed after every stage: the next one is collective too (the erasure group's
        # transfers), and a rank that skipped it would leave its peers waiting.
        try:
            agree(ctx.comm, label, action, step=step)
        except CheckpointError as exc:
            if ctx.rank == 0:
                _warn(ctx, f"version {step} is restored but could not be protected again: {exc}; "
                            "the next checkpoint protects the run")
            return
    if ctx.log:
        ctx.log.info(f"version {step} protected again on this rank's levels after the loss")


def _check_compatible(ctx, manifest: Manifest) -> None:
    problems = manifest.layout.same_tensors(ctx.layout, "checkpoint", "current model")
    local_now = set(ctx.local_array_names)
    if set(manifest.local_arrays) != local_now:
        problems.append(f"per-rank arrays differ: checkpoint {sorted(manifest.local_arrays)}, now {sorted(local_now)}")
    if manifest.local_arrays and manifest.world_size != ctx.world_size:
        problems.append(f"per-rank arrays {list(manifest.local_arrays)} were saved by {manifest.world_size} ranks "
                        f"and cannot be re-partitioned onto {ctx.world_size}")
    if problems:
        raise IncompatibleCheckpointError(
            f"checkpoint version {manifest.step} is incompatible with this job (it does not match): "
            + "; ".join(problems))


def _fetch(ctx, level, manifest: Manifest) -> dict[str, np.ndarray]:
    """This rank's pieces under the CURRENT layout, read and verified."""
    rank = ctx.rank
    layout = ctx.layout
    pieces = {}
    if manifest.world_size == ctx.world_size and manifest.layout == layout:
        path = level.shard_path(manifest.step, rank)
        table = read_shard_table(path)
        manifest.check_shard_table(table, rank, path)
        with open(path, "rb") as f:
            for tl in layout.rank_pieces(rank):
                pieces[tl.name] = read_tensor(f, table, tl.name, out=ctx.buffers[tl.name])
            for name in ctx.local_array_names:
                pieces[name] = read_tensor(f, table, name, out=ctx.buffers[name])
        _log_reads(ctx, [path], sum(p.nbytes for p in pieces.values()))
        return pieces
    if level.name != "pfs":
        raise CheckpointError(f"version {manifest.step} was written by {manifest.world_size} ranks with another "
                              "layout; re-partitioning reads from L4 only")
    return _fetch_repartitioned(ctx, level, manifest, layout)


def _fetch_repartitioned(ctx, level, manifest: Manifest, layout: Layout) -> dict[str, np.ndarray]:
    """Build this rank's new pieces from the old pieces they overlap, each old piece read
    whole and verified (repartition/exchange.py's OldPieceReader). Where old and new pieces do
    not line up, a rank reads more than it keeps: 2x from 2 to 4 ranks, 1.5x from 4 to 3, 3x
    from 2 to 3 at worst."""
    rank = ctx.rank
    pieces = {tl.name: ctx.buffers[tl.name] for tl in layout.rank_pieces(rank)}
    keep_what_gaps_leave(ctx, manifest.layout, layout)
    reader = OldPieceReader(manifest, lambda old_rank: level.shard_path(manifest.step, old_rank))
    try:
        for request in read_requests(manifest.layout, layout, rank):
            place_from_piece(pieces[request.name], request, reader.piece(request.old_rank, request.name),
                             manifest.layout, layout, rank)
        _log_reads(ctx, reader.paths, reader.bytes_read)
    finally:
        reader.close()
    return pieces


def _log_reads(ctx, paths, payload_bytes: int) -> None:
    if ctx.log:
        ctx.log.info(f"restore read {payload_bytes} payload bytes from {len(paths)} file(s): "
                      + ", ".join(str(p) for p in paths))


def _load(ctx, manifest: Manifest, pieces: dict[str, np.ndarray]) -> None:
    """(all ranks) Reassemble every replicated tensor everywhere, each rank's blocks on it;
    write all arrays in place; then the engine sets the registered state (ctx.apply_state)."""
    assemble(ctx, ctx.layout, pieces)
    for name in ctx.local_array_names:
        write_in_place(ctx.targets[name], pieces[name])
    if ctx.apply_state is not None:
        ctx.apply_state(manifest.state)


def init_from(ctx, source: str, select) -> Manifest:
    """(all ranks) Start a new run from another run's state: the arrays `select(name)` picks
    are read from a version on that run's L4 (re-partitioned onto this job's ranks) and
    verified; nothing else is taken (step, data position, RNG and the arrays not picked start
    fresh), and nothing is written there. `source`: a run directory (its newest complete L4
    version), a PFS directory, or one version directory in it."""
    root, data = on_root(ctx.comm, f"--init-from {source}: finding the version", lambda: _init_source(source))
    manifest = Manifest.from_bytes(data, f"--init-from {source}")
    names = [tl.name for tl in ctx.layout.tensors if select(tl.name)]
    stored = {tl.name for tl in manifest.layout.tensors}
    wanted_old = Layout(manifest.world_size, tuple(t for t in manifest.layout.tensors if t.name in names))
    wanted_new = Layout(ctx.world_size, tuple(t for t in ctx.layout.tensors if t.name in names))
    problems = [f"tensor {n!r} is not in version {manifest.step}" for n in names if n not in stored]
    problems += wanted_old.same_tensors(wanted_new, f"version {manifest.step}", "current model") if not problems else []
    if not names:
        problems.append("no protected array was selected to load")
    if problems:
        raise IncompatibleCheckpointError(
            f"--init-from {source}: version {manifest.step} does not fit this job: " + "; ".join(problems),
            collective=True)

    def read_pieces():
        try:
            return _fetch_repartitioned(ctx, PfsLevel(root, ctx.rank), replace(manifest, layout=wanted_old),
                                        wanted_new)
        except OSError as exc:
            raise CheckpointError(str(exc)) from None

    pieces = agree(ctx.comm, f"--init-from {source}: reading", read_pieces, step=manifest.step)
    assemble(ctx, wanted_new, pieces)
    return manifest


def _init_source(source: str) -> tuple[str, bytes]:
    """(rank 0) The L4 directory and the commit record of the version `source` names."""
    path = Path(source).expanduser()
    step = None
    try:
        identity = read_run_identity(path)
    except DamagedRecordError as exc:  # the source run's own files are left as they are
        _warn_init(f"--init-from {source}: {exc}; its L4 directory is taken as {path / 'pfs'}")
        identity = RunIdentity("", str(path), "", "", 0.0)
    if identity is not None:
        root = Path(identity.pfs_dir) if identity.pfs_dir else path / "pfs"
    elif path.name.startswith("v") and path.name[1:].isdigit() and (path / PFS_COMMIT_NAME).is_file():
        root, step = path.parent, int(path.name[1:])
    elif list_version_steps(path):
        root = path
    else:
        raise ConfigError(f"--init-from {source}: not a run directory (no run.json), an L4 (PFS) directory (no "
                          f"v<step> directories) or an L4 version directory (v{0:012d} with a manifest.json)")
    level = PfsLevel(root, 0)
    committed = level.committed_steps()
    if step is not None and step not in committed:
        raise ConfigError(f"--init-from {source}: version {step} is not complete on L4 ({version_dir_name(step)} "
                          "has no readable commit record)")
    for candidate in [step] if step is not None else sorted(committed, reverse=True):
        try:
            return str(root), level.manifest(candidate).to_bytes()
        except DamagedRecordError as exc:
            if step is not None:
                raise ConfigError(f"--init-from {source}: {exc}; name another version of that run") from None
            _warn_init(f"--init-from {source}: {exc}; taking the newest intact version before it")
        except OSError as exc:
            raise ConfigError(f"--init-from {source}: cannot read the commit record of version {candidate}: "
                              f"{exc.strerror or exc}") from None
    raise ConfigError(f"--init-from {source}: no complete version with an intact commit record in {str(root)!r}; "
                      "another run starts only from an L4 (PFS) version: drain the source run to L4 first")


def _warn_init(message: str) -> None:
    """(rank 0, before the job's log exists for it) What --init-from passes over, on stderr."""
    print(f"hpcckpt: warning: {message}", file=sys.stderr, flush=True)


def _clear_newer(ctx, restored: int, failed: dict[int, str], ledger: RestartLedger | None = None) -> None:
    """Versions newer than the restored one were not loaded (not complete on every rank,
    failed verification, or marked failed after a crashed restart); the resumed run will
    write those steps again, and shard files are never overwritten, so move them out of the
    way: node-local ones are deleted, committed L4 ones are renamed for inspection. A failed
    version's ledger entry goes with its files, or it would keep the new writing of that step
    from ever being loaded."""
    if ctx.local is not None:
        newer = sorted(s for s in _node_local_steps(ctx) if s > restored)
        if newer:
            # Said, not silent: a version another rank count wrote is gone once this job goes on.
            _warn(ctx, f"rank {ctx.rank}: node-local version(s) {newer} cannot be loaded by this job "
                        f"(incomplete, unusable, or written by another rank count); deleted, as the resumed "
                        "run writes those steps again")
        for step in newer:
            _remove_node_local(ctx, step)

    def set_aside_on_l4():
        if ctx.pfs is not None:
            for step in ctx.pfs.uncommitted_steps():
                if step > restored:
                    ctx.pfs.remove(step)
            for step in ctx.pfs.committed_steps():
                if step > restored:
                    aside = ctx.pfs.set_aside(step, ".failed" if step in failed else ".unusable")
                    _warn(ctx, f"L4 version {step} was not loaded; kept aside as {aside}")
                    if ledger is not None and step in failed:
                        ledger.set_aside(step, aside)
        if ledger is not None:
            for step in sorted(s for s in failed if s > restored):  # node-local only: deleted above
                ledger.set_aside(step, f"v{step:012d} (node-local copies deleted)")

    on_root(ctx.comm, f"moving newer L4 versions out of the way under {ctx.pfs_dir!r}", set_aside_on_l4)


def clear_old_geometry(ctx, which) -> list[int]:
    """(all ranks) After a version was loaded over another job's shards: the node-local
    versions `which(step)` picks, every file of every old rank, go. Their names are those
    this job's ranks write (files are never overwritten) and their redundancy was cut for
    ranks and nodes that are gone. Called for the loaded version and newer ones before the
    engine writes it again under this job's geometry, and for older ones once that worked:
    until then they are the fallback. One rank per node-local directory deletes; L4 keeps
    its versions (the engine writes the version there first where L4 lacks it). Returns the
    steps deleted."""
    where = (ctx.local_dir, ctx.node)
    first = first_of_each(ctx.comm, where)
    steps = [s for s in list_version_steps(ctx.local_dir) if which(s)] if first and ctx.levels.node_local else []
    for step in steps:
        remove_tree(Path(ctx.local_dir) / version_dir_name(step))
    if steps and ctx.log:
        ctx.log.info(f"deleted node-local version(s) {steps} of the job that ran before (its rank count and "
                     f"placement) from {ctx.local_dir}")
    quiet_barrier(ctx.comm)  # no rank writes before every old file is gone
    return steps


def _clear_unfinished(ctx, unfinished: list[int]) -> None:
    """(all ranks) A fresh start writes its first steps again, and files are never
    overwritten: what earlier attempts half wrote goes (versions never complete, uncommitted
    leftovers). A committed version is never touched here, an unreadable one included: that
    is damage for the operator to look at, and writing its step again fails naming the file."""
    if ctx.local is not None:
        leftovers = set(ctx.local.stray_steps())  # every node-local level's, in one scan
        for step in sorted(set(unfinished) | leftovers):
            _remove_node_local(ctx, step)

    def on_l4():
        if ctx.pfs is not None:
            for step in ctx.pfs.uncommitted_steps():
                ctx.pfs.remove(step)

    on_root(ctx.comm, f"removing unfinished L4 versions under {ctx.pfs_dir!r}", on_l4)


def _node_local_steps(ctx) -> set[int]:
    """Versions this rank has node-local files of, committed or not."""
    return set(ctx.local.rank_steps())


def _remove_node_local(ctx, step: int) -> None:
    """This rank's files of a node-local version, each level its own (L1's commit record first)."""
    for level in ctx.levels:
        if level.node_local:
            level.remove(step)
    ctx.local.remove_strays(step)  # files of levels this job does not run


def _warn(ctx, message: str) -> None:
    if ctx.log:
        ctx.log.warning(message) if ctx.rank == 0 else ctx.log.info("warning: " + message)
