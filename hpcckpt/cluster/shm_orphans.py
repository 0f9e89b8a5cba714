"""Shared-memory segments that MPI leaves behind when ranks are killed.

MPICH's ranks on one node share a segment in /dev/shm (mpich_shm_*, several MiB each) and remove it
at MPI_Finalize. A rank killed with SIGKILL, as a lost node's ranks are, never gets there: the
segment stays, in RAM, until the node reboots: a day of fault tests can leave a third of a
node's memory there. Batch systems often leave /dev/shm alone
between jobs, so the restart loop (jobs/restart-loop.sh) removes them after a failed attempt,
and the test suite after its run.

A segment is an orphan when it is ours (same user) and no process has it open or mapped:
MPICH's ranks keep it mapped from creation to MPI_Finalize, and the creator holds it open from
shm_open until it is mapped, so a live job's segments are never taken. Processes of ours that
cannot be inspected (not dumpable, or a sandbox's init) and processes in another PID
namespace sharing this /dev/shm (containers with a shared IPC namespace) are beyond this
check; the former are reported, and the restart loop and the test session only take
segments created since their failed attempt or session began (`--newer-than`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIXES = ("mpich_shm_",)  # MPICH (ch4 posix); Open MPI's own segments are named by job


@dataclass(frozen=True)
class Orphans:
    paths: tuple[Path, ...]
    nbytes: int
    uninspected: tuple[str, ...] = ()  # "PID (command)" of our processes we could not inspect


def find_orphans(directory: Path = SHM_DIR, prefixes: tuple[str, ...] = PREFIXES,
                 newer_than: float | None = None) -> Orphans:
    """Our segments in `directory` that no process has open or mapped; with `newer_than`
    (seconds since the epoch), only those last modified since then."""
    directory = Path(os.path.realpath(directory))  # /dev/shm may be a link (/run/shm)
    candidates = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return Orphans((), 0)
    for entry in entries:
        if not entry.name.startswith(prefixes) or not entry.is_file(follow_symlinks=False):
            continue
        info = entry.stat(follow_symlinks=False)
        if info.st_uid != os.getuid() or (newer_than is not None and info.st_mtime < newer_than):
            continue
        candidates[info.st_ino] = (Path(entry.path), info.st_size)
    uninspected = ()
    if candidates:
        in_use, unreadable = _inodes_in_use(directory)
        uninspected = tuple(f"{pid} ({_command_of(pid)})" for pid in unreadable)
        for inode in in_use:
            candidates.pop(inode, None)
    paths = tuple(sorted(path for path, _ in candidates.values()))
    return Orphans(paths, sum(size for _, size in candidates.values()), uninspected)


def remove_orphans(directory: Path = SHM_DIR, newer_than: float | None = None) -> Orphans:
    """Delete the orphans find_orphans reports; returns what was deleted."""
    found = find_orphans(directory, newer_than=newer_than)
    removed, nbytes = [], 0
    for path in found.paths:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:  # another cleaner got there first
            continue
        removed.append(path)
        nbytes += size
    return Orphans(tuple(removed), nbytes, found.uninspected)


def _inodes_in_use(directory: Path) -> tuple[set[int], list[str]]:
    """(inodes of the files in `directory` (one file system) that a process we can see has
    open or mapped, PIDs of this user's processes we could not inspect). Other users'
    processes are unreadable to us, but cannot use our segments."""
    device = os.stat(directory).st_dev
    prefix = str(directory).rstrip("/") + "/"
    in_use, unreadable = set(), []
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:  # gone
            continue
        except OSError:
            if _owned_by_us(pid):
                unreadable.append(pid)
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    info = os.stat(f"/proc/{pid}/fd/{fd}")
                    if info.st_dev == device:
                        in_use.add(info.st_ino)
            except OSError:
                continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)  # address perms offset device inode path
                    if len(fields) == 6 and fields[5].startswith(prefix):
                        in_use.add(int(fields[4]))
        except FileNotFoundError:
            continue
        except OSError:
            if _owned_by_us(pid):
                unreadable.append(pid)
    return in_use, unreadable


def _owned_by_us(pid: str) -> bool:
    """Whether a process belongs to this user (only those can use our segments)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _command_of(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return "?"
