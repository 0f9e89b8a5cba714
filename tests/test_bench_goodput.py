"""What perf/bench_goodput.py's figures rest on: the failure schedule is the seed's alone, the
model has the state size asked for, and each job's output is read into attempts, steps redone
and restart times as it should be."""

import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "perf"))

import bench_goodput as bench  # noqa: E402

MIX = {"crash": 0.5, "node": 0.35, "two_nodes": 0.15}


def test_the_failure_schedule_is_the_seeds_alone():
    first = bench.failure_schedule(4, 30.0, MIX, ranks=4, nodes=4, horizon_s=3600)
    assert first == bench.failure_schedule(4, 30.0, MIX, ranks=4, nodes=4, horizon_s=3600)
    assert first != bench.failure_schedule(5, 30.0, MIX, ranks=4, nodes=4, horizon_s=3600)
    times = [f.at_s for f in first]
    assert times == sorted(times) and times[-1] <= 3600
    assert 20 <= 3600 / len(first) <= 45  # exponential gaps with a 30 s mean
    for failure in first:
        assert len(failure.victims) == bench.NODES_LOST.get(failure.kind) or failure.kind == "crash"
        assert len(set(failure.victims)) == len(failure.victims) and all(0 <= v < 4 for v in failure.victims)
    assert {f.kind for f in first} == set(MIX)


def test_the_seeds_taken_each_meet_the_failures_asked_for_within_the_failure_free_time():
    seeds = bench.seeds_with_failures(1, 5, 3, 30.0, 15.0, MIX, 4, 4)
    assert len(seeds) == 5 and seeds == sorted(set(seeds))
    for seed in range(seeds[0], seeds[-1] + 1):
        within = len(bench.failure_schedule(seed, 15.0, MIX, 4, 4, horizon_s=30.0))
        assert (seed in seeds) == (within >= 3), (seed, within)
    assert bench.seeds_with_failures(7, 3, 0, 30.0, 15.0, MIX, 4, 4) == [7, 8, 9]


def test_the_model_holds_the_state_size_asked_for():
    h, _ = bench.hidden_for(100.0)
    params = bench.FEATURES * h + h + h * h + h + 10 * h + 10
    assert abs(8 * params / 1e6 - 100.0) < 1.0


def test_a_jobs_output_becomes_attempts_redone_steps_and_restart_times(tmp_path):
    job = bench.Job("hpcckpt", {}, tmp_path / "run", "tag", ranks=4, nodes=4)
    job.lines = [
        (0.0, "hpcckpt-job: attempt 1 (at most 1001): python -m hpcckpt train"),
        (1.5, "starting from scratch (no checkpoint to resume from)"),
        *[(1.5 + 0.5 * s, f"step {s:6d}  epoch   0  loss 1.0") for s in range(1, 13)],
        (8.0, "hpcckpt-job: attempt 1 failed with exit code 9; restarting from the surviving checkpoint levels"),
        (8.0, "hpcckpt-job: attempt 2 (at most 1001): python -m hpcckpt train"),
        (10.0, "restored version 10: 3 rank(s) from L1 local, 1 rank(s) from L2 partner"),
        *[(10.0 + 0.5 * (s - 10), f"step {s:6d}  epoch   0  loss 1.0") for s in range(11, 21)],
        (16.0, "done: 20 steps in 6.0 s, final val_accuracy n/a, weights 0123456789abcdef (identical on all ranks)"),
        (16.1, "hpcckpt-job: finished after 2 attempt(s)"),
    ]
    failures = [(bench.Failure(7.8, "node", (1,)), True), (bench.Failure(30.0, "crash", (0,)), False)]
    outcome = job._outcome(16.2, True, failures)
    assert len(outcome.attempts) == 2
    assert (outcome.attempts[0].start_step, outcome.attempts[0].reached) == (0, 12)
    assert (outcome.attempts[1].start_step, outcome.attempts[1].reached) == (10, 20)
    assert outcome.attempts[1].restored_from.startswith("3 rank(s) from L1 local")
    assert outcome.steps_run - 20 == 2  # steps 11 and 12 done twice
    assert outcome.digest == "0123456789abcdef"
    (at, kind, hit, restart), missed = outcome.failures
    assert (kind, hit) == ("node", True) and abs(restart - 2.2) < 1e-9
    assert missed[2] is False and missed[3] is None
    split = bench.where_the_waste_went(outcome, baseline_s=10.0, step_s=0.5, steps=20)
    assert abs(split["waste_s"] - 6.2) < 1e-9 and abs(split["restarts_s"] - 2.2) < 1e-9
    assert abs(split["redone_s"] - 1.0) < 1e-9 and abs(split["rest_s"] - 3.0) < 1e-9


