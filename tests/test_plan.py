"""hpcckpt plan: a site's inputs -> the library's own choice, the simulated goodput, the spares
and config lines that load through the job config and make the library choose the same."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO

from hpcckpt import cli
from hpcckpt.config import load_config
from hpcckpt.schedule.level_intervals import choose_level_intervals
from hpcckpt.schedule.policy import IntervalPolicy
from hpcckpt.simulate import approaches
from hpcckpt.simulate.plan import make_plan, read_settings

HOUR = 3600.0


def hpcckpt_plan(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "hpcckpt", "plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def plan_json(capsys, *args) -> dict:
    assert cli.main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def load_pasted(tmp_path, text: str):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_config(path, environ={})  # HPCCKPT_* variables of the test's own run play no part


def pasted_lines(output: str) -> str:
    """The TOML block of the text output, as a user copies it (indented by four spaces)."""
    block = output.split("For the job's TOML", 1)[1].split("For the job script", 1)[0]
    lines = block.splitlines()[1:]
    return "\n".join(line[4:] for line in lines) + "\n"


def test_a_new_user_gets_the_answer_and_config_for_2048_nodes(tmp_path):
    proc = hpcckpt_plan("--nodes", "2048")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for fragment in ("Levels and intervals", "a version every", "Predicted goodput (simulated: 3 seeds",
                     "detection + recovery", "idle spares", "Spares", "SPARE_NODES=",
                     "assumed: per node, Llama 3", "  nodes          2,048                      --nodes"):
        assert fragment in out, out
    config = load_pasted(tmp_path, pasted_lines(out))
    assert config.resilience.levels == ("local", "partner", "erasure", "pfs")
    assert config.checkpoint.every_steps == "auto"
    assert config.resilience.mtbf_node_hours > 0 and config.resilience.mtbf_crash_hours > 0


@pytest.mark.parametrize("args", [("--nodes", "2048"), ("--nodes", "256", "--mtbf", "400h", "--state", "300GB",
                                                         "--pfs-write-bw", "500GB/s", "--network-bw", "800Gb/s")])
def test_the_choice_is_choose_level_intervals_and_the_pasted_config_makes_the_same(tmp_path, capsys, monkeypatch,
                                                                                    args):
    calls = []

    def recorded(levels, failures, floor):
        chosen = choose_level_intervals(levels, failures, floor)
        calls.append((levels, failures, floor, chosen))
        return chosen

    monkeypatch.setattr(approaches, "choose_level_intervals", recorded)
    out = plan_json(capsys, *args)
    choice = out["choice"]
    # The scenario weighs holding spares (its first choice) against relaunching (its second).
    levels, failures, floor, chosen = calls[0] if choice["spares_held"] else calls[1]
    assert choice["interval_s"] == chosen.interval_s
    assert choice["every"] == chosen.every

    config = load_pasted(tmp_path, out["config_toml"])
    assert config.resilience.levels == tuple(level["config"] for level in choice["levels"])
    assert config.resilience.group_size == out["inputs"]["group_size"]["value"]
    assert config.resilience.parity == out["inputs"]["parity"]["value"]
    policy = IntervalPolicy.from_config(config.checkpoint, config.resilience)
    assert policy.adaptive
    pasted = {f.nodes_lost: f.per_second for f in policy.failures}
    assert pasted == pytest.approx({f.nodes_lost: f.per_second for f in failures}, rel=1e-5)
    again = choose_level_intervals(levels, list(policy.failures), floor)
    assert again.every == chosen.every
    assert again.interval_s == pytest.approx(chosen.interval_s, rel=1e-4)


def test_more_failures_give_a_shorter_interval():
    intervals = [make_plan(read_settings({"nodes": "256", "mtbf": mtbf})).chosen.plan.interval_s
                 for mtbf in ("25000h", "6335h", "1584h", "400h")]
    assert all(later < earlier for earlier, later in zip(intervals, intervals[1:])), intervals


def test_a_job_wide_mtbf_is_the_nodes_together(capsys):
    per_node = plan_json(capsys, "--nodes", "1000", "--mtbf-node", "5000h")
    per_job = plan_json(capsys, "--nodes", "1000", "--mtbf-node", "5h", "--mtbf-per", "job")
    assert per_job["failures_per_node_per_hour"] == pytest.approx(per_node["failures_per_node_per_hour"])
    assert per_job["choice"]["interval_s"] == pytest.approx(per_node["choice"]["interval_s"])


def poisson_tail(mean: float, k: int) -> float:
    return 1 - sum(mean ** i * math.exp(-mean) / math.factorial(i) for i in range(k + 1))


@pytest.mark.parametrize("nodes, mtbf_node_job_h, window_h", [(2048, 4.0, 24), (512, 2.0, 12), (64, 50.0, 72)])
def test_the_spares_run_out_in_a_repair_window_with_probability_under_1_percent(capsys, nodes, mtbf_node_job_h,
                                                                                window_h):
    out = plan_json(capsys, "--nodes", str(nodes), "--mtbf-node", f"{mtbf_node_job_h}h", "--mtbf-per", "job",
                    "--repair-window", f"{window_h}h")
    spares = out["spares"]
    mean = window_h / mtbf_node_job_h
    assert spares["expected_node_losses"] == pytest.approx(mean)
    k = spares["needed"]
    assert poisson_tail(mean, k) < 0.01 <= poisson_tail(mean, k - 1)
    assert spares["p_run_out"] == pytest.approx(poisson_tail(mean, k), abs=1e-9)
    assert out["choice"]["spares_held"] in (0, k)


def test_the_goodput_split_adds_up_and_states_its_seeds(capsys):
    out = plan_json(capsys, "--nodes", "4096", "--seeds", "2", "--days", "20d")
    g = out["goodput"]
    assert g["seeds"] == 2 and g["work_days_per_run"] == pytest.approx(20)
    total = g["goodput"] + g["checkpoints"] + g["work_redone"] + g["detection_recovery"] + g["idle_spares"]
    assert total == pytest.approx(1.0, abs=1e-9)
    assert 0.9 < g["goodput"] < 1


def test_a_plan_table_in_a_file_with_flags_over_it(tmp_path, capsys):
    site = tmp_path / "site.toml"
    site.write_text('[plan]\nnodes = 512\nnetwork_bw = "200GB/s"\nmtbf = "3000h"\n\n[run]\ndir = "run"\n')
    out = plan_json(capsys, "-c", str(site), "--nodes", "1024")
    inputs = out["inputs"]
    assert inputs["nodes"] == {"value": 1024, "given": "1024", "origin": "--nodes"}
    assert inputs["network_bw"]["value"] == 200e9
    assert inputs["network_bw"]["origin"] == f"{site} [plan] network_bw"
    assert inputs["pfs_write_bw"]["origin"].startswith("assumed: ")
    assert "mtbf_node" not in inputs and inputs["mtbf"]["value"] == pytest.approx(1 / (3000 * HOUR))


def assert_exit_2(proc, *fragments):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcckpt: error: plan: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragments", [
    (("--nodes", "-4"), ("--nodes -4", "must be > 0", "e.g. --nodes 2048")),
    (("--network-bw", "0GB/s"), ("--network-bw 0GB/s", "must be > 0", "e.g. --network-bw")),
    (("--state", "1.1XB"), ("--state 1.1XB", "unknown unit 'XB'", "TB")),
    (("--mtbf-node", "5"), ("--mtbf-node 5", "give a unit", "h")),
])
def test_bad_input_exits_2_naming_the_flag(args, fragments):
    assert_exit_2(hpcckpt_plan(*args), *fragments)


@pytest.mark.parametrize("args, fragments", [
    (("--pfs-write-bw", "2TB"), ("--pfs-write-bw 2TB", "per second")),
    (("--nodes", "2.5"), ("--nodes 2.5", "whole number")),
    (("--mtbf", "5h", "--mtbf-node", "3h"), ("--mtbf and --mtbf-node",)),
    (("--parity", "6"), ("--parity 6", "below the group size")),
    (("--mtbf-per", "team"), ("--mtbf-per team", "node or job")),
])
def test_more_bad_input(capsys, args, fragments):
    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err


def test_a_bad_key_in_the_plan_table_names_the_file_and_key(tmp_path, capsys):
    site = tmp_path / "site.toml"
    site.write_text('[plan]\nnodez = 512\n')
    assert cli.main(["plan", "-c", str(site)]) == 2
    err = capsys.readouterr().err
    assert f"{site} [plan]: unknown key 'nodez'" in err, err
    site.write_text('[plan]\nnodes = -3\n')
    assert cli.main(["plan", "-c", str(site)]) == 2
    assert f"{site} [plan] nodes = -3: must be a whole number >= 1" in capsys.readouterr().err


def test_a_job_that_cannot_outrun_its_failures_is_answered_in_seconds(capsys):
    """Failures every 13 s against restarts of minutes: not simulated (a restart would be tried
    about e^58 times), said so; failures every 2 min: simulated, cut at a wall time."""
    stalled = plan_json(capsys, "--nodes", "16384", "--mtbf", "60h")
    assert "next to no progress" in stalled["goodput"]["not_simulated"]
    heavy = plan_json(capsys, "--nodes", "16384", "--mtbf", "400h", "--seeds", "1")
    assert heavy["goodput"]["runs_cut_at_max_wall"] == 1 and heavy["goodput"]["goodput"] < 0.2
