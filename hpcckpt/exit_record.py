"""Why the ranks of an attempt exited, recorded for the job script's restart loop.

The launcher's exit code does not say which rank failed first, or why: when one rank exits
with 2 (a bad config), srun kills the others and itself returns 143 (or 137), which a loop
would retry. So the job script names a file in HPCCKPT_EXIT_FILE on a file system every node
sees, and the ranks write into it the exit code they agreed on:

    exit_code=2
    rank=0
    message=...

The first record wins (it is linked into place, never overwritten): every rank that meets a
collective error writes the same code, so whichever rank the launcher lets finish first
records it; a rank's own error (not collective) is recorded by that rank before it aborts
the job. A rank killed outright records nothing, and the launcher's code stands.
"""

from __future__ import annotations

import os
import sys

from hpcckpt.env_names import EXIT_FILE_VARIABLE
from hpcckpt.io.first_write import write_if_absent



def record_exit(code: int, rank: int, message: str = "", environ=None) -> None:
    environ = os.environ if environ is None else environ
    path = environ.get(EXIT_FILE_VARIABLE)
    if not path:
        return
    text = f"exit_code={code}\nrank={rank}\nmessage={' '.join(message.split())}\n"
    try:
        write_if_absent(path, text)  # False: another rank recorded first
    except OSError as exc:
        # The loop falls back to the launcher's exit code; say why the record is missing.
        print(f"hpcckpt: warning: could not record exit code {code} in {path} ({EXIT_FILE_VARIABLE}): "
              f"{exc.strerror or exc}", file=sys.stderr, flush=True)


STARTED_SUFFIX = ".started"


def record_started(comm, environ=None) -> None:
    """(all ranks) Every rank got through MPI start-up: rank 0 says so beside the exit file,
    and the restart loop's start-up watchdog (jobs/restart-loop.sh, START_TIMEOUT) lets the
    attempt run. Without it the loop takes the attempt for hung in MPI_Init (a PMI request
    the launcher lost hangs it for good: hpcckpt/cluster/slurm_pmi.py) and starts it again."""
    environ = os.environ if environ is None else environ
    path = environ.get(EXIT_FILE_VARIABLE)
    if not path:
        return
    comm.Barrier()
    if comm.Get_rank() == 0:
        try:
            with open(path + STARTED_SUFFIX, "w") as f:
                f.write("started\n")
        except OSError as exc:
            print(f"hpcckpt: warning: could not mark the start in {path + STARTED_SUFFIX} ({EXIT_FILE_VARIABLE}): "
                  f"{exc.strerror or exc}; the job script may take this attempt for hung at start-up",
                  file=sys.stderr, flush=True)
