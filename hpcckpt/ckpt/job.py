"""What the checkpointer builds from a communicator: the job as its ranks see it.

    job = CommJob(comm, config, registry, log, faults)   # (all ranks) collective
    job.comm, job.topology, job.storage (the level stack), job.arrays (the layout and
    snapshot buffers over the application's registry), job.pipeline, job.schedule, job.tally
    job.close()

Everything here follows from the communicator: which node each rank is on, the partners and
erasure groups, the levels' directories, the layout of the protected arrays over the ranks,
the save pipeline's threads, the schedule's agreement (its own duplicate). What the
application handed over (ckpt/registry.py: arrays, tables, state) is not: it outlives this
object, and another communicator (the survivors of a failure) builds another CommJob over
the same registry.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcckpt.ckpt.capture import SnapshotCapture
from hpcckpt.ckpt.memory_forecast import MemoryTier, rank_need, warn_if_short
from hpcckpt.ckpt.snapshot import ProtectedArrays
from hpcckpt.cluster.collectives import quiet_barrier
from hpcckpt.cluster.placement import discover_topology
from hpcckpt.errors import CheckpointError, ConfigError, StorageError
from hpcckpt.exit_record import record_started
from hpcckpt.format.layout import Layout
from hpcckpt.format.manifest import record_peers
from hpcckpt.levels.node_places import RAM_FILE_SYSTEMS, file_system_type
from hpcckpt.run.job_storage import JobStorage, RunClaim
from hpcckpt.save.commit_record import CommitRecords
from hpcckpt.save.pipeline import SavePipeline
from hpcckpt.save.save_types import PipelineSettings, SaveJob
from hpcckpt.schedule.checkpoint_schedule import CheckpointSchedule
from hpcckpt.schedule.stopping import HALT_FILE_NAME
from hpcckpt.schedule.tally import CheckpointTally


def require_running_mpi() -> None:
    """A checkpointer needs MPI started and not yet finalized: bad input otherwise (exit 2)."""
    from mpi4py import MPI

    if MPI.Is_finalized():
        raise ConfigError("MPI was finalized already: create and close the Checkpointer before MPI_Finalize")
    if not MPI.Is_initialized():
        raise ConfigError("MPI is not running: create the Checkpointer once MPI has started (after your framework "
                          "started it, e.g. at its first grid, or after from mpi4py import MPI; MPI.Init_thread()) "
                          "and close it before MPI_Finalize")


class CommJob:
    def __init__(self, comm, config, registry, log, faults, *, topology=None, read_only: bool = False,
                 catch_signals: bool = True):
        """(all ranks) Collective: claims the run (run/lease.py), checks storage on every rank
        and fails together; `comm` is duplicated, so checkpoint traffic never meets the
        application's."""
        from mpi4py import MPI

        self.comm = comm.Dup()
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.log = log
        self.chunk_bytes = config.checkpoint.chunk_bytes
        self.keep_local = config.checkpoint.keep_local
        self.topology = topology or discover_topology(comm, config.simulated_nodes, config.failure_domains,
                                                      config.simulated_domains)
        self.node = self.topology.node_of_rank[self.rank]
        record_started(self.comm)  # the job script's start-up watchdog: every rank is through MPI_Init
        self.claim = RunClaim(self.comm, config, JobStorage.pfs_dir_for(config), log, read_only)
        self.run = self.claim.identity
        self.schedule = None
        try:
            self.storage = JobStorage(self.comm, config, self.topology, self.run, log, faults)
            self.arrays = ProtectedArrays(self.comm, registry, config.checkpoint.split_threshold_kb * 1024,
                                          config.checkpoint.gpu_snapshot, {"node": self.node}, log)
            self.capture = SnapshotCapture(self.arrays)
            settings = PipelineSettings.from_config(config)
            records = CommitRecords(self.arrays, self.world_size, self.topology.node_of_rank, self.storage.local_dirs,
                                    self.partner_of, self.groups, self.storage.redundancy.parity, self.run.run_id,
                                    config.recorded, *self._domains_recorded())
            save_job = SaveJob(log, threaded=MPI.Query_thread() >= MPI.THREAD_MULTIPLE, lease=self.claim.lease,
                               record_peers=record_peers(self.rank, self.partner_of, self.topology.node_of_rank,
                                                         self.groups),
                               node_sharers=self.storage.memory_sharers)
            self.pipeline = SavePipeline(self.comm, self.storage.levels, settings, records, self.arrays, save_job)
            self.storage.prepare(read_only)
            self.storage.log_placement()
            own_pace = self.pipeline.flush is not None
            level_specs = tuple((level.name, level.survives_nodes, own_pace and not level.node_local)
                                for level in self.storage.levels)
            self.schedule = CheckpointSchedule(comm, config.checkpoint, end_time=config.end_time,
                                               halt_seconds=config.halt_seconds,
                                               halt_file=Path(config.run_dir) / HALT_FILE_NAME, log=log,
                                               catch_signals=catch_signals and not read_only,
                                               resilience=config.resilience, levels=level_specs,
                                               fixed_every=settings.every,
                                               confirm_after_steps=config.checkpoint.confirm_after_steps)
            self.tally = CheckpointTally(log)
        except BaseException:
            if self.schedule is not None:
                self.schedule.close()
            self.claim.release()
            raise

    levels = property(lambda self: self.storage.levels)
    partner_of = property(lambda self: self.storage.partner_of)
    groups = property(lambda self: self.storage.groups)

    def _domains_recorded(self) -> tuple[tuple, tuple]:
        """(domain of each rank, domain names) for the commit records; empty where every node
        is a domain of its own."""
        if not self.topology.has_domains:
            return (), ()
        return self.topology.domain_of_rank, self.topology.domain_names

    def restart_step_clock(self) -> None:
        """The application's step begins now, beside what the save pipeline runs (a persist,
        a copy at the global levels' own pace, a restored version written again)."""
        pipeline = self.pipeline
        self.schedule.restart_clock(pipeline.persisting, pipeline.copying_at_own_pace, pipeline.working_behind)

    def ensure_layout(self) -> Layout:
        """(all ranks, the first time) The layout and the snapshot buffers; then whether the
        nodes have the host memory that checkpointing will take (ckpt/memory_forecast.py)."""
        if self.arrays.layout is not None:
            return self.arrays.layout
        layout = self.arrays.ensure_layout()
        tier = self._memory_tier()
        # The versions kept and the one being written before the oldest goes.
        need = rank_need(self.arrays.snapshot_bytes, self.levels, self.chunk_bytes,
                         self.keep_local + 1 if tier is not None else 0)
        warn_if_short(self.comm, self.node, need, self.log, tier)
        return layout

    def _memory_tier(self) -> MemoryTier | None:
        """This node's memory directory where its files take the node's RAM (None otherwise)."""
        places = self.storage.places
        if places.memory is None or file_system_type(places.memory) not in RAM_FILE_SYSTEMS:
            return None
        return MemoryTier(places.budget_bytes, places.memory_used())

    def l4_copying(self, step: int) -> bool:
        """L4 is copying version `step` at its own pace right now."""
        flush = self.pipeline.flush
        return flush is not None and flush.flushing == step

    def finish_in_flight(self, settle):
        """The checkpoint in flight and the copy to L4 running at its own pace, both over;
        `settle(held)` learns whether some level holds the version (False: failed)."""
        self.capture.copies_done()
        report = self.persist_over(settle)
        self.pipeline.wait_for_global_levels()
        return report

    def persist_over(self, settle):
        """The checkpoint in flight over; `settle(held)` as in finish_in_flight."""
        try:
            report = self.pipeline.finish_in_flight()
        except BaseException:
            settle(False)
            raise
        if report is not None:
            settle(report.held)
        return report

    def drain(self) -> list[int]:
        """(all ranks) Checkpointer.drain's copies (see there); the in-flight work is over."""
        landing = self.levels.landing
        if landing is None or not self.levels.global_levels:
            return []
        try:
            return [step for target in self.levels.global_levels for step in self.pipeline.drain(landing, target)]
        except CheckpointError as exc:
            # The node-local versions are intact; they go with the allocation, so this is the
            # job's to retry (exit 3) while they are still there, once the PFS takes writes.
            error = StorageError(f"the end-of-run copy to L4 failed: {exc}; the newest versions are on node-local "
                                 "storage only. Free space on the PFS (or fix it) and run the job again before the "
                                 "allocation ends: it resumes from node-local storage and copies them",
                                 collective=True)
            raise error from None

    def require_newest_on_global_levels(self, newest: int | None) -> None:
        """(all ranks) After the end-of-run drain: every global level holds version `newest`,
        the newest checkpoint() took; a StorageError (exit 3) naming it and where it is otherwise."""
        if newest is None or not self.levels.global_levels:
            return
        from hpcckpt.cluster.collectives import on_root

        def where() -> tuple[list, list]:
            return ([level.number for level in self.levels.global_levels if newest not in level.committed_steps()],
                    [level.number for level in self.levels.node_local if newest in level.committed_steps()])
        lacking, held = on_root(self.comm, "listing the levels' versions", where)
        if lacking:
            there = f"rank 0's node holds it on {', '.join(held)}" if held else "rank 0's node does not hold it"
            raise StorageError(f"the run's newest version ({newest}) is not on {', '.join(lacking)} after the "
                               f"end-of-run copy ({there}; the rank logs say why); run the job again before the "
                               "allocation ends: it resumes from the newest version it can load and copies it",
                               collective=True)

    def release_memory(self) -> None:
        """(all ranks) After a run that finished and whose newest version L4 holds (the drain):
        the versions in memory (storage.memory_dir) would hold the nodes' RAM until they reboot,
        so this run's directory there goes (one rank per node). Without L4 they are the run's
        newest copies: they stay, and rank 0 says what they hold."""
        storage = self.storage
        if storage.memory_dir is None:
            return
        if not self.levels.global_levels:
            if self.rank == 0 and self.log:
                self.log.warning(f"the versions in memory ({storage.memory_dir} on each node) stay: with no L4 they "
                                 "are this run's newest copies, and they hold the nodes' RAM until they reboot or "
                                 "you delete them")
            return
        self.pipeline.wait_for_global_levels()
        quiet_barrier(self.comm)  # no rank of the node still copies from there
        if storage.first_in_memory_dir:
            shutil.rmtree(storage.memory_dir, ignore_errors=True)
        if self.rank == 0 and self.log:
            self.log.info(f"the run finished and L4 holds its newest version: deleted its versions in memory "
                          f"({storage.memory_dir} on each node)")

    def report_stop(self, drained: bool) -> None:
        """The run stopped on request: where its final version is, said once; the halt file
        that asked for the stop removed, so the next job goes on."""
        step, final_step, reason = self.tally.last_checkpoint, self.schedule.final_step, self.schedule.stopping
        if step != final_step:
            where = (f"no checkpoint was taken at the stop (due() said one was due), so this run resumes from "
                     f"{'version ' + str(step) if step is not None else 'its newest earlier version'}")
        elif self.levels.global_levels and drained:
            where = f"its final checkpoint (step {step}) is durable on the PFS ({self.storage.pfs_dir})"
        else:
            where = (f"its final checkpoint (step {step}) is on node-local storage only (the PFS level is "
                     f"{'not drained' if self.levels.global_levels else 'off'}), so it survives only on these "
                     "nodes")
        self.log.info(f"stopped cleanly after step {final_step}: {reason}; {where}; run the job again to continue",
                      console=True)
        self.log.metrics({"event": "halted", "step": final_step, "reason": reason})
        removed = self.schedule.stops.consume_halt_file()
        if removed:
            self.log.info(f"removed the halt file {removed}: the next job of this run goes on", console=True)

    def communicators(self) -> list:
        """Every communicator derived from the application's: what a process failure must
        revoke so that no survivor stays blocked in one of the library's collectives (its
        threads' included)."""
        schedule, erasure, flush = self.schedule, self.levels.erasure, self.pipeline.flush
        found = [self.comm, schedule.comm if schedule else None, schedule.stops.comm if schedule else None,
                 erasure.comm if erasure is not None else None, flush.comm if flush is not None else None,
                 *self.arrays.copy_groups.communicators()]
        return [comm for comm in found if comm is not None]

    def abandon(self) -> list[str]:
        """After ranks died, once communicators() are revoked: stop the threads (what they were
        doing fails on the revoked communicators) and give back the signals and the run's lease,
        with no collective and without freeing the revoked communicators. The version in flight
        is not trusted by anyone: its commit records never completed. Returns what failed on
        the way for another reason than the revoke or the death (those are what abandoning
        means), for the log. Once the pipeline's threads stopped, the snapshot buffer is left
        to the next checkpointer of this process (io/inherited_memory.py)."""
        failures = []
        if _attempt_while_abandoning("stopping the save pipeline", self.pipeline.stop, failures):
            self.arrays.leave_memory()  # no thread of the pipeline can touch the snapshot any more
        _attempt_while_abandoning("ending the stop signals' exchange", self.schedule.stops.close, failures)
        _attempt_while_abandoning("handing back the run's lease", self.claim.release, failures)
        self.comm = None
        return failures

    def read_ahead_for(self, lost: frozenset[int]) -> None:
        """(a survivor, after abandon(), this rank alone) Ranks `lost` (this job's numbering)
        died: the files from which this rank will deliver their shards to the survivors' restore
        (a partner's replica, written past the page cache) are read into the page cache now,
        behind the shrink and the new checkpointer's set-up, instead of from the disk while
        the restore waits on them. Advice: what it cannot read, the restore reads itself."""
        from hpcckpt.io.mapped import read_into_page_cache_behind

        try:
            paths = [path for level in self.levels.node_local for path in level.delivering_files(lost)]
        except OSError:  # a directory the restore will find unreadable too, and say so
            return
        if paths:
            read_into_page_cache_behind(paths)

    def close(self) -> None:
        """Stop the threads, release the storage, the schedule, the communicators and the run."""
        try:
            self.pipeline.stop()
            self.storage.close()
            self.schedule.close()
            self.arrays.copy_groups.close()
        finally:
            if self.comm is not None:
                self.comm.Free()
                self.comm = None
            self.claim.release()


def _attempt_while_abandoning(what: str, step, failures: list[str]) -> bool:
    """step(); whether it worked. A failure for another reason than the revoke or the death
    (those are what abandoning means) goes to `failures`: the survivors go on, and what this
    left behind is logged."""
    from hpcckpt.cluster.fault_tolerance import is_process_failure

    try:
        step()
    except Exception as exc:
        chain, seen = [], set()
        while exc is not None and id(exc) not in seen:
            chain.append(exc)
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        if not any(is_process_failure(error) for error in chain):
            failures.append(f"{what}: {type(chain[0]).__name__}: {chain[0]}")
        return False
    return True
