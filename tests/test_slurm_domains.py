"""Failure domains under a real Slurm: 8 nodes under 2 leaf switches of 4 (tests/slurm/up.sh with
SWITCH_SIZE=4 and topology/tree, so every task gets SLURM_TOPOLOGY_ADDR), jobs/slurm.sbatch
running examples/heat2d.py (its grid is bit-identical whatever the rank count, so a run that
ends on the uninterrupted grid restored exactly what was saved).

- A whole switch fails (its 4 nodes, with their disks): with L2 partners placed in the other
  switch the job goes on on the 4 nodes left from L1/L2 alone (placement by node only loses
  those copies with the switch: tests/test_failure_domains_mpi.py shows it on simulated nodes).
- The node running the batch script fails: a guard job on another node requeues the job,
  which restarts under the same job id from what the surviving nodes and L4 hold.

Needs root and Debian's slurm packages, as tests/test_slurm_jobs.py.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, mpi_env, mpiexec_prefix
from test_slurm_jobs import (SLURM, _run, ensure_all_nodes_up, fail_node, job_info, submit, the_test_cluster,
                             wait_for, wait_for_step)

NODES, SWITCH_SIZE = 8, 4
HEAT2D = REPO / "examples" / "heat2d.py"
HEAT2D_ARGS = ("--run-dir run --shape 160 160 --iterations 2000 --tol 0 --every 100 --dump grids "
               "--set resilience.group_size=4 --set resilience.parity=1")


def _switches_env() -> dict:
    return dict(os.environ, SWITCH_SIZE=str(SWITCH_SIZE), CRED_EXPIRE="10")


def _up():
    return _run(["bash", str(SLURM / "up.sh"), str(NODES)], timeout=600, env=_switches_env())


@pytest.fixture(scope="module")
def switches():
    """The test cluster with its two leaf switches, up for this module; down at its end."""
    with the_test_cluster(NODES, env=_switches_env()):
        yield


@pytest.fixture
def cluster(switches):
    """Every test starts with all nodes up, whatever the test before did to them."""
    ensure_all_nodes_up(NODES, _up)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """heat2d's final grid run straight through (mpiexec here, 2 ranks)."""
    directory = tmp_path_factory.mktemp("heat2d-straight")
    command = [*mpiexec_prefix(), "-n", "2", sys.executable, str(HEAT2D), *HEAT2D_ARGS.split(), "--nodes", "2"]
    proc = _run(command, cwd=directory, env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return directory / "grids" / "final.npy"


def workdir(tmp_path: Path) -> Path:
    directory = tmp_path / "submit"
    directory.mkdir()
    shutil.copytree(REPO / "jobs", directory / "jobs", symlinks=False)
    return directory


def heat2d_job(directory: Path, *sbatch_args: str, **settings) -> int:
    return submit(directory, *sbatch_args, "--ntasks-per-node=1",
                  APP=f"{sys.executable} {HEAT2D} {HEAT2D_ARGS} --nodes 0", **settings)


def lose_switch(job: int, directory: Path, nodes) -> None:
    """All the switch's nodes at once, as its failure takes them, with their disks."""
    import subprocess

    failing = [subprocess.Popen(["bash", str(SLURM / "fail-node.sh"), node], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for node in nodes]
    for proc in failing:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    for node in nodes:
        shutil.rmtree(directory / "scratch" / "hpcckpt-root" / str(job) / node, ignore_errors=True)


def same_grid(directory: Path, straight: Path) -> bool:
    import numpy as np

    return np.load(directory / "grids" / "final.npy").tobytes() == np.load(straight).tobytes()


def test_a_lost_switch_is_restored_from_partners_in_the_other_switch(cluster, tmp_path, straight):
    directory = workdir(tmp_path)
    job = heat2d_job(directory, "--nodes=8")
    wait_for_step(directory, job, 600)
    lose_switch(job, directory, ["n5", "n6", "n7", "n8"])
    code, out = wait_for(job, directory, timeout=300)
    assert code == 0, out
    assert "failure domains: 2 (top.s1 (4 node(s)), top.s2 (4 node(s))), L2 partner copies in another domain for " \
           "8 of 8 rank(s)" in out, out
    # Groups of 4 from two switches of 4 cannot keep a switch to parity 1: said, naming them.
    assert "L3 erasure groups of 4+ ranks with parity 1 cannot keep each failure domain to 1 member(s)" in out
    # Where an attempt is placed while slurmctld has marked only some of the switch's nodes
    # down is Slurm's timing; an attempt placed on a failed node cannot start and the loop
    # places the next one again. The attempt that finished ran on the other switch alone: on
    # all of it, unless Slurm also drained some of its nodes (a loaded machine: "Kill task
    # failed" when a step's ranks do not end in time), and then on what it left.
    placements = re.findall(r"next attempt on \d+ node\(s\): ([^\n]*)", out)
    last = placements[-1].split() if placements else []
    assert last and set(last) <= {"n1", "n2", "n3", "n4"}, out
    restored = re.findall(r"restored version \d+ \(written by 8 ranks\) onto (\d+) rank\(s\): old shards ([^\n]*)",
                          out)
    assert restored and int(restored[-1][0]) == len(last), out
    assert "failure domain(s) lost whole: top.s2" in restored[-1][1], out
    if len(last) == 4:  # the whole surviving switch: its partner copies hold the lost switch's shards
        assert "L4" not in restored[-1][1] and "4 from L2 partner" in restored[-1][1], out
    attempts = re.search(r"finished after (\d+) attempt\(s\)", out)
    assert attempts and int(attempts.group(1)) >= 2, out
    assert same_grid(directory, straight)


def test_a_failed_batch_node_requeues_the_job_which_restarts_from_what_survived(cluster, tmp_path, straight):
    directory = workdir(tmp_path)
    job = heat2d_job(directory, "--nodes=4", GUARD_INTERVAL=1)
    wait_for_step(directory, job, 600)
    # Which of the 8 nodes Slurm gives a 4-node job is its choice: the one running the batch
    # script is the one to fail.
    batch_host = job_info(job)["BatchHost"]
    fail_node(batch_host, job, directory)
    code, out = wait_for(job, directory, timeout=300, completing_is_done=False)
    assert code == 0, out
    assert re.search(rf"guard job \d+ watches the batch node {batch_host} from another node: if it fails, this job is "
                     "requeued", out), out
    assert f"the node running the batch script ({batch_host}) failed: requeueing job {job}" in out
    assert "requeued (1 time(s)): restarting from the surviving checkpoint levels" in out
    # Where the requeued job runs is Slurm's choice (topology/tree prefers one whole switch):
    # the surviving nodes' files, or L4 where it got other nodes.
    assert re.search(r"restored version \d+", out), out
    assert job_info(job)["BatchHost"] != batch_host
    assert same_grid(directory, straight)
