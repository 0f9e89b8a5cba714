"""The checkpointer: the library API and the save flow.

    ckpt = Checkpointer(comm, config)        # (all ranks)
    ckpt.protect("w", w)                     # NumPy or CuPy array, filled in place on restart
    ckpt.register_state("loop", get, set)    # small JSON-able state
    start = ckpt.restart() or 0              # (all ranks) newest version every rank can load
    ckpt.checkpoint(step, metrics)           # (all ranks) returns once the snapshot is taken
    ckpt.close()                             # (all ranks) drains what is in flight

Or, to overlap the snapshot with the step (what the trainer does):

    ckpt.begin_checkpoint(step, copy_in_background=True)
    ...  ckpt.before_update(name); update name in place; ckpt.capture(name)  ...
    ckpt.end_checkpoint(metrics)             # returns at once; copies finish behind the step

Save flow: snapshot (this rank's slice of every tensor, into reused buffers; the only part
that can block training; CuPy arrays go device to device on a side stream, see
ckpt/device_snapshot.py) -> shard image (checksums, layout) -> L1 node-local write, while L2
partner and L3 erasure send and encode the same bytes -> L1-L3 commit -> L4 flush -> L4
commit -> retention. Background copies run on a copier thread, the L1 write on a writer
thread, the rest on a persist thread; all live as long as the Checkpointer. At most one checkpoint is in
flight: the next snapshot first waits for the previous persist. Checkpoint traffic uses its
own communicator (a duplicate), never interleaved with the gradient allreduce. A failure on
any rank becomes the same CheckpointError on every rank (carrying the failures by rank) at
the next call.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hpcckpt.ckpt import direct_io
from hpcckpt.ckpt.lease import RunLease
from hpcckpt.ckpt.layout import Layout, TensorSpec, copy_strided, piece_view_slices, plan_layout
from hpcckpt.ckpt.manifest import Manifest, ShardRecord
from hpcckpt.ckpt.retention import steps_to_delete
from hpcckpt.ckpt.run_identity import (
    RUN_FILE,
    RunIdentity,
    claim_pfs_dir,
    establish_run_identity,
    other_runs_in,
    pfs_owner,
    read_run_identity,
)
from hpcckpt.ckpt.settings_record import recorded_settings
from hpcckpt.ckpt.shardfile import ShardImage, payload_layout, plan_shard, verify_shard
from hpcckpt.cluster.backend import array_module
from hpcckpt.cluster.placement import discover_topology, local_dir_of, pfs_dir_of, user_name
from hpcckpt.cluster.topology import job_id
from hpcckpt.errors import CheckpointError, ConfigError, HpcckptError, PeerFailed, StorageError
from hpcckpt.faults import NO_FAULTS
from hpcckpt.levels import dir_safety
from hpcckpt.levels.base import hold_to_bandwidth
from hpcckpt.levels.erasure import ErasureLevel
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.messaging import quiet_allgather, quiet_any, wait_all
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.spares import SpareFiles

ENGINE_STATE_KEY = "_hpcckpt"
_PEER_FAILED = "\0peer: "  # marks an agreed error that only says another rank failed (PeerFailed)
_STAGE_LABELS = {"layout": "shard layout", "local": "L1 local write", "partner": "L2 partner copy",
                 "erasure": "L3 erasure coding", "pfs": "L4 pfs write"}


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of this rank's shard of one step, handed to the persist stage."""

    step: int
    ordinal: int  # 1-based count of checkpoints of this job, for every-Nth levels
    pieces: tuple[tuple[str, np.ndarray], ...]
    state: dict
    metrics: dict
    final: bool


@dataclass
class _Protected:
    name: str
    array: object
    replicated: bool


@dataclass
class PersistReport:
    """Timings of one checkpoint, for logs, the interval policy and benchmarks.

    snapshot_s: what end_checkpoint() blocked for; captured_early_s: time spent in capture()
    during the step (the copies themselves, or only queueing them with copy_in_background);
    copy_wait_s: what before_update() blocked for until a background copy was taken;
    background_copy_s: the copies made behind the step by the worker thread;
    device_to_host_s: the persist thread's wait for the GPU snapshot to reach host memory;
    device_copy_s: GPU time of the snapshot's copies on the side stream (CuPy arrays);
    durable_s: seconds from end_checkpoint() until each level was durable;
    started_s: seconds from end_checkpoint() until this rank began writing each level (a
    level's own time is durable_s - started_s; L4 starts after the L1-L3 commit);
    cpu_s: CPU seconds this rank spent on the checkpoint outside the training loop's own
    work, by thread ("copy", "persist", "l1_write"; "persist" is the calling thread when the
    engine runs unthreaded): what it takes from training on saturated cores.
    """

    step: int
    snapshot_s: float = 0.0
    captured_early_s: float = 0.0
    copy_wait_s: float = 0.0
    background_copy_s: float = 0.0
    device_to_host_s: float = 0.0
    device_copy_s: float = 0.0
    durable_s: dict = field(default_factory=dict)
    started_s: dict = field(default_factory=dict)
    cpu_s: dict = field(default_factory=dict)


@dataclass
class _PendingSnapshot:
    step: int
    opened: float
    captured: set = field(default_factory=set)
    capture_s: float = 0.0


class _BackgroundCopies:
    """Copies of one snapshot queued by capture() and taken by the copier thread while
    training goes on (CheckFreq's snapshot overlapping the next step). Each array has an
    event, set once its copy is taken, which before_update() waits for."""

    def __init__(self, report: PersistReport):
        self.taken: dict[str, threading.Event] = {}
        self.report = report
        self.error: str | None = None

    def release_all(self) -> None:
        for event in self.taken.values():
            event.set()


class _LocalWrite:
    """One shard's L1 write, on the writer thread: L2 and L3 send and encode the same bytes
    meanwhile, so the checkpoint is durable on L1-L3 after the disk's time for the files
    rather than after the disk's time plus the transfers and the encoding."""

    def __init__(self):
        self.done = threading.Event()
        self.error: str | None = None
        self.info = None
        self.finished_at = 0.0
        self.cpu_s = 0.0


