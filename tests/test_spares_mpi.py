"""Spare ranks that take dead ranks' places in the job (run/spares.py), on real ranks of the
ULFM MPI: the job goes on at its size and ends on the failure-free run's state."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, mpi_env, read_metrics, run_mpi, run_ulfm, run_ulfm_script, script_results

SURVIVING_APP = REPO / "tests" / "scripts" / "surviving_app.py"
APP_ARGS = ["4", "60", "--set", "checkpoint.every_steps=10"]
DIGESTS = ("weights", "field", "residuals", "step")
JOB = str(REPO / "jobs" / "local.toml")


def final_weights(out: str) -> str:

    found = re.findall(r"weights ([0-9a-f]{16}) \(identical on all ranks\)", out)
    assert len(found) == 1, out[-3000:]
    return found[0]


def events(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == kind]


def app_result(proc) -> dict:
    results = script_results(proc)
    assert len(results) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results[0]


@pytest.fixture(scope="module")
def failure_free_weights(tmp_path_factory) -> str:
    """The README job's final weights on 4 ranks (mpich wheel), no failure, no spare."""
    directory = tmp_path_factory.mktemp("straight")
    proc = run_mpi(4, ["train", "-c", JOB, "--set", f"run.dir={directory / 'run'}"], directory)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return final_weights(proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The solver's end on 4 ranks of the ULFM MPI, no failure, no spare."""
    directory = tmp_path_factory.mktemp("solver")
    proc = run_ulfm_script(4, SURVIVING_APP, [str(directory / "run"), *APP_ARGS], directory)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return app_result(proc)


@pytest.mark.parametrize("fault, place, from_memory", [
    ("rank-kill:rank=2:step=75:attempt=1", 2, True),  # mid-step
    ("rank-kill:rank=0:step=75:attempt=1", 0, True),  # rank 0: the run's records and lease
    ("rank-kill:rank=1:step=100:phase=partner:attempt=1", 1, None),  # inside a checkpoint's L2 copies
], ids=["mid-step", "rank-0", "mid-checkpoint"])
def test_the_trainer_with_a_spare_ends_at_its_size_on_the_failure_free_weights(tmp_path, failure_free_weights,
                                                                                fault, place, from_memory):
    """5 ranks, one of them a spare: a rank dies and the spare takes its place, so the job ends
    on 4 ranks, from one launcher, on the weights of the run that lost nothing, byte for byte
    (every array replicated: the spare is handed the step the survivors hold, no version
    read)."""
    proc = run_ulfm(5, ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}", "--set", "resilience.spares=1",
                        "--inject", fault], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"spare(s) took place(s) {place}: going on in the job on 4 rank(s), 0 spare(s) left" in out, out[-3000:]
    assert final_weights(out) == failure_free_weights
    if from_memory:
        assert "held in memory by the 3 survivor(s) and handed to 1 spare(s) in dead ranks' places: no version " \
               "read" in out, out[-3000:]
    [failure] = events(tmp_path / "run", "process_failure")
    assert (failure["lost_ranks"], failure["ranks_left"]) == ([place], 4), failure
    [spares] = events(tmp_path / "run", "spares")
    assert (spares["filled"], spares["given_up"], spares["spares_left"]) == ({str(place): 4}, [], 0), spares
    report = subprocess.run([sys.executable, "-m", "hpcckpt", "report", "-c", JOB, "--set",
                             f"run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=mpi_env(), capture_output=True,
                            text=True)
    assert f"attempt 2: in the job after rank(s) {place} died (4 rank(s) left; spare(s) took place(s) {place}; 0 " \
           f"spare(s) left, shrunk in" in report.stdout, report.stdout + report.stderr


def test_a_spare_taking_a_place_clears_what_an_earlier_attempt_left_on_its_node(tmp_path, failure_free_weights):
    """An earlier attempt in which the spare held place 2 died while writing version 110 there
    (every 50 steps from version 60): its shard of 110 stayed on the spare's node, uncommitted
    (planted here). No restart tidies an idle spare's node, and the spare, taking place 2
    again, goes on from memory, no version read: without its own tidy, its write of version
    110 met the old file (files are never overwritten) and the job ended."""
    job = ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}", "--set", "resilience.spares=1"]
    first = run_ulfm(5, [*job, "--set", "run.steps=60"], tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    [run_id] = {p.name for p in (tmp_path / "run" / "local" / "node0").glob("run-*")}
    leftover = tmp_path / "run" / "local" / "node4" / run_id / "v000000000110" / "shard-r00002.hck"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"an earlier attempt's shard, cut short by its node's death")
    proc = run_ulfm(5, [*job, "--inject", "rank-kill:rank=2:step=75:attempt=1"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "spare(s) took place(s) 2: going on in the job on 4 rank(s), 0 spare(s) left" in out, out[-3000:]
    assert "handed to 1 spare(s) in dead ranks' places: no version read" in out, out[-3000:]
    assert final_weights(out) == failure_free_weights
    said = (tmp_path / "run" / "log" / "rank2.log").read_text()
    assert "rank 2 took a dead rank's place on a node where an earlier attempt left its files of version(s) [110]" \
        in said, said[-3000:]


@pytest.mark.parametrize("victim", [0, 3], ids=["the-sender", "another-survivor"])
def test_a_death_in_the_hand_over_to_a_spare_starts_the_recovery_again_and_the_step_still_comes_from_memory(
        tmp_path, failure_free_weights, victim):
    """4 working ranks and 2 spares: rank 2 dies at step 75 and the first spare takes its place;
    as the survivors begin to hand it the step they hold in memory, another survivor dies:
    rank 0, which sends it the arrays, or rank 3, which sends nothing (the others may then
    finish the hand-over and go on before they meet the death). The recovery starts again: the
    second spare takes the new place, the first is still owed the step, and the 2 survivors
    left hand it to both, no version read. One launcher, 4 ranks to the end, the failure-free
    weights."""
    proc = run_ulfm(6, ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}", "--set", "resilience.spares=2",
                        "--inject", "rank-kill:rank=2:step=75:attempt=1",
                        # a recovery in the job counts as an attempt: the hand-over is the second's
                        "--inject", f"rank-kill:rank={victim}:step=75:phase=handover:attempt=2"], tmp_path,
                    timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"injected rank-kill on rank {victim} (node {victim}) at step 75 in phase handover" in out, out[-3000:]
    assert "held in memory by the 2 survivor(s) and handed to 2 spare(s) in dead ranks' places: no version " \
           "read" in out, out[-3000:]
    assert final_weights(out) == failure_free_weights
    failures = events(tmp_path / "run", "process_failure")
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures] == [([2], 4), ([victim], 4)], failures
    assert [s["filled"] for s in events(tmp_path / "run", "spares")] == [{"2": 4}, {str(victim): 5}]


