"""The job scripts as users run them: restart loops, a node-loss demo, clean stops on signals
and before the allocation ends, and versions whose restart crashed. Real mpiexec ranks."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


from conftest import (REPO, assert_ok, final_record, mpi_env, mpiexec_prefix, read_metrics, run_job, run_mpi,
                      small_job)


def script_env(tmp_path: Path, **extra) -> dict:
    env = mpi_env()
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "HPCCKPT_ATTEMPT"):
        env.pop(name, None)
    env.update(HPCCKPT=f"{shlex.quote(sys.executable)} -m hpcckpt",
               MPIEXEC=" ".join(shlex.quote(p) for p in mpiexec_prefix()), RESTART_DELAY="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_job_script(script: str, tmp_path: Path, timeout: float = 400, **extra) -> subprocess.CompletedProcess:
    # A hang is a finding: run_job says where every rank of the job was before ending them.
    return run_job(["bash", str(REPO / "jobs" / script)], tmp_path, script_env(tmp_path, **extra), timeout)


def job(tmp_path: Path, **sections) -> Path:
    base = dict(checkpoint={"every_steps": 5, "keep_local": 2, "keep_pfs": 3, "split_threshold_kb": 4},
                storage={"pfs_every": 2}, resilience={"levels": ["local", "partner", "pfs"]},
                cluster={"simulated_nodes": 2})
    for key, values in sections.items():
        base.setdefault(key, {}).update(values)
    return small_job(tmp_path, **base)


def straight_digest(tmp_path: Path, config: Path, n: int = 4) -> str:
    """The weights of the same job run without any failure, for comparison."""
    clean = tmp_path / "clean"
    clean.mkdir()
    assert_ok(run_mpi(n, ["train", "-c", str(config), "--set", f"run.dir={clean / 'run'}"], cwd=clean))
    return final_record(clean / "run")["weights_digest"]


def run_with_faults(tmp_path: Path, config: Path, *faults: str) -> str:
    """The job script with each of `faults` injected (--inject); its output, once it ended well."""
    proc = run_job_script("slurm.sbatch", tmp_path, CONFIG=config,
                          TRAIN_ARGS=" ".join(f"--inject {fault}" for fault in faults))
    assert_ok(proc)
    return proc.stdout + proc.stderr


HEAT2D = REPO / "examples" / "heat2d.py"


def test_the_job_script_runs_any_application_and_restarts_it_after_a_crash(tmp_path):
    """APP instead of `hpcckpt train`: heat2d loses its last rank at iteration 350 in the
    first attempt; the loop starts it again, it resumes from version 300 and ends on the grid
    of an uninterrupted run."""
    heat = f"{shlex.quote(sys.executable)} {HEAT2D} --run-dir run --nodes 4 --every 100 --tol 1e-4"
    proc = run_job_script("slurm.sbatch", tmp_path, APP=f"{heat} --crash-at 350 --dump grids")
    assert_ok(proc)
    assert f"attempt 1 (at most 4): {sys.executable} -m hpcckpt exec -- {sys.executable} {HEAT2D}" in proc.stdout
    assert "attempt 1 failed with exit code" in proc.stdout and "finished after 2 attempt(s)" in proc.stdout
    assert "restored version 300: 4 rank(s) from L1 local" in proc.stdout
    clean = tmp_path / "clean"
    clean.mkdir()
    straight = subprocess.run([*mpiexec_prefix(), "-n", "4", *shlex.split(heat), "--dump", "grids"], cwd=clean,
                              env=mpi_env(), capture_output=True, text=True, timeout=240)
    assert_ok(straight)
    import numpy as np

    resumed, expected = np.load(tmp_path / "grids" / "final.npy"), np.load(clean / "grids" / "final.npy")
    assert resumed.tobytes() == expected.tobytes()


def test_a_bad_application_argument_or_setting_is_not_retried(tmp_path):
    heat = f"{shlex.quote(sys.executable)} {HEAT2D} --run-dir run --nodes 4"
    for app, said in ((f"{heat} --every -3", "argument --every: expected auto or a number of iterations >= 1"),
                      (f"{heat} --set checkpoint.keep_local=0", "checkpoint.keep_local: must be > 0, got 0")):
        proc = run_job_script("pbs.pbs", tmp_path, APP=app)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "attempt 1 failed with exit code 2" in proc.stdout and "not retrying" in proc.stdout
        assert "attempt 2" not in proc.stdout
        assert said in proc.stderr + proc.stdout


def test_demo_loses_two_nodes_restarts_and_summarises(tmp_path):
    markers_before = set(REPO.glob(".hpcckpt-exit.*"))  # the demo runs in the repository's root
    proc = run_job_script("demo.sh", tmp_path, RUN_DIR=tmp_path / "demo")
    assert_ok(proc)
    # Each attempt's exit record is read and removed; the report after the loop writes none.
    assert set(REPO.glob(".hpcckpt-exit.*")) == markers_before
    out = proc.stdout
    assert "injected node-loss on rank 1 (node 1) at step 350 in phase snapshot" in proc.stderr
    assert "attempt 2" in out and "finished after 2 attempt(s)" in out
    # The two lost nodes come back from the partner copy and the erasure rebuild.
    assert "restored version 300: 2 rank(s) from L1 local, 1 rank(s) from L2 partner, 1 rank(s) from L3 erasure" in out
    summary = out[out.index("== summary"):]
    for line in ("attempts: 2", "steps done: 400 (finished)", "checkpoints taken: 8",
                 "rebuilt: rank 1: L3 erasure, rank 2: L2 partner", "work lost to failures: 49 step(s)"):
        assert line in summary, summary
    digest = final_record(tmp_path / "demo")["weights_digest"]
    assert digest == straight_digest(tmp_path, REPO / "jobs" / "local.toml")


def _modified_before(path, moment: float) -> bool:
    try:
        return path.stat().st_mtime < moment
    except FileNotFoundError:  # cleaned up meanwhile
        return False


def test_slurm_script_outside_slurm_restarts_after_a_crash_and_finishes(tmp_path):
    from hpcckpt.cluster.shm_orphans import find_orphans

    started = time.time() - 1
    config = job(tmp_path)
    proc = run_job_script("slurm.sbatch", tmp_path, CONFIG=config,
                          TRAIN_ARGS="--inject rank-kill:rank=1:step=20:phase=snapshot:attempt=1")
    assert_ok(proc)
    assert "attempt 1 failed with exit code" in proc.stdout and "finished after 2 attempt(s)" in proc.stdout
    # The killed attempt's MPI shared memory went before the restart (MPICH leaves it behind).
    from mpi4py import MPI

    cleaned = re.search(r"hpcckpt-job: clean-shm: deleted (\d+) orphaned", proc.stdout)
    assert cleaned, proc.stdout
    if "MPICH" in MPI.Get_library_version():
        assert int(cleaned.group(1)) >= 1, proc.stdout
    # This job's first attempt made its segments before the second began: a job of another
    # test, on the other worker, may leave its own afterwards.
    restarted = next(r["time"] for r in read_metrics(tmp_path / "run") if r.get("event") == "restart"
                     and r.get("attempt") == 2)
    assert [path for path in find_orphans(newer_than=started).paths if _modified_before(path, restarted)] == []
    assert "restored version 15" in proc.stdout
    assert final_record(tmp_path / "run")["step"] == 30
    assert final_record(tmp_path / "run")["weights_digest"] == straight_digest(tmp_path, config)


def test_pbs_script_outside_pbs_gives_up_on_bad_config_without_retrying(tmp_path):
    config = job(tmp_path)
    proc = run_job_script("pbs.pbs", tmp_path, CONFIG=config, TRAIN_ARGS="--set run.steps=-1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not retrying" in proc.stdout and "attempt 2" not in proc.stdout
    assert "run.steps: must be > 0" in proc.stderr


def _wait_for_step(run_dir: Path, step: int, process, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, "the job ended before it could be signalled"
        try:
            if int((run_dir / "heartbeat").read_text().split()[0]) >= step:
                return
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the job did not reach step {step} in {timeout} s")


def _signal_after_step(command, env, cwd, step: int, sig=signal.SIGTERM):
    """Start `command`, send `sig` once the run has done `step` steps; (exit code, stdout+stderr)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(Path(cwd) / "run", step, process)
        process.send_signal(sig)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, out + err


