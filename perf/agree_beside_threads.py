"""How often Open MPI's fault-tolerant agreement returns an outcome no rank gave, while another
thread of each rank is inside MPI: what rules out commit_step's agreement beside the save
pipeline's threads (ckpt/step_commits.py, docs/in-job-recovery.md).

    MPI4PY_RC_THREAD_LEVEL=multiple python -m hpcckpt.cluster.ulfm_mpiexec -n 4 \\
        python perf/agree_beside_threads.py 30000 [--alone]

Each rank's second thread exchanges with its ring neighbours and allreduces, on communicators
of its own, polling as the library's waits do, while the main thread runs MPIX_Comm_agree(0b11)
ROUNDS times (--alone: with no second thread). No rank dies, so every outcome should be 0b11.
Rank 0 prints the rounds, the bad outcomes each rank met, and the rounds where the ranks'
outcomes differed.
"""

import json
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

COMMITTING = 0b11


def traffic(rank: int, size: int, stop: threading.Event) -> None:
    ring, sums = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    out = np.full(1 << 14, rank, dtype=np.float64)
    into = np.empty_like(out)
    total = np.zeros(1 << 12)
    while True:  # every rank's thread runs the same rounds: the last is matched everywhere
        stopping = np.array([1 if stop.is_set() else 0])
        sums.Allreduce(MPI.IN_PLACE, stopping, op=MPI.MAX)
        if stopping[0]:
            return
        requests = [ring.Irecv(into, source=(rank - 1) % size, tag=7),
                    ring.Isend(out, dest=(rank + 1) % size, tag=7),
                    sums.Iallreduce(MPI.IN_PLACE, total, op=MPI.SUM)]
        while not MPI.Request.Testall(requests):
            time.sleep(0.0005)


def main() -> int:
    rounds, alone = int(sys.argv[1]), "--alone" in sys.argv
    if not alone and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        print("agree_beside_threads: needs MPI_THREAD_MULTIPLE: set MPI4PY_RC_THREAD_LEVEL=multiple", file=sys.stderr)
        return 2
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    agreeing = world.Dup()
    agreeing.Set_errhandler(MPI.ERRORS_RETURN)
    stop = threading.Event()
    thread = None if alone else threading.Thread(target=traffic, args=(rank, size, stop))
    if thread is not None:
        thread.start()
    bad = {}
    started = time.perf_counter()
    for index in range(rounds):
        outcome = agreeing.Agree(COMMITTING)
        if outcome != COMMITTING:
            bad[index] = outcome
    seconds = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join()
    everyone = world.gather(bad, root=0)
    if rank == 0:
        rounds_bad = sorted(set().union(*everyone))
        uneven = [index for index in rounds_bad if len({b.get(index) for b in everyone}) > 1]
        print(json.dumps({"rounds": rounds, "beside_a_thread": not alone, "seconds": round(seconds, 2),
                          "bad_by_rank": [len(b) for b in everyone],
                          "outcomes": sorted({v for b in everyone for v in b.values()}),
                          "rounds_bad": len(rounds_bad), "rounds_uneven": len(uneven)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
