"""Ranks that go on after others die: every step is an allreduce of ones (which counts the
ranks alive); `--kill STEP:RANK[+RANK...]` kills those ranks (COMM_WORLD ranks) just before
that step's allreduce, and may repeat (a second failure after the first recovery). The lowest
of them SIGKILLs the others and then itself, so that they die together as a node's ranks do: a
rank killing only itself can leave a peer of the same kill still inside the previous step's
allreduce, which fails there, joins the shrink, and dies only after it (two recoveries). Survivors shrink and go on from the earliest step one of
them had not finished. Each rank writes one JSON line per recovery ("recovered") and one at
the end ("final") to records-WORLDRANK.jsonl in the working directory (lines that ranks print
at the same moment can come out of the launcher interleaved); with --why, only why in-job
recovery is or is not available here.

    mpiexec --with-ft ulfm -n 4 python dead_ranks.py --steps 20 --kill 5:2 --kill 12:0
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np
from mpi4py import MPI

from hpcckpt.cluster.fault_tolerance import in_job_recovery_unavailable, is_process_failure, shrink


def record(**fields) -> None:
    with open(f"records-{MPI.COMM_WORLD.Get_rank()}.jsonl", "a") as out:
        out.write(json.dumps(fields) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kill", action="append", default=[], help="STEP:RANK[+RANK...]")
    parser.add_argument("--why", action="store_true")
    args = parser.parse_args()
    if args.why:
        record(unavailable=in_job_recovery_unavailable())
        return
    kills = {}
    for spec in args.kill:
        step, ranks = spec.split(":")
        kills[int(step)] = {int(r) for r in ranks.split("+")}
    comm = MPI.COMM_WORLD
    world_rank = comm.Get_rank()
    pids = comm.allgather(os.getpid())
    ones, counted = np.ones(1), np.zeros(1)
    step = 0
    while step < args.steps:
        doomed = kills.get(step, set())
        if doomed and world_rank == min(doomed):
            for other in sorted(doomed - {world_rank}):
                os.kill(pids[other], signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.Allreduce(ones, counted)
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            survivors = shrink(comm, timeout=60)
            comm = survivors.comm
            # A collective can finish on some ranks and fail on others: those that finished it
            # are a step ahead. All go on from the earliest step any survivor has not finished.
            earliest = np.array([step])
            comm.Allreduce(MPI.IN_PLACE, earliest, op=MPI.MIN)
            step = int(earliest[0])
            record(recovered=step, world_rank=world_rank, lost=list(survivors.lost),
                   size=comm.Get_size(), seconds=survivors.seconds)
            continue
        step += 1
    record(final=step, world_rank=world_rank, rank=comm.Get_rank(), size=comm.Get_size(),
           counted=int(counted[0]))
    if comm.Get_size() < MPI.COMM_WORLD.Get_size():
        # MPI_Finalize hangs on survivors (a known ULFM fault): leave as run_main does.
        comm.Barrier()
        time.sleep(0.5)
        os._exit(0)


if __name__ == "__main__":
    main()
