"""The restore flow: discover -> agree -> fetch -> verify -> load (all ranks, collectively).

discover: every rank asks each level of the stack what it holds (restore/discover.py).
agree:    rank 0 gathers what every rank holds and decides (restore/plan.py): the newest
          version for which every rank has a source wins; each rank is told its sources,
          levels of the stack in its order.
fetch:    each rank takes its own shard from the first of its sources that delivers it
          verified, one loop over the stack (restore/fetch.py): its own node-local file,
          what the redundancy levels deliver over their peers (a partner's replica, an
          erasure rebuild), a global level's file; on another rank count or layout, the
          byte ranges of the old shards its new pieces need, wherever they survived
          (restore/repartitioned.py, repartition/). Files it only passes on are mapped, not
          read into buffers, and what travels goes in chunks.
verify:   checksums per tensor; a mismatch makes that source missing and the rank falls
          through to the next level; if a rank has no good source left, the whole job drops
          that version and agrees on the next older one.
load:     pieces are exchanged with allgather so every rank holds the full replicated
          tensors, written in place into the protected arrays (restore/load.py); the
          RestoreResult carries the registered state, which the engine sets last.

The engine hands over a frozen RestoreContext and gets a frozen RestoreResult back
(restore/context.py); nothing here reads or writes the engine itself, and no level is
named here: what a level holds, delivers and protects again is asked of the level.
"""

from __future__ import annotations

from dataclasses import replace

from hpcckpt.run.ledger import RestartLedger, ledger_path
from hpcckpt.run.settings_record import changed_settings
from hpcckpt.cluster.collectives import agree, allgather_compact, decide_at_root, on_root
from hpcckpt.errors import CheckpointError, ConfigError, HpcckptError, IncompatibleCheckpointError, UnrecoverableError
from hpcckpt.format.manifest import Manifest
from hpcckpt.restore.context import RestoreContext, RestoreResult, warn
from hpcckpt.restore.discover import Holdings, discover
from hpcckpt.restore.fetch import LazyShard, fetch_as_written, shared_manifest
from hpcckpt.restore.from_memory import SOURCE_LABELS, counted_by_source
from hpcckpt.restore.init_from import init_from
from hpcckpt.restore.load import load
from hpcckpt.restore.plan import Candidate, plan_restore
from hpcckpt.restore.repartitioned import try_repartition
from hpcckpt.restore.tables import load_tables
from hpcckpt.restore.tidy import clear_newer, clear_old_geometry, clear_unfinished

__all__ = ["RESTART_MODES", "RestoreContext", "RestoreResult", "clear_old_geometry", "init_from", "restore"]

RESTART_MODES = ("auto", "require", "never")
_RANK0_WORK = "rank 0's storage work"  # what an OSError in the ledger's upkeep on rank 0 is called


def restore(ctx: RestoreContext, mode: str = "auto", wanted: int | None = None) -> RestoreResult | None:
    """(all ranks) The newest version every rank can load, loaded into ctx's arrays: its step,
    where each rank's shard came from and its registered state; None for a fresh start."""
    if mode not in RESTART_MODES:
        raise ConfigError(f"--restart {mode!r}: use one of {', '.join(RESTART_MODES)}")
    mine = discover(ctx, repair=wanted is None)
    # An explicit version (evaluate) is read as asked; a resuming job skips versions whose
    # restart crashed and records the one it tries, so a crash while loading is not repeated.
    ledger = RestartLedger(ledger_path(ctx.run.run_dir), lambda message: warn(ctx, message)) if wanted is None else None
    outlook, my_sources = decide_at_root(ctx.job.comm, _RANK0_WORK, mine,
                                         lambda everyone: plan_restore(ctx, everyone, mode, wanted, ledger))
    if not outlook.candidates:
        clear_unfinished(ctx, list(outlook.unfinished))
        if outlook.lost_everything_up_to is not None:
            _clear_what_the_lost_left(ctx, outlook, ledger)
        return None
    for candidate in outlook.candidates:
        step = candidate.step
        if ledger is not None:
            on_root(ctx.job.comm, _RANK0_WORK, lambda: ledger.begin(step, outlook.nodes_with_files))
        ctx.faults.strike(step, "restore")
        try:
            loaded = _try_restore(ctx, candidate, mine, my_sources.get(step, ()), repair=wanted is None)
        except HpcckptError as exc:
            # A clean error every rank agreed on (e.g. an incompatible model) is not a crash:
            # the version is not to blame. Any other failure ends the job like a crash.
            if ledger is not None and exc.collective:
                on_root(ctx.job.comm, _RANK0_WORK, ledger.confirm)
            raise
        if loaded is not None:
            if wanted is None:  # a resuming job; evaluating an older version must leave newer ones be
                clear_newer(ctx, step, outlook.failed, ledger)
                return replace(loaded, unconfirmed=ledger)
            return loaded
    if ledger is not None:
        on_root(ctx.job.comm, _RANK0_WORK, ledger.confirm)  # nothing was loaded, so nothing can have crashed on it
    raise UnrecoverableError(
        f"no checkpoint version could be loaded: every candidate ({[c.step for c in outlook.candidates]}) failed "
        "verification; see the rank logs for the pieces that were bad", collective=True)


