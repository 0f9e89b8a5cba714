"""Damaged records never stop a run that something intact can carry on (run/records.py,
run/ledger.py): each is not used, one warning names it, it is set aside or rewritten from an
intact copy, and nothing intact is deleted. Real ranks."""

import json
import re
import shutil

from conftest import REPO, assert_ok, read_metrics, run_mpi, small_job

LOCAL_TOML = REPO / "hpcckpt" / "jobs" / "local.toml"


def main_job(tmp_path, steps: int):
    return run_mpi(4, ["train", "-c", str(LOCAL_TOML), "--set", f"run.dir={tmp_path / 'run'}",
                       "--set", f"run.steps={steps}"], cwd=tmp_path)


def _cut_in_half(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_a_damaged_l4_record_of_a_version_l1_holds_is_set_aside_and_written_again(tmp_path):
    """The operator's report: the main job to step 200, L4's record of 200 cut in half. The
    next run restores 200 from L1 once, sets the L4 copy aside, copies 200 to L4 again at its
    end and exits 0; the one after resumes from 200 without redoing a step."""
    assert_ok(main_job(tmp_path, 200))
    pfs = tmp_path / "run" / "pfs"
    _cut_in_half(pfs / "v000000000200" / "manifest.json")

    again = main_job(tmp_path, 200)
    assert_ok(again)
    out = again.stdout + again.stderr
    assert out.count("restored version 200: 4 rank(s) from L1 local") == 1, out
    assert ("L4 pfs version 200: its commit record is damaged" in out and "set aside as v000000000200.damaged" in out
            and "not a readable commit record" in out), out
    assert "drained version 200 from node-local storage to L4" in out
    assert json.loads(json.dumps(read_metrics(tmp_path / "run")[-1]))["final"] is True
    aside = pfs / "v000000000200.damaged"
    assert aside.is_dir() and (aside / "manifest.json").stat().st_size > 0  # kept for inspection
    assert (pfs / "v000000000200" / "manifest.json").is_file()
    ledger = tmp_path / "run" / "restarts.json"
    assert not ledger.exists() or not json.loads(ledger.read_text())["failed"], ledger.read_text()

    third = main_job(tmp_path, 300)
    assert_ok(third)
    assert "restored version 200: 4 rank(s) from L1 local" in third.stdout
    assert "done again" not in third.stdout and "marked failed" not in third.stdout + third.stderr

    verify = run_mpi(1, ["verify", "-c", str(LOCAL_TOML), "--set", f"run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert verify.returncode == 1, verify.stdout
    assert "v000000000200.damaged: set aside (a damaged commit record)" in verify.stdout, verify.stdout


def test_a_damaged_l4_record_with_nothing_else_holding_the_version_falls_back_to_an_older_one(tmp_path):
    """Node-local storage gone and L4's newest record damaged: the restart goes on from the
    newest intact version on L4 and keeps the damaged one aside; nothing intact is deleted."""
    assert_ok(main_job(tmp_path, 200))
    shutil.rmtree(tmp_path / "run" / "local")
    pfs = tmp_path / "run" / "pfs"
    intact = sorted(p.name for p in pfs.iterdir() if p.name.startswith("v"))
    assert intact[-1] == "v000000000200", intact
    _cut_in_half(pfs / "v000000000200" / "manifest.json")
    again = main_job(tmp_path, 250)
    assert_ok(again)
    out = again.stdout + again.stderr
    older = int(intact[-2][1:])
    assert f"restored version {older}: 4 rank(s) from L4 pfs" in out, out
    assert "set aside as v000000000200.damaged" in out
    assert (pfs / "v000000000200.damaged" / "shard-r00000.hck").is_file()


def test_damaged_run_records_are_set_aside_or_rewritten_and_the_run_goes_on(tmp_path):
    """run.json, the PFS directory's owner record, the lease, the heartbeat and metrics.jsonl,
    each damaged between attempts: every attempt resumes from the newest version, says what
    it found once, and verify and report name the damage."""
    import os

    job = small_job(tmp_path, run={"steps": 20}, checkpoint={"every_steps": 10},
                    resilience={"levels": ["local", "partner", "pfs"]})
    run = tmp_path / "run"

    def train(steps: int):
        proc = run_mpi(4, ["train", "-c", str(job), "--set", f"run.steps={steps}"], cwd=tmp_path)
        assert_ok(proc)
        return proc.stdout + proc.stderr

    train(20)
    run_id = json.loads((run / "run.json").read_text())["run_id"]

    _cut_in_half(run / "run.json")
    damaged = run_mpi(1, ["verify", "-c", str(job)], cwd=tmp_path)
    assert damaged.returncode == 1 and "run.json: damaged (" in damaged.stdout, damaged.stdout
    out = train(30)
    assert "restored version 20" in out
    assert "not a readable run identity" in out and "set aside as run.json.damaged and rewritten from the PFS " \
        "directory's record" in out, out
    assert json.loads((run / "run.json").read_text())["run_id"] == run_id

    owner = run / "pfs" / ".hpcckpt-run.json"
    owner.write_text("{}")
    out = train(40)
    assert "restored version 30" in out and "set aside as .hpcckpt-run.json.damaged" in out, out
    assert json.loads(owner.read_text())["run_id"] == run_id

    # A lease a crash would not leave (it is written whole), damaged from outside and left
    # alone for longer than two renewals; a heartbeat and a metrics line cut short.
    (run / "lease.json").write_text('{"job": "12')
    os.utime(run / "lease.json", (1, 1))
    (run / "heartbeat").write_text("garbage")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 41, "loss"')
    out = train(50)
    assert "restored version 40" in out and "lease.json is damaged (it names no job)" in out, out
    assert "metrics.jsonl: its last line was cut short" in out
    report = run_mpi(1, ["report", "-c", str(job)], cwd=tmp_path)
    assert_ok(report)
    assert "steps done: 50 (finished)" in report.stdout, report.stdout
    assert re.search(r"note: 1 damaged line\(s\) of metrics.jsonl skipped \(line \d+\)", report.stdout), report.stdout
    assert not (run / "lease.json").exists()
