"""What recycling retired node-local files saves (storage.recycle_files, hpcckpt/levels/spares.py):
the CPU of one checkpoint's file write plus the retirement of the version it replaces, with
a new file and an unlink against an overwrite of the spare, on the same file system in the
same run.

Each way runs a chain of checkpoints like one rank's L1 with checkpoint.keep_local = 2: write
version i's file (io/atomic.write_bytes_atomically: temp name, fsync, rename, directory
fsync; O_DIRECT where the file system takes it, as storage.direct_io does), then retire
version i-2 (unlink, or keep it as the spare the next write overwrites). Per checkpoint: CPU
time of the thread and wall time. The two ways alternate, chain by chain; medians over
--repeats chains of --chain checkpoints each (the first two of a chain, before any spare
exists, are not counted).

    PYTHONPATH=. python perf/bench_recycle.py                          # /dev/shm and the temp dir, 25 MB
    PYTHONPATH=. python perf/bench_recycle.py --dirs /dev/shm --mb 100
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import alternated, machine, print_machine, write_json  # perf/ is on sys.path: the scripts run from it

from hpcckpt.io import direct_io  # noqa: E402
from hpcckpt.io.atomic import write_bytes_atomically  # noqa: E402
from hpcckpt.levels.spares import SpareFiles  # noqa: E402

KEEP = 2


def chain(root: Path, data: memoryview, checkpoints: int, recycle: bool, direct: bool) -> tuple[list, list]:
    """(CPU seconds, wall seconds) per counted checkpoint of one chain in a fresh `root`."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    spares = SpareFiles(root, enabled=recycle)
    cpu, wall = [], []
    for i in range(checkpoints):
        version = root / f"v{i:04d}"
        started_cpu, started_wall = time.thread_time(), time.perf_counter()
        version.mkdir()
        path = version / "shard-r00000.hck"
        write_bytes_atomically(path, data, direct=direct, recycle=spares.spare_for(path))
        if i >= KEEP:
            retired = root / f"v{i - KEEP:04d}"
            spares.retire(retired / "shard-r00000.hck")
            retired.rmdir()
        if i >= KEEP:
            cpu.append(time.thread_time() - started_cpu)
            wall.append(time.perf_counter() - started_wall)
    shutil.rmtree(root)
    return cpu, wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirs", default=f"/dev/shm,{tempfile.gettempdir()}",
                        help="comma-separated directories to measure in (default /dev/shm and the temp dir)")
    parser.add_argument("--mb", type=int, default=25, help="MB per file (default 25: a 100 MB model's shard on 4 ranks)")
    parser.add_argument("--chain", type=int, default=12, help="checkpoints per chain (default 12)")
    parser.add_argument("--repeats", type=int, default=5, help="chains of each way (default 5)")
    parser.add_argument("--no-direct", action="store_true", help="buffered writes (storage.direct_io = false)")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)
    if args.mb < 1 or args.chain <= KEEP or args.repeats < 1:
        parser.error(f"--mb and --repeats must be at least 1, --chain more than {KEEP}")
    directories = [Path(d) for d in args.dirs.split(",") if d]
    for directory in directories:
        if not directory.is_dir():
            parser.error(f"--dirs: {directory} is not a directory")
    host = machine()
    print_machine(host)
    data = direct_io.aligned_empty(args.mb * 1_000_000)
    data[:] = 0x5A  # touched before the clock starts, like the long-lived snapshot buffer
    results = {}
    for directory in directories:
        samples = {"new_file": ([], []), "recycled": ([], [])}
        for repeat in range(args.repeats):
            for way in alternated(("new_file", "recycled"), repeat):
                cpu, wall = chain(directory / f"hpcckpt-bench-recycle-{way}", memoryview(data), args.chain,
                                  way == "recycled", not args.no_direct)
                samples[way][0].extend(cpu)
                samples[way][1].extend(wall)
        row = {way: {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall)}
               for way, (cpu, wall) in samples.items()}
        row["cpu_ratio"] = row["recycled"]["cpu_ms"] / row["new_file"]["cpu_ms"]
        results[str(directory)] = row
        print(f"{directory}: {args.mb} MB per checkpoint; CPU new file + unlink {row['new_file']['cpu_ms']:.1f} ms, "
              f"recycled {row['recycled']['cpu_ms']:.1f} ms (x{row['cpu_ratio']:.2f}); wall "
              f"{row['new_file']['wall_ms']:.1f} / {row['recycled']['wall_ms']:.1f} ms")
    if args.json:
        write_json(args.json, {"mb": args.mb, "direct": not args.no_direct, "dirs": results}, host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
