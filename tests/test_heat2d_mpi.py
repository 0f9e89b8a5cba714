"""The example application: examples/heat2d.py, a Jacobi solver on a block-decomposed grid
with halo exchange, checkpointed on all four levels. Killed mid-run on 4 ranks (one rank dies
as in a node crash, at iteration 350: versions 100-300 are saved), then restarted on 4 ranks
(the grid ends bit-identical to an uninterrupted run's), on 3 ranks after losing a node (from
the node-local levels) and on 6: the restored global grid equals the one saved, byte for
byte, and the run converges to the same answer within tolerance. Stopped by a signal or a
halt file: every rank after the same iteration, a final version on L4, exit 75, and the
resumed run ends bit-identical. The interval chosen by the library ("auto", Young/Daly). A
solution that blows up rewound in process by the library's divergence check."""

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, assert_ok, mpi_env, mpiexec_prefix, run_script, run_ulfm_script, script_results

HEAT2D = REPO / "examples" / "heat2d.py"
TOL = 1e-4


def heat2d(tmp_path: Path, ranks: int, nodes: int, *extra):
    return run_script(ranks, HEAT2D, ["--run-dir", str(tmp_path / "run"), "--nodes", str(nodes), "--tol", str(TOL),
                                      *extra], cwd=tmp_path)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("heat2d")
    proc = heat2d(tmp_path, 4, 4, "--every", "100", "--dump", str(tmp_path / "grids"))
    assert_ok(proc)
    [result] = script_results(proc)
    assert result["restored"] is None and result["change"] <= TOL and result["iteration"] > 400
    return tmp_path / "grids"


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("heat2d-crashed")
    proc = heat2d(tmp_path, 4, 4, "--every", "100", "--crash-at", "350")
    assert proc.returncode != 0 and not script_results(proc)
    return tmp_path / "run"


@pytest.mark.parametrize("ranks, nodes, lose", [(4, 4, ()), (3, 3, (1,)), (6, 3, ())])
def test_a_killed_run_restarts_on_any_rank_count(uninterrupted, crashed, tmp_path, ranks, nodes, lose):
    shutil.copytree(crashed, tmp_path / "run")
    for node in lose:
        shutil.rmtree(tmp_path / "run" / "local" / f"node{node}")
    proc = heat2d(tmp_path, ranks, nodes, "--every", "100", "--dump", str(tmp_path / "grids"))
    assert_ok(proc)
    [result] = script_results(proc)
    step = result["restored"]
    assert step in (200, 300) and result["started"] == step, result
    if lose:
        sources = set(result["sources"])  # the level each old rank's shard came from
        assert "pfs" not in sources and sources & {"partner", "erasure"}, sources
    restored = np.load(tmp_path / "grids" / "restored.npy")
    assert restored.tobytes() == np.load(uninterrupted / f"step-{step}.npy").tobytes()
    final, expected = np.load(tmp_path / "grids" / "final.npy"), np.load(uninterrupted / "final.npy")
    assert result["change"] <= TOL
    if ranks == 4:
        assert final.tobytes() == expected.tobytes()
    else:
        assert np.max(np.abs(final - expected)) <= TOL


