"""The node-local stage of a save: the node-local levels due store one version together (the
first, L1's file, on the writer thread while L2 sends and L3 encodes the same bytes) and
commit it with one record per rank. When a rank's node-local storage fails, that rank keeps
nothing of the version there and commits nothing; the version stands on the other nodes
while the redundancy levels (Level.supplies) still deliver that rank's shard from them,
else it fails on every rank (save/save_plan.py decides; the pipeline degrades or retries)."""

from __future__ import annotations

import time
from typing import Callable

from hpcckpt.save.room import out_of_space
from hpcckpt.save.save_plan import partial_version_stands
from hpcckpt.save.stages import RoomOnce, StageRunner, note_failures
from hpcckpt.cluster.collectives import agree_per_rank, is_storage_failure
from hpcckpt.errors import CheckpointError


class NodeLocalStage:
    """(all ranks) `make_manifest(snapshot, shard_infos, level names)` builds the commit
    record; `pruner` deletes what a failed version left (save/pruning.py)."""

    def __init__(self, runner: StageRunner, node_local: tuple, make_manifest: Callable, pruner,
                 one_write_at_a_time: bool):
        self.runner = runner
        self.rank = runner.rank
        self.world_size = runner.comm.Get_size()
        self.node_local = node_local
        self.make_manifest = make_manifest
        self.pruner = pruner
        self.one_write_at_a_time = one_write_at_a_time

    @property
    def label(self) -> str:
        """The node-local levels fail and recover together: one version directory, one commit
        record per rank."""
        return "node-local " + " ".join(level.number for level in self.node_local)

    def run(self, v, levels: tuple, names: tuple, room: RoomOnce):
        """Store and commit the version in flight `v` (save_types.VersionInFlight) on `levels`;
        `names`: every level it is due on, for its commit record. Returns (the commit record,
        {rank: why} of the ranks whose node could not take its part, the same on every rank)."""
        step = v.step
        try:
            lacking = self._store(v.version, levels, v.report, v.started)
            self._raise_unless_supplied(step, levels, lacking, room)
            manifest = self.make_manifest(v.snapshot, v.shard_infos, names)

            def commit():
                if self.rank not in lacking:
                    for level in levels:
                        level.commit(manifest)
            _, failed = agree_per_rank(self.runner.comm, "L1-L3 commit", commit, step=step)
            note_failures(lacking, failed, "commit record")
            self._raise_unless_supplied(step, levels, lacking, room)
        except CheckpointError as exc:
            self.runner.withdraw(step, levels)
            if is_storage_failure(exc):
                # What the ranks wrote of it goes now, not at the next retention: a full disk
                # is when writes fail. (After any other failure a file may be in the way that
                # no level wrote: it stays for the operator to see.)
                self.pruner.prune("node-local", lambda: self.pruner.remove_node_local(step))
            raise
        if self.rank in lacking:
            self.runner.withdraw(step, levels)
            self.pruner.prune("node-local", lambda: self.pruner.remove_node_local(step))
            self.pruner.committed_without_me.add(step)
        return manifest, lacking

    def _store(self, version, levels: tuple, report, started: float) -> dict:
        """The first level stores on the writer thread while the others send and encode the
        same bytes; with one write at a time it finishes first. Returns {rank: why} of the
        ranks whose node's storage failed in some level (each rank goes on with the others'
        transfers: they need its bytes); any other failure raises."""
        step = version.step
        lacking: dict = {}
        first, rest = levels[0], levels[1:]
        report.started_s[first.name] = time.perf_counter() - started
        writing = self.runner.start_background(first, version)
        try:
            if self.one_write_at_a_time:
                self.runner.finish_background(first, step, writing, report, started, lacking)
            for level in rest:
                report.started_s[level.name] = time.perf_counter() - started
                stored, failed = self.runner.per_rank(step, level, version)
                note_failures(lacking, failed, level.stage_label)
                if self.rank not in failed:
                    self.runner.mark(report, step, level.name, started, stored)
            if not self.one_write_at_a_time:
                self.runner.finish_background(first, step, writing, report, started, lacking)
        finally:
            writing.done.wait()  # never leave while the writer still reads the snapshot
        return lacking

    def _raise_unless_supplied(self, step: int, levels: tuple, lacking: dict, room: RoomOnce) -> None:
        """(all ranks) The version stands with some ranks' parts missing while the redundancy
        levels due supply those ranks' shards from the others' files and no level that ran
        out of space can make room to take it whole; else the stage fails, agreed (a storage
        failure, which degrades, or makes room and tries once more)."""
        if not lacking:
            return
        lost = frozenset(lacking)
        supplied = frozenset().union(*(level.supplies(lost) for level in levels))
        failure = CheckpointError(self.partial_failure(step, lacking), lacking, collective=True)
        if partial_version_stands(lost, supplied) and not (out_of_space(failure) and not room.tried and room()):
            return
        raise failure

    def partial_failure(self, step: int, lacking: dict) -> str:
        first = lacking[min(lacking)]
        who = f"rank(s) {sorted(lacking)}" if len(lacking) < self.world_size else f"all {self.world_size} ranks"
        return f"{self.label} write of step {step} failed on {who}: {first}"

    def held_despite(self, levels: tuple, lacking: dict) -> str:
        """Where a version stands that some ranks' nodes could not take (for the warning)."""
        lost = frozenset(lacking)
        supplying = [level.label for level in levels if level.supplies(lost)]
        return (f"{self.label} (the shard of rank(s) {sorted(lost)} by {' and '.join(supplying)} "
                "from other nodes)")
