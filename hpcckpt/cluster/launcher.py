"""How to start N ranks of this Python from a script (tests, benchmarks): the mpiexec beside
the interpreter (the `mpich` wheel's) or on PATH, with the flags Open MPI needs to
oversubscribe cores and to run as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def find_mpiexec(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    beside = Path(sys.executable).with_name("mpiexec")
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec") or "mpiexec"


def mpiexec_flags(mpiexec: str) -> tuple[list[str], str]:
    """(extra flags, a one-line name of the MPI) for this mpiexec."""
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    flags: list[str] = []
    if "Open MPI" in version or "OpenRTE" in version:
        flags.append("--oversubscribe")
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    lines = [" ".join(line.split()) for line in version.splitlines() if line.strip()]
    named = [line for line in lines if "Version" in line or "Open MPI" in line]
    return flags, (named or lines or ["?"])[0]


def mpiexec_command(ranks: int, explicit: str | None = None) -> tuple[list[str], str]:
    """(['mpiexec', flags..., '-n', N], MPI name)."""
    mpiexec = find_mpiexec(explicit)
    flags, label = mpiexec_flags(mpiexec)
    return [mpiexec, *flags, "-n", str(ranks)], label
