"""One job at a time per run directory (run/lease.py): who takes the lease, who is refused,
and a second real job started on a running run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mpi_env, mpiexec_prefix, small_job

from hpcckpt.run import lease as lease_module
from hpcckpt.run.lease import Holder, LeaseError, RunLease


def plant(run_dir, **fields) -> None:
    now = time.time()
    holder = dict(job="77", host="elsewhere", pid=1, user="someone", since=now, renewed=now)
    holder.update(fields)
    (run_dir / "lease.json").write_text(json.dumps(holder))


def test_a_free_run_is_taken_and_released(tmp_path):
    lease = RunLease(tmp_path, "local", "me").acquire()
    held = Holder(**json.loads((tmp_path / "lease.json").read_text()))
    assert (held.pid, held.job) == (os.getpid(), "local")
    lease.release()
    assert not (tmp_path / "lease.json").exists()


def test_a_live_process_on_this_host_is_refused(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        plant(tmp_path, host=os.uname().nodename, pid=other.pid, job="local")
        with pytest.raises(LeaseError, match=rf"is in use by job local \(host .*, pid {other.pid}"):
            RunLease(tmp_path, "local", "me").acquire(exit_grace_s=0.5)
    finally:
        other.kill()
        other.wait()
    # Gone now: its lease is stale and taken over.
    RunLease(tmp_path, "local", "me").acquire().release()


def test_a_holder_on_this_host_that_exits_within_the_grace_is_taken_over(tmp_path):
    """A relaunch right after the launcher returned may find the old rank 0 still exiting: it
    waits for it (up to EXIT_GRACE_S) instead of refusing the run."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        plant(tmp_path, host=os.uname().nodename, pid=other.pid, job="local")
        started = time.monotonic()
        RunLease(tmp_path, "local", "me").acquire(exit_grace_s=20).release()
        assert 0.5 < time.monotonic() - started < 15
    finally:
        other.kill()
        other.wait()


def test_a_holder_that_exited_but_was_not_reaped_is_taken_over(tmp_path):
    """A zombie (exited, its parent has not waited for it) holds nothing: taken over at once."""
    other = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{other.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    try:
        plant(tmp_path, host=os.uname().nodename, pid=other.pid, job="local")
        started = time.monotonic()
        RunLease(tmp_path, "local", "me").acquire(exit_grace_s=20).release()
        assert time.monotonic() - started < 5
    finally:
        other.wait()


def test_an_earlier_attempt_of_the_same_batch_job_is_taken_over(tmp_path):
    plant(tmp_path, job="4242", host="n9")
    lease = RunLease(tmp_path, "4242", "me").acquire()
    assert json.loads((tmp_path / "lease.json").read_text())["pid"] == os.getpid()
    lease.release()


def test_another_host_is_waited_for_then_refused_while_it_renews(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_module, "RENEW_S", 0.05)
    plant(tmp_path, host="n9")
    started = time.time()

    def renew():
        plant(tmp_path, host="n9")

    class Renewing(RunLease):
        def _read(self):
            renew()
            return super()._read()

    with pytest.raises(LeaseError, match="is in use by job 77 .host n9"):
        Renewing(tmp_path, "5", "me").acquire(expire_s=0.5)
    assert time.time() - started >= 0.5


def test_another_host_that_stopped_renewing_is_taken_over(tmp_path):
    plant(tmp_path, host="n9", renewed=time.time() - 120)
    RunLease(tmp_path, "5", "me").acquire(expire_s=60).release()


def test_a_lease_taken_by_another_job_is_noticed(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_module, "RENEW_S", 0.05)
    lease = RunLease(tmp_path, "local", "me").acquire()
    plant(tmp_path, host="n9", job="99")
    deadline = time.time() + 5
    while lease.lost_to is None and time.time() < deadline:
        time.sleep(0.05)
    assert lease.lost_to is not None and lease.lost_to.job == "99"
    assert "lost the lease" in str(lease.lost_error())
    lease.release()
    assert json.loads((tmp_path / "lease.json").read_text())["job"] == "99"  # not ours to delete


def test_a_second_job_on_a_running_run_exits_2_and_the_first_goes_on(tmp_path):
    config = small_job(tmp_path, run={"steps": 10 ** 6, "log_every": 10 ** 5}, eval={"every_steps": 0},
                       checkpoint={"every_steps": 100, "split_threshold_kb": 4},
                       resilience={"levels": ["local", "pfs"]})
    command = [*mpiexec_prefix(), "-n", "2", sys.executable, "-m", "hpcckpt", "train", "-c", str(config)]
    first = subprocess.Popen(command, cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run" / "lease.json").exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.05)
        second = subprocess.run(command, cwd=tmp_path, env=mpi_env(), capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first job ended: the second met no running job"
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"is in use by job local (host {os.uname().nodename}, pid" in second.stderr
    # The first job never noticed: asked to stop, it stops cleanly with a final checkpoint.
    assert first.returncode == 75, out + err
    assert "stopped cleanly" in out
    assert not (tmp_path / "run" / "lease.json").exists()
