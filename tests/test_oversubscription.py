"""MPICH's waiting ranks sleep rather than spin only where a node's ranks outnumber its cores."""

import pytest

from hpcckpt.cluster.oversubscription import ranks_on_this_node, yield_when_oversubscribed


@pytest.mark.parametrize("environ, ranks", [
    ({"MPI_LOCALNRANKS": "4"}, 4),                                              # Hydra
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "1"}, 2),          # srun
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 1),
    ({"SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_NODEID": "0"}, 8),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_NODEID": "5"}, None),         # not in the list
    ({"SLURM_STEP_TASKS_PER_NODE": "garbled", "SLURM_NODEID": "0"}, None),
    ({}, None),                                                                  # no launcher said
])
def test_the_ranks_on_this_node_are_read_from_the_launcher(environ, ranks):
    assert ranks_on_this_node(environ) == ranks


def test_more_ranks_than_cores_make_mpich_sleep_while_it_waits():
    environ = {"MPI_LOCALNRANKS": "4"}
    assert yield_when_oversubscribed(environ, cores=2)
    assert environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"


@pytest.mark.parametrize("environ", [
    {"MPI_LOCALNRANKS": "2"},                                           # a core each: spinning is fastest
    {},                                                                 # unknown: left as MPICH has it
    {"MPI_LOCALNRANKS": "8", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"},       # the user's choice wins
    {"MPI_LOCALNRANKS": "8", "MPICH_ENABLE_HEAVY_YIELD": "0"},
])
def test_dedicated_cores_unknown_counts_and_the_users_own_setting_are_left_alone(environ):
    before = dict(environ)
    assert not yield_when_oversubscribed(environ, cores=2)
    assert environ == before


def test_an_application_started_through_run_main_gets_the_setting_before_mpi_starts(tmp_path):
    """On real ranks of the mpich wheel: run_main makes the setting before main imports MPI,
    where this machine has fewer cores than the job's ranks (and only there)."""
    import os
    import sys

    from conftest import mpi_env, mpiexec_prefix, run_job

    ranks = 4
    app = tmp_path / "app.py"
    app.write_text("import os\n"
                   "from hpcckpt import run_main\n\n"
                   "def main():\n"
                   "    from mpi4py import MPI\n"
                   "    with open(f'rank{MPI.COMM_WORLD.Get_rank()}.txt', 'w') as f:\n"
                   "        f.write(str(os.environ.get('MPIR_CVAR_ENABLE_HEAVY_YIELD')))\n\n"
                   "raise SystemExit(run_main(main))\n")
    env = mpi_env()
    del env["MPIR_CVAR_ENABLE_HEAVY_YIELD"]  # the test jobs' own setting, left to the library here
    proc = run_job([*mpiexec_prefix(), "-n", str(ranks), sys.executable, str(app)], tmp_path, env, 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = "1" if ranks > (os.cpu_count() or 1) else "None"
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(ranks)] == [expected] * ranks
