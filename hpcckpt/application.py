"""An application's main, run on every rank the way hpcckpt's own commands run.

    from hpcckpt import run_main
    if __name__ == "__main__":
        raise SystemExit(run_main(main))        # main() returns ckpt.close(): 0, or 75 after a stop

What it gives a job script's restart loop (jobs/restart-loop.sh), which cannot tell from the
launcher's exit code which rank failed first or why:
- the exit code the ranks agreed on, recorded in HPCCKPT_EXIT_FILE (hpcckpt/exit_record.py):
  0 done, 75 stopped cleanly, 2 bad input (a ConfigError, or argparse's usage error), 4 no
  loadable checkpoint, which the loop does not retry; 3 and anything else, retried;
- an error every rank meets alike (HpcckptError.collective) printed once and returned; one
  rank's own error printed with its rank and ended with MPI_Abort, so no rank waits for ever
  in a collective the failed one never joins; a traceback for anything unexpected (exit 1);
- before MPI starts (when mpi4py.MPI is not imported yet), the start-up settings the batch
  system needs (cluster/slurm_pmi.py) and those of a node with more ranks than cores
  (cluster/oversubscription.py); an application that imports mpi4py.MPI at its top is
  started through `hpcckpt exec`, which makes them and then becomes the application.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

from hpcckpt.errors import HpcckptError
from hpcckpt.exit_record import record_exit


def run_main(main: Callable[[], int | None]) -> int:
    """Call main() and return the process's exit code (its return value, None being 0). A
    process that survived ranks' deaths inside the job (run/in_job.py) exits here with that
    code without MPI_Finalize, which can hang on the survivors of a failure (a known fault of
    Open MPI's ULFM)."""
    code = _run_main(main)
    from hpcckpt.run.in_job import exit_if_survived_failures

    exit_if_survived_failures(code)
    return code


def _run_main(main: Callable[[], int | None]) -> int:
    prepare_mpi_startup()
    try:
        code = _exit_code(main())
        from hpcckpt.run.in_job import speaks_for_the_job

        if speaks_for_the_job(rank_or_zero()):
            record_exit(code, 0)
        return code
    except HpcckptError as exc:
        # Errors every rank sees alike (a bad config) are printed once; exit without abort so
        # the launcher reports the exit code instead of a kill.
        rank = rank_or_zero()
        record_exit(exc.exit_code, rank, str(exc))
        if exc.collective:
            if rank == 0:
                print(f"hpcckpt: error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        print(f"hpcckpt: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        abort_world(exc.exit_code)
        return exc.exit_code
    except SystemExit as exc:
        # argparse's usage error is 2 on every rank: bad input, as a ConfigError is.
        code = _exit_code(exc.code)
        said = str(exc.code) if isinstance(exc.code, str) else \
            f"{os.path.basename(sys.argv[0]) or 'the application'} exited with code {code} (its own message is above)"
        record_exit(code, rank_or_zero(), said)
        return code
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        traceback.print_exc()
        record_exit(1, rank_or_zero(), f"{type(exc).__name__}: {exc}")
        abort_world(1)
        return 1


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        if not isinstance(value, bool):
            print(value, file=sys.stderr, flush=True)  # what sys.exit("text") prints
        return 1 if value else 0
    return value


def prepare_mpi_startup() -> None:
    """Settings MPI_Init reads, made before anything imports mpi4py.MPI; too late after,
    which is said once (rank 0) where a setting was needed."""
    from hpcckpt.cluster.oversubscription import yield_when_oversubscribed
    from hpcckpt.cluster.slurm_pmi import prepare_mpi_startup as prepare

    started = "mpi4py.MPI" in sys.modules
    if not started:
        yield_when_oversubscribed()
    said = prepare(too_late=started)
    if said and rank_or_zero() == 0:
        print(f"hpcckpt: {said}", file=sys.stderr, flush=True)


def rank_or_zero() -> int:
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized():
            return MPI.COMM_WORLD.Get_rank()
    # Errors before MPI starts (a bad config); the launcher's variables still tell the rank.
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PALS_RANKID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def abort_world(code: int) -> None:
    """An uncaught error on one rank must not leave the others hanging in a collective (where
    the MPI survives dead ranks, they learn of this one's end as of a death)."""
    if "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        from hpcckpt.cluster.fault_tolerance import in_job_recovery_unavailable

        if in_job_recovery_unavailable() is None:
            # With fault tolerance on, Open MPI's MPI_Abort ends the calling process only (the
            # others learn of it as of any dead rank), and when several ranks abort at once the
            # launcher can hang for good after they are gone. Leaving without MPI_Finalize ends
            # this rank the same way, and the launcher exits once every rank has.
            os._exit(code)
        MPI.COMM_WORLD.Abort(code)
