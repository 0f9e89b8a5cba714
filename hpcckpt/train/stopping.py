"""Stop requests: a signal from the scheduler or the job script, or the allocation's end near.

Schedulers warn before they kill: Slurm sends SIGTERM (then SIGKILL after KillWait) at the
time limit, or the signal of `--signal=USR1@SECONDS` ahead of it; PBS sends SIGTERM. Any rank
may see the request first, or alone, so the ranks agree on it: each step posts a non-blocking
OR-reduce of its flags before the step and completes it after, so every rank stops after the
same step without an extra blocking collective. The loop then takes a final checkpoint, makes
it durable on the PFS and exits with EXIT_HALTED.
"""

from __future__ import annotations

import signal
import time

import numpy as np

EXIT_HALTED = 75  # sysexits' EX_TEMPFAIL: stopped on request after a final checkpoint; run again to continue
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")

_SIGNAL_FLAG = 1
_TIME_FLAG = 2


class StopRequests:
    def __init__(self, comm, end_time: float = 0.0, halt_seconds: float = 0.0, clock=time.time):
        """(all ranks) `end_time`: the allocation's end (seconds since the epoch; 0 unknown);
        the run stops once fewer than `halt_seconds` remain. Rank 0's clock decides, so all
        ranks agree even when clocks differ."""
        from mpi4py import MPI

        self.comm = comm.Dup() if comm.Get_size() > 1 else None
        self.rank = comm.Get_rank()
        self.end_time = end_time
        self.halt_seconds = halt_seconds
        self.clock = clock
        self.signal_name: str | None = None
        self._previous_handlers = {}
        self._request = None
        self._sent = np.zeros(1, dtype=np.int32)
        self._agreed = np.zeros(1, dtype=np.int32)
        self._op = MPI.BOR

    def install(self) -> "StopRequests":
        for name in STOP_SIGNALS:
            number = getattr(signal, name)
            self._previous_handlers[number] = signal.signal(number, self._on_signal)
        return self

    def _on_signal(self, number, frame) -> None:
        # Only a flag: the step in progress finishes, then every rank stops after the same step.
        self.signal_name = self.signal_name or signal.Signals(number).name

    def _local_flags(self) -> int:
        flags = _SIGNAL_FLAG if self.signal_name else 0
        if self.rank == 0 and self.end_time and self.halt_seconds and \
                self.end_time - self.clock() < self.halt_seconds:
            flags |= _TIME_FLAG
        return flags

    def post(self) -> None:
        """(all ranks) Before a step: share this rank's flags."""
        self._sent[0] = self._local_flags()
        if self.comm is not None:
            self._request = self.comm.Iallreduce(self._sent, self._agreed, op=self._op)

    def agreed(self) -> str | None:
        """(all ranks) After the step: why every rank stops now, or None to go on."""
        if self.comm is not None:
            while not self._request.Test():  # done long before: the step's own collectives progressed it
                time.sleep(0.0002)
            flags = int(self._agreed[0])
        else:
            flags = int(self._sent[0])
        if not flags:
            return None
        if flags & _TIME_FLAG:
            return (f"the allocation ends in less than run.halt_seconds = {self.halt_seconds:g} s "
                    f"(run.end_time {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.end_time))})")
        return f"{self.signal_name or 'a stop signal'} received" + ("" if self.signal_name else " by another rank")

    def close(self) -> None:
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers.clear()
        if self._request is not None:
            self._request.Wait()
            self._request = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
