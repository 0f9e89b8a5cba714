"""One of the library's threads inside MPI at a time, and the fault-tolerant agreement polled
under the same gate.

Open MPI 5's MPIX_Comm_agree, while another thread of the process is inside MPI, now and then
returns an outcome no rank gave (0), and not always alike on every rank
(perf/agree_beside_threads.py counts them; with no other thread inside MPI it never does, even
with nonblocking transfers pending). The save pipeline's threads move the levels' bytes
behind the application through nonblocking calls polled with Testall: every such call takes
the gate (`gated_call`, `test_all` in cluster/collectives.py), and `fault_tolerant_agree` posts the agreement
nonblocking and tests it under the gate. So no library thread is inside MPI while the
agreement is, and yet the threads' transfers go on between its tests.

The gate is released between tests on purpose: a blocking agreement held under it would
deadlock, since another rank may reach its agreement only once its own pipeline, waiting on
a transfer with this rank's pipeline, has finished.

Not gated: the application's own MPI calls (made on the thread that agrees, so never beside
the agreement) and the calls a recovery makes once the library's threads are stopped.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

import numpy as np

T = TypeVar("T")

_gate = threading.RLock()  # reentrant: a gated helper may call another

# An agreement of the happy path ends within tens of microseconds on idle cores: tested
# back to back for this long, then with the library's usual sleep between tests.
SPIN_S = 0.002
POLL_S = 0.0005


def held():
    """The gate, as a context manager: `with held(): <MPI calls>`."""
    return _gate


def gated_call(call: Callable[..., T], *args, **kwargs) -> T:
    """`call(*args, **kwargs)` (an MPI call that returns at once: a post, a test) under the
    gate."""
    with _gate:
        return call(*args, **kwargs)


def fault_tolerant_agree(comm, flag: int) -> int:
    """(all ranks of comm) MPIX_Comm_agree: the bitwise AND of every live rank's `flag`, the
    same on every rank; raises MPI's error where a rank died (the outcome of the live ones
    is then not used). Posted nonblocking and tested under the gate."""
    flags = np.array([flag], dtype=np.intc)
    with _gate:
        request = comm.Iagree(flags)
    spin_until = time.perf_counter() + SPIN_S
    while True:
        with _gate:
            if request.Test():
                return int(flags[0])
        time.sleep(0 if time.perf_counter() < spin_until else POLL_S)
