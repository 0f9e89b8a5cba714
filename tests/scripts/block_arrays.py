"""Blocks of global arrays (#23 item 1), saved on one decomposition and restored onto another.

    mpiexec -n N python block_arrays.py <run dir> <nodes> <mode>

Arrays: "field", float64 (29, 17, 6), cut into a grid of uneven blocks over its first two
axes (the grid depends on N; a rank may hold nothing); "mask", int16 (40,), blocks with gaps
(allow_gaps) when saved; "w", a replicated float32 array beside them.

modes:
  save           protect, checkpoint step 10 (all levels the run dir's config names)
  restore        a new job on N ranks protects its own blocks (NaN, -1) and restarts; each
                 rank says whether its blocks came back byte for byte
  restore-reordered  the same, with the ranks taking the blocks in reverse order
  overlap, gaps  bad blocks at the first checkpoint: one error on every rank (exit 2)
  restore-wrong  restart with "field" as float32 and "mask" of another global shape: one
                 error on every rank
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config
from hpcckpt.errors import HpcckptError

run_dir, nodes, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
FIELD = (29, 17, 6)
MASK = 40
SAVED_RANKS = 4


def uneven_edges(dim: int, parts: int) -> list[int]:
    """Cut points with part sizes growing 1:2:3..., so no two blocks are alike."""
    weights = np.cumsum(np.arange(1, parts + 1))
    return [0] + [int(round(dim * w / weights[-1])) for w in weights]


def field_box(world: int, r: int) -> tuple:
    """Rank r's box of "field" on `world` ranks: a px x py grid, ranks in column-major order
    (reversed when reordered); on 5 ranks rank 4 holds nothing."""
    r = world - 1 - r if mode == "restore-reordered" else r
    px, py = {1: (1, 1), 3: (1, 3), 4: (2, 2), 5: (2, 2), 6: (3, 2)}[world]
    if r >= px * py:
        return ((0, 0), (0, 0), (0, 0))
    i, j = r % px, r // px
    rows, cols = uneven_edges(FIELD[0], px), uneven_edges(FIELD[1], py)
    return ((rows[i], rows[i + 1]), (cols[j], cols[j + 1]), (0, FIELD[2]))


def mask_box(world: int, r: int) -> tuple:
    if world == SAVED_RANKS:
        return ((10 * r + 2, 10 * r + 8),)  # 4 of every 10 elements are gaps
    edges = uneven_edges(MASK, world)
    return ((edges[r], edges[r + 1]),)


GLOBAL_FIELD = np.arange(np.prod(FIELD), dtype=np.float64).reshape(FIELD) * 1.25 - 7.0
GLOBAL_MASK = np.arange(MASK, dtype=np.int16) * 3 - 50
HELD_MASK = np.zeros(MASK, bool)
for old in range(SAVED_RANKS):
    (start, stop), = mask_box(SAVED_RANKS, old)
    HELD_MASK[start:stop] = True


def region(array, box):
    return array[tuple(slice(a, b) for a, b in box)]


config = load_config(None, [f"run.dir={run_dir}", f"cluster.simulated_nodes={nodes}",
                            'resilience.levels=["local", "partner", "erasure", "pfs"]', "resilience.group_size=4",
                            "resilience.parity=2", "storage.pfs_async=false", "storage.pfs_every=1", "checkpoint.split_threshold_kb=1"])
ckpt = Checkpointer(comm, config)
fbox, mbox = field_box(size, rank), mask_box(size, rank)
if mode == "overlap" and rank == 1:
    fbox = ((fbox[0][0] - 2, fbox[0][1]),) + fbox[1:]  # two rows into rank 0's block
if mode == "gaps" and rank == 2:
    fbox = (fbox[0], (fbox[1][0], fbox[1][1] - 1), fbox[2])  # one column short, gaps not allowed
saving = not mode.startswith("restore")
field = region(GLOBAL_FIELD, fbox).copy() if saving else np.full([b - a for a, b in fbox], np.nan)
mask = region(GLOBAL_MASK, mbox).copy() if saving else np.full(mbox[0][1] - mbox[0][0], -1, np.int16)
weights = np.linspace(0, 1, 3000, dtype=np.float32) if saving else np.zeros(3000, np.float32)
if mode == "restore-wrong":
    field = field.astype(np.float32)
ckpt.protect("field", field, global_shape=FIELD, offset=[a for a, _ in fbox])
ckpt.protect("mask", mask, global_shape=(MASK + (mode == "restore-wrong"),), offset=(mbox[0][0],), allow_gaps=True)
ckpt.protect("w", weights)
result = {"rank": rank}
code = 0
try:
    if saving:
        ckpt.checkpoint(10)
        ckpt.wait()
        result["saved"] = True
    else:
        step = ckpt.restart(mode="require")
        expected_mask = np.where(HELD_MASK, GLOBAL_MASK, -1)
        result.update(step=step, sources=list(ckpt.restored_sources),
                      field=field.tobytes() == region(GLOBAL_FIELD, fbox).tobytes(),
                      mask=mask.tobytes() == region(expected_mask, mbox).tobytes(),
                      w=bool(np.array_equal(weights, np.linspace(0, 1, 3000, dtype=np.float32))),
                      held=int(field.size))
except HpcckptError as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
    code = exc.exit_code
finally:
    ckpt.close()
for each in comm.gather(result, root=0) or []:
    print("RESULT " + json.dumps(each), flush=True)
sys.exit(code)
