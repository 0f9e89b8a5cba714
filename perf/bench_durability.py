"""How soon a checkpoint is durable on the node-local levels when nothing else runs, against
the disk's time for the same bytes, measured in the same run (issue #5's target: local +
erasure, group 4, parity 2, 1 GiB on 4 ranks, durable within 1.5x the disk's time; FTI's
synchronous Reed-Solomon level took 5.2 s there, about 3x its disk time).

The state is replicated float32 arrays, so every rank stores a quarter of it (its shard); L3
adds p/(n-p) of the shard as parity on every rank (as much again for group 4, parity 2). Per
repeat, in an order that rotates:

  disk_state    every rank writes its shard's bytes to a new file with fsync (file and
                directory), all ranks at once; the slowest rank's time
  disk_written  the same with the shard's bytes plus its parity's (what L1 + L3 write)
  checkpoint    Checkpointer.checkpoint(step) then wait(); durable_s of each level (the
                slowest rank's) and the total until wait() returned

Medians of --repeats. Runs checkpoints with the hpcckpt package of this checkout, or of
--impl DIR (an older checkout, for A/B runs of a change).

    PYTHONPATH=. python perf/bench_durability.py --json durability.json   # 1 GiB, 4 ranks, 5 repeats, ~2 min
    PYTHONPATH=. python perf/bench_durability.py --quick                  # 256 MiB, 3 repeats, ~20 s
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from harness import (REPO, machine, median, print_machine, rotated, run_worker,  # perf/ is on sys.path
                     write_durably, write_json)

ARRAYS = 8


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcckpt import Checkpointer, load_config
    from hpcckpt.cluster.collectives import quiet_barrier

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    root = Path(args.run_root)
    levels = args.levels.split(",")
    settings = [f"run.dir={root / 'run'}", f"cluster.simulated_nodes={size}",
                "resilience.levels=" + json.dumps(levels), f"resilience.group_size={args.group}",
                f"resilience.parity={args.parity}", "checkpoint.keep_local=1", "checkpoint.keep_pfs=1",
                *(args.set or [])]
    config = load_config(None, settings, environ={})
    per_array = args.mib * 2 ** 20 // 4 // ARRAYS
    arrays = [np.random.default_rng(i).random(per_array, dtype=np.float32) for i in range(ARRAYS)]
    ckpt = Checkpointer(comm, config)
    for i, array in enumerate(arrays):
        ckpt.protect(f"a{i}", array)

    shard = args.mib * 2 ** 20 // size
    k = args.group - args.parity
    parity = args.parity * -(-shard // k) if "erasure" in levels else 0
    disk_dir = root / "disk" / f"r{rank}"
    disk_dir.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(100 + rank).integers(0, 255, size=min(shard + parity, 256 << 20), dtype=np.uint8)

    def disk(nbytes: int, tag: str) -> float:
        path = str(disk_dir / f"{tag}.bin")
        quiet_barrier(comm)
        repeats, rest = divmod(nbytes, noise.size)
        started = time.perf_counter()
        write_durably(path, [noise] * repeats + [noise[:rest]])
        elapsed = time.perf_counter() - started
        os.unlink(path)
        return max(comm.allgather(elapsed))

    step = 0

    def checkpoint() -> dict:
        nonlocal step
        step += 1
        for array in arrays:
            array += 1  # a new version's bytes, as after a training step
        quiet_barrier(comm)
        started = time.perf_counter()
        ckpt.checkpoint(step)
        report = ckpt.wait()
        total = time.perf_counter() - started
        mine = dict(report.durable_s, total=total)
        everyone = comm.allgather(mine)
        return {key: max(r[key] for r in everyone) for key in mine}

    measures = {"disk_state": lambda: disk(shard, "state"), "disk_written": lambda: disk(shard + parity, "written"),
                "checkpoint": checkpoint}
    names = list(measures)
    samples: dict[str, list] = {name: [] for name in names}
    checkpoint()  # warm-up: files, buffers and communicators are created on the first one
    for repeat in range(args.repeats):
        for name in rotated(names, repeat):
            samples[name].append(measures[name]())
    ckpt.close()
    if rank == 0:
        result = {"ranks": size, "state_bytes": args.mib * 2 ** 20, "shard_bytes": shard, "parity_bytes": parity,
                  "levels": levels, "group": args.group, "parity": args.parity, "repeats": args.repeats,
                  "disk_state_s": median(samples["disk_state"]), "disk_written_s": median(samples["disk_written"]),
                  "disk_state_all": samples["disk_state"], "disk_written_all": samples["disk_written"],
                  "durable_s": {level: median([c[level] for c in samples["checkpoint"]])
                                for level in samples["checkpoint"][0]},
                  "checkpoints": samples["checkpoint"]}
        write_json(args.out, result)


def parent(args) -> dict:
    host = machine(args.mpiexec, args.tmp)
    print_machine(host)
    run_root = tempfile.mkdtemp(prefix="bench_durability_", dir=args.tmp)
    worker_args = ["--run-root", run_root, "--mib", str(args.mib), "--repeats", str(args.repeats),
                   "--levels", args.levels, "--group", str(args.group), "--parity", str(args.parity)]
    for setting in args.set or []:
        worker_args += ["--set", setting]
    impl = str(Path(args.impl).resolve()) if args.impl else str(REPO)
    try:
        result, _ = run_worker(__file__, args.ranks, worker_args, f"{args.ranks}-rank job", mpiexec=args.mpiexec,
                               pythonpath_first=impl, capture="none")
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    result["impl"] = impl
    result["machine"] = host
    durable, state_s, written_s = result["durable_s"], result["disk_state_s"], result["disk_written_s"]
    both = max(durable[level] for level in result["levels"])
    result["durable_all_levels_s"] = both
    result["ratio_to_disk_state"] = both / state_s
    result["ratio_to_disk_written"] = both / written_s
    print(f"{args.ranks} ranks, state {args.mib} MiB ({result['shard_bytes'] / 2**20:.0f} MiB shard, "
          f"{result['parity_bytes'] / 2**20:.0f} MiB parity per rank), levels {','.join(result['levels'])}, "
          f"median of {args.repeats}; hpcckpt from {impl}")
    print(f"  disk, the state's bytes:        {state_s:.3f} s ({result['state_bytes'] / state_s / 1e9:.2f} GB/s)")
    print(f"  disk, state + parity bytes:     {written_s:.3f} s")
    for level, seconds in durable.items():
        print(f"  durable {level:<22} {seconds:.3f} s")
    print(f"  all levels durable / disk time: {result['ratio_to_disk_state']:.2f}x of the state's, "
          f"{result['ratio_to_disk_written']:.2f}x of the bytes written (target 1.5x)")
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 repeats")
    parser.add_argument("--mib", type=int, help="state size in MiB (default 1024, --quick 256)")
    parser.add_argument("--repeats", type=int, help="repeats of each measure (default 5, --quick 3)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--levels", default="local,erasure", help="comma-separated levels (default local,erasure)")
    parser.add_argument("--group", type=int, default=4, help="erasure group size (default 4)")
    parser.add_argument("--parity", type=int, default=2, help="erasure parity pieces (default 2)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for the checkpointer")
    parser.add_argument("--impl", help="directory holding the hpcckpt package to measure (default this checkout)")
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--tmp", default="/tmp", help="where run directories go (default /tmp)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mib is None:
        args.mib = 256 if args.quick else 1024
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeats < 1 or args.mib < 1:
        parser.error("--repeats and --mib must be >= 1")
    if not 1 <= args.parity < args.group:
        parser.error(f"--parity must be between 1 and --group - 1 ({args.group - 1}), got {args.parity}")
    if args.worker:
        worker(args)
        return
    result = parent(args)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
