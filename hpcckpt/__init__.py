"""hpcckpt: multi-level checkpoint/restart for SPMD applications: HPC solvers, data-parallel and
sharded training.

Library use: ``from hpcckpt import Checkpointer, load_config`` (see README).
"""

__version__ = "0.1.0"

__all__ = ["Checkpointer", "KeyedTable", "load_config", "run_main", "run_surviving", "EXIT_HALTED", "__version__"]


def __getattr__(name):
    # Lazy, so `import hpcckpt` (and the CLI's thread settings made before NumPy loads) stays cheap.
    if name == "Checkpointer":
        from hpcckpt.ckpt.engine import Checkpointer

        return Checkpointer
    if name == "KeyedTable":
        from hpcckpt.ckpt.keyed_table import KeyedTable

        return KeyedTable
    if name == "load_config":
        from hpcckpt.config import load_config

        return load_config
    if name == "run_main":
        from hpcckpt.application import run_main

        return run_main
    if name == "run_surviving":
        from hpcckpt.run.in_job import run_surviving

        return run_surviving
    if name == "EXIT_HALTED":
        from hpcckpt.schedule.stopping import EXIT_HALTED

        return EXIT_HALTED
    raise AttributeError(f"module 'hpcckpt' has no attribute {name!r}")
