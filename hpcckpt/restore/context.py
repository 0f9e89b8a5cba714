"""What a restore is handed and what it hands back: the engine builds a frozen RestoreContext
and gets a frozen RestoreResult; nothing in the restore reads or writes the engine itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES, LevelStack


@dataclass(frozen=True)
class JobGeometry:
    """The job a restore loads into: its ranks, where they run, and what they protect."""

    comm: object
    rank: int
    world_size: int
    node: int
    topology: object  # node_of_rank: the placement replicas and parity were written under
    layout: object  # format/layout.py: what each rank stores of each protected array
    local_array_names: tuple  # per-rank arrays, restored only onto as many ranks


@dataclass(frozen=True)
class RestoreTargets:
    """Where a loaded version goes: this rank's snapshot buffers (its pieces land there, read
    and verified), the protected arrays (written in place, all ranks' pieces assembled), and
    the engine's setter of the registered state, called after the arrays are filled and
    before anything newer is moved out of the way."""

    buffers: dict  # name -> this rank's snapshot buffer of the array
    arrays: dict  # name -> the protected array, filled in place
    # apply_state(shared state, {old rank: per-rank states} or None, ranks that wrote it)
    apply_state: object = None
    tables: dict = field(default_factory=dict)  # name -> KeyedTable, loaded with this job's rows
    # state_problems(shared state, ranks that wrote it) -> why the version's registered state
    # cannot go to this job's (a kind changed, per-rank state onto another rank count unasked)
    state_problems: object = None
    # The buffers came from a checkpointer set aside after ranks died, its pieces where they
    # were: they may hold this rank's pieces of the last version taken (unchecked; a restore
    # checks them against the version's checksums before loading them in place).
    pieces_inherited: bool = False


@dataclass(frozen=True)
class RunPlace:
    """The run a restore belongs to: its identity (another run's versions are left alone),
    its settings now (to say what changed since a version was written) and its directories."""

    run_id: str
    settings: dict
    run_dir: str
    pfs_dir: str  # named in messages about the global levels' directory
    node_dir: str  # this rank's node-local directory (on the disk: scratch files go there too)
    node_roots: tuple = ()  # every directory its node-local versions may be in, memory first (none: node_dir)

    @property
    def version_roots(self) -> tuple:
        return self.node_roots or (self.node_dir,)


@dataclass(frozen=True)
class RestoreContext:
    """What a restore reads and fills, in the parts it is made of: the job, the level stack
    (what each level holds, delivers and rebuilds is asked of the level), the targets and
    the run."""

    job: JobGeometry
    levels: LevelStack
    targets: RestoreTargets
    run: RunPlace
    log: object
    faults: object
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # what a rebuild moves and decodes at a time (checkpoint.chunk_mib)
    verify_finite: bool = True  # checkpoint.verify_finite (run/health.py)
    failures_per_second: float = 0.0  # how often the configuration says failures come (run/ledger.py)
    # Where versions were stored and none can be recovered: "stop" (UnrecoverableError),
    # "start_over" (a fresh start, the lost versions' leftovers cleared) or "relaunch" (start
    # over, but in new processes: StartOverInNewProcesses). resilience.unrecoverable.
    unrecoverable: str = "stop"


@dataclass(frozen=True)
class RestoreResult:
    """What a restore loaded: the engine sets the registered state and its own counters."""

    step: int
    sources: tuple  # the level each rank's shard came from (each OLD rank's, when repartitioned)
    state: dict  # the version's registered state, by name (already set through ctx.targets.apply_state)
    unconfirmed: object = None  # the restart ledger, until the resumed run proves itself
    # A version loaded over another job's shards: the levels to write it to again under this
    # job's geometry (the engine does, after the old geometry's files are gone).
    protect_again: tuple = ()
    protect_globally: tuple = ()  # those of protect_again that are global levels: written first
    geometry_changed: bool = False  # written by another rank count or placement: older node-local versions go too
    metrics: dict = field(default_factory=dict)  # the version's metrics, written again with it
    traffic: tuple = ()  # repartitioned: (shard bytes this rank read from files, bytes it received)


def warn(ctx, message: str) -> None:
    """A warning in the run log at rank 0; the other ranks note it in their own logs."""
    if ctx.log:
        ctx.log.warning(message) if ctx.job.rank == 0 else ctx.log.info("warning: " + message)