def test_a_rank_killed_in_a_restart_s_restore_gives_its_place_to_the_spare(tmp_path, failure_free_weights):
    """A job crashed under the mpich wheel (rank 1 at step 170); its relaunch under the ULFM MPI
    with a spare loses rank 3 while loading the newest version: the spare takes its place, the
    restore runs again on 4 ranks, and the run ends on the failure-free weights from one
    launcher."""
    job = ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}"]
    crashed = run_mpi(4, [*job, "--inject", "rank-kill:rank=1:step=170:attempt=1"], tmp_path)
    assert crashed.returncode != 0, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    # Version 150 may still have been in flight behind training when rank 1 died: the relaunch
    # then loads version 100, and rank 3 dies inside whichever it loads.
    proc = run_ulfm(5, [*job, "--set", "resilience.spares=1", "--restart", "auto",
                        "--inject", "rank-kill:rank=3:step=150:phase=restore:attempt=2",
                        "--inject", "rank-kill:rank=3:step=100:phase=restore:attempt=2"], tmp_path,
                    env={"HPCCKPT_ATTEMPT": "2"}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    killed = re.search(r"injected rank-kill on rank 3 \(node 3\) at step (100|150) in phase restore", out)
    assert killed, out[-3000:]
    assert "spare(s) took place(s) 3: going on in the job on 4 rank(s), 0 spare(s) left" in out, out[-3000:]
    assert f"restored version {killed.group(1)}:" in out, out[-3000:]
    assert final_weights(out) == failure_free_weights
    [failure] = events(tmp_path / "run", "process_failure")
    assert (failure["lost_ranks"], failure["ranks_left"]) == ([3], 4), failure


def test_a_whole_simulated_node_s_ranks_lost_at_once_go_to_two_spares(tmp_path, failure_free_weights):
    """4 working ranks on 2 simulated nodes and 2 spares: node 1 is lost at step 75 (both its
    ranks die, its directory is deleted); one recovery gives both places to the spares, and the
    job ends on 4 ranks on the failure-free weights, the step handed over from memory."""
    proc = run_ulfm(6, ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}", "--set", "resilience.spares=2",
                        "--set", "cluster.simulated_nodes=2", "--inject", "node-loss:node=1:step=75:attempt=1"],
                    tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rank(s) 2, 3 of 4 died; spare(s) took place(s) 2, 3: going on in the job on 4 rank(s), 0 spare(s) " \
           "left" in out, out[-3000:]
    assert "held in memory by the 2 survivor(s) and handed to 2 spare(s) in dead ranks' places" in out, out[-3000:]
    assert final_weights(out) == failure_free_weights
    [failure] = events(tmp_path / "run", "process_failure")
    assert (failure["lost_ranks"], failure["ranks_left"]) == ([2, 3], 4), failure
    [spares] = events(tmp_path / "run", "spares")
    assert (spares["filled"], spares["given_up"]) == ({"2": 4, "3": 5}, []), spares


