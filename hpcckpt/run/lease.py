"""One job at a time per run directory: a lease held by rank 0 of the job that writes it.

Two jobs writing one run (a resubmitted job while the first still runs, two `mpiexec` runs
started in one directory) would delete each other's versions through retention and write
over each other's ledger and metrics. So the job that checkpoints a run holds

    <run.dir>/lease.json   {"job": "1234", "host": "n1", "pid": 4321, "user": "me",
                            "since": 1700000000.0, "renewed": 1700000010.0}

renewed by a thread of rank 0 every RENEW_S seconds and removed by close(). Another job
finding it:
- takes it over when it is the same batch job (a later attempt of the restart loop: the
  launcher has returned, so the earlier attempt's ranks are gone);
- on the same host, takes it over when the holder's process is gone (a zombie counts as
  gone), is refused when it still lives after EXIT_GRACE_S (a launcher that returned may
  leave its ranks exiting for a moment, and a restart loop relaunches at once; the same
  process holding it twice is re-entrant: a library caller that did not close() its first
  Checkpointer);
- on another host, where the process cannot be checked, waits until the lease is EXPIRE_S
  old (a job that crashed stops renewing) and then takes it over, or is refused if the
  holder keeps renewing.
A refusal is a LeaseError (exit 2: another attempt in this allocation cannot fix it). If the
lease is taken from this job (it stalled for EXPIRE_S), the next checkpoint call fails
instead of writing beside the new holder.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcckpt.errors import ConfigError
from hpcckpt.io.first_write import write_if_absent

LEASE_NAME = "lease.json"

# Holders (host, pid) this process knows to be dead: ranks of this very job that MPI reported
# failed (cluster/fault_tolerance.py). Their lease is taken over at once, as a later attempt of
# the same batch job takes it, instead of waiting for it to expire.
_lost_holders: set[tuple[str, int]] = set()


def mark_holder_lost(host: str, pid: int) -> None:
    _lost_holders.add((host, pid))
RENEW_S = 10.0
EXPIRE_S = 60.0
# How long a live holder on this host is given to exit before a job is refused: a relaunch
# right after its launcher returned can find the old rank 0 still on its way out.
EXIT_GRACE_S = 5.0


class LeaseError(ConfigError):
    """Another job holds the run directory."""


@dataclass(frozen=True)
class Holder:
    job: str
    host: str
    pid: int
    user: str
    since: float
    renewed: float

    def describe(self, now: float) -> str:
        return (f"job {self.job} (host {self.host}, pid {self.pid}, user {self.user}), which renewed it "
                f"{max(0.0, now - self.renewed):.0f} s ago")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Exited, not yet reaped by its parent (a rank its launcher has not waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False  # gone meanwhile (the next check says so), or no /proc here


class RunLease:
    def __init__(self, run_dir, job: str, user: str, log=None, clock=time.time):
        self.path = Path(run_dir) / LEASE_NAME
        self.log = log
        self.clock = clock
        now = clock()
        self.me = Holder(job, socket.gethostname(), os.getpid(), user, now, now)
        self.lost_to: Holder | None = None  # set by the renewing thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it ---------------------------------------------------------------------------
    def acquire(self, expire_s: float = EXPIRE_S, exit_grace_s: float = EXIT_GRACE_S) -> "RunLease":
        """(rank 0) Take the lease or raise LeaseError; waits at most `expire_s` for a holder
        on another host to stop renewing, `exit_grace_s` for one on this host to exit."""
        waited_since = None
        refused_since = None
        while True:
            if self._create():
                return self._started()
            holder = self._read()
            now = self.clock()
            verdict = self._verdict(holder, now, expire_s)
            if verdict == "mine":
                return self._started()
            if verdict == "take":
                if holder is not None and self.log is not None and holder.pid != self.me.pid:
                    self.log.info(f"taking over the run directory's lease from {holder.describe(now)}")
                elif holder is None and self.log is not None:
                    self.log.warning(f"the lease {self.path} is damaged (it names no job) and no job renewed it for "
                                     f"{min(expire_s, 2 * RENEW_S):.0f} s: taken over")
                self._write(self.me)
                return self._started()
            if verdict == "refuse":
                refused_since = time.monotonic() if refused_since is None else refused_since
                if time.monotonic() - refused_since < exit_grace_s:
                    time.sleep(min(0.2, exit_grace_s / 10))
                    continue
            if verdict == "refuse" or (waited_since is not None and now - waited_since > expire_s + RENEW_S):
                raise LeaseError(
                    f"run.dir {str(self.path.parent)!r} is in use by "
                    f"{holder.describe(now) if holder else 'a job whose lease is damaged'}; two jobs writing "
                    "one run would delete each other's checkpoints. Wait for that job to end (or cancel it), "
                    f"or give this job its own run.dir. If that job is gone, delete {self.path}")
            if waited_since is None:
                waited_since = now
                if self.log is not None:
                    who = (f"leased to {holder.describe(now)} on another host" if holder is not None else
                           f"leased, but its lease {self.path} is damaged (it names no job)")
                    self.log.info(f"run.dir is {who}; waiting up to {expire_s:.0f} s for the lease to expire",
                                  console=True)
            time.sleep(min(1.0, expire_s / 10))

    def _verdict(self, holder: Holder | None, now: float, expire_s: float) -> str:
        if holder is None:
            # Damaged (leases are written whole, so only from outside): a live holder on any
            # host replaces the file whole at its next renewal; one that stayed damaged for two
            # renewal periods has none.
            return "take" if now - self._mtime() > min(expire_s, 2 * RENEW_S) else "wait"
        me = self.me
        if holder.job == me.job and me.job != "local":
            return "take"  # an earlier attempt of this batch job
        if (holder.host, holder.pid) in _lost_holders:
            return "take"  # a rank of this job that died; the survivors go on
        if holder.host == me.host:
            if holder.pid == me.pid:
                return "mine"
            return "refuse" if _process_alive(holder.pid) else "take"
        return "take" if now - holder.renewed > expire_s else "wait"

    def _create(self) -> bool:
        # Whole or not at all: a lease torn by a crash mid-write would name no holder.
        return write_if_absent(self.path, json.dumps(asdict(self.me)))

    def _read(self) -> Holder | None:
        try:
            return Holder(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            return None

    def _mtime(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _write(self, holder: Holder) -> None:
        temporary = self.path.with_name(f"{LEASE_NAME}.{self.me.host}.{self.me.pid}.tmp")
        temporary.write_text(json.dumps(asdict(holder)))
        os.replace(temporary, self.path)

    # -- keeping it ----------------------------------------------------------------------------
    def _started(self) -> "RunLease":
        self._thread = threading.Thread(target=self._renew_loop, name="hpcckpt-lease", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S):
            holder = self._read()
            if holder is not None and (holder.host, holder.pid) != (self.me.host, self.me.pid):
                self.lost_to = holder
                return
            try:
                self._write(Holder(**{**asdict(self.me), "renewed": self.clock()}))
            except OSError as exc:  # a missed renewal only shortens the lease; the next one retries
                if self.log is not None:
                    self.log.warning(f"cannot renew the lease {self.path}: {exc.strerror or exc}")

    def lost_error(self) -> LeaseError:
        """What to fail with once another job took the lease (this one stalled past EXPIRE_S)."""
        return LeaseError(f"this job lost the lease of run.dir {str(self.path.parent)!r} to "
                          f"{self.lost_to.describe(self.clock())}; it stops rather than write beside it")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        holder = self._read()
        if holder is not None and (holder.host, holder.pid) == (self.me.host, self.me.pid):
            try:
                self.path.unlink()
            except OSError as exc:  # the next job takes a stale lease over; say why it is there
                if self.log is not None:
                    self.log.warning(f"cannot remove the lease {self.path}: {exc.strerror or exc}")
