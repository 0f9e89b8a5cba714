"""What a restore is handed and what it hands back: the engine builds a frozen RestoreContext
and gets a frozen RestoreResult; nothing in the restore reads or writes the engine itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcckpt.levels.base import DEFAULT_CHUNK_BYTES, LevelStack


@dataclass(frozen=True)
class RestoreContext:
    """What a restore reads and fills: the job's shape and level stack, the layout, this
    rank's snapshot buffers (its pieces land there, read and verified) and the protected
    arrays (written in place, all ranks' pieces assembled)."""

    comm: object
    rank: int
    world_size: int
    node: int
    topology: object  # node_of_rank: the placement replicas and parity were written under
    levels: LevelStack  # what each level holds, delivers and rebuilds is asked of the level
    layout: object
    local_array_names: tuple
    buffers: dict  # name -> this rank's snapshot buffer of the array
    targets: dict  # name -> the protected array, filled in place
    run_id: str
    settings: dict  # the job's settings now, to say what changed since a version was written
    run_dir: str
    pfs_dir: str  # named in messages about the global levels' directory
    node_dir: str  # this rank's node-local directory
    log: object
    faults: object
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # what a rebuild moves and decodes at a time (checkpoint.chunk_mib)
    # Sets the registered state of the version being loaded: the engine's, called after the
    # arrays are filled and before anything newer is moved out of the way.
    apply_state: object = None


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
    protect_globally: tuple = ()  # those of protect_again that are global levels: written first
    geometry_changed: bool = False  # written by another rank count or placement: older node-local versions go too
    metrics: dict = field(default_factory=dict)  # the version's metrics, written again with it
    traffic: tuple = ()  # repartitioned: (shard bytes this rank read from files, bytes it received)


def warn(ctx, message: str) -> None:
    """A warning in the run log at rank 0; the other ranks note it in their own logs."""
    if ctx.log:
        ctx.log.warning(message) if ctx.rank == 0 else ctx.log.info("warning: " + message)