def _pfs_versions(run_dir: Path) -> dict[int, bool]:
    pfs = run_dir / "pfs"
    return {int(d.name[1:]): (d / "manifest.json").is_file() for d in pfs.iterdir()
            if d.name.startswith("v") and d.name[1:].isdigit()}


def test_sigterm_to_the_job_script_leaves_a_final_checkpoint_on_the_pfs(tmp_path):
    # Checkpoints every 50 steps, L4 every 4th: the stop lands between them and must still
    # end with the stopping step complete on the PFS.
    config = job(tmp_path, run={"steps": 10 ** 6, "log_every": 1000}, eval={"every_steps": 0},
                 checkpoint={"every_steps": 50}, storage={"pfs_every": 4})
    code, out = _signal_after_step(["bash", str(REPO / "jobs" / "slurm.sbatch")], script_env(tmp_path, CONFIG=config),
                                   tmp_path, 120)
    assert code == 0, out
    assert "got SIGTERM" in out and "stopped cleanly after a final checkpoint on the PFS" in out
    halted = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "halted"][-1]
    assert "received" in halted["reason"]
    stop_step = halted["step"]
    assert _pfs_versions(tmp_path / "run").get(stop_step) is True, _pfs_versions(tmp_path / "run")
    # It resumes from exactly there.
    again = run_mpi(4, ["train", "-c", str(config), "--restart", "require", "--set", f"run.steps={stop_step + 5}"],
                    cwd=tmp_path)
    assert_ok(again)
    assert f"restored version {stop_step}: 4 rank(s) from L1 local" in again.stdout


