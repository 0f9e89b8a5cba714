"""MPI start-up under Slurm's pmi2 plugin with the `mpich` wheel: settings that MPI_Init reads,
so they are made before anything imports mpi4py.MPI.

Slurm's pmi2 plugin reads a PMI-1 request with one read() of at most 1024 bytes and parses
what it got as the whole request (src/plugins/mpi/pmi2/pmi1.c, "TODO: read until newline").
The wheel's default UCX netmod publishes its address in nine PMI-1 puts whose lines run to
about 60 + 2 x 480 characters, hex of partly uninitialised memory shortened by run-length
coding, so whether a line passes 1024 depends on what that memory held. When one does, the
plugin logs "value not properly terminated in client request" and the step hangs in MPI_Init
for good (two CI runs). The wheel's OFI netmod publishes one 16-byte address: one short put.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

NETMOD_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")
SHORT_ADDRESS_NETMOD = "ofi"


def served_by_slurm_pmi2(environ: Mapping[str, str]) -> bool:
    """srun started this process with its pmi2 plugin as the PMI server (PMI_FD is its socket)."""
    return environ.get("SLURM_MPI_TYPE") == "pmi2" and bool(environ.get("PMI_FD"))


def mpich_wheel_installed() -> bool:
    # Imported here: importlib.metadata costs every rank ~0.1 s at start-up, and only a rank
    # that srun serves through pmi2 asks.
    from importlib import metadata

    try:
        metadata.distribution("mpich")
    except metadata.PackageNotFoundError:
        return False
    return True


def netmod_for_slurm_pmi2(environ: Mapping[str, str], mpich_wheel: bool) -> str | None:
    """The netmod to ask the wheel's MPICH for, or None to leave the environment as it is:
    another launcher, another MPI (mpi4py told which library by MPI4PY_LIBMPI), or a netmod
    the user chose."""
    if not mpich_wheel or not served_by_slurm_pmi2(environ):
        return None
    if environ.get("MPI4PY_LIBMPI") or any(environ.get(name) for name in NETMOD_VARIABLES):
        return None
    return SHORT_ADDRESS_NETMOD


def prepare_mpi_startup(environ: MutableMapping[str, str] | None = None, too_late: bool = False) -> str | None:
    """Sets the netmod when needed; returns a line for the log (None: nothing changed).
    `too_late`: MPI has started already (mpi4py.MPI imported): nothing is set, and the line
    says what should have been."""
    environ = os.environ if environ is None else environ
    netmod = netmod_for_slurm_pmi2(environ, served_by_slurm_pmi2(environ) and mpich_wheel_installed())
    if netmod is None:
        return None
    if too_late:
        return (f"MPI start-up: MPI started before run_main() (mpi4py.MPI was imported first, as frameworks such "
                f"as Heat and Devito do on import), so MPIR_CVAR_CH4_NETMOD={netmod} could not be set for the mpich "
                "wheel under Slurm's pmi2 plugin, whose default UCX netmod can hang MPI_Init; start the program "
                f"as `hpcckpt exec -- python ...`, or export MPIR_CVAR_CH4_NETMOD={netmod} in the job script")
    environ["MPIR_CVAR_CH4_NETMOD"] = netmod
    return (f"MPI start-up: the mpich wheel under Slurm's pmi2 plugin uses its {netmod} netmod "
            f"(MPIR_CVAR_CH4_NETMOD={netmod}): the default UCX one sends PMI-1 requests longer than "
            f"the 1024 bytes that plugin reads, which hangs MPI_Init; set MPIR_CVAR_CH4_NETMOD to choose")
