"""What run_surviving decides about an error that is not itself a process failure (an MPI
error of another class, as ULFM gives some survivors of a death): each rank prints
"RESULT {"rank", "verdict", "seconds"}" for caused_by_process_failure(MPI_ERR_OTHER).

    --case death   the last rank SIGKILLs itself; the others make no MPI call until the verdict
    --case revoke  the last rank revokes a communicator the others hold, as a survivor that saw
                   a death does before its shrink; it gives no verdict itself
    --case none    nobody died or revoked anything (the wait cut to --detection seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from mpi4py import MPI

from hpcckpt.run import in_job


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("death", "revoke", "none"), required=True)
    parser.add_argument("--detection", type=float, default=in_job.DETECTION_S)
    args = parser.parse_args()
    in_job.DETECTION_S = args.detection
    world = MPI.COMM_WORLD
    rank, last = world.Get_rank(), world.Get_size() - 1
    held = world.Dup()
    world.Barrier()
    if rank == last and args.case == "death":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == last and args.case == "revoke":
        time.sleep(0.3)
        held.Revoke()
    else:
        started = time.monotonic()
        verdict = in_job.caused_by_process_failure(MPI.Exception(MPI.ERR_OTHER), [held])
        print("RESULT " + json.dumps({"rank": rank, "verdict": verdict,
                                      "seconds": round(time.monotonic() - started, 3)}), flush=True)
    sys.stdout.flush()
    if args.case == "none":
        world.Barrier()
    else:
        # The survivors of a death or a revoke leave without MPI_Finalize, as run_surviving's do.
        time.sleep(1.0)
        os._exit(0)


if __name__ == "__main__":
    main()
