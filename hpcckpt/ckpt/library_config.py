"""What the checkpointing library reads of a job's configuration.

A JobConfig (hpcckpt/config.py) describes a whole training job: model, data, optimizer and
evaluation too, which the library never looks at. The Checkpointer works from this smaller
view, built from a JobConfig (or a job TOML) once; every setting keeps its validation and
its name (`storage.local_dir`, ...) from the job config, so errors still name what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcckpt.run.settings_record import recorded_settings
from hpcckpt.config import CheckpointConfig, ResilienceConfig, StorageConfig


@dataclass(frozen=True)
class LibraryConfig:
    run_dir: str
    checkpoint: CheckpointConfig
    storage: StorageConfig
    resilience: ResilienceConfig
    simulated_nodes: int = 0  # >0: ranks spread over that many simulated nodes on one host
    failure_domains: str = "auto"  # cluster.failure_domains (cluster/domains.py)
    simulated_domains: int = 0  # cluster.simulated_domains
    # The allocation's end (seconds since the epoch, 0 unknown) and how long before it a run
    # stops cleanly (run.end_time, run.halt_seconds; the job scripts set both).
    end_time: float = 0.0
    halt_seconds: float = 0.0
    # The whole job's settings, recorded in every commit record, so a restart can say what
    # changed since a version was written (run/settings_record.py).
    recorded: dict = field(default_factory=dict)

    @classmethod
    def of(cls, config) -> "LibraryConfig":
        """From a LibraryConfig, a JobConfig, or the path of a job TOML (library users)."""
        if isinstance(config, LibraryConfig):
            return config
        if not hasattr(config, "resilience"):
            from hpcckpt.config import load_config

            config = load_config(config)
        return cls(run_dir=str(config.run.dir), checkpoint=config.checkpoint, storage=config.storage,
                   resilience=config.resilience, simulated_nodes=config.cluster.simulated_nodes,
                   failure_domains=config.cluster.failure_domains,
                   simulated_domains=config.cluster.simulated_domains,
                   end_time=config.run.end_time, halt_seconds=config.run.halt_seconds,
                   recorded=recorded_settings(config))
