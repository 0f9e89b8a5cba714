"""A keyed table on real ranks (Checkpointer.protect_table), written and restored.

    table_job.py RUN_DIR write ROWS VERSIONS [SETTING ...]
    table_job.py RUN_DIR restore ROWS [SETTING ...]

write: the table starts with ids 0 .. ROWS-1, each row on the rank its id hashes to; every 5
steps a version, and between versions 1 % of the rows change and 100 new ids appear. Rank 0
prints, for each version, the digest of the whole table (KeyedTable.digest).
restore: restart and print the version, the digest of the table loaded, and whether every
row is on the rank its id hashes to now.
Simulated nodes: 2 (SETTING overrides anything, e.g. cluster.simulated_nodes=3).
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config
from hpcckpt.ckpt.keyed_table import KeyedTable
from hpcckpt.format.keyed_rows import owner_of

DIM = int(os.environ.get("TABLE_DIM", "8"))  # another dim: a job that does not fit the versions


def initial_rows(ids: np.ndarray) -> np.ndarray:
    return (ids[:, None] * 0.001 + np.arange(DIM)[None, :]).astype(np.float32)


def main():
    run_dir, mode, rows, *rest = sys.argv[1:]
    rows = int(rows)
    versions = int(rest.pop(0)) if mode == "write" else 0
    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2", "storage.pfs_async=false",
                                'resilience.levels=["local","partner"]', *rest], environ={})
    table = KeyedTable(DIM, np.float32, initializer=initial_rows)
    weights = np.zeros(100)
    state = {"step": 0}
    ckpt = Checkpointer(comm, config)
    ckpt.protect("weights", weights)
    ckpt.protect_table("emb", table)
    ckpt.register_state("loop", lambda: dict(state), state.update)
    if mode == "write":
        all_ids = np.arange(rows, dtype=np.int64)
        table.slots(all_ids[owner_of(all_ids, comm.size) == comm.rank], create=True)
        digests = {}
        for version in range(1, versions + 1):
            step = 5 * version
            if version > 1:
                rng = np.random.default_rng(version)
                changed = rng.choice(all_ids, size=max(1, all_ids.size // 100), replace=False)
                mine = changed[owner_of(changed, comm.size) == comm.rank]
                slots = table.slots(mine)
                table.values[slots] += version
                table.mark_changed(slots)
                new = np.arange(rows + 100 * (version - 2), rows + 100 * (version - 1), dtype=np.int64)
                table.slots(new[owner_of(new, comm.size) == comm.rank], create=True)
                all_ids = np.concatenate([all_ids, new])
            weights += step
            state["step"] = step
            ckpt.checkpoint(step, {"loss": 1.0 / step})
            digests[step] = table.digest(comm)
        ckpt.wait()
        ckpt.close()
        if comm.rank == 0:
            print("RESULT " + json.dumps({"digests": digests}), flush=True)
        return
    restored = ckpt.restart("require")
    placed = bool(np.all(owner_of(table.ids, comm.size) == comm.rank))
    placed = comm.allreduce(int(placed), op=MPI.MIN) == 1
    digest = table.digest(comm)
    ckpt.close()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"restored": restored, "digest": digest, "placed": placed,
                                      "weights": float(weights[0])}), flush=True)


if __name__ == "__main__":
    main()
