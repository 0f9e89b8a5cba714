"""The restore's "agree" step, decided once at rank 0, so no rank exchanges O(ranks) with
every other: which versions can be loaded, how, and from which level each rank reads its shard.

Every rank lists what it can reach (recovery._discover: a Holdings, O(versions) in size) and
rank 0 gathers them: O(ranks) there. It picks the candidate versions, newest first, each with
its route ("same": every rank its own shard, as the job that wrote it ran; "repartition": over
the old job's shards, wherever they survived) and what every rank needs to try it: the shared
part (the ranks whose node-local pieces are gone, the writing, and for a repartition what
each node-local directory holds) broadcast, and each rank's own sources scattered. No rank
receives every rank's holdings. Pure functions over the gathered holdings, no MPI, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hpcckpt.errors import CheckpointError, ConfigError, UnrecoverableError
from hpcckpt.levels.survey import Writing
from hpcckpt.repartition.plan import RepartitionPlan, plan_repartition


@dataclass(frozen=True)
class Holdings:
    """What one rank can reach, per level: the committed versions and who wrote them."""

    local: dict  # step -> world size that wrote it (own shard + commit record here)
    replicas: dict  # step -> source ranks whose replica this rank holds
    parity: tuple  # steps whose parity pieces this rank holds
    pfs: dict  # step -> world size
    # The rank's node-local directory holds version directories (complete or not) or spares:
    # its node survived, even if nothing on it is committed (a lost node's directory is gone).
    node_files: bool = False
    # step -> (Manifest.identity, created) of the commit record read, per level: which run's
    # writing of that step this rank holds.
    local_writings: dict = field(default_factory=dict)
    pfs_writings: dict = field(default_factory=dict)
    # Steps whose shard this rank wrote but never committed: the job stopped between its L1
    # write and the commit (the only way a rank lacks a record of a version others committed
    # without anything being lost, since the commit follows every rank's agreed L1 write).
    interrupted: tuple = ()
    # step -> what this rank's node-local directory holds of every old rank (levels/survey.py),
    # for a restart onto another rank count or other nodes; L4's writings by step.
    views: dict = field(default_factory=dict)
    pfs_geometry: dict = field(default_factory=dict)


def _one_writing_per_step(ctx, everyone: list[Holdings]) -> list[Holdings]:
    """Where two runs wrote the same step (a job resumed on fewer ranks rewrites steps whose
    older files other ranks' directories still hold), ranks could load different writings,
    and follow different paths into a deadlock. The newest writing of each step counts; the
    holdings of any other are dropped, with their replicas and parity."""
    writings = [(step, writing) for h in everyone for held in (h.local_writings, h.pfs_writings)
                for step, writing in held.items()]
    writings += [(step, (view.writing.identity, view.writing.created)) for h in everyone
                 for step, view in h.views.items() if view.writing is not None]
    newest = {}
    for step, (identity, created) in writings:
        if step not in newest or created > newest[step][1]:
            newest[step] = (identity, created)
    stale = {step for step, (identity, _) in writings if identity != newest[step][0]}
    if not stale:
        return everyone
    if ctx.rank == 0:
        warn(ctx, f"step(s) {sorted(stale)} were written by more than one run (a job resumed with another "
                    "rank count rewrote them): only the newest writing is used, older copies are ignored")

    def keep(h: Holdings) -> Holdings:
        local = {s: w for s, w in h.local.items() if h.local_writings[s][0] == newest[s][0]}
        return replace(h, local=local,
                       replicas={s: r for s, r in h.replicas.items() if s in local},
                       parity=tuple(s for s in h.parity if s in local),
                       pfs={s: w for s, w in h.pfs.items() if h.pfs_writings[s][0] == newest[s][0]},
                       views={s: v for s, v in h.views.items()
                              if v.writing is None or v.writing.identity == newest[s][0]})
    return [keep(h) for h in everyone]


def _sources_of_every_rank(ctx, everyone: list[Holdings], step: int) -> list[list[str]]:
    """rank -> the levels from which it can get its shard of `step`, cheapest first: every
    rank in one pass (O(ranks x group)), as rank 0 decides for all of them."""
    lacking = set(_lacking_node_local_pieces(ctx, everyone, step))
    erasure_serves = set()
    if ctx.erasure is not None and any(step in h.parity for h in everyone):
        for group in ctx.groups:
            if len(lacking.intersection(group)) <= ctx.parity:
                erasure_serves.update(group)
    every = []
    for rank, mine in enumerate(everyone):
        sources = []
        if mine.local.get(step) == ctx.world_size:
            sources.append("local")
        if ctx.partner is not None and rank in everyone[ctx.partner_of[rank]].replicas.get(step, ()):
            sources.append("partner")
        if rank in erasure_serves:
            sources.append("erasure")
        if step in mine.pfs:
            sources.append("pfs")
        every.append(sources)
    return every


def _surviving_nodes(ctx, everyone: list[Holdings]) -> set[int]:
    """Nodes whose directory still holds checkpoint files (a lost node's directory is gone)."""
    return {ctx.topology.node_of_rank[r] for r, h in enumerate(everyone) if h.node_files}


def _never_completed(ctx, everyone: list[Holdings], step: int) -> bool:
    """Every rank that has no copy of `step` on any level wrote its shard and stopped before
    committing it: the version never was complete, so skipping it loses nothing. A rank
    without even its shard (a lost or replaced node, deleted files) or with an unreadable
    commit record is damage, not this case; nor is a version of another rank count, which
    _missing_message explains."""
    if any(h.local.get(step, ctx.world_size) != ctx.world_size for h in everyone):
        return False
    missing = [r for r, sources in enumerate(_sources_of_every_rank(ctx, everyone, step)) if not sources]
    return bool(missing) and all(step in everyone[r].interrupted for r in missing)


def _candidates(ctx, everyone: list[Holdings], wanted: int | None, excluded=()) -> list[int]:
    steps = set()
    for h in everyone:
        steps.update(h.local)
        steps.update(h.pfs)
        steps.update(h.views)
    if wanted is not None:
        steps &= {wanted}
    steps -= set(excluded)
    return [s for s in sorted(steps, reverse=True) if _route(ctx, everyone, s)]


def _writing(everyone: list[Holdings], step: int) -> Writing | None:
    """The writing of `step` that counts (one per step: _one_writing_per_step), as any rank's
    node-local commit record or L4's tells it."""
    for h in everyone:
        view = h.views.get(step)
        if view is not None and view.writing is not None:
            return view.writing
    return next((h.pfs_geometry[step] for h in everyone if step in h.pfs), None)


def _repartition_plan(ctx, everyone: list[Holdings], step: int) -> RepartitionPlan | None:
    """Where every old rank's shard of `step` comes from, for a restart onto another rank
    count or other nodes (repartition/plan.py)."""
    writing = _writing(everyone, step)
    if writing is None:
        return None
    return plan_repartition(step, writing, [h.views.get(step) for h in everyone],
                            all(step in h.pfs for h in everyone))


def _route(ctx, everyone: list[Holdings], step: int) -> str | None:
    """How `step` can be loaded: "same" (each rank its own shard, from its own copy or its
    redundancy, as the job that wrote it ran), "repartition" (over the old job's shards,
    wherever they survived), or None."""
    writing = _writing(everyone, step)
    if writing is None or (writing.world_size == ctx.world_size and writing.layout_digest == ctx.layout.digest):
        if all(_sources_of_every_rank(ctx, everyone, step)):
            return "same"
    if _never_completed(ctx, everyone, step):
        return None
    plan = _repartition_plan(ctx, everyone, step)
    return "repartition" if plan is not None and plan.complete else None


def _raise_if_nothing_loadable(ctx, everyone: list[Holdings], mode: str, wanted: int | None,
                               newest_anywhere: int | None, failed: dict, ledger) -> None:
    """(rank 0) No candidate version: why, unless this is a fresh start (mode auto and
    nothing stored)."""
    loadable_but_failed = [s for s in _candidates(ctx, everyone, wanted) if s in failed]
    if loadable_but_failed:
        raise UnrecoverableError(
            f"every recoverable version ({loadable_but_failed}) is marked failed after crashed restarts "
            f"(see {ledger.path}); fix the cause (rank logs), then delete a step's entry under \"failed\" "
            "there to try it again")
    if wanted is not None or newest_anywhere is not None:
        step = wanted if wanted is not None else newest_anywhere
        raise UnrecoverableError(_missing_message(ctx, everyone, step))
    if mode == "require":
        raise CheckpointError(
            "--restart require, but no checkpoint version exists under "
            f"{ctx.pfs_dir!r} or the node-local directories; run with --restart auto to start fresh")


def _lacking_node_local_pieces(ctx, everyone: list[Holdings], step: int) -> list[int]:
    """Ranks whose node-local pieces of `step` (their L1 shard written by this rank count, and
    their parity) are not all there: an erasure group rebuilds those members too."""
    return [r for r, h in enumerate(everyone) if not (h.local.get(step) == ctx.world_size and step in h.parity)]


def _missing_message(ctx, everyone: list[Holdings], step: int) -> str:
    missing = [r for r, sources in enumerate(_sources_of_every_rank(ctx, everyone, step)) if not sources]
    writing = _writing(everyone, step)
    if writing is not None and writing.world_size != ctx.world_size:
        plan = _repartition_plan(ctx, everyone, step)
        lost = list(plan.missing) if plan is not None else []
        return (f"checkpoint version {step} (written by {writing.world_size} ranks) cannot be assembled onto "
                f"{ctx.world_size}: the shards of old rank(s) {lost} are on no surviving level (their node-local "
                "copies are gone, not enough replicas or parity are left, and L4 has no copy); restart from an "
                "older version (see hpcckpt inspect) or enable the pfs level")
    node_of = ctx.topology.node_of_rank
    # A node whose directory still holds checkpoint files survived; a rank there that lacks this
    # version usually was still writing it when the job stopped. Calling that a lost node would
    # send the operator looking for a failure that did not happen.
    surviving = _surviving_nodes(ctx, everyone)
    unfinished = [r for r in missing if node_of[r] in surviving]
    lost = [r for r in missing if node_of[r] not in surviving]
    parts = []
    if lost:
        parts.append(f"the shards of rank(s) {lost} on node(s) {sorted({node_of[r] for r in lost})} are on no "
                     "surviving level (those nodes' local copies are gone, not enough replicas or parity are "
                     "left (parity serves only the resilience.group_size and parity that wrote it), and L4 has "
                     "no copy)")
    if unfinished:
        parts.append(f"rank(s) {unfinished} on surviving node(s) {sorted({node_of[r] for r in unfinished})} hold "
                     "no copy of it and no other level has one (most likely the job stopped while they were "
                     "writing it)")
    return (f"checkpoint version {step} cannot be recovered: " + ", and ".join(parts)
            + "; restart from an older version or enable the pfs level")


@dataclass(frozen=True)
class Candidate:
    """A version to try, and what every rank needs to try it."""

    step: int
    route: str  # "same" or "repartition"
    lacking: frozenset  # ranks whose node-local pieces of it are not all there
    writing: Writing | None  # the writing that counts, as a commit record tells it
    pfs_holds: bool  # every rank can read it from L4
    # repartition: what each rank's node-local directory holds of it (one object per node: a
    # node's ranks share it, and the broadcast sends it once).
    views: tuple = ()


@dataclass(frozen=True)
class Outlook:
    """Rank 0's decision, the same on every rank."""

    unfinished: tuple  # versions never complete: deleted before the job writes them again
    failed: dict  # versions marked failed by crashed restarts (the ledger), step -> why
    candidates: tuple  # Candidate, newest first; () for a fresh start
    nodes_with_files: int = 0  # node-local directories holding the run's files (the ledger's evidence)


def plan_restore(ctx, everyone: list[Holdings], mode: str, wanted: int | None, ledger) -> tuple[Outlook, list]:
    """(rank 0) The outlook and, per rank, {step: its sources, cheapest first} for every
    candidate loaded the "same" way. Raises, for every rank, where nothing can be loaded
    that should be."""
    everyone = _one_writing_per_step(ctx, everyone)
    stored = {s for h in everyone for s in (*h.local, *h.pfs)}
    unfinished = tuple(sorted(s for s in stored if _never_completed(ctx, everyone, s)))
    if unfinished:
        warn(ctx, f"version(s) {list(unfinished)} were never complete (the job stopped after some ranks wrote "
                   "their shards and before they committed them): skipped, and written again")
    newest_anywhere = max(stored - set(unfinished), default=None)
    nothing = Outlook(unfinished, {}, ())
    if mode == "never":
        if newest_anywhere is not None:
            raise ConfigError(
                f"--restart never, but the storage already holds checkpoint versions (newest: step "
                f"{newest_anywhere}); resume with --restart auto, or give the run a new run.dir")
        return nothing, [{}] * ctx.world_size
    nodes_with_files = len(_surviving_nodes(ctx, everyone))
    failed = _failed_versions(ctx, ledger, nodes_with_files) if ledger is not None else {}
    steps = _candidates(ctx, everyone, wanted, excluded=failed)
    if not steps:
        _raise_if_nothing_loadable(ctx, everyone, mode, wanted, newest_anywhere, failed, ledger)
        return replace(nothing, failed=failed), [{}] * ctx.world_size
    candidates, sources = [], [{} for _ in range(ctx.world_size)]
    shared_views: dict = {}
    for step in steps:
        route = _route(ctx, everyone, step)
        views = ()
        if route == "same":
            for rank, levels in enumerate(_sources_of_every_rank(ctx, everyone, step)):
                sources[rank][step] = tuple(levels)
        else:
            views = tuple(shared_views.setdefault(v, v) if v is not None else None
                          for v in (h.views.get(step) for h in everyone))
        candidates.append(Candidate(step, route, frozenset(_lacking_node_local_pieces(ctx, everyone, step)),
                                    _writing(everyone, step), all(step in h.pfs for h in everyone), views))
    return Outlook(unfinished, failed, tuple(candidates), nodes_with_files), sources


def _failed_versions(ctx, ledger, nodes_with_files: int) -> dict[int, str]:
    """Versions that made a restart crash; the previous restart's pending entry, if any, is
    one of them now, unless a node was lost under it."""
    settled = ledger.settle_pending(nodes_with_files)
    if settled is not None:
        step, what, failed, counted = settled
        if not counted:
            warn(ctx, f"version {step}: {what}")
        elif failed:
            warn(ctx, f"version {step} is marked failed: {what}; falling back to an older version (the record is "
                       f"in {ledger.path})")
        else:
            warn(ctx, f"version {step}: {what}; it is tried once more (one crash may be a node that died under "
                       "the restart; a second one in a row marks it failed)")
    return ledger.failed_steps()


def warn(ctx, message: str) -> None:
    if ctx.log:
        ctx.log.warning(message) if ctx.rank == 0 else ctx.log.info("warning: " + message)
