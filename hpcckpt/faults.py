"""Fault injection for tests and demos: crash a rank, or lose a whole node, at a chosen point.

    --inject rank-kill:rank=R:step=S[:phase=P][:attempt=A]
    --inject node-loss:node=N:step=S[:phase=P][:attempt=A]
    --inject storage-error:level=L:step=S[:until=T][:rank=R][:errno=E][:attempt=A]
    --inject slow-level:level=L:seconds=X[:step=S][:until=T][:rank=R][:attempt=A]
    --inject nan:step=S[:rank=R][:attempt=A]
    --inject spike:step=S[:rank=R][:factor=F][:attempt=A]

A nan makes rank R's (default 0) gradients of step S not finite, once, as a silent data error
does; a spike scales rank R's inputs of step S by F (default 30), once, as a bad batch does:
its loss spikes and its update throws the weights off. Nothing dies (the trainer's divergence
check, resilience.rewind_on_divergence and resilience.divergence_factor, rewinds the run).
Without a phase the fault strikes right after training step S; with phase = snapshot, local,
partner, erasure, pfs or commit it strikes inside that phase of step S's checkpoint, and with
phase = restore while version S is being loaded at restart, with phase = handover as the
survivors of a death in the job begin to hand step S, which they hold in memory, to spare
ranks in dead ranks' places. A level's phase strikes where that
level's store begins, on the thread that runs it (faulty_levels.py): L1's runs on the writer
thread beside L2's and L3's transfers, so what those finished before the crash varies, as in
a real one. `attempt=A` limits the fault to
attempt A of a job script's restart loop (HPCCKPT_ATTEMPT, 1 when unset), so a restarted run
does not meet the same fault again. Death is abrupt (os._exit, or SIGKILL; no cleanup, no MPI
finalize), as in a crash.

A storage error makes level L's store of every version from step S to T (default: S only)
fail on rank R (default: every rank) with errno E: ENOSPC (the default, a full file
system), EIO or EROFS, as the file system would report it; nothing dies. Level node-local
fails every write of the rank to its node's directory (L1-L3 and its commit record), as a
node-local directory that turned read-only or full does. A level whose store is collective
(L2, L3) fails after its transfers, where its file is written, so its peers never wait. A slow level takes
X seconds longer for each store from step S to T (default: every version) on rank R (default:
every rank), as a contended parallel file system does.

A lost node's local directory must stay gone, as on a real node that went down. Deleting it
from the dying rank is not enough: its persist and writer threads, and the other ranks of the
node, keep running until the kill and may create files in it again. So a small reaper process
first stops (SIGSTOP) every lost rank on this host, waits until none of their threads can
still be inside a system call, deletes the lost directories, and only then kills the rank.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.env_names import ATTEMPT_VARIABLE
from hpcckpt.errors import ConfigError

PHASES = ("snapshot", "local", "partner", "erasure", "pfs", "commit", "restore", "handover")
CRASH_EXIT_CODE = 137
DEFAULT_SPIKE_FACTOR = 30.0
REAPER_GRACE_S = 30.0  # a dying rank exits by itself if its reaper has not killed it by then

# Runs as `python -I -c _REAPER victim freeze_pids dir...`: standard library only, so it starts
# in tens of milliseconds and cannot be broken by the application's environment.
_REAPER = r"""
import os, shutil, signal, sys, time

def quiet(pid):
    # Stopped (T/t) or gone in every thread. A thread inside a system call (an O_DIRECT write,
    # an open with O_CREAT) finishes it before stopping, so wait for the state, not the signal.
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    except OSError:
        return None  # no /proc here
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if state not in "TtZX":
            return False
    return True

victim = int(sys.argv[1])
freeze = [int(p) for p in sys.argv[2].split(",") if p]
for pid in freeze:
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
deadline = time.monotonic() + 10.0
while time.monotonic() < deadline:
    states = [quiet(pid) for pid in freeze]
    if None in states:
        time.sleep(0.5)
        break
    if all(states):
        break
    time.sleep(0.002)