def test_sigterm_to_mpiexec_stops_all_ranks_after_the_same_step(tmp_path):
    config = job(tmp_path, run={"steps": 10 ** 6, "log_every": 1000}, eval={"every_steps": 0},
                 checkpoint={"every_steps": 0}, resilience={"levels": ["local", "pfs"]})
    # Checkpoints off: the stop is still clean (exit 75), and says the run cannot be resumed.
    command = [*mpiexec_prefix(), "-n", "4", sys.executable, "-m", "hpcckpt", "train", "-c", str(config)]
    code, out = _signal_after_step(command, mpi_env(), tmp_path, 50)
    assert code == 75, out
    assert "stopped cleanly after step" in out and "checkpoints are off" in out
    assert "identical on all ranks" in out


def test_halt_seconds_stops_the_run_before_the_allocation_ends(tmp_path):
    config = job(tmp_path, run={"steps": 10 ** 6, "log_every": 1000, "halt_seconds": 1000.0},
                 eval={"every_steps": 0}, checkpoint={"every_steps": 100})
    end_time = time.time() + 1004.0  # the stop is due about 4 s from now
    proc = run_mpi(4, ["train", "-c", str(config)], cwd=tmp_path, env={"HPCCKPT_RUN_END_TIME": str(end_time)})
    assert proc.returncode == 75, proc.stdout + proc.stderr
    halted = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "halted"][-1]
    assert "run.halt_seconds = 1000" in halted["reason"]
    assert halted["time"] < end_time - 1000.0 + 60  # stopped soon after the halt point, not at the end
    assert _pfs_versions(tmp_path / "run").get(halted["step"]) is True


def test_restarts_under_which_a_node_was_lost_do_not_mark_their_version_failed(tmp_path):
    config = job(tmp_path)
    # Attempts 2 and 3 each lose a node while loading 20: explained by the node, not by the
    # version, so attempt 4 still loads 20 (two counted crashes would have marked it failed).
    out = run_with_faults(tmp_path, config, "rank-kill:rank=1:step=25:phase=snapshot:attempt=1",
                          "node-loss:node=1:step=20:phase=restore:attempt=2",
                          "node-loss:node=0:step=20:phase=restore:attempt=3")
    assert out.count("lost their node-local files since: not counted against it") == 2, out
    assert "is marked failed" not in out and "finished after 4 attempt(s)" in out
    assert "restored version 20" in out
    assert final_record(tmp_path / "run")["weights_digest"] == straight_digest(tmp_path, config)


def test_where_failures_are_frequent_two_crashed_restarts_do_not_give_up_a_version(tmp_path):
    """Failures every 2 s, as configured: two restarts in a row that crash while loading are
    what such failures do more often than not, so the version is tried again, and loaded."""
    config = job(tmp_path, checkpoint={"every_steps": "auto", "mtbf_hours": 2 / 3600})
    # "auto" profiles 5 steps and checkpoints step 6 (waited for); attempt 1 dies after step 7.
    out = run_with_faults(tmp_path, config, "rank-kill:rank=1:step=7:attempt=1",
                          "rank-kill:rank=2:step=6:phase=restore:attempt=2",
                          "rank-kill:rank=3:step=6:phase=restore:attempt=3")
    assert "injected rank-kill on rank 3 (node 1) at step 6 in phase restore" in out
    assert "2 restarts from it in a row" in out and "one every 2 s" in out and "it is tried again" in out, out
    assert "is marked failed" not in out and "finished after 4 attempt(s)" in out
    assert "restored version 6" in out
    ledger = tmp_path / "run" / "restarts.json"  # gone once nothing is left to remember
    assert not ledger.exists() or json.loads(ledger.read_text())["failed"] == {}


def test_a_version_whose_restart_crashed_twice_is_marked_failed_and_skipped(tmp_path):
    config = job(tmp_path)
    # Attempt 1 crashes once the checkpoint of step 20 is durable (the next snapshot waits for
    # it); attempts 2 and 3 crash while loading 20. One crash may be a node dying under the
    # restart: attempt 3 tries 20 again. After the second, attempt 4 must not load 20 again
    # but fall back to 15, and still end bit-identical.
    out = run_with_faults(tmp_path, config, "rank-kill:rank=1:step=25:phase=snapshot:attempt=1",
                          "rank-kill:rank=2:step=20:phase=restore:attempt=2",
                          "rank-kill:rank=3:step=20:phase=restore:attempt=3")
    assert "injected rank-kill on rank 2 (node 1) at step 20 in phase restore" in out
    assert "injected rank-kill on rank 3 (node 1) at step 20 in phase restore" in out
    assert "it is tried once more (one crash may be a node that died under the restart" in out
    assert "version 20 is marked failed: 2 restarts from it in a row" in out and "restored version 15" in out
    assert "finished after 4 attempt(s)" in out
    ledger = json.loads((tmp_path / "run" / "restarts.json").read_text())
    # Set aside, the failed writing of 20 no longer blocks the one attempt 3 wrote.
    assert ledger["failed"] == {} and ledger["pending"] is None
    assert list(ledger["set_aside"]) == ["v000000000020.failed"]
    assert (tmp_path / "run" / "pfs" / "v000000000020.failed").is_dir()
    assert _pfs_versions(tmp_path / "run").get(20) is True  # written again by attempt 3
    assert final_record(tmp_path / "run")["weights_digest"] == straight_digest(tmp_path, config)
