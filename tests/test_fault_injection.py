"""Injected faults (faults.py): how --inject parses them, whom and when they strike; a simulated
node loss leaves the node's directory gone, even while threads write into it."""

import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

from hpcckpt.errors import ConfigError
from hpcckpt.faults import Fault, parse_fault

DYING_RANK = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from hpcckpt.faults import FaultInjector, parse_fault

    local = Path(sys.argv[1])
    started = threading.Event()

    def keep_writing():  # a persist thread that knows nothing of the fault
        i = 0
        while True:
            version = local / "v12"
            version.mkdir(parents=True, exist_ok=True)
            (version / f"shard{i % 8}.tmp").write_bytes(b"x" * 65536)
            started.set()
            i += 1

    for _ in range(2):
        threading.Thread(target=keep_writing, daemon=True).start()
    started.wait()
    FaultInjector([parse_fault(sys.argv[2])], 3, 1, local).strike(5, sys.argv[3] or None)
    print("survived the fault")
""")


def _lose_node(tmp_path, phase=""):
    local = tmp_path / "local" / "node1"
    fault = "node-loss:node=1:step=5" + (f":phase={phase}" if phase else "")
    proc = subprocess.run([sys.executable, "-c", DYING_RANK, str(local), fault, phase], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return proc, local


def test_node_loss_deletes_the_directory_its_threads_keep_writing_to(tmp_path):
    for _ in range(3):  # the race was intermittent
        proc, local = _lose_node(tmp_path)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert "survived" not in proc.stdout
        assert "injected node-loss on rank 3 (node 1) at step 5" in proc.stderr
        assert not local.exists(), sorted(p.name for p in local.rglob("*"))


def test_node_loss_in_a_phase_also_kills_and_deletes(tmp_path):
    proc, local = _lose_node(tmp_path, "partner")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "at step 5 in phase partner" in proc.stderr
    assert not local.exists()


def test_parse_faults():
    assert parse_fault("rank-kill:rank=2:step=10") == Fault("rank-kill", 2, 10, None)
    assert parse_fault("node-loss:node=1:step=5:phase=pfs") == Fault("node-loss", 1, 5, "pfs")
    for bad in ("rank-kill:rank=2", "meteor:rank=1:step=2", "rank-kill:rank=x:step=1",
                "node-loss:node=1:step=2:phase=lunch", "rank-kill:node=1:step=2"):
        with pytest.raises(ConfigError):
            parse_fault(bad)


def test_a_slow_level_takes_its_extra_time_on_its_level_steps_and_ranks(monkeypatch):
    from hpcckpt.faults import FaultInjector

    fault = parse_fault("slow-level:level=pfs:seconds=0.5:step=20:until=30:rank=1")
    assert fault == Fault("slow-level", 1, 20, "pfs", None, 30, seconds=0.5)
    assert parse_fault("slow-level:level=local:seconds=2").until >= 10**12  # every version by default
    slept = []
    monkeypatch.setattr("hpcckpt.faults.time.sleep", slept.append)
    injector = FaultInjector([fault], 1, 0, None)
    for step, level in ((10, "pfs"), (20, "local"), (20, "pfs"), (30, "pfs"), (40, "pfs")):
        injector.storage_fault(step, level)
    assert slept == [0.5, 0.5]
    FaultInjector([fault], 0, 0, None).storage_fault(20, "pfs")  # another rank
    assert slept == [0.5, 0.5]
    for bad in ("slow-level:level=pfs", "slow-level:level=tape:seconds=1", "slow-level:level=pfs:seconds=0",
                "slow-level:level=pfs:seconds=x", "slow-level:level=pfs:seconds=1:step=5:until=4",
                "slow-level:level=pfs:seconds=1:errno=EIO"):
        with pytest.raises(ConfigError, match="slow-level"):
            parse_fault(bad)


def test_fault_attempt_field_limits_the_fault_to_one_attempt(monkeypatch):
    from hpcckpt.faults import FaultInjector

    fault = parse_fault("rank-kill:rank=1:step=20:phase=restore:attempt=2")
    assert fault == Fault("rank-kill", 1, 20, "restore", 2)
    monkeypatch.setenv("HPCCKPT_ATTEMPT", "1")
    assert FaultInjector([fault], 1, 0, None).faults == ()
    monkeypatch.setenv("HPCCKPT_ATTEMPT", "2")
    assert FaultInjector([fault], 1, 0, None).faults == (fault,)
    with pytest.raises(ConfigError, match="attempt must be integers"):
        parse_fault("rank-kill:rank=1:step=20:attempt=x")
