"""Arrays protected by reference follow the application (tests/scripts/followed_arrays.py on
real ranks): an array rebound every step (W = W * s + step) protected through a getter comes
back at its version's values; protected by value, the rebinding fails the next checkpoint
rather than saving stale values; a Heat DNDarray split with Heat's own uneven chunks, resplit
every step, is protected in one call and restored onto 4 ranks bit-identical and onto 3 equal."""

import importlib.util
import os
import shutil

import pytest

from conftest import REPO, assert_ok, run_script, script_results

SCRIPT = REPO / "tests" / "scripts" / "followed_arrays.py"
SHIMS = REPO / "tests" / "shims"


def run(tmp_path, ranks: int, run_dir: str, kind: str, steps: int, *extra: str, env=None):
    return run_script(ranks, SCRIPT, [str(tmp_path / run_dir), kind, str(steps), *extra], tmp_path, env=env)


def test_an_array_rebound_every_step_and_protected_through_a_getter_comes_back_at_its_version(tmp_path):
    through = run(tmp_path, 2, "through", "numpy", 8)
    assert_ok(through)
    [uninterrupted] = script_results(through)
    killed = run(tmp_path, 2, "run", "numpy", 8, "--kill-at", "7", "--every", "3")
    assert killed.returncode != 0
    resumed = run(tmp_path, 2, "run", "numpy", 8, "--every", "3")
    assert_ok(resumed)
    [result] = script_results(resumed)
    assert result["restored"] in (3, 6)
    # The values at the version restored are those an uninterrupted run had there.
    again = run(tmp_path, 2, "check", "numpy", result["restored"], "--every", "100")
    assert_ok(again)
    assert result["at_restore"] == script_results(again)[0]["final"]
    assert result["final"] == uninterrupted["final"]


def test_an_array_protected_by_value_and_rebound_fails_the_next_checkpoint_naming_it(tmp_path):
    proc = run(tmp_path, 2, "run", "value", 6)
    assert proc.returncode == 2, proc.stderr
    assert "protected array(s) 'W' are no longer held by the application, only by the checkpointer" in proc.stderr
    assert "protect a getter that returns the current one (ckpt.protect('W', lambda: W))" in proc.stderr
    log = (tmp_path / "run" / "log" / "rank0.log").read_text()
    assert "protect() keeps a reference to each array protected by value and saves what it holds: 'W' " \
           "(numpy.ndarray float64[64, 8])" in log


def test_a_heat_dndarray_split_unevenly_is_protected_in_one_call_and_restored_onto_4_and_3_ranks(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    if importlib.util.find_spec("heat") is None:
        pytest.fail("Heat is not installed: pip install --no-deps heat==1.8.0 (the README's test command does)")
    # Heat's import wants torchvision's names (tests/shims/README.md).
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(SHIMS)])}
    # Element-wise arithmetic gives the same values on any rank count (the restore onto 3
    # below asserts as much): one rank runs the reference.
    through = run(tmp_path, 1, "through", "heat", 10, env=env)
    assert_ok(through)
    [uninterrupted] = script_results(through)
    killed = run(tmp_path, 4, "run", "heat", 10, "--kill-at", "7", env=env)
    assert killed.returncode != 0
    shutil.copytree(tmp_path / "run", tmp_path / "run3")
    on_four = run(tmp_path, 4, "run", "heat", 10, env=env)
    assert_ok(on_four)
    [four] = script_results(on_four)
    assert four["restored"] in (4, 6)
    assert four["final"] == uninterrupted["final"]  # bit-identical
    on_three = run(tmp_path, 3, "run3", "heat", 10, env=env)
    assert_ok(on_three)
    [three] = script_results(on_three)
    assert three["restored"] == four["restored"]
    assert three["at_restore"] == four["at_restore"]
    assert f"restored version {three['restored']} (written by 4 ranks) onto 3 rank(s)" in on_three.stdout
    assert three["final"] == uninterrupted["final"]
