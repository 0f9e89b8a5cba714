"""Fault injection for tests and demos: crash a rank, or lose a whole node, at a chosen point.

    --inject rank-kill:rank=R:step=S[:phase=P][:attempt=A]
    --inject node-loss:node=N:step=S[:phase=P][:attempt=A]

Without a phase the fault strikes right after training step S; with phase = snapshot, local,
partner, erasure, pfs or commit it strikes inside that phase of step S's checkpoint, and with
phase = restore while version S is being loaded at restart. `attempt=A` limits the fault to
attempt A of a job script's restart loop (HPCCKPT_ATTEMPT, 1 when unset), so a restarted run
does not meet the same fault again. Death is abrupt (os._exit, no cleanup, no MPI finalize),
as in a crash; a lost node's local directory is deleted first.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.errors import ConfigError

PHASES = ("snapshot", "local", "partner", "erasure", "pfs", "commit", "restore")
ATTEMPT_VARIABLE = "HPCCKPT_ATTEMPT"
CRASH_EXIT_CODE = 137


@dataclass(frozen=True)
class Fault:
    kind: str  # "rank-kill" or "node-loss"
    target: int  # rank or node
    step: int
    phase: str | None = None
    attempt: int | None = None  # None: every attempt


def parse_fault(text: str) -> Fault:
    usage = ("use rank-kill:rank=R:step=S[:phase=P][:attempt=A] or node-loss:node=N:step=S[:phase=P][:attempt=A], "
             f"P one of {', '.join(PHASES)}")
    kind, *fields = text.split(":")
    if kind not in ("rank-kill", "node-loss"):
        raise ConfigError(f"--inject {text!r}: unknown fault {kind!r}; {usage}")
    values = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--inject {text!r}: expected key=value, got {item!r}; {usage}")
        values[key] = value
    target_key = "rank" if kind == "rank-kill" else "node"
    allowed = {target_key, "step", "phase", "attempt"}
    if set(values) - allowed or not {target_key, "step"} <= set(values):
        raise ConfigError(f"--inject {text!r}: needs {target_key}= and step=; {usage}")
    try:
        target, step = int(values[target_key]), int(values["step"])
        attempt = int(values["attempt"]) if "attempt" in values else None
    except ValueError:
        raise ConfigError(f"--inject {text!r}: {target_key}, step and attempt must be integers; {usage}") from None
    phase = values.get("phase")
    if phase is not None and phase not in PHASES:
        raise ConfigError(f"--inject {text!r}: unknown phase {phase!r}; {usage}")
    return Fault(kind, target, step, phase, attempt)


def current_attempt(environ=None) -> int:
    value = (os.environ if environ is None else environ).get(ATTEMPT_VARIABLE, "")
    return int(value) if value.isdigit() else 1


class FaultInjector:
    def __init__(self, faults, rank: int, node: int, local_dir: str | Path | None, comm=None):
        """`comm` (the application's, used by the main thread) lets simultaneous node losses
        between steps delete every lost directory before any lost rank dies: otherwise the
        first death makes mpiexec kill the rest before they delete theirs."""
        self.rank = rank
        self.node = node
        self.local_dir = Path(local_dir) if local_dir else None
        self.comm = comm
        attempt = current_attempt()
        self.all_faults = tuple(f for f in faults if f.attempt in (None, attempt))
        self.faults = tuple(f for f in self.all_faults if self._hits_me(f))

    def _hits_me(self, fault: Fault) -> bool:
        return fault.target == (self.rank if fault.kind == "rank-kill" else self.node)

    def strike(self, step: int, phase: str | None = None) -> None:
        """Die here if a fault targets this rank at (step, phase). Without a phase every rank
        calls this after each step (collectively when node losses are due)."""
        if phase is None and self.comm is not None and any(
                f.kind == "node-loss" and f.step == step and f.phase is None for f in self.all_faults):
            self.comm.Barrier()
            mine = [f for f in self.faults if f.kind == "node-loss" and f.step == step and f.phase is None]
            if mine and self.local_dir is not None:
                shutil.rmtree(self.local_dir, ignore_errors=True)
            self.comm.Barrier()  # every lost directory is gone before anyone dies
            if mine and self.local_dir is not None:
                # A persist thread of this rank may have recreated a file meanwhile.
                shutil.rmtree(self.local_dir, ignore_errors=True)
        for fault in self.faults:
            if fault.step == step and fault.phase == phase:
                self._die(fault)

    def _die(self, fault: Fault) -> None:
        if fault.kind == "node-loss" and self.local_dir is not None:
            # Every rank of the node deletes; whichever comes last finds less to delete.
            shutil.rmtree(self.local_dir, ignore_errors=True)
        where = f" in phase {fault.phase}" if fault.phase else ""
        sys.stderr.write(f"hpcckpt: injected {fault.kind} on rank {self.rank} (node {self.node}) "
                         f"at step {fault.step}{where}\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)


NO_FAULTS = FaultInjector((), 0, 0, None)
