"""Per-rank logs, rank 0's console lines and the metrics file of a run.

Every rank logs to <run.dir>/log/rank<R>.log; rank 0 also prints to the console and appends
one JSON object per metrics record to <run.dir>/metrics.jsonl, so a job script can tail it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from hpcckpt.errors import StorageError

HEARTBEAT_NAME = "heartbeat"


def bytes_text(n: float) -> str:
    """A byte count as a person reads it: 28064 -> "28.1 KB", 512 -> "512 bytes"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


# The launchers whose ranks' stdout is a pseudo-terminal of their own, whatever the launcher's
# stdout is (Open MPI's forwards the ranks' output through ptys): their variables.
PTY_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def watched(environ=None, parent_stdout=None) -> bool:
    """Whether this rank's output reaches a terminal a person watches: stdout is one, and,
    under a launcher that gives each rank a pty of its own, the launcher's stdout is one too
    (`mpiexec ... > log` must not fill the log with a bar's carriage returns).
    `parent_stdout`: what the launcher's stdout is (default: read from /proc)."""
    environ = os.environ if environ is None else environ
    if not sys.stdout.isatty():
        return False
    if not any(name in environ for name in PTY_LAUNCHER_VARIABLES):
        return True
    if parent_stdout is None:
        try:
            parent_stdout = os.readlink(f"/proc/{os.getppid()}/fd/1")
        except OSError:
            return False  # a launcher on another node, or no /proc: not known to be watched
    return parent_stdout.startswith(("/dev/pts/", "/dev/tty"))


def read_heartbeat(run_dir) -> tuple[int, float] | None:
    """(step, time) of the last step a previous run of this run.dir finished, if any."""
    try:
        step, stamp = (Path(run_dir) / HEARTBEAT_NAME).read_text().split()[:2]
        return int(step), float(stamp)
    except (OSError, ValueError):
        return None


def _ends_in_a_cut_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


METRICS_FILE = "metrics.jsonl"


def _append_records(path: Path, records: list[dict], check_cut: bool) -> bool:
    """`records`, time-stamped, at the end of the metrics file `path`. True where a crash had
    cut its last record short: that line stays (readers skip it), and what follows starts on a
    line of its own instead of joining it."""
    mended = False
    with open(path, "a") as f:
        if check_cut and _ends_in_a_cut_line(path):
            f.write("\n")
            mended = True
        for record in records:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
    return mended


def append_metrics(run_dir: str | Path, records: list[dict]) -> None:
    """Records for a run whose log this process does not hold open (one its abandoned
    checkpointers wrote), appended to its metrics as RunLog.metrics would."""
    _append_records(Path(run_dir) / METRICS_FILE, records, check_cut=True)


class RunLog:
    def __init__(self, run_dir: str | Path, rank: int, world_size: int, console: bool = True):
        self.rank = rank
        self.run_dir = Path(run_dir)
        try:
            (self.run_dir / "log").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"run.dir {str(self.run_dir)!r} cannot be created: {exc.strerror}; "
                               "point run.dir at a writable directory") from None
        self.logger = logging.getLogger(f"hpcckpt.rank{rank}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        for handler in list(self.logger.handlers):
            self.logger.removeHandler(handler)
            handler.close()
        file_handler = logging.FileHandler(self.run_dir / "log" / f"rank{rank}.log")
        file_handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank}/{world_size} %(levelname)s %(message)s"))
        self.logger.addHandler(file_handler)
        self.console = console and rank == 0
        self._progress_on_screen = False
        self._watched: bool | None = None  # a person watches this output (watched()), once known
        self.metrics_path = self.run_dir / METRICS_FILE
        self._metrics_checked = False
        self._heartbeat_fd: int | None = None

    def info(self, message: str, *, console: bool = False) -> None:
        """Log on this rank; `console` also prints it on rank 0's terminal."""
        self.logger.info(message)
        if console and self.console:
            self._clear_progress()
            print(message, flush=True)

    def warning(self, message: str) -> None:
        self.logger.warning(message)
        if self.console:
            self._clear_progress()
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def error(self, message: str) -> None:
        self.logger.error(message)

    def metrics(self, record: dict) -> None:
        """(rank 0 only writes) Append one metrics record."""
        if self.rank != 0:
            return
        mended = _append_records(self.metrics_path, [record], check_cut=not self._metrics_checked)
        self._metrics_checked = True
        if mended:
            self.warning(f"{self.metrics_path}: its last line was cut short (a crash while it was written); "
                         "kept, and skipped by its readers")

    def heartbeat(self, step: int) -> None:
        """(rank 0 only writes) The last step done, overwritten in place each step (page cache,
        no fsync): after a crash, the restart reads it to say how much work was lost."""
        if self.rank != 0:
            return
        if self._heartbeat_fd is None:
            self._heartbeat_fd = os.open(self.run_dir / HEARTBEAT_NAME, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._heartbeat_fd, f"{step:>14d} {time.time():>18.3f}\n".encode(), 0)

    def progress(self, step: int, total: int, text: str) -> None:
        """A one-line bar, only where a person watches (watched()) so batch logs stay clean."""
        if not self.console:
            return
        if self._watched is None:
            self._watched = watched()
        if not self._watched:
            return
        width = 30
        done = int(width * step / max(total, 1))
        sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} {text}")
        sys.stdout.flush()
        self._progress_on_screen = True

    def _clear_progress(self) -> None:
        if self._progress_on_screen:
            sys.stdout.write("\r\033[K")
            self._progress_on_screen = False

    def close(self) -> None:
        self._clear_progress()
        if self._heartbeat_fd is not None:
            os.close(self._heartbeat_fd)
            self._heartbeat_fd = None
        for handler in list(self.logger.handlers):
            self.logger.removeHandler(handler)
            handler.close()
