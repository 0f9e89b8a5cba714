"""Stop requests: a signal from the scheduler or the job script, the allocation's end near, or
a halt file an operator wrote.

Schedulers warn before they kill: Slurm sends SIGTERM (then SIGKILL after KillWait) at the
time limit, or the signal of `--signal=USR1@SECONDS` ahead of it; PBS sends SIGTERM. An
operator stops a run by writing `<run.dir>/HALT` (SCR's scr_halt); its first line, if any,
is the reason logged. Any rank may see a request first, or alone, so the ranks agree on it:
once per step each rank completes the non-blocking OR-reduce it posted at the previous step
and posts its flags of now, so every rank stops after the same step without an extra
blocking collective (the step's own collectives progress the reduce). The application then
takes a final checkpoint, makes it durable on the PFS and exits with EXIT_HALTED.

Signal handlers only set a flag. They are Python handlers installed after MPI_Init on
purpose: the `mpich` wheel's MPI_Init installs a C handler for SIGUSR1 that swallows the
signal, so without ours a job script's warning would never reach the application. A Python
handler the application installed before is called after ours, so its own reaction stays.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

EXIT_HALTED = 75  # sysexits' EX_TEMPFAIL: stopped on request after a final checkpoint; run again to continue
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
HALT_FILE_NAME = "HALT"
HALT_CHECK_S = 1.0  # a halt file is looked for at most this often between checkpoints (a stat per
#                     step is a metadata operation on the PFS, where run.dir usually lives), and at
#                     every checkpoint, so a run whose steps are short still sees it in time

_SIGNAL_FLAG = 1
_TIME_FLAG = 2
_HALT_FLAG = 4


class StopRequests:
    def __init__(self, comm, end_time: float = 0.0, halt_seconds: float = 0.0, halt_file: str | Path | None = None,
                 clock=time.time, *, dup: bool = True):
        """(all ranks) `end_time`: the allocation's end (seconds since the epoch; 0 unknown);
        the run stops once fewer than `halt_seconds` remain. `halt_file`: a path whose
        existence asks for a stop. Rank 0's clock and view of the file decide, so all ranks
        agree even when clocks differ. `dup`: agree on a duplicate of `comm` (False: the
        caller gives a communicator of its own, used from one thread)."""
        from mpi4py import MPI

        multi = comm.Get_size() > 1
        self.comm = (comm.Dup() if dup else comm) if multi else None
        self._owns_comm = multi and dup
        self.rank = comm.Get_rank()
        self.end_time = end_time
        self.halt_seconds = halt_seconds
        self.halt_file = Path(halt_file) if halt_file else None
        self.clock = clock
        self.signal_name: str | None = None
        self.halt_reason: str | None = None
        self.reason: str | None = None  # the agreed reason, once there is one
        self._next_halt_check = 0.0
        self._previous_handlers = {}
        self._request = None
        self._posted = False
        self._sent = np.zeros(1, dtype=np.int32)
        self._agreed = np.zeros(1, dtype=np.int32)
        self._op = MPI.BOR

    def install(self, log=None) -> "StopRequests":
        """Catch the stop signals. Only the main thread may install handlers: from another
        thread this says so in the log and relies on the time limit and the halt file."""
        if threading.current_thread() is not threading.main_thread():
            if log is not None:
                log.warning("stop signals (SIGTERM, SIGUSR1, SIGUSR2) are not caught: the checkpointer was made "
                            "outside the main thread; the halt file and run.end_time still stop the run cleanly")
            return self
        for name in STOP_SIGNALS:
            number = getattr(signal, name)
            self._previous_handlers[number] = signal.signal(number, self._on_signal)
        return self

    def _on_signal(self, number, frame) -> None:
        # Only a flag: the step in progress finishes, then every rank stops after the same step.
        self.signal_name = self.signal_name or signal.Signals(number).name
        previous = self._previous_handlers.get(number)
        if callable(previous):
            previous(number, frame)

    def request(self, reason: str) -> None:
        """The application asks for a stop itself (on this rank; agreed like a signal)."""
        self.signal_name = self.signal_name or reason

    def _halt_requested(self, look_now: bool) -> bool:
        if self.halt_file is None or self.halt_reason is not None:
            return self.halt_reason is not None
        now = time.monotonic()
        if now < self._next_halt_check and not look_now:
            return False
        self._next_halt_check = now + HALT_CHECK_S
        try:
            text = self.halt_file.read_text(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return False
        except OSError as exc:  # there, but unreadable: still a request to stop
            text = [f"unreadable: {exc.strerror or exc}"]
        self.halt_reason = f"halt file {self.halt_file}" + (f" ({text[0][:200]})" if text and text[0] else "")
        return True

    def _local_flags(self, look_now: bool) -> int:
        flags = _SIGNAL_FLAG if self.signal_name else 0
        if self.rank == 0:
            if self.end_time and self.halt_seconds and self.end_time - self.clock() < self.halt_seconds:
                flags |= _TIME_FLAG
            if self._halt_requested(look_now):
                flags |= _HALT_FLAG
        return flags

    def post(self, look_now: bool = False) -> None:
        """(all ranks) Share this rank's flags of now; agreed() completes the exchange.
        `look_now`: look for the halt file even if it was looked for less than HALT_CHECK_S ago."""
        self._sent[0] = self._local_flags(look_now)
        if self.comm is not None:
            self._request = self.comm.Iallreduce(self._sent, self._agreed, op=self._op)
        self._posted = True

    def post_if_idle(self) -> None:
        """(all ranks) Post now unless an exchange is pending or a stop is agreed already."""
        if not self._posted and self.reason is None:
            self.post()

    def agreed(self) -> str | None:
        """(all ranks) Why every rank stops now, or None to go on; completes the exchange
        post() began (None when nothing was posted)."""
        if not self._posted:
            return self.reason
        self._posted = False
        if self.comm is not None:
            while not self._request.Test():  # done long before: the step's own collectives progressed it
                time.sleep(0.0002)
            self._request = None
            flags = int(self._agreed[0])
        else:
            flags = int(self._sent[0])
        if flags and self.reason is None:
            self.reason = self._describe(flags)
        return self.reason

    def step_over(self, look_now: bool = False) -> str | None:
        """(all ranks, once per step) Complete the exchange of the previous step and post this
        one's: a request made during step k is agreed at the end of step k + 1, the same step
        on every rank. Once agreed, the reason stays. `look_now`: see post()."""
        reason = self.agreed()
        if reason is None:
            self.post(look_now)
        return reason

    def _describe(self, flags: int) -> str:
        if flags & _TIME_FLAG:
            return (f"the allocation ends in less than run.halt_seconds = {self.halt_seconds:g} s "
                    f"(run.end_time {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.end_time))})")
        if flags & _HALT_FLAG:
            return self.halt_reason or f"halt file {self.halt_file}"
        return f"{self.signal_name or 'a stop signal'} received" + ("" if self.signal_name else " by another rank")

    def consume_halt_file(self) -> str | None:
        """(rank 0) After the stop it asked for is complete: remove the halt file, so the
        next job of this run goes on. Returns the path removed."""
        if self.rank != 0 or self.halt_file is None or self.halt_reason is None:
            return None
        try:
            os.unlink(self.halt_file)
        except FileNotFoundError:
            return None
        return str(self.halt_file)

    def close(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers.clear()
        if self._request is not None:
            while not self._request.Test():
                time.sleep(0.0002)
            self._request = None
        if self.comm is not None and self._owns_comm:
            self.comm.Free()
        self.comm = None
