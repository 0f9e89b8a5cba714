"""The restore's "agree" step, decided once at rank 0, so no rank exchanges O(ranks) with
every other: which versions can be loaded, how, and from which level each rank reads its shard.

Every rank lists what it can reach (restore/discover.py: a Holdings, O(versions) in size) and
rank 0 gathers them: O(ranks) there. It picks the candidate versions, newest first, each with
its route ("same": every rank its own shard, as the job that wrote it ran; "repartition": over
the old job's shards, wherever they survived) and what every rank needs to try it: the shared
part (the ranks whose node-local pieces are gone, the writing, and for a repartition what
each node-local directory holds) broadcast, and each rank's own sources scattered: the levels
of the stack that can deliver its shard, in the stack's order. What a level can deliver is the
level's own rule (Level.serves); nothing here knows one level from another. No rank receives
every rank's holdings. Pure functions over the gathered holdings, no MPI, no I/O.

`ctx` (restore/context.py) needs: job.world_size, job.layout (its digest), job.topology
(node_of_rank), job.rank and log (warnings), levels (the stack: name, node_local, serves) and
run.pfs_dir (named in messages).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpcckpt.errors import CheckpointError, ConfigError, StartOverInNewProcesses, UnrecoverableError
from hpcckpt.levels.survey import Writing
from hpcckpt.repartition.plan import RepartitionPlan, plan_repartition
from hpcckpt.restore.context import warn
from hpcckpt.restore.discover import Holdings
from hpcckpt.run.ledger import CHANCE_EXPLAINED


def _one_writing_per_step(ctx, everyone: list[Holdings]) -> list[Holdings]:
    """Where two runs wrote the same step (a job resumed on fewer ranks rewrites steps whose
    older files other ranks' directories still hold), ranks could load different writings,
    and follow different paths into a deadlock. The newest writing of each step counts; the
    holdings of any other are dropped, with what the levels supply of it."""
    writings = [(step, writing.identity, writing.created) for h in everyone for held in h.written.values()
                for step, writing in held.items()]
    writings += [(step, view.writing.identity, view.writing.created) for h in everyone
                 for step, view in h.views.items() if view.writing is not None]
    newest = {}
    for step, identity, created in writings:
        if step not in newest or created > newest[step][1]:
            newest[step] = (identity, created)
    stale = {step for step, identity, _ in writings if identity != newest[step][0]}
    if not stale:
        return everyone
    if ctx.job.rank == 0:
        warn(ctx, f"step(s) {sorted(stale)} were written by more than one run (a job resumed with another "
                  "rank count rewrote them): only the newest writing is used, older copies are ignored")

    def keep(h: Holdings) -> Holdings:
        written = {level: {s: w for s, w in held.items() if w.identity == newest[s][0]}
                   for level, held in h.written.items()}
        supplies = {level: {s: r for s, r in held.items() if s in written.get(level, {})}
                    for level, held in h.supplies.items()}
        return replace(h, written=written, supplies=supplies,
                       views={s: v for s, v in h.views.items()
                              if v.writing is None or v.writing.identity == newest[s][0]})
    return [keep(h) for h in everyone]


class Gathered(list):
    """Every rank's holdings at rank 0, indexed by rank, with what the plan asks about one
    version worked out once per step: each level's holdings of it by rank, the ranks whose
    own shard is on their node, and where each rank can take its shard from."""

    def __init__(self, ctx, everyone):
        super().__init__(everyone)
        self.ctx = ctx
        self._supplies = {level.name: [h.supplies.get(level.name, {}) for h in self] for level in ctx.levels}
        self._held: dict = {}
        self._intact: dict = {}
        self._sources: dict = {}
        # step -> the rank counts its node-local commit records name (one record per rank
        # serves every node-local level: the same object, looked at once).
        self.node_local_sizes: dict = {}
        node_local = [level.name for level in ctx.levels.node_local]
        for h in self:
            seen = set()
            for name in node_local:
                for step, writing in h.written.get(name, {}).items():
                    if id(writing) not in seen:
                        seen.add(id(writing))
                        self.node_local_sizes.setdefault(step, set()).add(writing.world_size)

    def held(self, level, step: int) -> list[frozenset]:
        key = (level.name, step)
        if key not in self._held:
            self._held[key] = [supplies.get(step, _NONE) for supplies in self._supplies[level.name]]
        return self._held[key]

    def intact(self, step: int) -> frozenset[int]:
        """Ranks whose own shard of `step` is on their node, as this job's rank count wrote it."""
        if step not in self._intact:
            own = set()
            for level in self.ctx.levels.node_local:
                own.update(r for r, held in enumerate(self.held(level, step)) if r in held)
            self._intact[step] = frozenset(own)
        return self._intact[step]

    def lacking(self, step: int, level) -> frozenset[int]:
        """Ranks whose node-local pieces of `step` for `level` are not all there: their own
        shard, or what they hold of it on that level (a group rebuilds those members too)."""
        intact = self.intact(step)
        return frozenset(r for r, held in enumerate(self.held(level, step)) if not held or r not in intact)

    def lacking_by_level(self, step: int) -> dict[str, frozenset]:
        """level -> lacking, for every collective level (the ones that deliver over peers)."""
        return {level.name: self.lacking(step, level) for level in self.ctx.levels if level.collective}

    def sources(self, step: int) -> list[list[str]]:
        """rank -> the levels from which it can get its shard of `step`, in the stack's order
        (cheapest first): every rank in one pass, each level's rule over everyone's holdings."""
        if step not in self._sources:
            every = [[] for _ in self]
            for level in self.ctx.levels:
                lacking = self.lacking(step, level) if level.collective else frozenset()
                for rank in level.serves(self.held(level, step), lacking):
                    if rank < len(every):
                        every[rank].append(level.name)
            self._sources[step] = every
        return self._sources[step]


_NONE = frozenset()


def _sources_of_every_rank(ctx, everyone, step: int) -> list[list[str]]:
    gathered = everyone if isinstance(everyone, Gathered) else Gathered(ctx, everyone)
    return gathered.sources(step)


def _surviving_nodes(ctx, everyone: list[Holdings]) -> set[int]:
    """Nodes whose directory still holds checkpoint files (a lost node's directory is gone)."""
    return {ctx.job.topology.node_of_rank[r] for r, h in enumerate(everyone) if h.node_files}


def _never_completed(ctx, everyone: list[Holdings], step: int) -> bool:
    """Every rank that has no copy of `step` on any level wrote its shard and stopped before
    committing it: the version never was complete, so skipping it loses nothing. A rank
    without even its shard (a lost or replaced node, deleted files) or with an unreadable
    commit record is damage, not this case; nor is a version of another rank count, which
    _missing_message explains."""
    if everyone.node_local_sizes.get(step, {ctx.job.world_size}) != {ctx.job.world_size}:
        return False
    missing = [r for r, sources in enumerate(_sources_of_every_rank(ctx, everyone, step)) if not sources]
    return bool(missing) and all(step in everyone[r].interrupted for r in missing)


def _candidates(ctx, everyone: list[Holdings], wanted: int | None, excluded=()) -> list[int]:
    steps = _stored(everyone)
    for h in everyone:
        steps.update(h.views)
    if wanted is not None:
        steps &= {wanted}
    steps -= set(excluded)
    return [s for s in sorted(steps, reverse=True) if _route(ctx, everyone, s)]


def _stored(everyone: list[Holdings]) -> set[int]:
    """Every step some level committed, as some rank reads it."""
    return {step for h in everyone for held in h.written.values() for step in held}


def _writing(everyone: list[Holdings], step: int) -> Writing | None:
    """The writing of `step` that counts (one per step: _one_writing_per_step), as any rank's
    node-local commit record or a level's tells it."""
    for h in everyone:
        view = h.views.get(step)
        if view is not None and view.writing is not None:
            return view.writing
    return next((w for h in everyone for held in h.written.values() for w in [held.get(step)] if w), None)


def whole_on(ctx, everyone: list[Holdings], step: int) -> str | None:
    """The global level on which every rank reads `step`'s commit record (any rank reads any
    shard there), if one does."""
    return next((level.name for level in ctx.levels.global_levels
                 if all(h.writing(level.name, step) is not None for h in everyone)), None)


def _repartition_plan(ctx, everyone: list[Holdings], step: int) -> RepartitionPlan | None:
    """Where every old rank's shard of `step` comes from, for a restart onto another rank
    count or other nodes (repartition/plan.py)."""
    writing = _writing(everyone, step)
    if writing is None:
        return None
    return plan_repartition(step, writing, [h.views.get(step) for h in everyone],
                            whole_on(ctx, everyone, step) is not None)


def _route(ctx, everyone: list[Holdings], step: int) -> str | None:
    """How `step` can be loaded: "same" (each rank its own shard, from its own copy or its
    redundancy, as the job that wrote it ran), "repartition" (over the old job's shards,
    wherever they survived), or None."""
    writing = _writing(everyone, step)
    if writing is None or (writing.world_size == ctx.job.world_size and writing.layout_digest == ctx.job.layout.digest):
        sources = _sources_of_every_rank(ctx, everyone, step)
        if all(sources):
            from_pfs = _ranks_only_on_global_levels(ctx, sources)
            if not from_pfs or writing is None:
                return "same"
            # The same route finds a rank's redundancy by this job's placement. A rank now on
            # another node than the one that wrote its shard (a spare in a dead rank's place)
            # has other partners and another erasure group than the writer had, so that
            # route reads its shard from the PFS; the old shards' route finds its node-local
            # copies by the writer's placement. Planned only then: it looks at every node's
            # holdings for every old rank.
            plan = _repartition_plan(ctx, everyone, step)
            if plan is not None and plan.complete and _shards_read_from_global_levels(plan) < from_pfs:
                return "repartition"
            return "same"
    if _never_completed(ctx, everyone, step):
        return None
    plan = _repartition_plan(ctx, everyone, step)
    return "repartition" if plan is not None and plan.complete else None


def _ranks_only_on_global_levels(ctx, sources: list[list[str]]) -> int:
    """How many ranks can get their own shard from no node-local level (only from L4)."""
    node_local = {level.name for level in ctx.levels.node_local}
    return sum(1 for levels in sources if not node_local.intersection(levels))


def _shards_read_from_global_levels(plan: RepartitionPlan) -> int:
    """How many old shards `plan` reads from L4 (the sources no new rank provides)."""
    return sum(1 for source in plan.sources if source is not None and source.provider is None)


def _raise_if_nothing_loadable(ctx, everyone: list[Holdings], mode: str, wanted: int | None,
                               newest_anywhere: int | None, failed: dict, ledger) -> int | None:
    """(rank 0) No candidate version: why, unless this is a fresh start (mode auto and
    nothing stored), or a start over where the configuration allows one after every stored
    version was lost (returns the newest of them)."""
    loadable_but_failed = [s for s in _candidates(ctx, everyone, wanted) if s in failed]
    if loadable_but_failed:
        raise UnrecoverableError(
            f"every recoverable version ({loadable_but_failed}) is marked failed after crashed restarts "
            f"(see {ledger.path}); fix the cause (rank logs), then delete a step's entry under \"failed\" "
            "there to try it again")
    if wanted is None and mode == "auto" and newest_anywhere is not None and ctx.unrecoverable != "stop":
        lost = _missing_message(ctx, everyone, newest_anywhere)
        if ctx.unrecoverable == "relaunch":
            raise StartOverInNewProcesses(
                f"{lost}; resilience.unrecoverable = \"start_over\": this job's processes went on after ranks died "
                "and hold the lost run's state, so the job ends for a relaunch, which starts the run over")
        warn(ctx, f"{lost}; resilience.unrecoverable = \"start_over\": every stored version is lost, and the run "
                  "starts again from its beginning (what the lost versions left is cleared)")
        return newest_anywhere
    if wanted is not None:
        raise UnrecoverableError(_missing_message(ctx, everyone, wanted))
    if newest_anywhere is not None:
        raise UnrecoverableError(f"{_missing_message(ctx, everyone, newest_anywhere)} (resilience.unrecoverable = "
                                 "\"start_over\" starts the run again from its beginning instead)")
    if mode == "require":
        raise CheckpointError(
            "--restart require, but no checkpoint version exists under "
            f"{ctx.run.pfs_dir!r} or the node-local directories; run with --restart auto to start fresh")


def _missing_message(ctx, everyone: list[Holdings], step: int) -> str:
    missing = [r for r, sources in enumerate(_sources_of_every_rank(ctx, everyone, step)) if not sources]
    writing = _writing(everyone, step)
    if writing is not None and writing.world_size != ctx.job.world_size:
        plan = _repartition_plan(ctx, everyone, step)
        lost = list(plan.missing) if plan is not None else []
        return (f"checkpoint version {step} (written by {writing.world_size} ranks) cannot be assembled onto "
                f"{ctx.job.world_size}: the shards of old rank(s) {lost} are on no surviving level (their node-local "
                "copies are gone, not enough replicas or parity are left, and L4 has no copy); restart from an "
                "older version (see hpcckpt inspect) or enable the pfs level")
    node_of = ctx.job.topology.node_of_rank
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
    lacking: dict  # collective level -> ranks whose node-local pieces of it are not all there
    writing: Writing | None  # the writing that counts, as a commit record tells it
    whole_on: str | None  # the global level every rank reads it from, if any
    # repartition: what each rank's node-local directory holds of it (one object per node: a
    # node's ranks share it, and the broadcast sends it once).
    views: tuple = ()
    tables: tuple = ()  # TableMember of each version its keyed tables need, oldest first


@dataclass(frozen=True)
class TableMember:
    """One version of a candidate's table chain (format/keyed_rows.py), as a repartitioning
    read of its old shards needs it (restore/tables.py)."""

    step: int
    writing: Writing
    views: tuple  # what each rank's node-local directory holds of it
    whole_on: str | None  # the global level every rank reads it from, if any


@dataclass(frozen=True)
class Outlook:
    """Rank 0's decision, the same on every rank."""

    unfinished: tuple  # versions never complete: deleted before the job writes them again
    failed: dict  # versions marked failed by crashed restarts (the ledger), step -> why
    candidates: tuple  # Candidate, newest first; () for a fresh start
    nodes_with_files: int = 0  # node-local directories holding the run's files (the ledger's evidence)
    # Starting over (resilience.unrecoverable): the newest of the stored versions none of
    # which can be recovered; the restore clears what they left. None otherwise.
    lost_everything_up_to: int | None = None


def plan_restore(ctx, everyone: list[Holdings], mode: str, wanted: int | None, ledger) -> tuple[Outlook, list]:
    """(rank 0) The outlook and, per rank, {step: its sources, cheapest first} for every
    candidate loaded the "same" way. Raises, for every rank, where nothing can be loaded
    that should be."""
    everyone = Gathered(ctx, _one_writing_per_step(ctx, everyone))
    stored = _stored(everyone)
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
        return nothing, [{}] * ctx.job.world_size
    nodes_with_files = len(_surviving_nodes(ctx, everyone))
    failed = _failed_versions(ctx, ledger, nodes_with_files) if ledger is not None else {}
    steps = _candidates(ctx, everyone, wanted, excluded=failed)
    if not steps:
        lost = _raise_if_nothing_loadable(ctx, everyone, mode, wanted, newest_anywhere, failed, ledger)
        return replace(nothing, failed=failed, lost_everything_up_to=lost), [{}] * ctx.job.world_size
    candidates, sources = [], [{} for _ in range(ctx.job.world_size)]
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
        tables = _table_members(ctx, everyone, step, shared_views, failed)
        if tables is None:
            continue
        candidates.append(Candidate(step, route, everyone.lacking_by_level(step), _writing(everyone, step),
                                    whole_on(ctx, everyone, step), views, tables))
    if not candidates:
        raise UnrecoverableError(f"no checkpoint version can be loaded: the keyed tables of every one ({steps}) need a "
                                 "version of their chain that no level holds whole; see the warnings above")
    return Outlook(unfinished, failed, tuple(candidates), nodes_with_files), sources


def _table_members(ctx, everyone: list[Holdings], step: int, shared_views: dict, failed) -> tuple | None:
    """Each version `step`'s keyed tables need (its chain), with what reading it takes; None
    (said) when one of them cannot be assembled from what survives."""
    writing = _writing(everyone, step)
    chain = writing.table_chain if writing is not None else ()
    members = []
    for member in chain:
        member_writing = writing if member == step else _writing(everyone, member)
        plan = _repartition_plan(ctx, everyone, member) if member_writing is not None else None
        if member in failed or plan is None or not plan.complete or member_writing.table_chain != \
                chain[:chain.index(member) + 1]:
            warn(ctx, f"version {step} is skipped: its tables need version {member} (their chain is {list(chain)}), "
                      "which cannot be assembled from what survives")
            return None
        views = tuple(shared_views.setdefault(v, v) if v is not None else None
                      for v in (h.views.get(member) for h in everyone))
        members.append(TableMember(member, member_writing, views, whole_on(ctx, everyone, member)))
    return tuple(members)


def _failed_versions(ctx, ledger, nodes_with_files: int) -> dict[int, str]:
    """Versions that made a restart crash; the previous restart's pending entry, if any, is
    one of them now, unless a node was lost under it."""
    settled = ledger.settle_pending(nodes_with_files, ctx.failures_per_second)
    if settled is not None:
        step, what = settled.step, settled.reason
        if not settled.counted:
            warn(ctx, f"version {step}: {what}")
        elif settled.failed:
            warn(ctx, f"version {step} is marked failed: {what}; falling back to an older version (the record is "
                       f"in {ledger.path})")
        elif settled.crashes == 1:
            warn(ctx, f"version {step}: {what}; it is tried once more (one crash may be a node that died under "
                       "the restart; a second one in a row marks it failed"
                       f"{' unless failures as frequent as configured explain both' if ctx.failures_per_second else ''})")
        else:
            warn(ctx, f"version {step}: {what}; it is tried again (failures as frequent as configured explain its "
                       f"crashes in a row with a chance of {100 * CHANCE_EXPLAINED:g} % or more)")
    return ledger.failed_steps()
