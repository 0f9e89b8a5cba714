"""What every benchmark shares, so each script keeps only what it measures: launching its own
worker job under mpiexec (pinned BLAS threads, this repository on PYTHONPATH, no HPCCKPT_*
settings leaking in from the caller's shell), the statistics (median over repeats, the
paper's definition of overhead), quiet barriers and results as JSON.

Imported by the scripts in perf/ (they run as `python perf/<script>.py`, so this directory is
on sys.path); mpi4py is imported inside functions, as the scripts require.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcckpt.cluster.collectives import quiet_barrier  # noqa: F401  (the scripts take it from here)

REPO = Path(__file__).resolve().parent.parent


def median(values, empty=None):
    """Median of the values that were measured (None and NaN are "not this time"); `empty`
    when none was."""
    values = [v for v in values if v is not None and v == v]
    return float(statistics.median(values)) if values else empty


def paper_overhead(times, flags) -> tuple[float | None, float | None]:
    """Checkpoint overhead as the papers define it (CheckFreq, DeepFreeze): the mean time of
    the checkpointed steps and the steps right after them over the mean of the others, in %,
    and that mean of the others; (None, mean) when either set is empty."""
    hit = {j for i, f in enumerate(flags) if f for j in (i, i + 1) if j < len(flags)}
    with_ckpt = [t for i, t in enumerate(times) if i in hit]
    clean = [t for i, t in enumerate(times) if i not in hit]
    if not with_ckpt or not clean:
        return None, (statistics.fmean(clean) if clean else None)
    base = statistics.fmean(clean)
    return 100.0 * (statistics.fmean(with_ckpt) - base) / base, base


def mpiexec_command(ranks: int, mpiexec: str | None = None) -> tuple[list[str], str]:
    """The mpiexec prefix for `ranks` ranks and a label of the MPI it runs."""
    from hpcckpt.cluster.launcher import mpiexec_command as command

    return command(ranks, mpiexec)


def worker_env(pythonpath_first: str | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath_first, str(REPO), env.get("PYTHONPATH", "")]))
    return {k: v for k, v in env.items() if not k.startswith("HPCCKPT_")}


def run_worker(script: str, ranks: int, args: list[str], what: str, *, mpiexec: str | None = None,
               pythonpath_first: str | None = None, quiet: bool = True) -> tuple[dict, float]:
    """Run `script --worker --out <json> args...` on `ranks` ranks; its JSON result and the
    job's wall time. A failed job ends the benchmark with its output (`quiet`: captured and
    shown only then; otherwise it streams)."""
    fd, out = tempfile.mkstemp(prefix=f"{Path(script).stem}_", suffix=".json")
    os.close(fd)
    command, _ = mpiexec_command(ranks, mpiexec)
    command += [sys.executable, str(Path(script).resolve()), "--worker", "--out", out, *args]
    try:
        started = time.perf_counter()
        proc = subprocess.run(command, env=worker_env(pythonpath_first), capture_output=quiet, text=True)
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            if quiet:
                sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
            raise SystemExit(f"{Path(script).stem}: the {what} failed (exit {proc.returncode})")
        return json.loads(Path(out).read_text()), elapsed
    finally:
        Path(out).unlink(missing_ok=True)


def gloo_group(comm):
    """A torch.distributed gloo process group over the MPI ranks (rank 0 picks a free
    localhost port): what torch DCP needs to save and load across them."""
    import socket

    import torch.distributed as dist

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size(),
                            init_method=f"tcp://127.0.0.1:{port}")
    return dist.group.WORLD


def write_json(path: str | os.PathLike, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