for directory in sys.argv[3:]:
    shutil.rmtree(directory, ignore_errors=True)
try:
    os.kill(victim, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


STORAGE_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EROFS": errno.EROFS}
# "node-local": every write of the rank to its node's directory (L1's shard, the replicas and
# parity it holds, its commit record), as when that directory turns read-only or fills.
STORAGE_LEVELS = ("local", "partner", "erasure", "pfs", "node-local")
NODE_LOCAL_WRITES = ("local", "partner", "erasure", "node-local commit")


@dataclass(frozen=True)
class Fault:
    kind: str  # "rank-kill", "node-loss", "storage-error", "slow-level", "nan" or "spike"
    target: int  # rank or node (-1: every rank, for a storage fault)
    step: int
    phase: str | None = None  # the level, for a storage fault
    attempt: int | None = None  # None: every attempt
    until: int | None = None  # a storage fault's last step
    errno_name: str = "ENOSPC"
    seconds: float = 0.0  # a slow level's extra time per store
    factor: float = 0.0  # a spike's scale of the inputs


def parse_fault(text: str) -> Fault:
    usage = ("use rank-kill:rank=R:step=S[:phase=P][:attempt=A] or node-loss:node=N:step=S[:phase=P][:attempt=A], "
             f"P one of {', '.join(PHASES)}, or storage-error:level=L:step=S[:until=T][:rank=R][:errno=E][:attempt=A], "
             f"or slow-level:level=L:seconds=X[:step=S][:until=T][:rank=R][:attempt=A], "
             f"or nan:step=S[:rank=R][:attempt=A], or spike:step=S[:rank=R][:factor=F][:attempt=A], "
             f"L one of {', '.join(STORAGE_LEVELS)}, E one of {', '.join(STORAGE_ERRNOS)}")
    kind, *fields = text.split(":")
    if kind not in ("rank-kill", "node-loss", "storage-error", "slow-level", "nan", "spike"):
        raise ConfigError(f"--inject {text!r}: unknown fault {kind!r}; {usage}")
    values = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--inject {text!r}: expected key=value, got {item!r}; {usage}")
        values[key] = value
    if kind == "storage-error":
        return _parse_storage_error(text, values, usage)
    if kind == "slow-level":
        return _parse_slow_level(text, values, usage)
    if kind in ("nan", "spike"):
        return _parse_corruption(kind, text, values, usage)
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


def _parse_storage_error(text: str, values: dict, usage: str) -> Fault:
    allowed = {"level", "step", "until", "rank", "errno", "attempt"}
    if set(values) - allowed or not {"level", "step"} <= set(values):
        raise ConfigError(f"--inject {text!r}: needs level= and step=; {usage}")
    if values["level"] not in STORAGE_LEVELS or values.get("errno", "ENOSPC") not in STORAGE_ERRNOS:
        raise ConfigError(f"--inject {text!r}: unknown level or errno; {usage}")
    try:
        step = int(values["step"])
        until = int(values["until"]) if "until" in values else step
        rank = int(values["rank"]) if "rank" in values else -1
        attempt = int(values["attempt"]) if "attempt" in values else None
    except ValueError:
        raise ConfigError(f"--inject {text!r}: step, until, rank and attempt must be integers; {usage}") from None
    if until < step:
        raise ConfigError(f"--inject {text!r}: until={until} is before step={step}; {usage}")
    return Fault("storage-error", rank, step, values["level"], attempt, until, values.get("errno", "ENOSPC"))


def _parse_slow_level(text: str, values: dict, usage: str) -> Fault:
    allowed = {"level", "seconds", "step", "until", "rank", "attempt"}
    if set(values) - allowed or not {"level", "seconds"} <= set(values):
        raise ConfigError(f"--inject {text!r}: needs level= and seconds=; {usage}")
    if values["level"] not in STORAGE_LEVELS:
        raise ConfigError(f"--inject {text!r}: unknown level {values['level']!r}; {usage}")
    try:
        seconds = float(values["seconds"])
        step = int(values.get("step", 0))
        until = int(values["until"]) if "until" in values else (step if "step" in values else 2**62)
        rank = int(values["rank"]) if "rank" in values else -1
        attempt = int(values["attempt"]) if "attempt" in values else None
    except ValueError:
        raise ConfigError(f"--inject {text!r}: seconds must be a number, step, until, rank and attempt "
                          f"integers; {usage}") from None
    if not 0 < seconds < 3600 or until < step:
        raise ConfigError(f"--inject {text!r}: seconds must be in (0, 3600) and until at or after step; {usage}")
    return Fault("slow-level", rank, step, values["level"], attempt, until, seconds=seconds)


def _parse_corruption(kind: str, text: str, values: dict, usage: str) -> Fault:
    allowed = {"step", "rank", "attempt"} | ({"factor"} if kind == "spike" else set())
    if set(values) - allowed or "step" not in values:
        raise ConfigError(f"--inject {text!r}: needs step= (and only {', '.join(sorted(allowed))}); {usage}")
    try:
        step, rank = int(values["step"]), int(values.get("rank", 0))
        attempt = int(values["attempt"]) if "attempt" in values else None
        factor = float(values.get("factor", DEFAULT_SPIKE_FACTOR))
    except ValueError:
        raise ConfigError(f"--inject {text!r}: step, rank and attempt must be integers and factor a number; "
                          f"{usage}") from None
    if kind == "spike" and not factor > 1:
        raise ConfigError(f"--inject {text!r}: factor must be above 1; {usage}")
    return Fault(kind, rank, step, None, attempt, factor=factor if kind == "spike" else 0.0)


def current_attempt(environ=None) -> int:
    """The job script's attempt (HPCCKPT_ATTEMPT), counting each recovery inside the job as one
    more: a fault limited to an attempt strikes once, whichever tier went on after it."""
    from hpcckpt.run.in_job_state import recoveries_in_job

    value = (os.environ if environ is None else environ).get(ATTEMPT_VARIABLE, "")
    return (int(value) if value.isdigit() else 1) + recoveries_in_job()


@dataclass(frozen=True)
class _Peer:
    host: str
    pid: int
    node: int
    node_dirs: tuple[str, ...]


class FaultInjector:
    def __init__(self, faults, rank: int, node: int, local_dir: str | Path | None, comm=None,
                 memory_dir: str | Path | None = None):
        """`local_dir` and `memory_dir`: the node's directories a node loss takes (its disk's
        and its memory's, storage.memory_dir).
        `comm` (the application's, used by the main thread; construction is then collective)
        lets simultaneous node losses between steps delete every lost directory before any lost
        rank dies, otherwise the first death makes mpiexec kill the rest before they delete
        theirs; and it tells a dying rank which processes share its node and host."""
        self.rank = rank
        self.node = node
        self.local_dir = Path(local_dir) if local_dir else None
        self.node_dirs = tuple(str(d) for d in (local_dir, memory_dir) if d)
        self.comm = comm
        attempt = current_attempt()
        self.all_faults = tuple(f for f in faults if f.attempt in (None, attempt))
        self.faults = tuple(f for f in self.all_faults if self._hits_me(f))
        self._spent: set = set()
        me = _Peer(socket.gethostname(), os.getpid(), node, self.node_dirs)
        self.peers: tuple[_Peer, ...] = (me,)
        if comm is not None and any(f.kind == "node-loss" for f in self.all_faults):
            self.peers = tuple(comm.allgather(me))

    def _hits_me(self, fault: Fault) -> bool:
        if fault.kind in ("storage-error", "slow-level"):
            return fault.target in (-1, self.rank)
        return fault.target == (self.rank if fault.kind in ("rank-kill", "nan", "spike") else self.node)

    def corruption(self, step: int) -> Fault | None:
        """The nan or spike fault that corrupts this rank's step `step`, if any (each once: a
        rewound run that comes to the step again meets a healthy batch)."""
        for fault in self.faults:
            if fault.kind in ("nan", "spike") and fault.step == step and fault not in self._spent:
                self._spent.add(fault)
                return fault
        return None

    def storage_fault(self, step: int, level: str) -> None:
        """Take a slow level's extra time, then raise the OSError a storage error injected for
        `level` at `step` stands for."""
        def hits(fault: Fault) -> bool:
            return (fault.phase == level or (fault.phase == "node-local" and level in NODE_LOCAL_WRITES)) \
                and fault.step <= step <= fault.until
        for fault in self.faults:
            if fault.kind == "slow-level" and hits(fault):
                time.sleep(fault.seconds)
        for fault in self.faults:
            if fault.kind == "storage-error" and hits(fault):
                code = STORAGE_ERRNOS[fault.errno_name]
                raise OSError(code, f"{os.strerror(code)} (injected storage-error at step {step} on rank {self.rank})")

    def strike(self, step: int, phase: str | None = None) -> None:
        """Die here if a fault targets this rank at (step, phase). Without a phase every rank
        calls this after each step (collectively when node losses are due)."""
        if phase is None and self.comm is not None and any(
                f.kind == "node-loss" and f.step == step and f.phase is None for f in self.all_faults):
            self.comm.Barrier()
            mine = [f for f in self.faults if f.kind == "node-loss" and f.step == step and f.phase is None]
            if mine:
                self._delete_node_dirs()
            # Every lost directory is gone before anyone dies, on other hosts too; the reapers
            # then make sure that stays so on this one.
            self.comm.Barrier()
            lost_nodes = {f.target for f in self.all_faults
                          if f.kind == "node-loss" and f.step == step and f.phase is None}
        else:
            lost_nodes = {self.node}
        for fault in self.faults:
            if fault.kind in ("rank-kill", "node-loss") and fault.step == step and fault.phase == phase:
                self._die(fault, lost_nodes)

    def _die(self, fault: Fault, lost_nodes: set[int]) -> None:
        where = f" in phase {fault.phase}" if fault.phase else ""
        sys.stderr.write(f"hpcckpt: injected {fault.kind} on rank {self.rank} (node {self.node}) "
                         f"at step {fault.step}{where}\n")
        sys.stderr.flush()
        if fault.kind == "node-loss" and self.node_dirs:
            self._reap_node(lost_nodes)
        # A crash is a signal: Open MPI's launcher ends the whole job when a rank exits with
        # a non-zero code, but lets fault-tolerant survivors go on after a rank killed.
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(CRASH_EXIT_CODE)

    def _reap_node(self, lost_nodes: set[int]) -> None:
        """Have a reaper freeze the lost ranks of this host, delete their node directories and
        kill this rank; returns only if that did not happen in time."""
        host = socket.gethostname()
        lost = [p for p in self.peers if p.host == host and p.node in lost_nodes]
        pids = sorted({p.pid for p in lost} | {os.getpid()})
        directories = sorted({d for p in lost for d in p.node_dirs} | set(self.node_dirs))
        try:
            reaper = subprocess.Popen(
                [sys.executable, "-I", "-c", _REAPER, str(os.getpid()), ",".join(map(str, pids)), *directories],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)  # mpiexec's kill of this rank's group must not stop it
        except OSError as exc:
            sys.stderr.write(f"hpcckpt: could not start the node-loss reaper ({exc}); deleting from here\n")
            self._delete_node_dirs()
            return
        time.sleep(REAPER_GRACE_S)
        sys.stderr.write(f"hpcckpt: the node-loss reaper did not kill rank {self.rank} "
                         f"(exit {reaper.poll()}); exiting\n")
        self._delete_node_dirs()

    def _delete_node_dirs(self) -> None:
        for directory in self.node_dirs:
            shutil.rmtree(directory, ignore_errors=True)


NO_FAULTS = FaultInjector((), 0, 0, None)
