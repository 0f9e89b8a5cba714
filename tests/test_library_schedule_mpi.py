"""What the trainer gets, any application gets (tests/scripts/library_app.py on real ranks):
close() leaves the newest version on L4, the interval chosen by the library ("auto",
Young/Daly), and the exit code a job script reads."""

import re
import shutil

from conftest import REPO, assert_ok, node_local, run_script, script_results

APP = REPO / "tests" / "scripts" / "library_app.py"
LOCAL_AND_PFS = 'resilience.levels=["local","pfs"]'


def app(tmp_path, ranks: int, nodes: int, steps: int, *extra: str):
    return run_script(ranks, APP, [str(tmp_path / "run"), str(nodes), str(steps), *extra], cwd=tmp_path)


def test_close_leaves_the_newest_version_on_l4_and_a_restart_on_fewer_nodes_gets_it(tmp_path):
    """The embedded default config copies every 2nd checkpoint to L4 (storage.pfs_every = 2):
    version 10, the first, is due on L1 only. close() copies it to L4 (verified), so after
    node 3 and its directory are gone, 3 ranks restore it byte for byte."""
    saved = app(tmp_path, 4, 4, 10, "--set", LOCAL_AND_PFS, "--no-due", "--explicit", "10")
    assert_ok(saved)
    [first] = script_results(saved)
    assert first["code"] == 0 and first["stopped"] is None
    assert "drained version 10 from node-local storage to L4" in saved.stdout
    assert (tmp_path / "run" / "pfs" / "v000000000010" / "manifest.json").is_file()
    shutil.rmtree(node_local(tmp_path / "run", 3))

    restored = app(tmp_path, 3, 3, 10, "--set", LOCAL_AND_PFS, "--no-due")
    assert_ok(restored)
    [again] = script_results(restored)
    assert again["restored"] == 10 and again["step"] == 10
    assert (again["weights"], again["field"]) == (first["weights"], first["field"])
    assert "restored version 10 (written by 4 ranks) onto 3 rank(s)" in restored.stdout, restored.stdout
    # What one rank moved, in units that show it (not "0.0 MB" for tens of kilobytes).
    assert re.search(r"at most \d+\.\d KB read and [\d.]+ (bytes|KB) received by one rank", restored.stdout), \
        restored.stdout


def test_close_during_an_exception_copies_nothing_more_to_l4(tmp_path):
    proc = app(tmp_path, 4, 4, 10, "--set", LOCAL_AND_PFS, "--no-due", "--explicit", "10", "--close-with-error")
    assert proc.returncode == 1, proc.stderr
    assert "the application failed after its last step" in proc.stderr
    assert not (tmp_path / "run" / "pfs" / "v000000000010").exists()
    assert (node_local(tmp_path / "run", 0) / "v000000000010" / "commit-r00000.json").is_file()


def test_auto_interval_is_chosen_from_measured_costs_and_logged(tmp_path):
    proc = app(tmp_path, 4, 4, 120, "--set", "checkpoint.every_steps=\"auto\"", "--steps-ms", "2")
    assert_ok(proc)
    [result] = script_results(proc)
    assert result["interval"] > 0 and "shortest interval with overhead <= 3.5 %" in result["reason"], result
    assert "checkpoint interval now" in proc.stdout
    # The profiling checkpoint comes after 5 measured steps, the last step always has one.
    steps = sorted(int(p.name[1:]) for p in (tmp_path / "run" / "pfs").iterdir() if p.name.startswith("v"))
    assert steps[-1] == 120, steps


def test_mtbf_gives_the_young_daly_interval(tmp_path):
    proc = app(tmp_path, 4, 4, 60, "--set", "checkpoint.every_steps=\"auto\"", "--set", "checkpoint.mtbf_hours=0.001",
               "--steps-ms", "2")
    assert_ok(proc)
    [result] = script_results(proc)
    assert result["reason"].startswith("Young/Daly: Daly's optimum for C = "), result
    assert "checkpoint interval now" in proc.stdout and "Young/Daly" in proc.stdout


def test_a_restart_keeps_the_profile_and_the_interval(tmp_path):
    """The interval saved with version 80 (chosen before that checkpoint's own costs came in)
    is the resumed run's: it does not profile again."""
    first = app(tmp_path, 4, 4, 80, "--set", "checkpoint.every_steps=\"auto\"", "--steps-ms", "2")
    assert_ok(first)
    again = app(tmp_path, 4, 4, 120, "--set", "checkpoint.every_steps=\"auto\"", "--steps-ms", "2")
    assert_ok(again)
    kept = re.search(r"checkpoint interval (\d+) steps, kept from the checkpoint's profile: shortest interval", again.stdout)
    assert kept and int(kept.group(1)) > 0, again.stdout
    assert (tmp_path / "run" / "pfs" / "v000000000120").is_dir()


def test_a_bad_setting_is_exit_code_2_recorded_for_the_job_script(tmp_path):
    exit_file = tmp_path / "exit-record"
    proc = run_script(2, APP, [str(tmp_path / "run"), "2", "10", "--set", "checkpoint.keep_local=0"], cwd=tmp_path,
                      env={"HPCCKPT_EXIT_FILE": str(exit_file)})
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint.keep_local: must be > 0, got 0" in proc.stderr
    assert exit_file.read_text().startswith("exit_code=2\n")
