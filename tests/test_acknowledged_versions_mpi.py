"""No version that checkpoint() acknowledged goes missing, whatever the level set and however
the application calls it (tests/scripts/library_app.py on real ranks): a version no level was
due for is held until a newer one replaces it or close() writes it, close() leaves the newest
on L4 or says why not, and the run's summary counts the versions each level stored."""

import json
import re

from conftest import REPO, assert_ok, read_metrics, run_script, script_results

APP = REPO / "tests" / "scripts" / "library_app.py"
L4_ONLY = 'resilience.levels=["pfs"]'


def app(tmp_path, ranks: int, steps: int, *extra: str):
    return run_script(ranks, APP, [str(tmp_path / "run"), str(ranks), str(steps), *extra], cwd=tmp_path)


def l4_versions(tmp_path) -> list[int]:
    pfs = tmp_path / "run" / "pfs"
    return sorted(int(d.name[1:]) for d in pfs.glob("v*") if (d / "manifest.json").is_file())


def test_an_l4_only_run_checkpointing_every_step_keeps_every_acknowledged_version(tmp_path):
    """The embedded defaults copy every 2nd version to L4 (storage.pfs_every = 2): with L4 the
    only level, versions 1, 3 and 5 went nowhere, and a restart resumed from 4. Each is now
    replaced by the next, and close() writes the last one."""
    proc = app(tmp_path, 2, 5, "--set", L4_ONLY, "--set", "checkpoint.keep_pfs=10", "--no-due", "--every-step")
    assert_ok(proc)
    assert l4_versions(tmp_path) == [2, 4, 5]
    assert "version 5, the newest taken, which no level was due for, written to every level" in proc.stdout
    assert re.search(r"checkpoints: 5 taken \(2 replaced by a newer one before any level was due\); versions "
                     r"stored: L4 3 \(", proc.stdout), proc.stdout
    [summary] = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "checkpoint_summary"]
    assert summary["versions_per_level"] == {"pfs": 3} and summary["replaced_before_stored"] == 2

    again = app(tmp_path, 2, 7, "--set", L4_ONLY, "--no-due", "--every-step")
    assert_ok(again)
    assert script_results(again)[0]["restored"] == 5


def test_checkpoints_faster_than_a_slow_pfs_are_each_written_or_replaced_and_the_newest_is_on_l4(tmp_path):
    """A throttled PFS (each version takes longer than a step) and a checkpoint every step:
    every acknowledged version is either on L4 or replaced by the next one before any level was
    due; the newest is on L4 after close()."""
    steps = 8
    proc = app(tmp_path, 2, steps, "--set", L4_ONLY, "--set", "storage.pfs_bandwidth_mb=0.5",
               "--set", "storage.pfs_every=3", "--set", "checkpoint.keep_pfs=20", "--no-due", "--every-step")
    assert_ok(proc)
    on_l4 = l4_versions(tmp_path)
    assert on_l4 == [3, 6, 8], on_l4
    durable = {r["step"] for r in read_metrics(tmp_path / "run") if "checkpoint_durable_s" in r}
    acknowledged = {r["step"] for r in read_metrics(tmp_path / "run") if "checkpoint_blocking_s" in r}
    assert acknowledged == set(range(1, steps + 1))
    assert durable == set(on_l4)
    # Each version not stored was replaced by the very next one.
    assert all(step + 1 in acknowledged for step in acknowledged - durable)


def test_a_version_no_level_took_is_said_lost_when_the_run_ends_with_an_error(tmp_path):
    """Every rank logs it before its error leaves close(): the first rank whose error reaches
    mpi4py's abort ends the job, so rank 0's console line may never be printed, but that rank's
    log holds the warning."""
    proc = app(tmp_path, 2, 5, "--set", L4_ONLY, "--no-due", "--every-step", "--close-with-error")
    assert proc.returncode == 1, proc.stderr
    said = "version 5, the newest taken, is not stored: no level was due for it and the run did not end cleanly"
    logs = [path.read_text() for path in sorted((tmp_path / "run" / "log").glob("rank*.log"))]
    assert len(logs) == 2 and any(said in log for log in logs), proc.stdout + proc.stderr
    assert l4_versions(tmp_path) == [2, 4]
