"""How often Open MPI's fault-tolerant agreement returns an outcome no rank gave, while another
thread of each rank is inside MPI, and that the library's gate (cluster/mpi_gate.py) keeps
commit_step's agreement clear of it (ckpt/step_commits.py, docs/in-job-recovery.md).

    python -m hpcckpt.cluster.ulfm_mpiexec -n 4 \\
        python perf/agree_beside_threads.py 30000 [--alone | --gated]

Each rank's second thread exchanges with its ring neighbours and allreduces, on communicators
of its own, while the main thread agrees on 0b11 ROUNDS times. By default both are raw MPI:
the thread polls as the library's waits do, the agreement is MPIX_Comm_agree. --alone: no
second thread (the control). --gated: the thread's traffic goes through the library's own
collectives and the agreement through mpi_gate.fault_tolerant_agree, as the save pipeline and
commit_step do. No rank dies, so every outcome should be 0b11. Rank 0 prints the rounds, the bad
outcomes each rank met, the rounds where the ranks' outcomes differed, and how many rounds of
traffic the threads made meanwhile.
"""

import json
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from hpcckpt.cluster import collectives, mpi_gate

COMMITTING = 0b11


def raw_traffic(rank: int, size: int, stop: threading.Event, rounds: list) -> None:
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
        rounds[0] += 1


def library_traffic(rank: int, size: int, stop: threading.Event, rounds: list) -> None:
    ring, sums = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    out = np.full(1 << 17, rank % 256, dtype=np.uint8)
    into = np.empty_like(out)
    while not collectives.quiet_any(sums, stop.is_set()):
        collectives.exchange(ring, [((rank + 1) % size, out)], [((rank - 1) % size, into)], tag=7)
        collectives.quiet_allgather(sums, rounds[0])
        rounds[0] += 1


def main() -> int:
    rounds, alone, gated = int(sys.argv[1]), "--alone" in sys.argv, "--gated" in sys.argv
    if not alone and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        print("agree_beside_threads: needs MPI_THREAD_MULTIPLE: set MPI4PY_RC_THREAD_LEVEL=multiple", file=sys.stderr)
        return 2
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    agreeing = world.Dup()
    agreeing.Set_errhandler(MPI.ERRORS_RETURN)
    agree = (lambda flag: mpi_gate.fault_tolerant_agree(agreeing, flag)) if gated else agreeing.Agree
    stop = threading.Event()
    traffic_rounds = [0]
    thread = None if alone else threading.Thread(target=library_traffic if gated else raw_traffic,
                                                 args=(rank, size, stop, traffic_rounds))
    if thread is not None:
        thread.start()
    bad = {}
    started = time.perf_counter()
    for index in range(rounds):
        outcome = agree(COMMITTING)
        if outcome != COMMITTING:
            bad[index] = outcome
    seconds = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join()
    everyone = world.gather((bad, traffic_rounds[0]), root=0)
    if rank == 0:
        bads = [b for b, _ in everyone]
        rounds_bad = sorted(set().union(*bads))
        uneven = [index for index in rounds_bad if len({b.get(index) for b in bads}) > 1]
        print(json.dumps({"rounds": rounds, "beside_a_thread": not alone, "gated": gated,
                          "seconds": round(seconds, 2), "bad_by_rank": [len(b) for b in bads],
                          "outcomes": sorted({v for b in bads for v in b.values()}),
                          "rounds_bad": len(rounds_bad), "rounds_uneven": len(uneven),
                          "traffic_rounds": min(n for _, n in everyone)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