def test_a_failure_during_a_restart_counts_the_restart_once(tmp_path):
    job = bench.Job("dcp", {}, tmp_path / "run", "tag", ranks=4, nodes=4)
    job.lines = [
        (0.0, "hpcckpt-job: attempt 1 (at most 1001): python goodput_app.py"),
        (1.0, "starting from scratch (no checkpoint to resume from)"),
        (5.0, "hpcckpt-job: attempt 2 (at most 1001): python goodput_app.py"),
        (7.0, "hpcckpt-job: attempt 3 (at most 1001): python goodput_app.py"),
        (12.0, "restored version 4: 4 rank(s) from dcp"),
    ]
    hits = [(bench.Failure(4.0, "crash", (1,)), True), (bench.Failure(6.0, "node", (2,)), True)]
    outcome = job._outcome(20.0, True, hits)
    assert [f[3] for f in outcome.failures] == [None, 6.0]  # the first restart was cut short
    assert bench.where_the_waste_went(outcome, 10.0, 0.5, 4)["restarts_s"] == 8.0  # 4 s .. 12 s, once


def test_the_prediction_read_is_the_last_choices_checkpoint_share():
    lines = ["checkpoint interval now 3 steps: per-level intervals minimise expected waste 10.80 % (checkpoints "
             "4.10 %, failures 6.70 %) with a version every 1.21 s",
             "checkpoint interval now 6 steps: per-level intervals minimise expected waste 24.30 % (checkpoints "
             "12.50 %, failures 11.80 %) with a version every 2.84 s"]
    assert bench.predicted_checkpoint_waste(lines) == 0.125
    assert bench.predicted_checkpoint_waste(lines[:1]) == pytest.approx(0.041)
    assert bench.predicted_checkpoint_waste(["checkpoint interval now 5 steps: Young/Daly"]) is None


def test_the_choice_is_judged_over_the_steps_it_governed_against_the_same_steps_without_checkpoints():
    """The profile's steps (slow here) and a choice made before every level was timed are left
    out; the prediction is the mean of the shares in force over the governed steps."""
    def choice(share, pending=""):
        return (f"checkpoint interval now 4 steps: per-level intervals minimise expected waste 30.00 % "
                f"(checkpoints {share:.2f} %, failures 10.00 %) with a version every 2 s{pending}")
    baseline = bench.Outcome("nockpt", 0, 40.0, True, "d", step_times=[(float(s), s) for s in range(1, 31)])
    times = [(2.0 * s, s) for s in range(1, 6)]  # the profile: twice as slow, not the choice's doing
    at = 10.0
    for step in range(6, 31):
        at += 1.1 if step <= 20 else 1.3
        times.append((at, step))
    times.append((at + 0.5, 30))  # the evaluation line repeats the last step's number
    outcome = bench.Outcome("hpcckpt", 0, 50.0, True, "d", step_times=times, interval_times=[
        (8.0, choice(50.0, "; pfs not timed yet, rechosen within 6 steps")),
        (times[5][0] + 0.05, choice(10.0)),  # after step 6's line: steps 7.. are governed
        (times[15][0] + 0.05, choice(30.0)),  # after step 16's
    ])
    governed = bench.under_the_choice(outcome, [baseline])
    assert governed["steps"] == 23  # steps 8..30 after step 7, the first line after the choice
    assert governed["realized"] == pytest.approx((13 * 1.1 + 10 * 1.3) / 23 - 1)
    assert governed["predicted"] == pytest.approx((9 * 0.10 + 14 * 0.30) / 23)  # 8..16 and 17..30
    assert bench.under_the_choice(bench.Outcome("hpcckpt", 0, 1.0, True, "d", step_times=times), [baseline]) is None
    # Against the runs without checkpoints before and after it, whose steps drifted from 1 s
    # to 1.2 s: against their mean, not against either one.
    slower = bench.Outcome("nockpt", 0, 46.0, True, "d", step_times=[(1.2 * s, s) for s in range(1, 31)])
    between = bench.under_the_choice(outcome, [baseline, slower])
    assert between["realized"] == pytest.approx((13 * 1.1 + 10 * 1.3) / (23 * 1.1) - 1)


def test_a_run_that_gave_up_delivered_nothing():
    """Its short wall time must not read as little waste: its goodput is 0."""
    finished = bench.Outcome("a", 1, 20.0, True, "d", failures=[(1.0, "crash", True, 2.0)])
    gave_up = bench.Outcome("a", 2, 12.0, False, "", failures=[(1.0, "crash", True, None)])
    assert bench.goodput(finished, 10.0) == 0.5 and bench.goodput(gave_up, 10.0) == 0.0
    table = bench.summarise([finished, gave_up], {1: 10.0, 2: 10.0}, {1: "d", 2: "d"}, 32, {1: 0.3, 2: 0.3})
    assert table["a"]["waste_by_seed"] == {1: 0.5, 2: 1.0} and table["a"]["finished"] is False
    assert table["a"]["waste_range"] == (0.5, 1.0)


def test_the_checkout_is_compiled_to_bytecode_before_the_runs(tmp_path):
    """Every module of the package gets its bytecode beside it, newer than its source, so that
    no rank of any attempt compiles it again (the interpreter then only reads it)."""
    import importlib.util

    from harness import compile_checkout

    removed = Path(importlib.util.cache_from_source(str(REPO / "hpcckpt" / "schedule" / "level_intervals.py")))
    removed.unlink(missing_ok=True)  # a fresh clone's: no bytecode at all
    compile_checkout()
    assert removed.exists()
    for source in (REPO / "hpcckpt").rglob("*.py"):
        cached = Path(importlib.util.cache_from_source(str(source)))
        assert cached.exists() and cached.stat().st_mtime >= source.stat().st_mtime, source
