"""What a restart moves out of the way before the run writes again: shard files are never
overwritten, so versions the resumed run will write again (newer than the one loaded, never
complete, or another job's geometry) go first. Node-local files are deleted, each level its
own; a committed version on a global level is renamed for inspection, never deleted."""

from __future__ import annotations

from pathlib import Path

from hpcckpt.cluster.collectives import first_of_each, on_root, quiet_barrier
from hpcckpt.levels.base import remove_tree
from hpcckpt.levels.naming import list_version_steps, version_dir_name
from hpcckpt.restore.context import warn


def clear_newer(ctx, restored: int, failed: dict[int, str], ledger=None) -> None:
    """(all ranks) Versions newer than the restored one were not loaded (not complete on every
    rank, failed verification, or marked failed after a crashed restart); the resumed run
    will write those steps again. A failed version's ledger entry goes with its files, or it
    would keep the new writing of that step from ever being loaded."""
    landing = ctx.levels.landing
    if landing is not None:
        newer = sorted(s for s in landing.rank_steps() if s > restored)
        if newer:
            # Said, not silent: a version another rank count wrote is gone once this job goes on.
            warn(ctx, f"rank {ctx.job.rank}: node-local version(s) {newer} cannot be loaded by this job "
                      f"(incomplete, unusable, or written by another rank count); deleted, as the resumed "
                      "run writes those steps again")
        for step in newer:
            ctx.levels.remove_node_local(step)

    def set_aside_globally():
        for level in ctx.levels.global_levels:
            for step in level.uncommitted_steps():
                if step > restored:
                    level.remove(step)
            for step in level.committed_steps():
                if step > restored:
                    aside = level.set_aside(step, ".failed" if step in failed else ".unusable")
                    warn(ctx, f"{level.number} version {step} was not loaded; kept aside as {aside}")
                    if ledger is not None and step in failed:
                        ledger.set_aside(step, aside)
        if ledger is not None:
            for step in sorted(s for s in failed if s > restored):  # node-local only: deleted above
                ledger.set_aside(step, f"v{step:012d} (node-local copies deleted)")

    on_root(ctx.job.comm, f"moving newer versions out of the way under {ctx.run.pfs_dir!r}", set_aside_globally)


def clear_old_geometry(ctx, which) -> list[int]:
    """(all ranks) After a version was loaded over another job's shards: the node-local
    versions `which(step)` picks, every file of every old rank, go. Their names are those
    this job's ranks write (files are never overwritten) and their redundancy was cut for
    ranks and nodes that are gone. Called for the loaded version and newer ones before the
    engine writes it again under this job's geometry, and for older ones once that worked:
    until then they are the fallback. One rank per node-local directory deletes; the global
    levels keep their versions (the engine writes the version there first where they lack
    it). Returns the steps deleted."""
    deleted = set()
    for root in ctx.run.version_roots:  # as many on every rank: one choice of a rank per directory each
        first = first_of_each(ctx.job.comm, (root, ctx.job.node))
        steps = [s for s in list_version_steps(root) if which(s)] if first and ctx.levels.node_local else []
        for step in steps:
            remove_tree(Path(root) / version_dir_name(step))
        deleted.update(steps)
        if steps and ctx.log:
            ctx.log.info(f"deleted node-local version(s) {steps} of the job that ran before (its rank count and "
                         f"placement) from {root}")
    steps = sorted(deleted)
    quiet_barrier(ctx.job.comm)  # no rank writes before every old file is gone
    return steps


def clear_unfinished(ctx, unfinished: list[int]) -> None:
    """(all ranks) A fresh start writes its first steps again, and files are never
    overwritten: what earlier attempts half wrote goes (versions never complete, uncommitted
    leftovers). A committed version is never touched here, an unreadable one included: that
    is damage for the operator to look at, and writing its step again fails naming the file."""
    landing = ctx.levels.landing
    if landing is not None:
        leftovers = set(landing.stray_steps())  # every node-local level's, in one scan
        for step in sorted(set(unfinished) | leftovers):
            ctx.levels.remove_node_local(step)

    def globally():
        for level in ctx.levels.global_levels:
            for step in level.uncommitted_steps():
                level.remove(step)

    on_root(ctx.job.comm, f"removing unfinished versions under {ctx.run.pfs_dir!r}", globally)


def clear_for_a_place_taken(levels, went_on_from: int, log=None) -> list[int]:
    """(a spare that took a dead rank's place, going on from the survivors' memory: no version
    read, so no restart tidied its node) This rank's node-local files that an earlier attempt
    left where it now writes: of versions newer than the step the job goes on from (it writes
    those steps again), and of versions never committed. An idle spare's node is no working
    rank's at a restart, so nothing else removes them. Returns the steps cleared."""
    landing = levels.landing
    if landing is None:
        return []
    steps = sorted({s for s in landing.rank_steps() if s > went_on_from} | set(landing.stray_steps()))
    for step in steps:
        levels.remove_node_local(step)
    if steps and log:
        log.warning(f"rank {landing.rank} took a dead rank's place on a node where an earlier attempt left its "
                    f"files of version(s) {steps} (never committed, or newer than step {went_on_from} the job goes "
                    "on from); deleted, as the run writes those steps again")
    return steps
