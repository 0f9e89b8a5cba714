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