def _clear_what_the_lost_left(ctx, outlook, ledger) -> None:
    """(all ranks) A start over (resilience.unrecoverable): the run writes every step again,
    and files are never overwritten, so the pieces the lost versions left on the nodes that
    survived go, every old rank's (a global level's unusable copies are kept aside), with
    their ledger entries; the run's records say so."""
    clear_old_geometry(ctx, lambda step: True)
    clear_newer(ctx, -1, outlook.failed, ledger)
    if ctx.log:
        ctx.log.metrics({"event": "started_over", "lost_up_to": outlook.lost_everything_up_to})


def _try_restore(ctx, candidate: Candidate, mine: Holdings, my_sources: tuple, repair: bool = True
                 ) -> RestoreResult | None:
    """(all ranks) Get every rank's shard of the candidate version from the first level that
    delivers it verified, and load. With `repair` (a resuming job), copies that were missing
    or bad on node-local levels are put back; reading an explicit version (evaluate) writes
    nothing."""
    step = candidate.step
    manifest = shared_manifest(ctx, step, mine, whole=candidate.route == "repartition")
    if manifest is None:
        return None
    agree(ctx.job.comm, f"checking version {step} against this job", lambda: _check_compatible(ctx, manifest),
          error_type=IncompatibleCheckpointError)
    def tables_loaded() -> bool:
        return load_tables(ctx, manifest, candidate.tables,
                           lambda member: shared_manifest(ctx, member, mine, whole=True))

    if candidate.route == "repartition":
        result = try_repartition(ctx, manifest, candidate, repair)
        if result is not None and not tables_loaded():
            return None
        if result is not None:
            if manifest.world_size == ctx.job.world_size:  # rank r's shard is old rank r's: said as any restore says it
                _log_restored(ctx, step, result.sources[ctx.job.rank], result.sources)
            _log_changed_settings(ctx, manifest)
        return result
    pieces, source = fetch_as_written(ctx, manifest, candidate.lacking, my_sources, repair)
    outcomes = allgather_compact(ctx.job.comm, source)
    failed = [r for r, s in enumerate(outcomes) if s is None]
    if failed:
        if ctx.job.rank == 0:
            warn(ctx, f"version {step} cannot be loaded on rank(s) {failed}; trying an older one")
        return None
    if not tables_loaded():
        return None
    landing = ctx.levels.landing
    if repair and landing is not None and any(s != landing.name for s in outcomes):
        _protect_again(ctx, manifest)
    load(ctx, manifest, pieces)
    _log_restored(ctx, step, source, outcomes)
    _log_changed_settings(ctx, manifest)
    return RestoreResult(step, tuple(outcomes), manifest.state)