def test_a_solver_s_block_goes_to_the_spare_from_its_partner_with_no_pfs_read(tmp_path, straight):
    """A block-decomposed field: the spare in rank 2's place restores that rank's block of the
    newest version from the partner's copy (rank 2's node-local files are on another node),
    the others theirs from their snapshot buffers where these still hold that version (else
    from L1), and the solver ends on the failure-free state on 4 ranks. L4
    holds every version too, and is not read: the spare's partner and erasure group under the
    job's new placement are not the writer's, and the old shards' route finds the writer's."""
    # Steps of 0.1 s: version 20 is on L4 too before rank 2 dies at step 29.
    proc = run_ulfm_script(5, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--set", "storage.pfs_every=1",
                                              "--set", "checkpoint.keep_pfs=8", "--step-seconds", "0.1",
                                              "--spares", "1", "--kill", "29:2"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    result = app_result(proc)
    assert [entry["ranks"] for entry in result["entries"]] == [4, 4], result
    restored = result["entries"][1]["restored"]
    assert restored in (10, 20), result
    # The buffers hold the version taken last: 20, unless its writes were still going on.
    own = "memory" if restored == 20 else "local"
    said = "memory" if own == "memory" else "L1 local"
    assert f"onto 4 rank(s): old shards 3 from {said}, 1 from L2 partner;" in out, out[-3000:]
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    [restart] = [r for r in events(tmp_path / "run", "restart") if r["attempt"] == 2]
    assert sorted(restart["sources"]) == [own, own, own, "partner"], restart
    # L4 holds the version restored (it keeps every version here), and was not read.
    assert (tmp_path / "run" / "pfs" / f"v{restart['step']:012d}" / "manifest.json").is_file()


def test_a_rank_killed_in_the_restore_the_job_runs_for_a_spare_gives_its_place_to_the_next_spare(
        tmp_path, straight):
    """A block-decomposed field, 4 working ranks and 2 spares: rank 2 dies, the first spare
    takes its place and the job restores the newest version (the spare's block from its
    partner); rank 0 dies inside that restore, the second spare takes place 0 and the restore
    runs again. The solver ends on 4 ranks on the failure-free state."""
    # Version 20 may still be in flight behind the step when rank 2 dies: the job then restores
    # version 10, and rank 0 dies inside whichever restore it runs.
    proc = run_ulfm_script(6, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--spares", "2", "--kill", "25:2",
                                              "--inject", "rank-kill:rank=0:step=20:phase=restore",
                                              "--inject", "rank-kill:rank=0:step=10:phase=restore"], tmp_path,
                           timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"injected rank-kill on rank 0 \(node 0\) at step (10|20) in phase restore", out), out[-3000:]
    result = app_result(proc)
    assert result["ranks"] == 4 and result["entries"][-1]["ranks"] == 4, result
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    failures = events(tmp_path / "run", "process_failure")
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures] == [([2], 4), ([0], 4)], failures
    assert [s["filled"] for s in events(tmp_path / "run", "spares")] == [{"2": 4}, {"0": 5}]