class _Worker:
    """One long-lived daemon thread that runs submitted jobs in order. Starting a thread per
    checkpoint would cost a scheduling round trip (Thread.start() waits for the new thread to
    run: milliseconds on busy cores) inside the blocking time."""

    def __init__(self, name: str, on_start: Callable[[], None] | None = None):
        self.name = name
        self.on_start = on_start
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, job: Callable, *args) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.jobs.put((job, args))

    def _run(self) -> None:
        if self.on_start is not None:
            self.on_start()
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, args = item
            job(*args)  # jobs keep their own errors (see Checkpointer._worker_error)

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None


def quiet_barrier(comm) -> None:
    """A barrier that sleeps while it waits: MPICH's blocking barrier spins, and on shared cores
    a spinning background thread steals time from training and from the ranks doing I/O."""
    wait_all([comm.Ibarrier()])


class Checkpointer:
    def __init__(self, comm, config, *, topology=None, log=None, faults=NO_FAULTS, read_only: bool = False):
        """(all ranks) Collective: claims the run (ckpt/lease.py), checks storage on every rank
        and fails together. `read_only`: for jobs that only read checkpoints (evaluate), which
        must leave a run as it is: no lease (they may run beside the job that writes it) and
        no pruning of the spare files this job could not reuse (levels/spares.py)."""
        from mpi4py import MPI

        if not hasattr(config, "resilience"):  # a path to a job TOML, for library users
            from hpcckpt.config import load_config

            config = load_config(config)
        self.config = config
        self.comm = comm.Dup()  # checkpoint traffic apart from the application's collectives
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.topology = topology or discover_topology(comm, config.cluster.simulated_nodes)
        self.node = self.topology.node_of_rank[self.rank]
        self.log = log
        self.faults = faults
        self.levels_enabled = tuple(config.resilience.levels)
        run_dir = str(config.run.dir)
        self.pfs_dir = pfs_dir_of(config.storage.pfs_dir, run_dir)
        self._lease = None
        self.run = self._identify_run(read_only)
        try:
            # Node-local versions live in a directory of this run's own under the configured one,
            # so runs that share a node-local directory never see each other's versions.
            self.local_base = local_dir_of(config.storage.local_dir, run_dir, self.topology, self.rank)
            self.local_dir = str(Path(self.local_base) / self.run.local_subdir)
            self.local_dirs = tuple(self.comm.allgather(self.local_dir))
            self._dir_mode, file_mode = dir_safety.modes(config.storage.share_with_group)
            use_direct_io = config.storage.direct_io
            # L1-L3 share the node-local directory and so its spares: L1's retention retires
            # replicas and parity too (levels/spares.py).
            # Ranks whose node-local directory is this rank's: on its node, under the same path (the
            # same path on two nodes is two directories, as with a plain /local/scratch/ckpt).
            node_of = self.topology.node_of_rank
            self._dir_sharers = frozenset(r for r, d in enumerate(self.local_dirs)
                                          if d == self.local_dir and node_of[r] == self.node)
            spares = self._node_spares = SpareFiles(self.local_dir, config.storage.recycle_files,
                                                    self._reusable_node_spare)
            self.local = (LocalLevel(self.local_dir, self.rank, use_direct_io, spares, file_mode=file_mode)
                          if "local" in self.levels_enabled else None)
            self.pfs = (PfsLevel(self.pfs_dir, self.rank, config.storage.pfs_bandwidth_mb, use_direct_io,
                                 SpareFiles(self.pfs_dir, config.storage.pfs_recycle_files,
                                            lambda kind, writer, _: kind == "shard" and writer < self.world_size))
                        if "pfs" in self.levels_enabled else None)
            self.partner = None
            self.erasure = None
            self.partner_of: tuple[int, ...] = ()
            self.groups: tuple[tuple[int, ...], ...] = ()
            if "partner" in self.levels_enabled:
                # The topology validates the scheme (e.g. partners need two nodes) on every rank
                # alike, so a bad one fails the same way everywhere before any collective.
                self.partner_of = self.topology.partner_of()
                self.partner = PartnerLevel(self.local_dir, self.rank, self.partner_of, self.comm, use_direct_io, spares,
                                            file_mode=file_mode)
            if "erasure" in self.levels_enabled:
                self.groups = self.topology.erasure_groups(config.resilience.group_size, config.resilience.parity)
                group_index = self.topology.group_of(self.groups, self.rank)
                members = self.groups[group_index]
                group_comm = self.comm.Split(color=group_index, key=members.index(self.rank))
                self.erasure = ErasureLevel(self.local_dir, self.rank, members, group_comm, config.resilience.parity,
                                            use_direct_io, spares, file_mode=file_mode)
            self._protected: dict[str, _Protected] = {}
            self._settings = recorded_settings(config)  # in every commit record: what changed at restart
            self._states: dict[str, tuple[Callable[[], dict], Callable[[dict], None]]] = {}
            self._layout: Layout | None = None
            self._buffers: dict[str, np.ndarray] | None = None
            self._ordinal = 0
            self._pending: _PendingSnapshot | None = None
            self._copies: _BackgroundCopies | None = None
            self._shard_bytes: np.ndarray | None = None  # laid out as the shard file; holds the host snapshot
            self._shard_extra = {"node": self.node}  # the shard's extra record (layout depends on it)
            self._device_snapshot = None  # copies of CuPy arrays (ckpt/device_snapshot.py), if any
            # Copies run at normal priority (training may wait for them in before_update()), the
            # persist at checkpoint.persist_nice; a done event per checkpoint marks it finished.
            self._copier = _Worker("hpcckpt-copy", on_start=self._background_scheduling)
            self._persister = _Worker("hpcckpt-persist", on_start=self._start_writing_thread)
            self._local_writer = _Worker("hpcckpt-l1-write", on_start=self._start_writing_thread)
            self._in_flight: threading.Event | None = None
            self._worker_error: BaseException | None = None
            self.last_report: PersistReport | None = None
            self.restored_sources: tuple[str, ...] = ()  # level each rank's shard came from at restart
            self.restart_unconfirmed = None  # the restart ledger until the resumed run proves itself
            self.bytes_stored: dict[str, int] = {}  # level -> bytes this rank stored on it, this run
            self._threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
            self._prepare_storage(read_only)
            self._log_placement()
        except BaseException:
            self._release_run()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _identify_run(self, read_only: bool) -> RunIdentity:
        """(all ranks) Which run this is (ckpt/run_identity.py). A writing job: rank 0 takes the
        run directory's lease, creates or reads the run's identity and claims the PFS directory
        for it; a reading one (read_only) only reads the identity. Rank 0's refusal fails every
        rank alike."""
        identity, outcome = None, None
        if self.rank == 0:
            run_dir = Path(self.config.run.dir)
            try:
                if read_only:
                    identity = read_run_identity(run_dir)
                    if identity is None:
                        raise ConfigError(f"run.dir {str(run_dir)!r} holds no run ({RUN_FILE} is missing): point "
                                          "run.dir (-c, --set run.dir=...) at the directory of the run to read")
                else:
                    dir_safety.check_path(run_dir, "run.dir")
                    run_dir.mkdir(parents=True, exist_ok=True)
                    self._lease = RunLease(run_dir, job_id(os.environ), user_name(), self.log).acquire()
                    identity, created = establish_run_identity(run_dir, user_name(), self.pfs_dir)
                    if self.log:
                        self.log.info(("started " if created else "this is ") + identity.describe())
                    if "pfs" in self.levels_enabled:
                        dir_safety.check_path(self.pfs_dir, "storage.pfs_dir")
                        try:
                            claim_pfs_dir(self.pfs_dir, identity, self._foreign_pfs_steps(identity))
                        except OSError as exc:
                            raise StorageError(f"storage.pfs_dir {str(self.pfs_dir)!r} is not usable: "
                                               f"{exc.strerror or exc}; point it at a writable directory") from None
            except HpcckptError as exc:
                outcome = exc
            except OSError as exc:
                outcome = StorageError(f"run.dir {str(self.config.run.dir)!r}: cannot take the run's lease or "
                                       f"record its identity: {exc.strerror or exc}; point run.dir at a writable "
                                       "directory")
        identity, outcome = self.comm.bcast((identity, outcome), root=0)
        if outcome is not None:
            self._release_run()
            outcome.collective = True
            raise outcome
        return identity

    def _foreign_pfs_steps(self, identity: RunIdentity) -> list[int]:
        """(rank 0) Committed versions in the PFS directory that another run (or an hpcckpt
        without run identities) wrote, for a PFS directory no run has claimed yet."""
        if pfs_owner(self.pfs_dir) is not None:
            return []
        probe = PfsLevel(self.pfs_dir, 0)
        foreign = []
        for step in probe.committed_steps():
            try:
                if probe.manifest(step).run_id != identity.run_id:
                    foreign.append(step)
            except (HpcckptError, OSError):
                foreign.append(step)
        return foreign

    def _log_placement(self) -> None:
        """(all ranks) Where this rank's redundancy lives: an operator checks from the logs that
        partners and erasure groups really span nodes (hosts, or simulated nodes on one host);
        each rank logs its own line, rank 0 prints a summary."""
        others = other_runs_in(self.local_base, self.run.local_subdir) if self.local_base else []
        seen = self.comm.allgather((socket.gethostname(), others))
        hosts = [host for host, _ in seen]
        if self.log is None:
            return
        if others:
            self.log.info(f"{self.local_base} also holds {', '.join(others)}: other runs' versions, left alone")
        others_anywhere = sorted({name for _, names in seen for name in names})
        if others_anywhere:
            self.log.info(f"node-local directories also hold other runs' versions ({', '.join(others_anywhere[:4])}"
                          f"{', ...' if len(others_anywhere) > 4 else ''}): never loaded, deleted or overwritten "
                          f"by this run ({self.run.local_subdir})", console=True)
        simulated = bool(self.config.cluster.simulated_nodes)
        node_of = self.topology.node_of_rank
        where = [f"simulated node {node_of[r]}" if simulated else f"host {hosts[r]}" for r in range(self.world_size)]
        parts = [f"node-local directory {self.local_dir} on {where[self.rank]}"]
        if self.partner_of:
            partner = self.partner_of[self.rank]
            parts.append(f"L2 partner copy on rank {partner} ({where[partner]})")
        if self.groups:
            members = self.groups[self.topology.group_of(self.groups, self.rank)]
            parts.append(f"L3 erasure group {list(members)} on {[where[m] for m in members]}")
        self.log.info("placement: " + "; ".join(parts))
        names = sorted(set(hosts))
        summary = (f"placement: {self.world_size} rank(s) on {self.topology.node_count} simulated node(s) of host(s) "
                   if simulated else f"placement: {self.world_size} rank(s) on {len(names)} host(s) ")
        summary += f"({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
        domain = node_of if simulated else hosts
        if self.partner_of:
            apart = sum(domain[r] != domain[p] for r, p in enumerate(self.partner_of))
            summary += f"; L2 partner copies on another node for {apart} of {self.world_size} rank(s)"
        if self.groups:
            spread = min(len({domain[m] for m in g}) for g in self.groups)
            summary += f"; L3 {len(self.groups)} erasure group(s), each across {spread}+ node(s)"
        self.log.info(summary, console=True)

    def _release_run(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _prepare_storage(self, read_only: bool) -> None:
        """(all ranks) Check every rank's storage paths (dir_safety: nothing planted), create
        this run's private node-local directory, prove each level writable; fail together."""
        error, error_type = None, StorageError
        try:
            if not self.levels_enabled:
                raise ConfigError("resilience.levels is empty; list at least one of local, partner, erasure, pfs")
            node_local = set(self.levels_enabled) & {"local", "partner", "erasure"}
            if node_local:
                if read_only:
                    dir_safety.check_path(self.local_dir, "storage.local_dir")
                else:
                    dir_safety.make_private_dirs(self.local_dir, "storage.local_dir", self._dir_mode)
                    self._keep_private(Path(self.local_dir))
            if self.pfs is not None:
                dir_safety.check_path(self.pfs_dir, "storage.pfs_dir")
            if not read_only:  # first: stale spares may be what filled the disk the probe writes to
                self._prune_spares()
            for level in (self.local, self.pfs):
                if level is not None:
                    level.prepare()
        except ConfigError as exc:
            error, error_type = str(exc), ConfigError
        except HpcckptError as exc:
            error = str(exc)
        if quiet_any(self.comm, error_type is ConfigError):
            error_type = ConfigError  # a refused path is the user's to fix: exit 2 on every rank
        self._raise_if_any_failed("storage check", error, error_type)

    def _keep_private(self, directory: Path) -> None:
        """This run's node-local directory has the mode the config asks for, also when an
        earlier start of the run made it with another storage.share_with_group."""
        try:
            if directory.stat().st_mode & 0o777 != self._dir_mode:
                os.chmod(directory, self._dir_mode)
        except OSError as exc:
            raise StorageError(f"storage.local_dir: cannot set the mode of {str(directory)!r}: "
                               f"{exc.strerror or exc}") from None

    def _reusable_node_spare(self, kind: str, writer: int, source: int | None) -> bool:
        """Whether this job can overwrite a node-local spare: its writer is a rank of this
        directory, the level that writes it is on, and a replica's pair is still partners."""
        if writer not in self._dir_sharers:
            return False
        if kind == "replica":
            return ("partner" in self.levels_enabled and source < self.world_size
                    and self.partner_of[source] == writer)
        return ("local" if kind == "shard" else "erasure") in self.levels_enabled

    def _prune_spares(self) -> None:
        """Spares an earlier run left that this one can never reuse (another rank count or
        placement, another partner scheme, a level or recycling turned off) would hold their
        space for good: one rank per node-local directory, and rank 0 on L4, delete them
        before the first checkpoint. Spares are never versions, so nothing saved is lost."""
        prunes = []
        if self.rank == min(self._dir_sharers) and set(self.levels_enabled) & {"local", "partner", "erasure"}:
            prunes.append(self._node_spares)
        if self.rank == 0 and self.pfs is not None:
            prunes.append(self.pfs.spares)
        for spares in prunes:
            try:
                files, nbytes = spares.prune()
            except OSError as exc:  # recycling only saves time: a start that worked before still does
                if self.log:
                    self.log.warning(f"cannot clean up the spare files in {str(spares.directory)!r}: "
                                     f"{exc.strerror or exc}; delete that directory by hand")
                continue
            if files and self.log:
                self.log.info(f"deleted {files} spare file(s) ({nbytes / 1e6:.1f} MB) in {spares.directory} "
                              "that this job cannot reuse")

    def _raise_if_any_failed(self, phase: str, error: str | None, error_type=CheckpointError, step=None):
        """(all ranks) Turn a failure on any rank into the same exception on every rank."""
        if not quiet_any(self.comm, error is not None):
            return
        errors = quiet_allgather(self.comm, error)
        failures = {rank: e for rank, e in enumerate(errors) if e}
        if not failures:
            return
        # Ranks that only saw a peer fail are named when no rank has its own error to tell.
        own = {rank: e for rank, e in failures.items() if not e.startswith(_PEER_FAILED)}
        failures = own or {rank: e[len(_PEER_FAILED):] for rank, e in failures.items()}
        first_rank, first_error = next(iter(failures.items()))
        where = f" of step {step}" if step is not None else ""
        who = f"rank(s) {sorted(failures)}" if len(failures) < self.world_size else f"all {self.world_size} ranks"
        message = f"{phase}{where} failed on {who}: {first_error}" if step is not None or len(failures) < self.world_size \
            else first_error
        if issubclass(error_type, CheckpointError):
            exc = error_type(message, failures)
        else:
            exc = error_type(message)
        exc.collective = True
        raise exc

    # -- the library API -----------------------------------------------------------------
    def protect(self, name: str, array, replicated: bool = True) -> None:
        """Protect a NumPy/CuPy array, restored in place. Replicated arrays (the same on every
        rank, like data-parallel weights) are sharded across ranks; others are stored whole
        by their own rank (restart must then use the same number of ranks)."""
        if self._layout is not None:
            raise CheckpointError(f"protect({name!r}) after the first checkpoint or restart; protect everything first")
        if name in self._protected:
            raise CheckpointError(f"an array named {name!r} is already protected")
        if not hasattr(array, "dtype") or not hasattr(array, "shape"):
            raise CheckpointError(f"protect({name!r}): expected a NumPy or CuPy array, got {type(array).__name__}")
        self._protected[name] = _Protected(name, array, replicated)

    def register_state(self, name: str, get: Callable[[], dict], set: Callable[[dict], None]) -> None:
        """Small JSON-able state (step, iterator position, RNG states) saved with every version."""
        if name in self._states or name == ENGINE_STATE_KEY:
            raise CheckpointError(f"state {name!r} is already registered")
        self._states[name] = (get, set)

    def checkpoint(self, step: int, metrics: dict | None = None, final: bool = False) -> PersistReport | None:
        """(all ranks) Take a snapshot of `step` and persist it in the background.

        Returns once the snapshot is taken. Raises here if the previous checkpoint failed.
        Returns the report of the previous checkpoint (its durability times), if any.
        """
        previous = self.begin_checkpoint(step)
        self.end_checkpoint(metrics, final)
        return previous

    def begin_checkpoint(self, step: int, copy_in_background: bool = False) -> PersistReport | None:
        """(all ranks) Open the snapshot of `step`, to be filled array by array with capture()
        as the application finalises each one (extraction during backprop: a layer's shard is
        copied right after its weight update). Waits for the previous persist, whose buffers
        this snapshot reuses. Returns the previous checkpoint's report.

        copy_in_background: capture() and end_checkpoint() only queue the copies, which the
        copier thread takes once end_checkpoint() returns, while training goes on. The caller
        then promises to call before_update(name) before it next changes a protected array
        in place (until the next begin_checkpoint(), wait() or close()). CuPy arrays are
        copied on a side stream of the GPU as they are captured, ordered after the work
        enqueued before capture(); before_update() then makes the GPU wait for the copy, not
        the host (without copy_in_background, capture() does so at once).
        """
        if self._pending is not None:
            raise CheckpointError(f"begin_checkpoint({step}) while the snapshot of step {self._pending.step} is open")
        previous = self._finish_in_flight()
        self.confirm_restart()
        self._ensure_layout()
        self.faults.strike(step, "snapshot")
        self._pending = _PendingSnapshot(step, time.perf_counter())
        self._copies = None
        if copy_in_background and self._threaded:
            self._copies = _BackgroundCopies(PersistReport(step))
        return previous

    def capture(self, name: str) -> None:
        """Copy this rank's piece of protected array `name` into the open snapshot now (or
        queue the copy, see begin_checkpoint); the array may change afterwards (after
        before_update(name) with background copies). No-op when no snapshot is open or it
        was captured."""
        pending = self._pending
        if pending is None or name in pending.captured:
            return
        if name not in self._protected:
            raise CheckpointError(f"capture({name!r}): no protected array has that name; protect() it first")
        started = time.perf_counter()
        self._take_or_queue(name)
        pending.captured.add(name)
        pending.capture_s += time.perf_counter() - started

    def before_update(self, name: str) -> None:
        """Wait until the snapshot's copy of `name` is taken, if it is queued in the
        background; call before changing a protected array in place. Cheap otherwise."""
        copies = self._copies
        if copies is None:
            return
        if self._device_snapshot is not None and self._on_gpu(name):
            self._device_snapshot.guard(name)  # the GPU waits, not the host
            return
        event = copies.taken.get(name)
        if event is None or event.is_set():
            return
        started = time.perf_counter()
        if self._pending is not None:
            # Changed again before end_checkpoint() (e.g. two updates in one step): the copier
            # has not started, so the copy is taken here, with the value it had at capture().
            self._copy_piece(name)
            event.set()
        else:
            event.wait()
        copies.report.copy_wait_s += time.perf_counter() - started

    def end_checkpoint(self, metrics: dict | None = None, final: bool = False) -> PersistReport:
        """(all ranks) Capture whatever is left, freeze the small state and hand the snapshot
        to the background persist. Returns the (still filling) report of this checkpoint."""
        pending = self._pending
        if pending is None:
            raise CheckpointError("end_checkpoint() without begin_checkpoint()")
        remaining_started = time.perf_counter()
        for name in self._protected:
            if name not in pending.captured:
                self._take_or_queue(name)
        self._ordinal += 1
        snapshot = self._freeze(pending.step, metrics or {}, final)
        self._pending = None
        copies = self._copies
        report = copies.report if copies is not None else PersistReport(pending.step)
        report.snapshot_s = time.perf_counter() - remaining_started
        report.captured_early_s = pending.capture_s
        if copies is not None:
            self._in_flight = threading.Event()
            self._copier.submit(self._take_copies, copies, snapshot, remaining_started, self._in_flight)
        elif self._threaded:
            self._in_flight = threading.Event()
            self._persister.submit(self._persist_guarded, snapshot, report, remaining_started, self._in_flight)
        else:
            self._persist_guarded(snapshot, report, remaining_started)
        return report

    @property
    def persisting(self) -> bool:
        """A checkpoint's copies or persist are running in the background right now."""
        return self._in_flight is not None and not self._in_flight.is_set()

    def wait(self) -> PersistReport | None:
        """(all ranks) Block until the checkpoint in flight is durable; raise if it failed."""
        return self._finish_in_flight()

    def close(self, confirm: bool | None = None) -> None:
        """(all ranks) Drain what is in flight and release the communicator. A clean close
        confirms a restart: a resumed run that had nothing left to do, or stopped before its
        next checkpoint, did not crash on the version it loaded, and must not get it marked
        failed by the next restart. `confirm` None: clean means no exception is being handled
        where close() is called (sys.exc_info); a caller inside an `except` block that
        recovered passes True, one that knows the run went wrong passes False."""
        self._pending = None  # a snapshot left open (an exception in the step) is abandoned
        try:
            self._finish_in_flight()
            if confirm if confirm is not None else sys.exc_info()[0] is None:
                self.confirm_restart()
        finally:
            self._copier.stop()  # after the copies queued for the abandoned snapshot
            self._persister.stop()
            self._local_writer.stop()
            if self.erasure is not None and self.erasure.comm is not None:
                self.erasure.comm.Free()
                self.erasure.comm = None
            if self.comm is not None:
                self.comm.Free()
                self.comm = None
            self._release_run()

    def confirm_restart(self) -> None:
        """(all ranks) The resumed run works: the version it restarted from is good. Called at
        the next checkpoint; the trainer calls it earlier, after checkpoint.confirm_after_steps.
        Until then a crash marks that version failed (see ckpt/ledger.py)."""
        ledger, self.restart_unconfirmed = self.restart_unconfirmed, None
        if ledger is not None and self.rank == 0:
            ledger.confirm()

    def drain(self) -> list[int]:
        """(all ranks) Before node-local storage goes away with the allocation: copy to L4 the
        committed node-local versions that L4's retention would keep (the newest keep_pfs, the
        best by keep_best) but that skipped L4 (storage.pfs_every). Returns the steps copied;
        each copy is verified against its checksums before its manifest is written."""
        self._finish_in_flight()
        if self.local is None or self.pfs is None:
            return []
        common = set.intersection(*(set(s) for s in quiet_allgather(self.comm, self.local.committed_steps())))
        on_pfs = set(self.comm.bcast(self.pfs.committed_steps() if self.rank == 0 else None, root=0))
        manifests = {}
        for step in sorted(common - on_pfs):
            manifest = self.local.manifest(step)
            if manifest.world_size == self.world_size:
                manifests[step] = manifest
        metrics = {step: m.metrics for step, m in manifests.items()}
        if self.config.checkpoint.keep_best:  # one broadcast of rank 0's reads, not one per version
            metrics.update(self.comm.bcast({step: self.pfs.manifest(step).metrics for step in on_pfs}
                                           if self.rank == 0 else None, root=0))
        cfg = self.config.checkpoint
        dropped = set(steps_to_delete(sorted(set(manifests) | on_pfs), cfg.keep_pfs, metrics, cfg.keep_best))
        copied = [step for step in sorted(manifests) if step not in dropped]
        for step in copied:
            def copy_shard(step=step):
                self.pfs.write_shard_bytes(step, np.fromfile(self.local.shard_path(step), dtype=np.uint8))
                problems = verify_shard(self.pfs.shard_path(step))
                if problems:
                    raise CheckpointError(f"L4 copy of {self.local.shard_path(step)}: {problems[0]}")
            self._stage(step, "pfs", copy_shard, label="drain to L4")
            manifest = dataclasses.replace(manifests[step], levels=manifests[step].levels + ("pfs",))
            self._stage(step, "commit", lambda: self.pfs.commit(manifest) if self.rank == 0 else None,
                        label="L4 commit")
            if self.log:
                self.log.info(f"drained version {step} from node-local storage to L4", console=True)
        if copied and self.rank == 0:
            for step in self._deletable(self.pfs, cfg.keep_pfs, max(copied)):
                self.pfs.remove(step)
        return copied

    def init_from(self, source: str, select: Callable[[str], bool] | None = None) -> int:
        """(all ranks) Start this new run from another run's state: the protected replicated
        arrays `select(name)` picks (default: all) are loaded from `source` (a run directory,
        its L4 directory, or one L4 version directory), re-partitioned onto this job's ranks
        and verified. The step, data position, RNG and registered state are not taken: the run
        starts at its own step 0, and its versions are its own. Returns the source's step."""
        from hpcckpt.recovery import init_from

        self._finish_in_flight()
        self._ensure_layout()
        select = select or (lambda name: True)
        manifest = init_from(self, source, select)
        if self.log:
            count = sum(1 for t in self.layout.tensors if select(t.name))
            self.log.info(f"initialized {count} array(s) from version {manifest.step} of run "
                          f"{manifest.run_id or '(no run id)'} ({source})")
        return manifest.step

    def restart(self, mode: str = "auto", step: int | None = None) -> int | None:
        """(all ranks) Restore the newest version every rank can load; None when there is none.

        mode: "auto" (resume if a version exists), "require" (fail if none), "never" (start
        fresh; refuses to if versions exist, so nothing is overwritten). `step` restores that
        version instead of the newest.
        """
        from hpcckpt.recovery import restore

        self._finish_in_flight()
        self._ensure_layout()
        return restore(self, mode, step)

    # -- snapshot (blocks training) ------------------------------------------------------
    def _ensure_layout(self) -> Layout:
        if self._layout is None:
            specs = [TensorSpec.of(p.name, p.array) for p in self._protected.values() if p.replicated]
            threshold = self.config.checkpoint.split_threshold_kb * 1024
            self._layout = plan_layout(specs, self.world_size, threshold)
            shapes = {tl.name: (tl.piece_shape(self.rank), tl.spec.dtype) for tl in self._layout.rank_pieces(self.rank)}
            shapes.update({p.name: (p.array.shape, p.array.dtype) for p in self._protected.values() if not p.replicated})
            on_gpu = {name: shape for name, shape in shapes.items() if self._on_gpu(name)}
            self._buffers = self._snapshot_buffers(shapes, on_gpu)
            if on_gpu:
                from hpcckpt.ckpt.device_snapshot import DeviceSnapshot

                self._device_snapshot = DeviceSnapshot(on_gpu, self.config.checkpoint.gpu_snapshot, self.log)
                self._buffers.update(self._device_snapshot.host_buffers)
        return self._layout

    def _snapshot_buffers(self, shapes: dict, on_gpu: dict) -> dict[str, np.ndarray]:
        """Host snapshot buffers as views into one buffer laid out as this rank's shard file
        (shardfile.payload_layout, in _freeze's piece order): the contiguous file bytes that L2
        and L3 send then cost only the header, not a second copy of the shard."""
        order = [tl.name for tl in self._layout.rank_pieces(self.rank)] + list(self.local_array_names)
        _, offsets, size = payload_layout([(name, shapes[name][1], shapes[name][0]) for name in order],
                                          self._shard_extra)
        self._shard_bytes = direct_io.aligned_empty(size)  # so O_DIRECT writes take the pieces in place
        return {name: np.ndarray(shapes[name][0], dtype=shapes[name][1], buffer=self._shard_bytes, offset=offset)
                for name, offset in zip(order, offsets) if name not in on_gpu}

    def _on_gpu(self, name: str) -> bool:
        return not isinstance(self._protected[name].array, np.ndarray)

    @property
    def layout(self) -> Layout:
        return self._ensure_layout()

    @property
    def local_array_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self._protected.values() if not p.replicated)

    def _take_or_queue(self, name: str) -> None:
        copies = self._copies
        if self._on_gpu(name):
            # Enqueued on the GPU's side stream, so the host goes on at once either way. Without
            # the before_update() promise the compute stream must not run ahead of the copy.
            self._copy_piece(name)
            if copies is None:
                self._device_snapshot.guard(name)
        elif copies is not None:
            copies.taken[name] = threading.Event()
        else:
            self._copy_piece(name)

    def _copy_piece(self, name: str) -> None:
        protected = self._protected[name]
        buffer = self._buffers.get(name)
        if buffer is None:  # a whole tensor that another rank stores
            return
        if not protected.replicated:
            region = protected.array
        else:
            tl = self._layout.tensor(name)
            if not tl.piece_nbytes(self.rank):
                return
            region = protected.array.reshape(tl.logical_shape)[piece_view_slices(tl, self.rank)]
            region = array_module(protected.array).moveaxis(region, tl.axis, 0) if tl.axis else region
        if self._on_gpu(name):
            self._device_snapshot.copy(name, region)
        else:
            copy_strided(buffer, region)

    def _freeze(self, step: int, metrics: dict, final: bool) -> Snapshot:
        pieces = [(tl.name, self._buffers[tl.name]) for tl in self._layout.rank_pieces(self.rank)]
        pieces += [(name, self._buffers[name]) for name in self.local_array_names]
        state = {name: get() for name, (get, _) in self._states.items()}
        state[ENGINE_STATE_KEY] = {"ordinal": self._ordinal}
        # A JSON round trip freezes the state as it is now and proves it is serialisable.
        try:
            state = json.loads(json.dumps(state))
        except TypeError as exc:
            raise CheckpointError(f"registered state is not JSON-serialisable: {exc}") from None
        return Snapshot(step, self._ordinal, tuple(pieces), state, copy.deepcopy(metrics), final)

    # -- persist (background) ------------------------------------------------------------
    def _take_copies(self, copies: _BackgroundCopies, snapshot: Snapshot, ended_at: float,
                     done: threading.Event) -> None:
        """(copier thread) The snapshot's copies in capture order (the order the next step
        updates them in), then on to the persist; after a failed copy the rest are skipped.
        They start once the step is over: copies woken during the step competed with it for
        the cores and the GIL, which on busy cores cost more than they overlapped."""
        try:
            started, cpu_started = time.perf_counter(), time.thread_time()
            for name, taken in list(copies.taken.items()):
                if copies.error is None and not taken.is_set():
                    try:
                        self._copy_piece(name)
                    except Exception as exc:  # agreed by every rank before the persist
                        copies.error = f"copying {name!r} into the snapshot: {type(exc).__name__}: {exc}"
                taken.set()
            copies.report.background_copy_s += time.perf_counter() - started
            copies.report.cpu_s["copy"] = time.thread_time() - cpu_started
        finally:
            copies.release_all()
        self._persister.submit(self._persist_guarded, snapshot, copies.report, ended_at, done, copies)

    def _finish_in_flight(self) -> PersistReport | None:
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None
        self._copies = None
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            raise error
        report, self.last_report = self.last_report, None
        return report

    def _background_scheduling(self) -> None:
        """(worker thread) SCHED_BATCH: the scheduler does not let this thread's wake-ups (a
        copy job arriving, the persist's polls of MPI requests) preempt training; it keeps its
        fair share of the CPU, so it cannot hold the GIL or MPICH's lock for long while
        preempted, as a niced thread did (Linux schedules threads separately)."""
        if self.config.checkpoint.background_policy != "batch":
            return
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
        except (AttributeError, OSError) as exc:
            if self.log and not getattr(self, "_policy_warned", False):
                self.log.info(f"cannot use SCHED_BATCH for background threads here ({exc}); they run as normal")
                self._policy_warned = True

    def _start_writing_thread(self) -> None:
        """(persist and L1 writer threads) Priority first, then the O_DIRECT bounce buffer."""
        self._lower_priority()
        if self.config.storage.direct_io and direct_io.O_DIRECT:
            direct_io.reserve_bounce()

    def _lower_priority(self) -> None:
        """(persist thread) Its scheduling policy, and checkpoint.persist_nice if set."""
        self._background_scheduling()
        nice = self.config.checkpoint.persist_nice
        if not nice or threading.current_thread() is threading.main_thread():
            return
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError) as exc:
            if self.log and not getattr(self, "_priority_warned", False):
                self.log.info(f"cannot lower the persist thread's priority here ({exc}); it runs at normal priority")
                self._priority_warned = True

    def _persist_guarded(self, snapshot: Snapshot, report: PersistReport, started: float,
                         done: threading.Event | None = None, copies: _BackgroundCopies | None = None) -> None:
        """Persist; a failure surfaces on the next call on the main thread. With background
        `copies`, every rank first agrees on a failed copy like on any stage, so no rank
        persists a torn snapshot. `done` marks the checkpoint finished either way."""
        cpu_started = time.thread_time()
        try:
            error = copies.error if copies is not None else None
            if error is None and self._lease is not None and self._lease.lost_to is not None:
                error = str(self._lease.lost_error())
            if error is None and self._device_snapshot is not None:
                device_started = time.perf_counter()
                try:
                    report.device_copy_s = self._device_snapshot.to_host()
                except Exception as exc:  # a CUDA error of an asynchronous copy lands here
                    error = f"copying GPU arrays into the snapshot: {type(exc).__name__}: {exc}"
                report.device_to_host_s = time.perf_counter() - device_started
            # Every rank agrees, so none persists a torn snapshot (one allreduce round).
            self._raise_if_any_failed("snapshot", error, step=report.step)
            self._persist(snapshot, report, started)
            self.last_report = report
        except BaseException as exc:
            self._worker_error = exc
            if self.log:
                self.log.error(f"checkpoint of step {report.step} failed: {exc}")
        finally:
            report.cpu_s["persist"] = time.thread_time() - cpu_started
            if done is not None:
                done.set()

    def levels_due(self, snapshot: Snapshot) -> tuple[str, ...]:
        due = []
        for level in self.levels_enabled:
            if level == "pfs":
                if snapshot.final or snapshot.ordinal % self.config.storage.pfs_every == 0:
                    due.append(level)
            elif level == "local":
                due.append(level)
            else:
                every = getattr(self.config.resilience, f"{level}_every")
                if snapshot.final or snapshot.ordinal % every == 0:
                    due.append(level)
        return tuple(due)

    def _persist(self, snapshot: Snapshot, report: PersistReport, started: float) -> None:
        """(all ranks, background) Every due level in data-flow order; each stage ends with an
        agreement, so a failure anywhere stops the version everywhere before its commit."""
        step = snapshot.step
        due = self.levels_due(snapshot)
        to_pfs = self.pfs is not None and "pfs" in due
        if self.local is None and not to_pfs:
            return
        where = self.local if self.local is not None else self.pfs
        image = self._stage(step, "layout", lambda: plan_shard(step, self.rank, self.world_size, snapshot.pieces,
                                                               self._shard_extra, str(where.shard_path(step))))
        shard_infos = quiet_allgather(self.comm, (image.size, image.checksums))
        if self.local is not None:
            capped = bool(self.config.storage.local_bandwidth_mb)  # capped: one write at a time
            report.started_s["local"] = time.perf_counter() - started
            writing = self._start_local_write(step, image)
            try:
                if capped:
                    self._finish_local_write(step, writing, report, started)
                if "partner" in due or "erasure" in due:
                    shard = image.copy_into(self._shard_bytes)  # the pieces are in place already
                    sizes = [size for size, _ in shard_infos]
                    if "partner" in due:
                        report.started_s["partner"] = time.perf_counter() - started
                        stored = self._stage(step, "partner",
                                             lambda: self.partner.protect(step, shard, shard_sizes=sizes))
                        self._mark(report, step, "partner", started, stored)
                    if "erasure" in due:
                        report.started_s["erasure"] = time.perf_counter() - started
                        stored = self._stage(step, "erasure", lambda: self.erasure.protect(step, shard, sizes,
                                                                                           self.world_size))
                        self._mark(report, step, "erasure", started, stored)
                if not capped:
                    self._finish_local_write(step, writing, report, started)
            finally:
                writing.done.wait()  # never leave while the writer still reads the snapshot
            manifest = self._manifest(snapshot, shard_infos, due)
            self.faults.strike(step, "commit")
            try:
                self._stage(step, "commit", lambda: self.local.commit(manifest), label="L1-L3 commit")
            except CheckpointError:
                self._withdraw_commit(step)
                raise
        if to_pfs:
            # L4 gets L1's exact bytes (same header, same checksums, one manifest for both).
            report.started_s["pfs"] = time.perf_counter() - started
            self._stage(step, "pfs", lambda: self.pfs.write_image(step, image))
            manifest = self._manifest(snapshot, shard_infos, due)
            self.faults.strike(step, "commit")
            self._stage(step, "commit", lambda: self.pfs.commit(manifest) if self.rank == 0 else None,
                        label="L4 commit")
            self._mark(report, step, "pfs", started, image.size)
        self._apply_retention(step)

    def _withdraw_commit(self, step: int) -> None:
        """A version some rank could not commit is committed nowhere: the ranks that did drop
        their record, or their retention would count it and delete an older complete one."""
        try:
            self.local.commit_path(step).unlink(missing_ok=True)
        except OSError as exc:
            if self.log:
                self.log.warning(f"step {step}: cannot withdraw this rank's commit record of the failed version: "
                                 f"{exc.strerror or exc}; a restart will not use it, as other ranks lack theirs")

    def _start_local_write(self, step: int, image: ShardImage) -> _LocalWrite:
        """(all ranks) Hand the L1 write to the writer thread; _finish_local_write agrees on it."""
        self.faults.strike(step, "local")
        writing = _LocalWrite()

        def write():
            cpu_started = time.thread_time()
            try:
                writing.error, writing.info = self._attempt("local", lambda: self.local.write_image(step, image))
            except Exception as exc:  # agreed by every rank like any stage's error, never lost
                writing.error = f"{type(exc).__name__}: {exc}"
            finally:
                writing.finished_at = time.perf_counter()
                writing.cpu_s = time.thread_time() - cpu_started
                writing.done.set()

        self._local_writer.submit(write)
        return writing

    def _finish_local_write(self, step: int, writing: _LocalWrite, report: PersistReport, started: float) -> None:
        """(all ranks) Wait for the L1 write and agree on it."""
        writing.done.wait()
        report.cpu_s["l1_write"] = writing.cpu_s
        self._raise_if_any_failed(_STAGE_LABELS["local"], writing.error, step=step)
        self._mark(report, step, "local", started, writing.info.size, finished=writing.finished_at)

    def _attempt(self, phase: str, action) -> tuple[str | None, object]:
        """Run one stage's action on this rank: (error or None, result)."""
        error, result = None, None
        started = time.perf_counter()
        try:
            result = action()
        except PeerFailed as exc:
            error = _PEER_FAILED + str(exc)
        except HpcckptError as exc:
            error = str(exc)
        except Exception as exc:  # MemoryError, an MPI or CuPy error: still agreed, never a hang
            error = f"{type(exc).__name__}: {exc}"
        if error is None and phase in ("local", "partner", "erasure"):
            # storage.local_bandwidth_mb: checkpoints leave the node-local disk to the
            # application's own I/O (L1 returns a ShardInfo, L2/L3 the bytes they stored).
            nbytes = result.size if hasattr(result, "size") else int(result or 0)
            hold_to_bandwidth(nbytes, self.config.storage.local_bandwidth_mb * 1e6, started)
        return error, result

    def _stage(self, step: int, phase: str, action, label: str | None = None):
        """(all ranks) Run one stage of the persist; a failure on any rank fails it on all."""
        if phase != "commit":
            self.faults.strike(step, phase)
        error, result = self._attempt(phase, action)
        self._raise_if_any_failed(label or _STAGE_LABELS[phase], error, step=step)
        return result

    def _mark(self, report: PersistReport, step: int, level: str, started: float, nbytes: int,
              finished: float | None = None) -> None:
        report.durable_s[level] = (finished or time.perf_counter()) - started
        self.bytes_stored[level] = self.bytes_stored.get(level, 0) + int(nbytes)
        if self.log:
            self.log.info(f"step {step}: {level} done after {report.durable_s[level]:.3f} s "
                          f"({nbytes} bytes stored by this rank)")

    def _manifest(self, snapshot: Snapshot, shard_infos, levels) -> Manifest:
        return Manifest(
            step=snapshot.step,
            world_size=self.world_size,
            layout=self._layout,
            shards=tuple(ShardRecord(r, size, checksums) for r, (size, checksums) in enumerate(shard_infos)),
            state=snapshot.state,
            metrics=snapshot.metrics,
            node_of_rank=self.topology.node_of_rank,
            local_dirs=self.local_dirs,
            local_arrays=self.local_array_names,
            levels=tuple(levels),
            created=time.time(),
            run_id=self.run.run_id,
            settings=self._settings,
        )

    def _apply_retention(self, newest: int) -> None:
        """Delete old whole versions; uncommitted leftovers older than `newest` go too."""
        cfg = self.config.checkpoint
        if self.local is not None:
            for step in self._deletable(self.local, cfg.keep_local, newest):
                self.local.remove(step)
        if self.pfs is not None and self.rank == 0:
            for step in self._deletable(self.pfs, cfg.keep_pfs, newest):
                self.pfs.remove(step)

    def _deletable(self, level, keep: int, newest: int) -> list[int]:
        committed = level.committed_steps()
        manifests: dict[int, Manifest | None] = {}

        def manifest(step: int) -> Manifest | None:  # each commit record read once per retention
            if step not in manifests:
                try:
                    manifests[step] = level.manifest(step)
                except HpcckptError:
                    manifests[step] = None
            return manifests[step]

        metrics = {}
        if self.config.checkpoint.keep_best:
            metrics = {s: manifest(s).metrics for s in committed if manifest(s) is not None}
        stale = [s for s in level.uncommitted_steps() if s < newest]
        pinned = self._newest_redundant_versions(committed, manifest) if level is self.local else set()
        return [s for s in steps_to_delete(committed, keep, metrics, self.config.checkpoint.keep_best)
                if s not in pinned] + stale

    def _newest_redundant_versions(self, committed: list[int], manifest) -> set[int]:
        """The newest node-local version holding partner copies, and the newest holding parity.
        With partner_every or erasure_every above keep_local, the newest versions are L1 only;
        deleting older ones by count alone would delete the only version that survives a node
        loss (its replicas and parity live in the same version directory)."""
        missing = {name for name in ("partner", "erasure") if name in self.levels_enabled}
        pinned: set[int] = set()
        for step in sorted(committed, reverse=True):
            if not missing:
                break
            found = missing & set(manifest(step).levels if manifest(step) is not None else ())
            if found:
                pinned.add(step)
                missing -= found
        return pinned