def test_the_auto_interval_is_chosen_and_logged_and_young_daly_with_an_mtbf(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    auto = heat2d(tmp_path / "a", 4, 4)
    assert_ok(auto)
    assert re.search(r"checkpoint interval now \d+ steps: shortest interval with overhead <= 3.5 %", auto.stdout), \
        auto.stdout
    daly = heat2d(tmp_path / "b", 4, 4, "--set", "checkpoint.mtbf_hours=0.01")
    assert_ok(daly)
    assert re.search(r"checkpoint interval now \d+ steps: Young/Daly: Daly's optimum for C = [0-9.]+ ms and "
                     r"MTBF 0.01 h", daly.stdout), daly.stdout


def _heartbeat(run_dir: Path) -> int:
    try:
        return int((run_dir / "heartbeat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _stopped_run(tmp_path: Path, request) -> tuple[subprocess.CompletedProcess, int]:
    """heat2d on 4 ranks, asked to stop by `request(process)` once past iteration 200."""
    run_dir = tmp_path / "run"
    command = [*mpiexec_prefix(), "-n", "4", sys.executable, str(HEAT2D), "--run-dir", str(run_dir), "--nodes", "4",
               "--tol", str(TOL), "--every", "100"]
    process = subprocess.Popen(command, cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.time() + 120
        while _heartbeat(run_dir) < 200 and process.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        asked_at = _heartbeat(run_dir)
        request(process)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), asked_at


@pytest.mark.parametrize("how", ["SIGUSR1", "halt file"])
def test_a_stop_request_ends_every_rank_after_the_same_iteration_and_the_resumed_run_is_identical(
        uninterrupted, tmp_path, how):
    run_dir = tmp_path / "run"
    if how == "SIGUSR1":
        # To mpiexec, as the job scripts send it: the mpich wheel's launcher passes it on to the
        # ranks, whose MPI_Init installed a handler that swallows it unless hpcckpt catches it.
        request = lambda process: process.send_signal(signal.SIGUSR1)  # noqa: E731
    else:
        request = lambda process: (run_dir / "HALT").write_text("maintenance at noon\n")  # noqa: E731
    stopped, asked_at = _stopped_run(tmp_path, request)
    assert stopped.returncode == 75, f"{stopped.returncode}\n{stopped.stdout}\n{stopped.stderr}"
    [result] = script_results(stopped)
    stop = result["iteration"]
    assert 200 <= asked_at <= stop < 815, (asked_at, result)
    reason = "SIGUSR1 received" if how == "SIGUSR1" else f"halt file {run_dir / 'HALT'} (maintenance at noon)"
    assert result["stopped"] == reason
    said = f"stopped cleanly after step {stop}: {reason}; its final checkpoint (step {stop}) is durable on the PFS"
    assert said in stopped.stdout
    for rank in range(4):  # every rank stopped after the same iteration
        assert f"stopped cleanly after step {stop}: " in (run_dir / "log" / f"rank{rank}.log").read_text()
    assert (run_dir / "pfs" / f"v{stop:012d}" / "manifest.json").is_file()
    if how == "halt file":
        assert not (run_dir / "HALT").exists() and "removed the halt file" in stopped.stdout

    resumed = heat2d(tmp_path, 4, 4, "--every", "100", "--dump", str(tmp_path / "grids"))
    assert_ok(resumed)
    [again] = script_results(resumed)
    assert again["restored"] == stop and again["stopped"] is None
    final = np.load(tmp_path / "grids" / "final.npy")
    assert final.tobytes() == np.load(uninterrupted / "final.npy").tobytes()


def test_a_solution_that_blows_up_is_rewound_in_process_and_ends_on_the_uninterrupted_grid(uninterrupted, tmp_path):
    # A NaN enters one block at iteration 250; the sweep after spreads it, the library's check
    # (Checkpointer.observe) sees the change is not finite, and the solver goes back to version
    # 200 without a relaunch.
    proc = heat2d(tmp_path, 4, 4, "--every", "100", "--poison-at", "250", "--dump", str(tmp_path / "grids"),
                  "--set", "resilience.rewind_on_divergence=true")
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "rewound from step 251 to version 200: non-finite loss (inf) at step 251" in out, out[-3000:]
    final = np.load(tmp_path / "grids" / "final.npy")
    assert final.tobytes() == np.load(uninterrupted / "final.npy").tobytes()
    # Without rewinds the solver stops there, nothing non-finite saved.
    (tmp_path / "stopped").mkdir()
    stopped = heat2d(tmp_path / "stopped", 4, 4, "--every", "100", "--poison-at", "250")
    assert stopped.returncode == 2, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert "step 251: the run diverged (non-finite loss (inf) at step 251)" in stopped.stdout + stopped.stderr



def test_a_spare_takes_the_dead_rank_s_block_from_its_partner_and_the_grid_ends_as_uninterrupted(uninterrupted,
                                                                                                 tmp_path):
    """5 ranks of the fault-tolerant MPI, the last a spare: the last worker dies at iteration 350
    (versions 100-300 durable), the spare takes its place in the job, so the grid keeps its 2 x 2
    cut; version 300 is restored onto the same ranks, the spare's block from the partner's copy
    (its rank's node-local files are on another node), the survivors' blocks from their
    snapshot buffers (they still hold version 300, checked against its checksums), none from
    the PFS; the grid ends bit-identical to the uninterrupted run's, from one launch."""
    # The spare comes from the job's config, as the job scripts' SPARE_RANKS hands it over.
    proc = run_ulfm_script(5, HEAT2D, ["--run-dir", str(tmp_path / "run"), "--nodes", "4", "--tol", str(TOL),
                                       "--every", "100", "--crash-at", "350", "--dump", str(tmp_path / "grids")],
                           tmp_path, env={"HPCCKPT_RESILIENCE_SPARES": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "spare(s) took place(s) 3: going on in the job on 4 rank(s), 0 spare(s) left" in out, out[-3000:]
    [result] = script_results(proc)
    assert result["ranks"] == 4 and result["restored"] == 300, result
    assert sorted(result["sources"]) == ["memory", "memory", "memory", "partner"], result
    assert "old shards 3 from memory, 1 from L2 partner" in out, out[-3000:]
    final = np.load(tmp_path / "grids" / "final.npy")
    assert final.tobytes() == np.load(uninterrupted / "final.npy").tobytes()


def test_out_of_spares_relaunch_ends_the_job_instead_of_shrinking_and_the_relaunch_ends_as_uninterrupted(
        uninterrupted, tmp_path):
    """resilience.out_of_spares = "relaunch" reaches the example's run_surviving: under the
    fault-tolerant MPI with no spare, the last rank's death at iteration 350 ends the job
    (exit 1, no shrink to 3 ranks and a new cut); the relaunch at 4 ranks restores version 300
    and ends bit-identical to the uninterrupted run."""
    args = ["--run-dir", str(tmp_path / "run"), "--nodes", "4", "--tol", str(TOL), "--every", "100",
            "--set", "resilience.out_of_spares=relaunch", "--dump", str(tmp_path / "grids")]
    first = run_ulfm_script(4, HEAT2D, [*args, "--crash-at", "350"], tmp_path)
    out = first.stdout + first.stderr
    assert first.returncode == 1, out[-3000:]
    assert 'it may not shrink (resilience.out_of_spares = "relaunch")' in out, out[-3000:]
    assert not script_results(first), out[-3000:]
    again = run_ulfm_script(4, HEAT2D, args, tmp_path, env={"HPCCKPT_ATTEMPT": "2"})
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    [result] = script_results(again)
    assert result["ranks"] == 4 and result["restored"] == 300, result
    final = np.load(tmp_path / "grids" / "final.npy")
    assert final.tobytes() == np.load(uninterrupted / "final.npy").tobytes()