def test_two_deaths_and_one_spare_take_one_place_and_shrink_for_the_other(tmp_path, straight):
    """Rank 0 dies (the spare takes its place, and from then on speaks for the job), then world
    rank 3: no spare is left, and the job shrinks to 3 ranks as it would without spares."""
    proc = run_ulfm_script(5, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--spares", "1", "--kill", "15:0",
                                              "--kill", "45:3"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    result = app_result(proc)
    assert result["entries"][-1]["ranks"] == 3 and result["ranks"] == 3, result
    assert {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    failures = events(tmp_path / "run", "process_failure")
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures] == [([0], 4), ([3], 3)], failures
    spares = events(tmp_path / "run", "spares")
    assert [(s["filled"], s["given_up"]) for s in spares] == [({"0": 4}, []), ({}, [3])], spares
    assert "rank(s) 3 of 4 died; no spare left for place(s) 3: going on in the job on 3 rank(s)" in out


def test_out_of_spares_relaunch_ends_the_job_for_a_relaunch_at_its_size_on_the_failure_free_weights(
        tmp_path, failure_free_weights):
    """resilience.out_of_spares = "relaunch": the first death is the spare's to fill, the second
    finds none left and the survivors end the attempt (exit code 1, said once) instead of
    shrinking; the relaunch (5 ranks again, --restart auto) reads the newest version and ends
    on 4 working ranks on the weights of the run that lost nothing."""
    job = ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}", "--set", "resilience.spares=1",
           "--set", "resilience.out_of_spares=relaunch"]
    exit_file = tmp_path / "exit"
    first = run_ulfm(5, [*job, "--inject", "rank-kill:rank=2:step=75:attempt=1",
                         "--inject", "rank-kill:rank=1:step=160:attempt=2"], tmp_path,
                     env={"HPCCKPT_EXIT_FILE": str(exit_file)})
    out = first.stdout + first.stderr
    assert "spare(s) took place(s) 2: going on in the job on 4 rank(s), 0 spare(s) left" in out, out[-3000:]
    assert exit_file.read_text().startswith("exit_code=1\n"), out[-3000:]
    assert out.count("it may not shrink (resilience.out_of_spares = \"relaunch\")") == 1, out[-3000:]
    assert "identical on all ranks" not in out, out[-3000:]  # it did not finish
    again = run_ulfm(5, [*job, "--restart", "auto"], tmp_path)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    # The newest version every rank finished: 150, or 100 where 150's persist was still running
    # when the second rank died (a busy machine)
    restored = re.search(r"restored version (\d+)", out)
    assert restored and int(restored.group(1)) in (100, 150), out[-3000:]
    assert final_weights(out) == failure_free_weights
    assert [(f["lost_ranks"], f["ranks_left"]) for f in events(tmp_path / "run", "process_failure")] == \
        [([2], 4), ([1], 3)]


