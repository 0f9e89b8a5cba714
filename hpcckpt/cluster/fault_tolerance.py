"""Process failures survived inside the job: MPI's fault-tolerance extension (ULFM).

A rank that dies (a crash, an OOM kill, a GPU fault that takes its process) surfaces in the
survivors as an MPI error in whatever operation touched it: class ERR_PROC_FAILED, or
ERR_REVOKED where another survivor got there first. Not every survivor sees it in the same
call (a collective can finish on some ranks and fail on others), so whoever sees it revokes
the communicator, which fails every pending and later operation on it on every rank; then the
survivors shrink it into a communicator of their own, which MPI builds by agreement, so every
survivor gets the same one and the same list of the lost.

    reason = in_job_recovery_unavailable()        # None where this MPI can do it
    try:
        ...collectives on comm...
    except MPI.Exception as exc:
        if not is_process_failure(exc):
            raise
        survivors = shrink(comm, timeout=60)      # survivors.comm, survivors.lost
        comm = survivors.comm

Where it cannot work (the mpich wheel, Open MPI launched without `--with-ft ulfm`), the
failure ends the job as it always did and the job script relaunches it. ULFM's own known
faults (Shrink occasionally never returning, a second failure during the shrink) are bounded
by a watchdog: a recovery step that overruns its time ends this rank with RELAUNCH_EXIT_CODE,
recorded for the job script's loop, so a stuck recovery costs a relaunch, never a hang.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

from hpcckpt.cluster.mpi_gate import held
from hpcckpt.exit_record import record_exit

# What a rank exits with when the job cannot go on in place: the restart loop retries any
# code but 2 (bad input); 1 is what an unexpected error exits with too.
RELAUNCH_EXIT_CODE = 1


def in_job_recovery_unavailable(environ=None) -> str | None:
    """Why this process cannot survive a peer's death inside the job, or None where it can:
    an MPI with ULFM (Open MPI 5) started with fault tolerance on, and an mpi4py that has
    its calls. Needs MPI imported (not necessarily initialized)."""
    from mpi4py import MPI

    environ = os.environ if environ is None else environ
    if not hasattr(MPI.Comm, "Shrink"):
        return "this mpi4py has no ULFM calls (Revoke, Shrink): install mpi4py 4 or newer"
    library = MPI.Get_library_version()
    if "Open MPI" not in library:
        name = library.splitlines()[0].strip() if library.strip() else "this MPI"
        return (f"{name} is not Open MPI: only Open MPI 5's ULFM survives a dead rank here (MPICH's is "
                f"experimental); install the ULFM MPI (docs/in-job-recovery.md) or rely on the relaunch")
    if environ.get("OMPI_MCA_mpi_ft_enable", "0").lower() not in ("1", "true", "yes", "on"):
        return "Open MPI was started without fault tolerance: launch with `mpiexec --with-ft ulfm`"
    return None


def is_process_failure(exc: BaseException) -> bool:
    """An MPI error that means a rank of the communicator died (or another survivor already
    revoked it because one did), as opposed to a usage error."""
    from mpi4py import MPI

    if not isinstance(exc, MPI.Exception):
        return False
    if exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
        return True
    # A wait on several requests says only that one of them failed; the failure detector says
    # whether a rank died meanwhile.
    return exc.Get_error_class() == MPI.ERR_IN_STATUS and a_rank_died()


# Failures MPI had reported when the survivors last recovered: only a new one is news.
_failures_handled = 0
_watching: bool | None = None  # whether this process can survive failures (decided once)
_idle_spares: frozenset = frozenset()  # COMM_WORLD ranks started as spares that are not working


def _failures_known() -> int:
    """Dead processes MPI knows of, but idle spares (run/spares.py): the workers go on without
    them, and the next recovery counts them as lost."""
    from mpi4py import MPI

    with held():  # asked from the pipeline's threads too
        failed = MPI.COMM_WORLD.Get_failed()
        try:
            count = failed.Get_size()
            if not count or not _idle_spares:
                return count
            world = MPI.Group.Translate_ranks(failed, list(range(count)), MPI.COMM_WORLD.Get_group())
            return sum(1 for rank in world if rank not in _idle_spares)
        finally:
            failed.Free()


def note_idle_spares(world_ranks) -> None:
    """The COMM_WORLD ranks started as spares that do not work (dead ones included): their
    deaths are no reason for the workers to recover."""
    global _idle_spares
    _idle_spares = frozenset(world_ranks)


def a_rank_died() -> bool:
    """MPI has learnt of a dead rank since the survivors last recovered (always False where
    the job cannot survive one)."""
    global _watching
    if _watching is None:
        _watching = in_job_recovery_unavailable() is None
    return bool(_watching) and _failures_known() > _failures_handled


def failure_reported(*comms) -> bool:
    """Whether MPI has learnt of a dead rank since the last recovery, or another survivor has
    revoked one of `comms` (which it does only after a process failure). Both reach this rank
    in MPI's progress engine, which runs only inside MPI calls: a rank that waits for the
    verdict outside MPI (sleeping) would never learn of either, so this makes one."""
    from mpi4py import MPI

    # A probe of this rank's own messages on COMM_SELF: it drives progress and, unlike an
    # ANY_SOURCE probe on a communicator with a dead member, never fails for that death.
    with held():
        MPI.COMM_SELF.Iprobe(0, _PROGRESS_TAG)
        if a_rank_died():
            return True
        return any(_is_communicator(comm) and comm.Is_revoked() for comm in comms)


_PROGRESS_TAG = 32100  # a tag nothing sends to


def raise_if_a_rank_died() -> None:
    """For a wait on nonblocking requests: raise a process failure if MPI has learnt of a dead
    rank since the last recovery. Open MPI never completes some nonblocking collectives with a
    dead member (its libnbc schedules wait on for ever), so a wait that only tests its
    requests would hang the survivors instead of letting them recover."""
    if a_rank_died():
        from mpi4py import MPI

        raise MPI.Exception(MPI.ERR_PROC_FAILED)


def failures_handled() -> None:
    """The survivors have recovered from every failure MPI knows of so far."""
    global _failures_handled
    _failures_handled = _failures_known()


@dataclass(frozen=True)
class Survivors:
    """The communicator of the ranks still alive and what the shrink took."""

    comm: object
    lost: tuple[int, ...]  # ranks of the old communicator that are gone
    kept: tuple[int, ...]  # the survivors' ranks in the old communicator, in their new order
    old_rank: int  # this rank's rank in the old communicator
    seconds: float  # from the revoke to a working communicator


class RecoveryWatchdog:
    """A recovery step that must end in `timeout` seconds, or this rank exits with
    RELAUNCH_EXIT_CODE (recorded for the job script) so that the job relaunches instead of
    hanging: ULFM's Shrink can wait for ever on a second failure or one of its known faults."""

    def __init__(self, what: str, timeout: float, rank: int, log=None):
        self.what, self.timeout, self.rank, self.log = what, timeout, rank, log
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hpcckpt-watchdog-{what}", daemon=True)

    def __enter__(self) -> RecoveryWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self.timeout):
            return
        message = (f"in-job recovery: {self.what} did not finish in {self.timeout:g} s; ending this rank "
                   f"with exit code {RELAUNCH_EXIT_CODE} so the job is relaunched from its checkpoints")
        if self.log is not None:
            self.log.error(message)
        print(f"hpcckpt: rank {self.rank}: {message}", file=sys.stderr, flush=True)
        record_exit(RELAUNCH_EXIT_CODE, self.rank, message)
        os._exit(RELAUNCH_EXIT_CODE)


