"""Keyed tables saved incrementally (checkpoint.table_full_every) against whole every version.

One job per way and repeat, 4 ranks on 2 simulated nodes, levels L1 + L2 + L4 (L4 in step, so
every version reaches it): a table of --rows rows of --dim float32 values placed by the hash of
their id (hpcckpt.ckpt.keyed_table) beside 1 MB of dense weights. Between versions --changed %
of the rows change (random ids, the same draw in both ways) and --added new ids appear. Per
version: the bytes of every rank's shard file (what each level writes) and of its table pieces
alone, the blocking time of
checkpoint() and the time until durable on each level (the job waits for each version).
Then a job on the same ranks restores the newest version (from L1; incremental: the chain
applied) and one reads the version from L4 alone (every node-local directory deleted); both
digests of the whole table (every rank's rows by id) must equal the writer's, and the
incremental run's must equal the export of the same version saved whole.

    PYTHONPATH=. python perf/bench_tables.py                 # 10^6 rows x 16, 16 versions, 3 repeats
    PYTHONPATH=. python perf/bench_tables.py --quick         # 10^5 rows, 9 versions, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import machine, median, print_machine, run_worker, worker_env, write_json  # perf/ is on sys.path

RANKS = 4
WAYS = {"incremental": 8, "whole": 1}  # checkpoint.table_full_every


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcckpt import Checkpointer, load_config
    from hpcckpt.ckpt.keyed_table import KeyedTable
    from hpcckpt.format.keyed_rows import is_table_piece, owner_of
    from hpcckpt.format.shardfile import read_shard_table

    comm = MPI.COMM_WORLD
    config = load_config(None, [f"run.dir={args.run_dir}", "cluster.simulated_nodes=2", "storage.pfs_async=false",
                                'resilience.levels=["local","partner","pfs"]', f"checkpoint.keep_local={args.versions}",
                                f"checkpoint.keep_pfs={args.versions}", f"checkpoint.table_full_every={args.full_every}"],
                         environ={})
    table = KeyedTable(args.dim, np.float32, initializer=lambda ids: np.repeat(
        (ids[:, None] % 1000).astype(np.float32) / 1000, args.dim, axis=1))
    weights = np.zeros(1 << 17)  # 1 MB of dense state beside the table
    state = {"step": 0}
    ckpt = Checkpointer(comm, config)
    ckpt.protect("weights", weights)
    ckpt.protect_table("table", table)
    ckpt.register_state("loop", lambda: dict(state), state.update)
    result = {"versions": []}
    if args.mode == "write":
        ids = np.arange(args.rows, dtype=np.int64)
        table.slots(ids[owner_of(ids, comm.size) == comm.rank], create=True)
        for version in range(1, args.versions + 1):
            if version > 1:
                rng = np.random.default_rng([args.seed, version])
                changed = rng.choice(ids, size=int(ids.size * args.changed / 100), replace=False)
                mine = table.slots(changed[owner_of(changed, comm.size) == comm.rank])
                table.values[mine] += 1.0
                table.mark_changed(mine)
                new = np.arange(ids.size, ids.size + args.added, dtype=np.int64)
                table.slots(new[owner_of(new, comm.size) == comm.rank], create=True)
                ids = np.concatenate([ids, new])
            weights += 1.0
            state["step"] = version
            comm.Barrier()
            started = time.perf_counter()
            ckpt.checkpoint(version)
            blocking = time.perf_counter() - started
            report = ckpt.wait()
            path = ckpt.levels.landing.shard_path(version)
            total = comm.allreduce(path.stat().st_size)
            table_bytes = comm.allreduce(sum(e.nbytes for e in read_shard_table(path).entries
                                             if is_table_piece(e.name)))
            durable = comm.allreduce(max(report.durable_s.values()), op=MPI.MAX)
            blocking = comm.allreduce(blocking, op=MPI.MAX)
            result["versions"].append({"step": version, "bytes": total, "table_bytes": table_bytes,
                                       "blocking_s": blocking,
                                       "durable_s": durable, "levels_durable_s": report.durable_s})
        result["digest"] = table.digest(comm)
        ckpt.close()
    else:
        comm.Barrier()
        started = time.perf_counter()
        result["restored"] = ckpt.restart("require")
        result["restore_s"] = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
        result["digest"] = table.digest(comm)
        result["placed"] = comm.allreduce(int(np.all(owner_of(table.ids, comm.size) == comm.rank)), op=MPI.MIN)
        ckpt.close(drain=False)
    if comm.rank == 0:
        write_json(args.out, result)


def exported_digest(run_dir: Path, step: int, full_every: int) -> str:
    import h5py

    from hpcckpt.format.keyed_rows import digest_text, rows_digest

    out = run_dir.parent / f"export-{run_dir.name}.h5"
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "hpcckpt", "export", "--version", str(step), "-o", str(out),
                           "--set", f"run.dir={run_dir}", "--set", "cluster.simulated_nodes=2",
                           "--set", f"checkpoint.table_full_every={full_every}"],
                          env=worker_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_tables: export failed: {proc.stderr[-2000:]}")
    with h5py.File(out) as f:
        ids, rows = f["table/table/ids"][()], f["table/table/rows"][()]
    return digest_text(*rows_digest(ids, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="write", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--full-every", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--versions", type=int, default=16)
    parser.add_argument("--changed", type=float, default=1.0, help="%% of the rows changed between versions")
    parser.add_argument("--added", type=int, default=1000, help="new ids between versions")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rows, args.versions, args.repeats, args.added = 100_000, 9, 1, 100
    common = ["--rows", str(args.rows), "--dim", str(args.dim), "--versions", str(args.versions), "--changed",
              str(args.changed), "--added", str(args.added), "--seed", str(args.seed)]
    results = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench_tables_") as tmp:
        host = machine(directory=tmp)
        print_machine(host)
        for repeat in range(args.repeats):
            for way, full_every in WAYS.items():
                run_dir = Path(tmp) / f"{way}-{repeat}"
                mode = ["--run-dir", str(run_dir), "--full-every", str(full_every)]
                written, _ = run_worker(__file__, RANKS, common + mode, f"{way} write")
                export = exported_digest(run_dir, args.versions, full_every)
                restored, _ = run_worker(__file__, RANKS, common + mode + ["--mode", "restore"], f"{way} restore")
                shutil.rmtree(run_dir / "local")
                from_l4, _ = run_worker(__file__, RANKS, common + mode + ["--mode", "restore"], f"{way} L4 restore")
                for what, got in (("export", export), ("restore", restored["digest"]), ("L4 restore", from_l4["digest"])):
                    if got != written["digest"]:
                        raise SystemExit(f"bench_tables: {way}: the {what} of version {args.versions} ({got}) is not "
                                         f"the table written ({written['digest']})")
                if not (restored["placed"] and from_l4["placed"]):
                    raise SystemExit(f"bench_tables: {way}: a restored row is not on the rank its id hashes to")
                results[way].append({"written": written, "export": export, "restore_s": restored["restore_s"],
                                     "l4_restore_s": from_l4["restore_s"]})
                shutil.rmtree(run_dir)
                print(f"repeat {repeat + 1}/{args.repeats} {way}: done", flush=True)
    if results["incremental"][0]["written"]["digest"] != results["whole"][0]["written"]["digest"]:
        raise SystemExit("bench_tables: the two ways wrote different tables")
    summary = summarise(results, args)
    print(json.dumps(summary, indent=1))
    if args.json:
        write_json(args.json, {"summary": summary, "runs": results, "args": vars(args)}, host)


def summarise(results: dict, args) -> dict:
    def per_version(way, key, which):
        return median([statistics.median([v[key] for v in run["written"]["versions"] if which(v["step"])])
                       for run in results[way]])

    full_every = WAYS["incremental"]
    delta = lambda step: (step - 1) % full_every != 0  # noqa: E731  (versions 1, 9, 17, ... go whole)
    every = lambda step: True  # noqa: E731
    whole_bytes = per_version("whole", "bytes", every)
    summary = {
        "rows": args.rows, "dim": args.dim, "versions": args.versions, "changed_pct": args.changed,
        "added": args.added, "ranks": RANKS, "repeats": args.repeats,
        "whole_bytes_per_version": whole_bytes,
        "delta_bytes_per_version": per_version("incremental", "bytes", delta),
        "incremental_mean_bytes_per_version": median([statistics.fmean(v["bytes"] for v in run["written"]["versions"])
                                                      for run in results["incremental"]]),
        "whole_table_bytes_per_version": per_version("whole", "table_bytes", every),
        "delta_table_bytes_per_version": per_version("incremental", "table_bytes", delta),
        "whole_durable_s": per_version("whole", "durable_s", every),
        "delta_durable_s": per_version("incremental", "durable_s", delta),
        "whole_blocking_s": per_version("whole", "blocking_s", every),
        "delta_blocking_s": per_version("incremental", "blocking_s", delta),
        "restore_s": {way: median([run["restore_s"] for run in results[way]]) for way in WAYS},
        "l4_restore_s": {way: median([run["l4_restore_s"] for run in results[way]]) for way in WAYS},
        "export_equals_restore": True,
    }
    summary["delta_over_whole"] = summary["delta_bytes_per_version"] / whole_bytes
    summary["table_delta_over_whole"] = summary["delta_table_bytes_per_version"] / \
        summary["whole_table_bytes_per_version"]
    summary["incremental_mean_over_whole"] = summary["incremental_mean_bytes_per_version"] / whole_bytes
    return summary


if __name__ == "__main__":
    main()
