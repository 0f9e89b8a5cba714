"""One exception hierarchy. Each error also inherits the matching built-in so callers
that only know the built-ins still catch it (zarr's errors.py does the same)."""


class HpcckptError(Exception):
    """Base of every error hpcckpt raises on purpose; its message is meant for users."""

    exit_code = 1
    # True when every rank raises the same error at the same point (e.g. a bad config read by
    # all), so ranks can exit together; otherwise the job is aborted to free the other ranks.
    collective = False

    def __init__(self, *args, collective: bool | None = None):
        """`collective`: every rank raises this error at this point (the class says by default)."""
        super().__init__(*args)
        if collective is not None:
            self.collective = collective


class ConfigError(HpcckptError, ValueError):
    """The job configuration (file, --set or environment) is unusable."""

    exit_code = 2
    collective = True


class TopologyError(ConfigError):
    """A partner map or erasure-group scheme cannot be built for this job's shape."""


class DataError(HpcckptError, ValueError):
    """Training data is missing or malformed."""

    exit_code = 2
    collective = True


class StorageError(HpcckptError, OSError):
    """A storage path is missing, unwritable or full."""

    exit_code = 3


class FormatError(HpcckptError, ValueError):
    """A checkpoint file is not in a format this version can read."""

    exit_code = 3


class DamagedRecordError(FormatError):
    """A stored record (a commit record, the run's identity) is damaged: cut short, bytes
    flipped, not what it should be. That copy is not used; readers set it aside or rewrite it
    from an intact copy and go on with what is intact."""


class ChecksumError(FormatError):
    """Bytes read back do not match the checksum written with them."""


class CheckpointError(HpcckptError, RuntimeError):
    """Saving or restoring a checkpoint failed; carries failures by rank when collective."""

    exit_code = 4

    def __init__(self, message, failures_by_rank=None, *, collective: bool | None = None):
        super().__init__(message, collective=collective)
        self.failures_by_rank = dict(failures_by_rank or {})


class PeerFailed(CheckpointError):
    """This rank's part of a collective step stopped because another rank's failed (that
    rank's own error says why); agreements report it as a PeerFailure, not as a cause."""


class IncompatibleCheckpointError(CheckpointError):
    """A stored version does not fit the model or job it is being restored into."""


class UnrecoverableError(CheckpointError):
    """No version can be rebuilt from the pieces that survive."""


class StartOverInNewProcesses(HpcckptError):
    """No stored version can be recovered and the run may start over, but this job's processes
    went on in the job after ranks died and hold the lost run's state: every rank ends for
    the job script's relaunch, which starts the run over in new processes."""

    exit_code = 1
    collective = True


class DivergenceError(DataError):
    """The run diverged (non-finite gradients or loss, a loss spike) and may not rewind, kept
    diverging after the rewinds allowed, or has no older version left: every rank raises it
    after the same step."""

    collective = True
