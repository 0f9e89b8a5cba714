"""What a durable write of checkpoint bytes costs the CPU: buffered (page cache, then fsync)
against O_DIRECT (storage.direct_io, hpcckpt/io/direct_io.py), on the same file system in
the same run.

Each repeat writes a new file of --mib MiB with io/atomic.write_bytes_atomically (temp name,
fsync, rename, directory fsync), first one way then the other, in an order that alternates.
Per write: wall time until durable, CPU time of the writing thread, and CPU time of the whole
machine (/proc/stat: user + system + irq + softirq of every core, which includes the kernel's
writeback threads), and steal (time a VM's hypervisor took). With --writers N, N processes
write at once (as the ranks of one node do); their CPU times are summed. Medians of --repeats.

With --load N, N processes spin on arithmetic the whole time, standing in for a training job
that keeps every core busy, and each write reports what it cost them: load_lost_s = write
time - (work they did during the write / their rate in an equal window just before it), the
wall time of the loaded cores that the write took away (through its own CPU, the kernel's,
or a hypervisor descheduling them: on a VM, disk I/O can show up as steal).

    PYTHONPATH=. python perf/bench_write.py --json write.json         # 256 MiB x 1 and x 4 writers, ~1 min
    PYTHONPATH=. python perf/bench_write.py --quick                   # 32 MiB, a few seconds
    PYTHONPATH=. python perf/bench_write.py --writers 1 --load 2      # under a CPU-bound load
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import alternated, machine, print_machine, write_json  # perf/ is on sys.path: the scripts run from it

from hpcckpt.io import direct_io  # noqa: E402
from hpcckpt.io.atomic import write_bytes_atomically  # noqa: E402


def _machine_ticks() -> tuple[int, int]:
    """(busy, steal) clock ticks of all cores since boot."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq, steal


def _spin(counter) -> None:
    """A CPU-bound load: counts chunks of arithmetic into its own shared counter, forever."""
    while True:
        total = 0
        for i in range(20000):
            total += i * i
        counter.value += 1


class Load:
    """--load N spinning processes and a way to read how much work they have done."""

    def __init__(self, processes: int):
        context = multiprocessing.get_context("spawn")
        self.counters = [context.RawValue("q", 0) for _ in range(processes)]
        self.procs = [context.Process(target=_spin, args=(c,), daemon=True) for c in self.counters]
        for proc in self.procs:
            proc.start()

    def work(self) -> int:
        return sum(c.value for c in self.counters)

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.join()


def _write_one(args) -> tuple[float, float]:
    path, mib, direct, start = args
    data = direct_io.aligned_empty(mib << 20)
    data[:] = 7  # pages touched before the clock starts, like a long-lived snapshot buffer
    while time.time() < start:  # every writer starts together
        time.sleep(0.0005)
    cpu, wall = time.thread_time(), time.perf_counter()
    write_bytes_atomically(path, memoryview(data), direct=direct)
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(directory: Path, mib: int, writers: int, direct: bool, pool, load: Load | None = None,
            window_s: float = 1.0) -> dict:
    tick = os.sysconf("SC_CLK_TCK")
    paths = [directory / f"w{i}-{time.monotonic_ns()}" for i in range(writers)]
    start = time.time() + 1.0 + (window_s if load else 0.0)  # the writers fill their buffers before it
    pending = pool.map_async(_write_one, [(p, mib, direct, start) for p in paths])
    idle_rate = None
    if load is not None:
        time.sleep(max(0.0, start - window_s - time.time()))
        work0, t0 = load.work(), time.perf_counter()
        time.sleep(max(0.0, start - time.time()))
        idle_rate = (load.work() - work0) / (time.perf_counter() - t0)
    time.sleep(max(0.0, start - time.time()))
    busy0, steal0 = _machine_ticks()
    work0, t0 = (load.work() if load else 0), time.perf_counter()
    results = pending.get()
    elapsed = time.perf_counter() - t0
    work1 = load.work() if load else 0
    busy1, steal1 = _machine_ticks()
    for path in paths:
        os.unlink(path)
    sample = {
        "durable_s": max(w for w, _ in results),
        "thread_cpu_s": sum(c for _, c in results),
        "machine_cpu_s": (busy1 - busy0) / tick,
        "steal_s": (steal1 - steal0) / tick,
    }
    if load is not None:
        sample["load_lost_s"] = elapsed - (work1 - work0) / idle_rate
    return sample


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB, 3 repeats")
    parser.add_argument("--mib", type=int, help="MiB per writer (default 256, --quick 32)")
    parser.add_argument("--writers", default="1,4", help="comma-separated writer counts (default 1,4)")
    parser.add_argument("--repeats", type=int, help="repeats of each way (default 5, --quick 3)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (default the temp dir)")
    parser.add_argument("--load", type=int, default=0,
                        help="processes keeping the cores busy meanwhile (default 0: an idle machine)")
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)
    mib = args.mib or (32 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 5)
    try:
        writer_counts = [int(n) for n in args.writers.split(",")]
    except ValueError:
        parser.error(f"--writers {args.writers!r}: expected comma-separated integers")
    if mib < 1 or repeats < 1 or any(n < 1 for n in writer_counts):
        parser.error("--mib, --repeats and --writers must be at least 1")
    if args.load < 0:
        parser.error("--load must be 0 or more")
    if not direct_io.O_DIRECT:
        parser.error("this platform has no O_DIRECT: nothing to compare")
    directory = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-write-", dir=args.dir))
    probe = str(directory / "probe")
    fd, is_direct = direct_io.open_for_writing(probe, os.O_WRONLY | os.O_CREAT, 0o644, True)
    os.close(fd)
    os.unlink(probe)
    if not is_direct:
        directory.rmdir()
        parser.error(f"{args.dir} refuses O_DIRECT, so both ways would be buffered; pick another --dir")
    host = machine(directory=args.dir)
    print_machine(host)
    result = {"mib_per_writer": mib, "repeats": repeats, "dir": str(args.dir), "load": args.load, "runs": {}}
    load = Load(args.load) if args.load else None
    try:
        for writers in writer_counts:
            with multiprocessing.get_context("spawn").Pool(writers) as pool:
                samples = {"buffered": [], "direct": []}
                window_s = 1.0
                for repeat in range(repeats):
                    for way in alternated(["buffered", "direct"], repeat):
                        sample = measure(directory, mib, writers, way == "direct", pool, load, window_s)
                        samples[way].append(sample)
                        window_s = max(1.0, sample["durable_s"])
            run = {way: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
                   for way, runs in samples.items()}
            run["buffered_over_direct_machine_cpu"] = run["buffered"]["machine_cpu_s"] / max(
                run["direct"]["machine_cpu_s"], 1e-9)
            result["runs"][str(writers)] = run
            print(f"{writers} writer(s) x {mib} MiB, median of {repeats}:")
            for way in ("buffered", "direct"):
                r = run[way]
                lost = f"   load lost {r['load_lost_s']:.2f} s" if load else ""
                print(f"  {way:8s}  durable {r['durable_s']:.3f} s   writing threads' CPU {r['thread_cpu_s']:.3f} s"
                      f"   machine CPU {r['machine_cpu_s']:.2f} s   steal {r['steal_s']:.2f} s{lost}")
    finally:
        if load is not None:
            load.close()
        for leftover in directory.iterdir():
            leftover.unlink()
        directory.rmdir()
    if args.json:
        write_json(args.json, result, host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
