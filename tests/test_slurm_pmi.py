"""When MPI start-up needs the wheel's OFI netmod (under Slurm's pmi2 plugin) and when the
environment is left alone. The start-up itself is tested under a real Slurm in
test_slurm_jobs.py (the README example, with MPICH's own record of every PMI request)."""

from __future__ import annotations

import pytest

from hpcckpt.cluster.slurm_pmi import netmod_for_slurm_pmi2, prepare_mpi_startup

SRUN_PMI2 = {"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "PMI_RANK": "0", "PMI_SIZE": "4"}


def test_srun_with_pmi2_and_the_wheel_gets_the_short_address_netmod():
    assert netmod_for_slurm_pmi2(SRUN_PMI2, mpich_wheel=True) == "ofi"


@pytest.mark.parametrize("environ", [
    {},                                                                # no launcher
    {"PMI_FD": "11", "PMI_RANK": "0"},                                 # Hydra's mpiexec serves PMI itself
    {"SLURM_MPI_TYPE": "pmix", "PMIX_RANK": "0"},                      # srun --mpi=pmix
    {"SLURM_MPI_TYPE": "pmi2"},                                        # a batch script, not a step
    {**SRUN_PMI2, "MPIR_CVAR_CH4_NETMOD": "ucx"},                      # the user's choice
    {**SRUN_PMI2, "MPICH_CH4_NETMOD": "ucx"},
    {**SRUN_PMI2, "MPI4PY_LIBMPI": "/opt/site-mpi/lib/libmpi.so"},     # another MPI library
])
def test_the_environment_is_left_alone_elsewhere(environ):
    assert netmod_for_slurm_pmi2(environ, mpich_wheel=True) is None


def test_an_mpi_other_than_the_wheel_is_left_alone():
    assert netmod_for_slurm_pmi2(SRUN_PMI2, mpich_wheel=False) is None


def test_prepare_sets_the_variable_and_says_why(monkeypatch):
    monkeypatch.setattr("hpcckpt.cluster.slurm_pmi.mpich_wheel_installed", lambda: True)
    environ = dict(SRUN_PMI2)
    said = prepare_mpi_startup(environ)
    assert environ["MPIR_CVAR_CH4_NETMOD"] == "ofi"
    assert "1024 bytes" in said and "MPIR_CVAR_CH4_NETMOD" in said
    assert prepare_mpi_startup(environ) is None  # now the variable is set: a second call changes nothing


def test_after_mpi_started_nothing_is_set_and_what_was_needed_is_said(monkeypatch):
    """A framework that imports mpi4py on import (Heat, Devito) starts MPI before run_main."""
    monkeypatch.setattr("hpcckpt.cluster.slurm_pmi.mpich_wheel_installed", lambda: True)
    environ = dict(SRUN_PMI2)
    said = prepare_mpi_startup(environ, too_late=True)
    assert "MPIR_CVAR_CH4_NETMOD" not in environ
    assert "MPI started before run_main()" in said and "hpcckpt exec -- python" in said
    assert "export MPIR_CVAR_CH4_NETMOD=ofi" in said
    assert prepare_mpi_startup(dict(SRUN_PMI2, MPIR_CVAR_CH4_NETMOD="ucx"), too_late=True) is None  # chosen
