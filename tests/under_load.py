"""Run the test suite beside busy processes, the way a shared or slow CI machine runs it.

    python tests/under_load.py                      # the suite beside one busy process per core
    python tests/under_load.py --busy 2 --rounds 3  # three loaded rounds, then the summary of each
    python tests/under_load.py --busy 0             # the same, unloaded
    python tests/under_load.py -- -k slurm          # anything after -- goes to pytest

A test that passes here only when the machine happens to be quiet asserts the machine's speed,
not the code's behaviour. Each busy process spins on one core at normal priority (a CPU hog
the scheduler shares time with, as another job on a shared node is), and with --io each also
writes and fsyncs a file in a loop, so the disk is shared too. Every round prints pytest's
summary line and its time; the exit code is the first failing round's, 0 when all passed.
Run it before resolving an issue (docs/testing.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SPIN = "while True: pass"
SPIN_AND_WRITE = """
import os, sys
block = os.urandom(1 << 20)
path = sys.argv[1]
while True:
    with open(path, "wb") as f:
        for _ in range(32):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
"""


def start_busy(count: int, io: bool, scratch: Path) -> list[subprocess.Popen]:
    busy = []
    for i in range(count):
        if io:
            command = [sys.executable, "-c", SPIN_AND_WRITE, str(scratch / f"busy-{i}.bin")]
        else:
            command = [sys.executable, "-c", SPIN]
        # A session of its own, so that a Ctrl-C meant for pytest does not stop the load first.
        busy.append(subprocess.Popen(command, start_new_session=True))
    return busy


def stop_busy(busy: list[subprocess.Popen]) -> None:
    for proc in busy:
        proc.send_signal(signal.SIGKILL)
    for proc in busy:
        proc.wait()


def summary_line(output: str) -> str:
    """pytest's last line: '5454 passed, 20 skipped in 912.3s' or the failures' count."""
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def run_round(number: int, busy_count: int, io: bool, pytest_args: list[str], log_dir: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="hpcckpt-load-") as scratch:
        busy = start_busy(busy_count, io, Path(scratch))
        started = time.monotonic()
        log = log_dir / f"round-{number}.log"
        try:
            with open(log, "w") as out:
                proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *pytest_args], cwd=REPO,
                                      stdout=out, stderr=subprocess.STDOUT)
        finally:
            stop_busy(busy)
        minutes = (time.monotonic() - started) / 60
    text = log.read_text(errors="replace")
    failed = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    print(f"round {number}: {busy_count} busy process(es){' writing' if io else ''} on {os.cpu_count()} core(s): "
          f"{summary_line(text)}; {minutes:.1f} min; exit {proc.returncode}; log {log}", flush=True)
    for line in failed:
        print(f"  {line}", flush=True)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                        help="busy processes beside the suite (default: one per core; 0: unloaded)")
    parser.add_argument("--io", action="store_true", help="the busy processes also write and fsync a file")
    parser.add_argument("--rounds", type=int, default=1, help="how many times to run the suite")
    parser.add_argument("--logs", type=Path, default=None, help="where each round's pytest output goes")
    args = parser.parse_args(argv)
    if args.busy < 0 or args.rounds < 1:
        parser.error("--busy must be 0 or more and --rounds at least 1")
    log_dir = args.logs or Path(tempfile.mkdtemp(prefix="hpcckpt-suite-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    first_failure = 0
    for number in range(1, args.rounds + 1):
        code = run_round(number, args.busy, args.io, pytest_args, log_dir)
        first_failure = first_failure or code
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
