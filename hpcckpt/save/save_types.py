"""What travels through the save pipeline: the snapshot of one step, the report of its
checkpoint, the pipeline's settings, background copies and what the commit records need of
the version's shards."""

from __future__ import annotations

import dataclasses

import threading
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of this rank's shard of one step, handed to the pipeline."""

    step: int
    ordinal: int  # 1-based count of checkpoints of this job, for every-Nth levels
    pieces: tuple[tuple[str, np.ndarray], ...]
    state: dict
    metrics: dict
    final: bool
    levels: tuple  # the names of the levels to write it to (the schedule decided: policy.levels_due)
    tables: dict = field(default_factory=dict)  # name -> TableSpec.to_dict() of each keyed table
    table_chain: tuple = ()  # the versions its tables need, oldest first (format/keyed_rows.py)


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
    failed: dict = field(default_factory=dict)  # level -> why it could not take this version (others hold it)
    held: bool = True  # some level holds the version (False: none could take it)

    def as_of_now(self) -> "PersistReport":
        """A copy as the report stands now, for the application: L4's thread, copying at its
        own pace, may still add to this one."""
        return dataclasses.replace(self, durable_s=dict(self.durable_s), started_s=dict(self.started_s),
                                   cpu_s=dict(self.cpu_s), failed=dict(self.failed))


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline needs of the job's configuration."""

    every: dict  # level -> every how many checkpoints it is due without per-level intervals
    keep: dict  # node_local / global -> versions retention keeps (checkpoint.keep_local, keep_pfs)
    keep_best: str = ""
    one_write_at_a_time: bool = False  # storage.local_bandwidth_mb is set: L1 before L2/L3
    background_policy: str = "batch"
    persist_nice: int = 0
    direct_io: bool = False
    max_unprotected: int = 3  # resilience.max_unprotected_checkpoints
    pfs_async: bool = True  # storage.pfs_async: L4 copies from L1 at its own pace (save/flush.py)
    keep_known_good: bool = False  # resilience.rewind_on_divergence: a rewind may need an older version

    @classmethod
    def from_config(cls, config) -> "PipelineSettings":
        resilience, storage, checkpoint = config.resilience, config.storage, config.checkpoint
        return cls(
            every={"partner": resilience.partner_every, "erasure": resilience.erasure_every, "pfs": storage.pfs_every},
            keep={"node_local": checkpoint.keep_local, "global": checkpoint.keep_pfs},
            keep_best=checkpoint.keep_best, one_write_at_a_time=bool(storage.local_bandwidth_mb),
            background_policy=checkpoint.background_policy, persist_nice=checkpoint.persist_nice,
            direct_io=storage.direct_io, max_unprotected=resilience.max_unprotected_checkpoints,
            pfs_async=storage.pfs_async, keep_known_good=resilience.rewind_on_divergence)


class BackgroundCopies:
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


@dataclass(frozen=True)
class ShardInfos:
    """What this rank's commit records need of the version's shards: (size, checksums) by rank
    of the shards they list (its node-local part, or all of them on L4's coordinator), the
    version id (a hash of every rank's shard_digest) and the bytes all ranks' files take."""

    records: dict
    version_id: str
    version_bytes: int
    in_memory: bool = False  # every node has room for the version in memory (save/memory_placement.py)

    @property
    def sizes(self) -> dict[int, int]:
        """The shard sizes of the ranks listed: this rank's, its L3 group's and the replica
        sources it holds, which are the ones its levels need."""
        return {rank: size for rank, (size, _) in self.records.items()}


@dataclass(frozen=True)
class SaveJob:
    """What the save pipeline needs of the job beside its levels and settings: the log,
    whether MPI allows its threads, the run's lease (None: no claim), and
    `record_peers` (format/manifest.py: the ranks whose node-local record lists this rank's
    shard, the ranks whose shards its lists)."""

    log: object
    threaded: bool
    lease: object = None
    record_peers: tuple = ((), ())
    node_sharers: int = 1  # ranks whose versions share this rank's memory directory (its budget)


@dataclass(frozen=True)
class VersionInFlight:
    """One version on its way through the save's stages: the snapshot it came from, this
    rank's planned shard (levels/base.py's VersionImage), what the commit records need of
    every shard, the report its stages fill, and when end_checkpoint() returned
    (perf_counter), which the report's times count from."""

    snapshot: Snapshot
    version: object
    shard_infos: ShardInfos
    report: PersistReport
    started: float

    @property
    def step(self) -> int:
        return self.snapshot.step