def _protect_again(ctx, manifest: Manifest) -> None:
    """(all ranks) After a loss, put back what the lost ranks held: each redundancy level's
    pieces and the commit records, so the version survives the next failure right away. The
    version is restored either way, so a failure here is a warning: the next checkpoint
    protects the run."""
    step = manifest.step
    shard = LazyShard(ctx, step)  # mapped only by ranks that have something to send
    sizes = manifest.shard_sizes()
    landing = ctx.levels.landing
    stages = [(level.stage_label, lambda level=level: level.protect_again(step, shard, sizes, ctx.job.world_size))
              for level in ctx.levels.node_local if level.collective and level.name in manifest.levels]
    stages.append(("commit record", lambda: landing.commit_path(step).exists() or landing.commit(manifest)))
    for label, action in stages:
        # Agreed after every stage: the next one is collective too (the erasure group's
        # transfers), and a rank that skipped it would leave its peers waiting.
        try:
            agree(ctx.job.comm, label, action, step=step)
        except CheckpointError as exc:
            if ctx.job.rank == 0:
                warn(ctx, f"version {step} is restored but could not be protected again: {exc}; "
                          "the next checkpoint protects the run")
            return
    if ctx.log:
        ctx.log.info(f"version {step} protected again on this rank's levels after the loss")


def _check_compatible(ctx, manifest: Manifest) -> None:
    problems = manifest.layout.same_tensors(ctx.job.layout, "checkpoint", "current model")
    local_now = set(ctx.job.local_array_names)
    if set(manifest.local_arrays) != local_now:
        problems.append(f"per-rank arrays differ: checkpoint {sorted(manifest.local_arrays)}, now {sorted(local_now)}")
    tables_now = {name: (table.dim, str(table.dtype)) for name, table in ctx.targets.tables.items()}
    tables_then = {name: (int(spec["dim"]), str(spec["dtype"])) for name, spec in manifest.tables.items()}
    if tables_then != tables_now:
        problems.append(f"keyed tables differ: checkpoint {_described(tables_then)}, now {_described(tables_now)}")
    if manifest.local_arrays and manifest.world_size != ctx.job.world_size:
        problems.append(f"per-rank arrays {list(manifest.local_arrays)} were saved by {manifest.world_size} ranks "
                        f"and cannot be re-partitioned onto {ctx.job.world_size}")
    if ctx.targets.state_problems is not None:
        problems += ctx.targets.state_problems(manifest.state, manifest.world_size)
    if problems:
        raise IncompatibleCheckpointError(
            f"checkpoint version {manifest.step} is incompatible with this job (it does not match): "
            + "; ".join(problems))


def _described(tables: dict) -> str:
    return "{" + ", ".join(f"{name}: {dim} x {dtype}" for name, (dim, dtype) in sorted(tables.items())) + "}"


def _log_restored(ctx, step: int, source: str, outcomes) -> None:
    if ctx.log:
        ctx.log.info(f"restored version {step} from {SOURCE_LABELS[source]} (rank {ctx.job.rank}, node {ctx.job.node})")
        ctx.log.info(f"restored version {step}: {counted_by_source(outcomes, 'rank(s)')}", console=True)


def _log_changed_settings(ctx, manifest: Manifest) -> None:
    """(rank 0) What differs from the settings the version was written with, said once."""
    if ctx.job.rank != 0 or ctx.log is None:
        return
    changes = changed_settings(manifest.settings, ctx.run.settings, manifest.world_size, ctx.job.world_size,
                               per_rank_arrays=bool(manifest.local_arrays))
    if not changes:
        return
    ctx.log.info(f"settings changed since version {manifest.step} was written: "
                  + "; ".join(str(c) for c in changes), console=True)
    meaning = [c for c in changes if c.changes_meaning]
    if meaning:
        ctx.log.warning(f"these changes alter what the restored state means (model, data, order or batch, "
                         f"seed): {'; '.join(str(c) for c in meaning)}; the run goes on from version "
                         f"{manifest.step}, but it is no longer the run that was checkpointed. To start a new run "
                         "from this state instead, give it a new run.dir and call Checkpointer.init_from() with "
                         "this run's directory (hpcckpt train: --init-from)")
