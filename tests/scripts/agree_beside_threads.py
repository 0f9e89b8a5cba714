"""commit_step's agreement while another thread of each rank is inside MPI, as the save
pipeline's threads are during a checkpoint under MPI_THREAD_MULTIPLE (ckpt/step_commits.py).

    mpiexec --with-ft ulfm -n N python agree_beside_threads.py ROUNDS [--raw]

Each rank's background thread exchanges with its ring neighbours and allreduces, on
communicators of its own, polling as the library's waits do, while the main thread agrees
ROUNDS times: through StepCommits.commit, or with --raw through MPIX_Comm_agree alone,
counting the outcomes that are no AND of what the ranks gave. No rank dies. Each rank prints
one JSON line: its rank, the rounds committed, the unsound outcomes met, and the error that
ended it early (null when none).
"""

import json
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from hpcckpt.ckpt.step_commits import COMMITTING, StepCommits


def traffic(rank: int, size: int, stop: threading.Event, errors: list) -> None:
    ring, sums = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    out = np.full(1 << 14, rank, dtype=np.float64)
    into = np.empty_like(out)
    total = np.zeros(1 << 12)
    try:
        rounds = 0
        # Every rank's thread runs the same number of rounds: the last is matched everywhere.
        while True:
            stopping = np.array([1 if stop.is_set() else 0])
            sums.Allreduce(MPI.IN_PLACE, stopping, op=MPI.MAX)
            if stopping[0]:
                break
            requests = [ring.Irecv(into, source=(rank - 1) % size, tag=7),
                        ring.Isend(out, dest=(rank + 1) % size, tag=7),
                        sums.Iallreduce(MPI.IN_PLACE, total, op=MPI.SUM)]
            while not MPI.Request.Testall(requests):
                time.sleep(0.0005)
            rounds += 1
    except Exception as exc:  # reported by the main thread's line
        errors.append(f"{type(exc).__name__}: {exc}")


def main() -> None:
    rounds = int(sys.argv[1])
    raw = "--raw" in sys.argv
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    agreeing = world.Dup()
    agreeing.Set_errhandler(MPI.ERRORS_RETURN)
    stop, errors = threading.Event(), []
    thread = threading.Thread(target=traffic, args=(rank, size, stop, errors))
    thread.start()
    commits, unsound, committed, ended = StepCommits(), [], 0, None
    try:
        for step in range(rounds):
            if raw:
                outcome = agreeing.Agree(COMMITTING)
                if outcome != COMMITTING:
                    unsound.append(outcome)
            else:
                commits.commit(step, agreeing.Agree, on_unsound=unsound.append)
            committed += 1
    except Exception as exc:
        ended = f"{type(exc).__name__}: {exc}"
    stop.set()
    thread.join()
    print(json.dumps({"rank": rank, "committed": committed, "unsound": unsound, "ended": ended,
                      "traffic": errors[0] if errors else None}), flush=True)


if __name__ == "__main__":
    main()
