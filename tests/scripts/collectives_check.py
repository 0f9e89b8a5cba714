"""The collectives that keep metadata off every rank (#27), on real ranks: each helper's
answer on every rank. Prints one RESULT line per check (rank 0 gathers every rank's
answers); tests/test_collectives_mpi.py asserts them.

    mpiexec -n 5 python collectives_check.py
"""

import json

from mpi4py import MPI

from hpcckpt.cluster.collectives import (
    allgather_compact,
    decide_at_root,
    failing_ranks,
    first_of_each,
    fold_at_root,
    quiet_bcast,
    quiet_scatter,
    raise_if_any_failed,
)
from hpcckpt.errors import CheckpointError, ConfigError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def report(name, value):
    answers = comm.gather(value, root=0)
    if rank == 0:
        print("RESULT " + json.dumps({"check": name, "answers": answers}), flush=True)


report("fold_sum", fold_at_root(comm, rank + 1, sum))
report("fold_root_2", fold_at_root(comm, [rank], lambda parts: sorted(x for p in parts for x in p), root=2))
report("bcast", quiet_bcast(comm, {"from": rank, "big": "x" * 100000} if rank == 3 else None, root=3)["from"])
report("scatter", quiet_scatter(comm, [f"to {r}" for r in range(size)] if rank == 1 else None, root=1))
# Unhashable values, a value that differs from its neighbours, and one that comes back after a gap.
value = {"level": "local"} if rank not in (1, 3) else {"level": "partner"}
report("compact", allgather_compact(comm, value))
report("compact_none", allgather_compact(comm, None if rank == 2 else rank % 2))
report("failing_none", sorted(failing_ranks(comm, True)))
report("failing_some", sorted(failing_ranks(comm, rank not in (0, 4))))
report("first_of_each", first_of_each(comm, ("dir", rank // 2)))
shared, mine = decide_at_root(comm, "test", rank * 10, lambda values: (sum(values), [v + 1 for v in values]))
report("decide", [shared, mine])
try:
    decide_at_root(comm, "test", rank, lambda values: (_ for _ in ()).throw(ConfigError("no good: " + str(values))))
    report("decide_error", None)
except ConfigError as exc:
    report("decide_error", [str(exc), exc.collective])
try:
    fold_at_root(comm, rank, lambda values: values[0] / 0)
    report("fold_bug", None)
except CheckpointError as exc:
    report("fold_bug", [str(exc), exc.collective])
try:
    raise_if_any_failed(comm, "stage", "disk full here" if rank == 3 else None, step=7)
    report("agreed", None)
except CheckpointError as exc:
    report("agreed", [str(exc), sorted(exc.failures_by_rank)])
