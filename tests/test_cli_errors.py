"""Bad input on the command line: one line naming the problem, exit code 2, no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, mpi_env

from hpcckpt import cli


def hpcckpt(args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "hpcckpt", *args], cwd=cwd, env=mpi_env(env),
                          capture_output=True, text=True, timeout=120)


def assert_config_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcckpt: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_synthetic_data_with_too_few_classes(tmp_path):
    proc = hpcckpt(["train", "--set", "data.source=synthetic", "--set", "data.classes=0"], tmp_path)
    assert_config_error(proc, "--set data.classes=0: data.classes: must be >= 2, got 0")


def test_override_error_names_the_override_not_the_file(tmp_path):
    proc = hpcckpt(["train", "-c", str(REPO / "jobs" / "local.toml"), "--set", "checkpoint.every_steps=-5"],
                   tmp_path)
    assert_config_error(proc, "--set checkpoint.every_steps=-5: checkpoint.every_steps: must be >= 0")
    assert "local.toml" not in proc.stderr


def test_misspelt_environment_variable(tmp_path):
    proc = hpcckpt(["inspect"], tmp_path, env={"HPCCKPT_CHECKPONT_EVERY_STEPS": "5"})
    assert_config_error(proc, "environment HPCCKPT_CHECKPONT_EVERY_STEPS: unknown section 'checkpont'")


@pytest.mark.parametrize("command", [["make-data"], ["export", "--set", "run.dir=run"]])
def test_output_in_a_missing_directory(tmp_path, command):
    target = tmp_path / "nonexistent" / "dir" / "out.h5"
    proc = hpcckpt([*command, "-o", str(target)], tmp_path)
    assert_config_error(proc, f"cannot write {target}: directory {target.parent} does not exist")


def test_failed_write_leaves_no_file_behind(tmp_path, monkeypatch, capsys):
    import hpcckpt.train.data as data

    def write_then_fail(path, *args):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(data, "write_hdf5_dataset", write_then_fail)
    target = tmp_path / "x.h5"
    assert cli.main(["make-data", "-o", str(target)]) == 3
    assert "make-data: writing" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == []


def test_make_data_still_writes(tmp_path):
    proc = hpcckpt(["make-data", "-o", "x.h5", "--samples", "20", "--features", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["x.h5"]


def test_help_names_every_command_and_the_attempt_field():
    parser = cli.build_parser()
    for name in cli.COMMANDS:
        assert name in parser.description, name
    train = parser._subparsers._group_actions[0].choices["train"]
    inject = next(a for a in train._actions if a.dest == "inject")
    assert inject.help.count("[:attempt=A]") == 2


def test_node_loss_on_a_node_the_job_does_not_have(tmp_path):
    from conftest import run_mpi

    proc = run_mpi(2, ["train", "--set", f"run.dir={tmp_path / 'run'}", "--set", "cluster.simulated_nodes=2",
                       "--inject", "node-loss:node=3:step=2"], cwd=tmp_path, timeout=120)
    assert_config_error(proc, "--inject node-loss:node=3: this job has 2 simulated node(s) "
                              "(cluster.simulated_nodes), numbered 0 to 1")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rank_kill_on_a_rank_the_job_does_not_have(tmp_path):
    proc = hpcckpt(["train", "--set", f"run.dir={tmp_path / 'run'}", "--set", "cluster.simulated_nodes=1",
                    "--inject", "rank-kill:rank=5:step=2"], tmp_path)
    assert_config_error(proc, "--inject rank-kill:rank=5: this job has ranks 0 to 0")


def test_too_many_simulated_nodes_names_the_override(tmp_path):
    proc = hpcckpt(["train", "--set", f"run.dir={tmp_path / 'run'}", "--set", "cluster.simulated_nodes=2"], tmp_path)
    assert_config_error(proc, "--set cluster.simulated_nodes=2: cluster.simulated_nodes = 2 but only 1 ranks run")


def test_restart_loop_passes_train_args_as_typed(tmp_path):
    # A file that an unquoted $TRAIN_ARGS would glob the --set value into.
    (tmp_path / "model.hidden=8").touch()
    script = tmp_path / "loop.sh"
    script.write_text(
        "set -u\n"
        f". {REPO / 'jobs' / 'restart-loop.sh'}\n"
        "CONFIG=job.toml\n"
        "hpcckpt_launch() { printf '<%s>\\n' \"$@\" > args.txt; exit 0; }\n"
        "hpcckpt_replan() { :; }\n"
        "hpcckpt_restart_loop\n"
    )
    for train_args, expected in [
        ("--set model.hidden=[8]  --set run.dir=*\n--inject x", ["--set", "model.hidden=[8]", "--set", "run.dir=*",
                                                                "--inject", "x"]),
        ("", []),
    ]:
        env = {**os.environ, "TRAIN_ARGS": train_args}
        proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        args = (tmp_path / "args.txt").read_text().split("\n")[:-1]
        assert args == [f"<{a}>" for a in ["train", "-c", "job.toml", "--restart", "auto", *expected]]


def test_ranks_record_the_exit_code_they_agreed_on_for_the_restart_loop(tmp_path):
    from conftest import run_mpi

    record = tmp_path / "exit"
    proc = run_mpi(2, ["train", "--set", "run.steps=-1"], cwd=tmp_path, env={"HPCCKPT_EXIT_FILE": str(record)})
    assert proc.returncode == 2
    fields = dict(line.split("=", 1) for line in record.read_text().splitlines())
    assert fields["exit_code"] == "2" and "run.steps: must be > 0" in fields["message"]
    assert list(tmp_path.glob("exit.*")) == []  # no temporaries left
    done = tmp_path / "done"
    proc = run_mpi(2, ["train", "--set", "run.steps=3", "--set", "checkpoint.every_steps=0",
                       "--set", "cluster.simulated_nodes=1"], cwd=tmp_path, env={"HPCCKPT_EXIT_FILE": str(done)})
    assert proc.returncode == 0, proc.stderr
    assert "exit_code=0\nrank=0\n" in done.read_text()


def test_the_first_exit_record_stands_and_an_unwritable_one_is_reported(tmp_path, capsys):
    from hpcckpt.exit_record import record_exit

    path = tmp_path / "exit"
    record_exit(2, 3, "bad config", environ={"HPCCKPT_EXIT_FILE": str(path)})
    record_exit(1, 0, "a later crash", environ={"HPCCKPT_EXIT_FILE": str(path)})
    assert path.read_text() == "exit_code=2\nrank=3\nmessage=bad config\n"
    record_exit(4, 0, "x", environ={"HPCCKPT_EXIT_FILE": str(tmp_path / "missing" / "exit")})
    assert "could not record exit code 4" in capsys.readouterr().err


def run_restart_loop(tmp_path, launch_body: str, **env) -> subprocess.CompletedProcess:
    """jobs/restart-loop.sh with `launch_body` as hpcckpt_launch (no MPI: it plays the ranks,
    HPCCKPT_ATTEMPT telling which attempt it is) and `env` added."""
    import sys

    script = tmp_path / "loop.sh"
    script.write_text(
        "set -u\n"
        f". {REPO / 'jobs' / 'restart-loop.sh'}\n"
        "CONFIG=job.toml\n"
        f"hpcckpt_launch() {{\n{launch_body}}}\n"
        "hpcckpt_replan() { :; }\n"
        "hpcckpt_restart_loop\n"
    )
    env = {**os.environ, "RESTART_DELAY": "0", "HPCCKPT": f"{sys.executable} -m hpcckpt", "PYTHONPATH": str(REPO),
           **env}
    return subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)


def test_an_attempt_hung_in_mpi_start_up_is_stopped_and_started_again(tmp_path):
    """An MPI start-up whose PMI request the launcher lost hangs for good: an attempt whose
    ranks never mark that they got through MPI start-up is stopped after START_TIMEOUT and
    counts as a failed attempt; one that marks it runs as long as it takes."""
    # Attempt 1 hangs before the mark; attempt 2 marks it, then outlives START_TIMEOUT.
    proc = run_restart_loop(tmp_path,
                            "  if [ \"$HPCCKPT_ATTEMPT\" = 1 ]; then exec sleep 600; fi\n"
                            "  : > \"$HPCCKPT_EXIT_FILE.started\"; sleep 4; exit 0\n",
                            START_TIMEOUT="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attempt 1 did not get through MPI start-up in 2 s" in proc.stdout, proc.stdout
    assert "attempt 2 did not get through" not in proc.stdout
    assert "finished after 2 attempt(s)" in proc.stdout
    assert not list(tmp_path.glob(".hpcckpt-exit.*"))  # markers cleaned up


def test_once_the_job_knows_its_start_up_a_stuck_one_is_stopped_long_before_start_timeout(tmp_path):
    """After an attempt got through start-up, a later one that takes far longer (under ULFM, a
    rank that died before the others were through MPI_Init leaves them there for good) is
    stopped after 4 times the longest start-up seen (at least START_TIMEOUT_MIN), not after
    START_TIMEOUT; the one after it gets twice that, in case start-ups have grown slower."""
    import time

    began = time.monotonic()
    # Attempt 1 gets through start-up at once (the loop counts that as 1 s, 2 across a second's
    # edge), then fails; 2 and 3 are stuck in start-up; 4 finishes.
    proc = run_restart_loop(tmp_path,
                            "  case $HPCCKPT_ATTEMPT in\n"
                            "    1) : > \"$HPCCKPT_EXIT_FILE.started\"; exit 1 ;;\n"
                            "    2|3) exec sleep 600 ;;\n"
                            "    *) : > \"$HPCCKPT_EXIT_FILE.started\"; exit 0 ;;\n"
                            "  esac\n",
                            START_TIMEOUT="300", START_TIMEOUT_MIN="3")
    took = time.monotonic() - began
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stopped = re.findall(r"attempt (\d) did not get through MPI start-up in (\d+) s \(its longest so far took (\d+) s",
                         proc.stdout)
    assert [attempt for attempt, _, _ in stopped] == ["2", "3"], proc.stdout
    (_, limit, longest), (_, doubled, _) = stopped
    assert 1 <= int(longest) <= 3 and int(limit) == max(3, 4 * int(longest)), proc.stdout
    assert int(doubled) == 2 * int(limit), proc.stdout
    assert "finished after 4 attempt(s)" in proc.stdout
    assert took < 90, f"{took:.0f} s: the stuck attempts waited for START_TIMEOUT"
