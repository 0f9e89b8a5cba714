"""The job scripts' shell logic without a scheduler: shellcheck over every script, and the
node placement of jobs/restart-loop.sh (which node runs which ranks after a failure)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import REPO

SCRIPTS = sorted(str(p.relative_to(REPO)) for pattern in ("jobs/*.sh", "jobs/*.sbatch", "jobs/*.pbs",
                                                          "tests/slurm/*.sh")
                 for p in REPO.glob(pattern))


def _shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "shellcheck"], capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=300)
        found = shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck is not installed and cannot be (Debian package shellcheck; .ci/run installs it)")
    return found


def test_every_job_script_passes_shellcheck():
    assert "jobs/slurm.sbatch" in SCRIPTS and "jobs/pbs.pbs" in SCRIPTS and "jobs/restart-loop.sh" in SCRIPTS
    proc = subprocess.run([_shellcheck(), "-x", *SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def place(placement: list[str], usable: list[str], allow_shrink: str = "1") -> tuple[int, list[str], str]:
    """Run hpcckpt_place_nodes: (its status, the new placement, what it said)."""
    script = (f'. "{REPO}/jobs/restart-loop.sh"; HPCCKPT_PLACEMENT=({" ".join(placement)}); '
              f'hpcckpt_place_nodes "$(printf "%s\\n" {" ".join(usable)})"; status=$?; '
              'echo "PLACED ${HPCCKPT_PLACEMENT[*]}"; exit $status')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "ALLOW_SHRINK": allow_shrink})
    placed = next(line for line in proc.stdout.splitlines() if line.startswith("PLACED")).split()[1:]
    return proc.returncode, placed, proc.stdout


def test_nodes_that_survive_keep_their_place():
    assert place(["n1", "n2", "n3", "n4"], ["n1", "n2", "n3", "n4", "n5"])[:2] == (0, ["n1", "n2", "n3", "n4"])


def test_a_spare_takes_the_failed_node_s_place_in_rank_order():
    status, placed, said = place(["n1", "n2", "n3", "n4"], ["n1", "n2", "n4", "n5"])
    assert (status, placed) == (0, ["n1", "n2", "n5", "n4"])
    assert "node n3 failed or left the allocation: spare node n5 takes its place" in said


def test_spares_are_used_in_order_for_several_failures():
    status, placed, _ = place(["a", "b", "c", "d"], ["b", "d", "x", "y", "z"])
    assert (status, placed) == (0, ["x", "b", "y", "d"])


def test_without_a_spare_the_failed_node_s_place_goes():
    status, placed, said = place(["n1", "n2", "n3", "n4"], ["n1", "n2", "n4"])
    assert (status, placed) == (0, ["n1", "n2", "n4"])
    assert "no spare node is left: going on without it" in said and "next attempt on 3 node(s): n1 n2 n4" in said


def test_without_a_spare_and_allow_shrink_0_the_job_stops():
    status, placed, said = place(["n1", "n2", "n3", "n4"], ["n1", "n2", "n4"], allow_shrink="0")
    assert status == 1 and placed == ["n1", "n2", "n3", "n4"]
    assert "ALLOW_SHRINK=0: stopping" in said


def test_no_usable_node_left_stops_the_job():
    status, _, said = place(["n1", "n2"], [])
    assert status == 1 and "no usable node is left" in said
