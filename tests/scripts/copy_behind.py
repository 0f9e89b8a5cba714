"""Snapshot copies taken behind the step: capture() only queues them, the next update waits in
before_update(). Arrays are changed right after before_update(); the version must still hold
the values they had at capture, bit for bit, and a snapshot left open must not hang close()."""

import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer, load_config

NAMES = [f"layer{i}" for i in range(4)]
ELEMENTS = 4 << 20  # 32 MiB per array: a copy takes long enough to race an unguarded write


def make_checkpointer(comm, run_dir, arrays):
    config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=2",
                                'resilience.levels=["local","pfs"]'], environ={})
    ckpt = Checkpointer(comm, config)
    for name in NAMES:
        ckpt.protect(name, arrays[name])
    return ckpt


def main():
    run_dir = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(7)
    arrays = {name: rng.standard_normal(ELEMENTS) for name in NAMES}
    expected = {name: a.copy() for name, a in arrays.items()}
    ckpt = make_checkpointer(comm, run_dir, arrays)
    ckpt.begin_checkpoint(1, copy_in_background=True)
    for name in NAMES:
        ckpt.capture(name)
    report = ckpt.end_checkpoint({})
    for name in NAMES:  # the next step: every array changes right after its guard
        ckpt.before_update(name)
        arrays[name][:] = -1.0
    ckpt.wait()
    # Changed twice in one step: the second change comes before end_checkpoint(), so the copy
    # must be taken at that guard, with the value of the capture.
    for name in NAMES:
        arrays[name][:] = 2.0
    ckpt.begin_checkpoint(2, copy_in_background=True)
    for name in NAMES:
        ckpt.capture(name)
        ckpt.before_update(name)
        arrays[name][:] = 3.0
    ckpt.end_checkpoint({})
    ckpt.wait()
    background = [t for t in threading.enumerate() if t.name in ("hpcckpt-copy", "hpcckpt-persist")]
    policies = sorted({t.name: os.sched_getscheduler(t.native_id) == os.SCHED_BATCH for t in background}.items())
    # A snapshot opened and never ended (an exception in the step) is abandoned by close().
    ckpt.begin_checkpoint(3, copy_in_background=True)
    ckpt.capture(NAMES[0])
    ckpt.close()

    restored = {name: np.zeros(ELEMENTS) for name in NAMES}
    again = make_checkpointer(comm, run_dir, restored)
    first = again.restart("require", step=1)
    equal = all(restored[n].tobytes() == expected[n].tobytes() for n in NAMES)
    step = again.restart("require")
    twice_changed = all(np.all(restored[n] == 2.0) for n in NAMES)
    again.close()
    result = {"rank": comm.rank, "first": first, "step": step, "equal": equal,
              "twice_changed_holds_capture": twice_changed, "background_copy_s": report.background_copy_s,
              "captured_early_s": report.captured_early_s, "copy_wait_s": report.copy_wait_s,
              "batch_policy": policies}
    results = comm.gather(result, root=0)  # one writer: lines of two ranks would interleave
    if comm.rank == 0:
        for result in results:
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