def revoke(*comms) -> None:
    """Revoke each communicator not revoked yet: every pending and later operation on it fails,
    on every rank, which is how the survivors that did not see the failure learn of it."""
    for comm in comms:
        if _is_communicator(comm) and not comm.Is_revoked():
            comm.Revoke()


def _is_communicator(comm) -> bool:
    from mpi4py import MPI

    return comm is not None and comm != MPI.COMM_NULL


def shrink(comm, also_revoke=(), *, timeout: float, log=None) -> Survivors:
    """(all survivors) Revoke `comm` and every communicator in `also_revoke` (duplicates the
    library made of it, whose pending operations must fail too), and shrink `comm` to the
    ranks still alive. Every survivor gets the same communicator and the same `lost`."""
    from mpi4py import MPI

    started = time.perf_counter()
    old_rank = comm.Get_rank()
    with RecoveryWatchdog("the shrink after a process failure", timeout, old_rank, log):
        revoke(comm, *also_revoke)
        new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    global _shrunk
    _shrunk = True
    failures_handled()
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), comm.Get_group())
    lost = tuple(sorted(set(range(comm.Get_size())) - set(kept)))
    return Survivors(new, lost, tuple(kept), old_rank, time.perf_counter() - started)


# Simulated nodes are numbered from rank blocks, which a shrink renumbers: the survivors keep
# the nodes (and so the node-local directories) they had, as real hosts keep their names.
_survivors_topology = None
_shrunk = False  # this process has gone on after ranks died


def world_ranks_after_shrink(comm) -> tuple[int, ...] | None:
    """After ranks died in the job: each rank of `comm` as the rank it has in COMM_WORLD, whose
    simulated nodes the survivors keep (also where no checkpointer was open to hand its
    topology on); None before any death."""
    from mpi4py import MPI

    if not _shrunk:
        return None
    return tuple(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                           MPI.COMM_WORLD.Get_group()))


_spares_at_start = 0  # the last ranks of COMM_WORLD started as spares (run/spares.py)


def note_spares_at_start(spares: int) -> None:
    global _spares_at_start
    _spares_at_start = spares


def spares_at_start() -> int:
    """How many of COMM_WORLD's last ranks were started as spares: with simulated nodes they
    sit on a node of their own past the workers' (a spare node), where they would on a
    cluster."""
    return _spares_at_start


def inherit_topology(topology) -> None:
    global _survivors_topology
    _survivors_topology = topology


def inherited_topology(world_size: int):
    """The survivors' simulated topology after the last recovery, for a communicator of their
    number; None otherwise."""
    if _survivors_topology is not None and _survivors_topology.world_size == world_size:
        return _survivors_topology
    return None
