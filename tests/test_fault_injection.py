"""A simulated node loss leaves the node's directory gone, even while threads write into it."""

import signal
import subprocess
import sys
import textwrap

from conftest import REPO

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
