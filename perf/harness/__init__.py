"""What every benchmark in perf/ shares, so each script keeps only what it measures:

- launch (harness/launch.py): the mpiexec command, the environment of the ranks (pinned BLAS
  threads, this checkout on PYTHONPATH, no HPCCKPT_* settings from the caller's shell) and
  the worker round trip, `script --worker --out <json> ...`;
- machine (harness/machine.py): the machine a result was measured on, printed and stored
  with every result;
- stats (harness/stats.py): medians over repeats, the papers' checkpoint overhead, timing of
  repeated calls and the orders that interleave variants;
- results (harness/results.py): results as JSON, with the machine;
- baselines (harness/baselines.py): raw files written durably (sharded or one writer), h5py
  and torch DCP over a gloo group of the MPI ranks, measured beside hpcckpt in the same run;
- load (harness/load.py): how busy the machine was while a benchmark ran;
- processes (harness/processes.py): a job's ranks found from outside, to kill one as a crash
  does.

The scripts run as `python perf/<script>.py`, so perf/ is on sys.path and `from harness import
...` finds this package; it puts the checkout on sys.path too. Importing it loads neither
NumPy nor MPI: a script may pin its threads (pin_threads) after importing it, and mpi4py is
imported inside functions, as the scripts that use DCP require.
"""

from __future__ import annotations

import sys

from .baselines import (Dcp, bcast_arrays, fsync_path, gloo_close, gloo_group, h5py_load, h5py_save,
                        shard_bounds, write_durably)
from .launch import (REPO, THREAD_VARS, compile_checkout, find_mpiexec, mpiexec_command, pin_threads, run_mpi,
                     run_worker, worker_env)
from .load import ForeignLoad
from .machine import describe, machine, mem_total, print_machine
from .processes import tagged_ranks
from .results import write_json
from .stats import alternated, median, paper_delay, paper_overhead, rotated, time_median

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def available(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def __getattr__(name):
    # quiet_barrier comes from hpcckpt, which loads NumPy: only when a script asks for it.
    if name == "quiet_barrier":
        from hpcckpt.cluster.collectives import quiet_barrier

        return quiet_barrier
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


__all__ = ["REPO", "THREAD_VARS", "Dcp", "ForeignLoad", "alternated", "available", "bcast_arrays", "compile_checkout",
           "describe",
           "find_mpiexec", "fsync_path", "gloo_close", "gloo_group", "h5py_load", "h5py_save", "machine",
           "median", "mem_total", "mpiexec_command", "paper_delay", "paper_overhead", "pin_threads", "tagged_ranks",
           "print_machine", "quiet_barrier", "rotated", "run_mpi", "run_worker", "shard_bounds", "time_median",
           "worker_env", "write_durably", "write_json"]