def test_a_spare_that_dies_idle_stops_no_work_and_is_not_replaced(tmp_path, straight):
    """The spare SIGKILLs itself while the workers run: they go on undisturbed (no recovery for
    an idle spare's death) and end on 4 ranks; a worker dying after it finds no spare left, and
    the recovery counts the dead spare."""
    slow = ["--spares", "1", "--spare-dies-after", "1.0", "--step-seconds", "0.05"]
    alone = tmp_path / "alone"
    alone.mkdir()
    proc = run_ulfm_script(5, SURVIVING_APP, [str(alone / "run"), *APP_ARGS, *slow], alone)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert [entry["ranks"] for entry in result["entries"]] == [4] and result["ranks"] == 4, result
    assert events(alone / "run", "process_failure") == []
    then = tmp_path / "then"
    then.mkdir()
    proc = run_ulfm_script(5, SURVIVING_APP, [str(then / "run"), *APP_ARGS, *slow, "--kill", "40:2"], then)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert result["ranks"] == 3 and {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    [spares] = events(then / "run", "spares")
    assert (spares["given_up"], spares["spares_lost"], spares["spares_left"]) == ([2], 1, 0), spares


def test_spares_are_refused_where_no_rank_could_take_a_place(tmp_path):
    """Under the mpich wheel no rank survives a death in the job, so a spare could never take a
    place: refused with exit 2, as is a job of spares only."""
    proc = run_mpi(2, ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run'}", "--set", "resilience.spares=1",
                       "--set", "cluster.simulated_nodes=1"], tmp_path)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resilience.spares = 1: spare ranks take dead ranks' places in the job, which needs in-job recovery" \
        in proc.stderr, proc.stderr[-3000:]
    proc = run_mpi(2, ["train", "-c", JOB, "--set", f"run.dir={tmp_path / 'run2'}", "--set", "resilience.spares=2"],
                   tmp_path)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resilience.spares = 2 but the job has 2 rank(s): mpiexec -n counts the spares too" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "run2").exists() or not any((tmp_path / "run2").rglob("v0*"))


def test_an_error_of_the_application_ends_the_job_and_releases_the_idle_spare(tmp_path):
    """main's own error (no rank died) ends the job as without spares: the idle spare is
    released rather than left waiting (a hang), and never runs main."""
    exit_file = tmp_path / "exit"
    proc = run_ulfm_script(5, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--spares", "1", "--fail-at", "21"],
                           tmp_path, timeout=120, env={"HPCCKPT_EXIT_FILE": str(exit_file)})
    assert exit_file.read_text().startswith("exit_code=1\n"), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RuntimeError is not a process failure MPI confirmed; the job ends" in proc.stderr, proc.stderr[-3000:]
    assert not script_results(proc) and not events(tmp_path / "run", "process_failure"), proc.stdout[-3000:]


def test_the_spare_that_took_a_place_dies_too_and_the_next_death_is_still_seen(tmp_path, straight):
    """World rank 1 dies (the spare, world rank 4, takes place 1), then world rank 4 itself,
    then world rank 2: each death is a recovery of its own, the last two shrinking (4 -> 3 ->
    2), and the state ends as the failure-free run's. The second recovery must not hide the
    third death from the workers' failure detection."""
    proc = run_ulfm_script(5, SURVIVING_APP, [str(tmp_path / "run"), *APP_ARGS, "--spares", "1", "--kill", "15:1",
                                              "--kill", "30:4", "--kill", "45:2"], tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = app_result(proc)
    assert result["ranks"] == 2 and {key: result[key] for key in DIGESTS} == {key: straight[key] for key in DIGESTS}
    failures = events(tmp_path / "run", "process_failure")
    assert [(f["lost_ranks"], f["ranks_left"]) for f in failures] == [([1], 4), ([1], 3), ([1], 2)], failures
    assert [s["filled"] for s in events(tmp_path / "run", "spares")] == [{"1": 4}, {}, {}]


def test_max_recoveries_counts_a_spare_s_recoveries_alike(tmp_path):
    """run_surviving(max_recoveries=1) with a spare: the first death is recovered from (the spare
    takes the place), the second ends the job for a relaunch on every rank, the former spare
    included, which counted the first recovery too."""
    exit_file = tmp_path / "exit"
    args = [str(tmp_path / "run"), *APP_ARGS, "--spares", "1", "--kill", "15:1", "--kill", "45:4",
            "--max-recoveries", "1"]
    proc = run_ulfm_script(5, SURVIVING_APP, args, tmp_path, timeout=120, env={"HPCCKPT_EXIT_FILE": str(exit_file)})
    assert not script_results(proc), proc.stdout[-3000:]
    assert "the job ends for a relaunch" in proc.stderr, proc.stderr[-3000:]
    assert exit_file.read_text().startswith("exit_code=1\n")
    assert [(f["lost_ranks"], f["ranks_left"]) for f in events(tmp_path / "run", "process_failure")] == [([1], 4)]
