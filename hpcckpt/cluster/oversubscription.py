"""Ranks that outnumber their node's cores (a laptop, a CI runner, simulated nodes on one
machine): how MPICH should wait there, set before MPI starts.

MPICH waits by polling. With MPI_THREAD_MULTIPLE, which the library's save threads need, a
rank polling in a blocking call gives MPI's lock up now and then with sched_yield, which on a
busy core hands the CPU to nobody: the rank the others wait for gets its core back only when
the scheduler's slice ends, and the system time of the yields piles up. With
MPIR_CVAR_ENABLE_HEAVY_YIELD=1 it sleeps (nanosleep) instead, so a rank that is ready runs.
On cores of its own a rank would only wait longer for its messages, so the setting is made
where the node's ranks outnumber its cores, never over the user's own choice, and only before
MPI_Init reads it (as UPC++ picks its yielding default from the local rank count).
"""

from __future__ import annotations

import os
import re
from typing import Mapping, MutableMapping

YIELD_VARIABLES = ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "MPICH_ENABLE_HEAVY_YIELD", "MPIR_PARAM_ENABLE_HEAVY_YIELD")


def ranks_on_this_node(environ: Mapping[str, str]) -> int | None:
    """How many ranks the launcher started on this node, where it says: Hydra (the mpich
    wheel's mpiexec) in MPI_LOCALNRANKS, srun in SLURM_STEP_TASKS_PER_NODE ("2(x3),1": two
    on each of the first three nodes, one on the fourth) and SLURM_NODEID."""
    local = environ.get("MPI_LOCALNRANKS", "")
    if local.isdigit():
        return int(local)
    per_node, node = environ.get("SLURM_STEP_TASKS_PER_NODE", ""), environ.get("SLURM_NODEID", "")
    if not node.isdigit():
        return None
    counts = []
    for part in filter(None, per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def yield_when_oversubscribed(environ: MutableMapping[str, str] | None = None,
                              cores: int | None = None) -> bool:
    """Sets MPICH's sleeping yield where this node's ranks outnumber its `cores` (default:
    the machine's); whether it did. Said nowhere: the environment shows it, and a line on
    every such run's console would tell a laptop user nothing to act on."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in YIELD_VARIABLES):
        return False
    ranks, cores = ranks_on_this_node(environ), cores or os.cpu_count() or 1
    if ranks is None or ranks <= cores:
        return False
    environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    return True
