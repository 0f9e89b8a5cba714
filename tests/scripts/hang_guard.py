"""For test scripts that check something does not hang: a watchdog that ends the whole MPI
job, printing "HANG rank R <what>", when a block takes too long, so the test fails on that
line instead of waiting for its own timeout."""

import contextlib
import threading

from mpi4py import MPI


@contextlib.contextmanager
def abort_if_stuck(seconds: float, what: str = ""):
    done = threading.Event()

    def watchdog():
        if not done.wait(seconds):
            print(f"HANG rank {MPI.COMM_WORLD.rank} {what}".rstrip(), flush=True)
            MPI.COMM_WORLD.Abort(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        yield
    finally:
        done.set()
