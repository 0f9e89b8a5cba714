"""An unexpected failure on one rank while a restart repartitions (out of memory reading
an old shard, while assembling the byte ranges) must end the restore with the same error
on every rank, not leave the others waiting in the next exchange.

    repartition_failure.py RUN_DIR save|restore STAGE FAILING_RANK
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hang_guard import abort_if_stuck  # tests/scripts, the script's own directory
from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import HpcckptError
from hpcckpt.repartition import exchange

HANG_S = 60
STAGES = {"read": "_load_shard", "move": "_post_receives"}


def main():
    run_dir, mode = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", f"cluster.simulated_nodes={comm.size}",
                                'resilience.levels=["local","partner"]', "checkpoint.split_threshold_kb=1"],
                         environ={})
    weights = np.zeros((64, 32))
    ckpt = Checkpointer(comm, config)
    ckpt.protect("w", weights)
    if mode == "save":
        weights[:] = 7.0
        ckpt.checkpoint(5)
        ckpt.close()
        return
    stage, failing = sys.argv[3], int(sys.argv[4])
    if comm.rank == failing:
        def fail(*args, **kwargs):
            raise MemoryError("injected: no memory for the old shard")
        setattr(exchange.RepartitionJob, STAGES[stage], fail)
    result = {"rank": comm.rank}
    with abort_if_stuck(HANG_S, "in restart"):
        try:
            ckpt.restart("auto")
            result["error"] = None
        except HpcckptError as exc:
            result["error"] = str(exc)
    ckpt.close(confirm=False)
    for record in comm.gather(result, root=0) or []:
        print("RESULT " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
