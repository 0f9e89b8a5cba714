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


def loop_over(launch: str, tmp_path, **settings) -> subprocess.CompletedProcess:
    """hpcckpt_restart_loop with `launch` as hpcckpt_launch's body (a stand-in for the launcher
    and its ranks), EXIT_DIR in tmp_path."""
    script = (f'. "{REPO}/jobs/restart-loop.sh"; hpcckpt_launch() {{ {launch}; }}; hpcckpt_replan() {{ :; }}; '
              'hpcckpt_restart_loop')
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={**os.environ, "EXIT_DIR": str(tmp_path), "RESTART_DELAY": "0", "MAX_RESTARTS": "2",
                               "HPCCKPT": "true", **settings})


def test_with_exit_records_required_a_zero_without_one_is_a_failure_and_with_one_the_end(tmp_path):
    """Open MPI's runtime exits 0 when it ends a job whose node daemon it lost: under
    EXIT_RECORD_REQUIRED=1 (LAUNCHER=ulfm) that attempt is retried; one whose ranks recorded 0
    (the survivors' rank 0 after an in-job recovery) finished. Without the setting a 0 stands."""
    first_lost = ('if [ "$HPCCKPT_ATTEMPT" = 1 ]; then exit 0; fi; '
                  'printf "exit_code=0\\nrank=0\\nmessage=\\n" > "$HPCCKPT_EXIT_FILE"; exit 0')
    proc = loop_over(first_lost, tmp_path, EXIT_RECORD_REQUIRED="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the launcher returned 0 but no rank recorded how attempt 1 ended" in proc.stdout, proc.stdout
    assert "finished after 2 attempt(s)" in proc.stdout, proc.stdout
    never_recorded = loop_over("exit 0", tmp_path, EXIT_RECORD_REQUIRED="1")
    assert never_recorded.returncode == 1 and "giving up after 2 restart(s)" in never_recorded.stdout, \
        never_recorded.stdout
    assert "finished after 1 attempt(s)" in loop_over("exit 0", tmp_path).stdout


def test_an_unknown_launcher_is_refused_with_exit_code_2(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "jobs" / "slurm.sbatch")], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "LAUNCHER": "mpirun"}, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "LAUNCHER=mpirun: use srun (the default) or ulfm" in proc.stdout
