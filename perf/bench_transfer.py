"""What receiving a shard costs the receiving thread's CPU: into a fresh buffer or a kept one.

Each of N ranks sends --mb MB to the next rank and receives from the previous one, polling
like the persist thread does (Testall, 0.5 ms sleeps), into either a fresh page-aligned buffer
(an anonymous mapping: every 4 KiB page faults on first touch) or the same buffer every
round. Reports the median thread CPU per transfer over all ranks and rounds (the first two
rounds are warm-up). Runs itself under mpiexec:

    PYTHONPATH=. python perf/bench_transfer.py [--ranks 4] [--mb 25] [--rounds 8] [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import machine, print_machine, run_worker, write_json  # perf/ is on sys.path: the scripts run from it


def worker(mode: str, nbytes: int, rounds: int, out: str) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcckpt.io.direct_io import aligned_empty

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    send = np.ones(nbytes, dtype=np.uint8)
    kept = aligned_empty(nbytes)
    cpu = []
    for _ in range(rounds):
        receive = kept if mode == "kept" else aligned_empty(nbytes)
        comm.Barrier()
        started = time.thread_time()
        requests = [comm.Irecv(receive, source=(rank - 1) % size, tag=1),
                    comm.Isend(send, dest=(rank + 1) % size, tag=1)]
        while not MPI.Request.Testall(requests):
            time.sleep(0.0005)
        cpu.append(time.thread_time() - started)
        del receive
    gathered = comm.gather(cpu[2:], root=0)
    if rank == 0:
        write_json(out, {"mode": mode, "cpu_ms": 1000 * statistics.median(c for r in gathered for c in r)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=float, default=25.0, help="MB per transfer (default 25: a 100 MB state on 4 ranks)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH)")
    parser.add_argument("--json", help="write the result to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("fresh", "kept"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the first two are warm-up")
    nbytes = int(args.mb * 1e6)
    if args.worker:
        worker(args.mode, nbytes, args.rounds, args.out)
        return
    host = machine(args.mpiexec)
    print_machine(host)
    results = {"fresh": [], "kept": []}
    for _ in range(args.repeats):
        for mode in ("fresh", "kept"):
            result, _ = run_worker(__file__, args.ranks, ["--mode", mode, "--mb", str(args.mb), "--rounds",
                                                          str(args.rounds)], f"{mode} job", mpiexec=args.mpiexec)
            results[mode].append(result["cpu_ms"])
    for mode, values in results.items():
        print(f"{mode:>5}: {statistics.median(values):.1f} ms CPU per {args.mb:g} MB received "
              f"(runs: {', '.join(f'{v:.1f}' for v in values)})")
    if args.json:
        write_json(args.json, {"ranks": args.ranks, "mb": args.mb, "rounds": args.rounds,
                               "cpu_ms": {mode: statistics.median(values) for mode, values in results.items()},
                               "runs": results}, host)


if __name__ == "__main__":
    main()
