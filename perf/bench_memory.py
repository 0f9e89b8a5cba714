"""Peak extra host memory while checkpointing (#26 item 4): per rank and per node, against
the state's size, for each combination of levels, beside h5py and torch DCP's async_save on
the same state, all measured in the same run.

    cd perf && PYTHONPATH=..:. python bench_memory.py [--sizes 0.25 1] [--ranks 4] [--repeats 3]

Each rank of a 4-rank job on this one machine (4 simulated nodes, so partner and erasure
traffic crosses "nodes") holds a replicated float32 state of the given size, as a
data-parallel job does, and takes 3 checkpoints of it (each waited for: the durable cost,
not a pipeline's overlap). This script samples every rank's RssAnon + RssShmem from
/proc/<pid>/status every 3 ms from outside the ranks (no GIL between the sampler and the
work), and the system's MemAvailable. Reported per variant (median of --repeats runs):

  extra per rank    the largest rank's peak minus its own RSS once the state was allocated
  x shard           that over the rank's shard (state / ranks): what the issue bounds
  node extra        the sum of the ranks' extras (one node here)
  MemAvailable drop the system's least MemAvailable during the checkpoints, below what it
                    was before them

Baselines: h5py (each rank writes its shard of the state to its own HDF5 file, as a plain
sharded save does) and torch.distributed.checkpoint.async_save (gloo; the state as one
tensor; DCP stages a CPU copy, then writes) when torch is installed.

With --restore (#26 item 2) it measures restarts instead: one 4-rank job saves the state
once on all four levels; then, per scenario and repeat, a copy of that run directory loses
a node (its local directory deleted) and a fresh job restarts from it, sampled the same way
from the moment its arrays are protected to the end of restart():

  L1                nothing lost: every rank reads its own L1 file
  L2 / L3 / L4      node 1 lost; rank 1's shard from its partner's replica, a rebuild from
                    its group's parity (the restarting job without L2), or L4 (without L2, L3)
  4 -> 3, L2 / L3   node 3 lost, 3 ranks restart: the old shards are re-partitioned, old
                    rank 3's from its replica or rebuilt from parity (its replica deleted too)
  4 -> 3, L4        3 ranks with L4 alone: every new piece read from the old L4 shards

  x new shard       the largest rank's peak extra over its new shard (state / new ranks):
                    a restore holds that shard (its snapshot buffers) plus the chunk pool
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from harness import (Dcp, available, gloo_close, h5py_save, machine, mem_total,  # perf/ is on sys.path
                     print_machine, run_worker, shard_bounds, write_json)

from hpcckpt.ckpt.memory_forecast import mem_available as _mem_available

LEVELS = {
    "local": ["local"],
    "local + partner": ["local", "partner"],
    "local + erasure (4, 2)": ["local", "erasure"],
    "all four": ["local", "partner", "erasure", "pfs"],
}
GIB = 1 << 30


def _status(pid: int) -> int | None:
    """RssAnon + RssShmem of `pid`, in bytes; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return sum(int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("RssAnon", "RssShmem"))


RESTORES = {  # scenario: (ranks that restart, the restarting job's levels, node lost, old rank whose replica goes)
    "L1": (4, LEVELS["all four"], None, None),
    "L2": (4, LEVELS["all four"], 1, None),
    "L3": (4, ["local", "erasure", "pfs"], 1, None),
    "L4": (4, ["local", "pfs"], 1, None),
    "4 -> 3, L2": (3, LEVELS["all four"], 3, None),
    "4 -> 3, L3": (3, ["local", "erasure", "pfs"], 3, 3),
    "4 -> 3, L4": (3, ["pfs"], 3, None),
}
SOURCE = {"L1": "local", "L2": "partner", "L3": "erasure", "L4": "pfs"}


def sampled(ranks: int, args: list[str], what: str, signals: Path, code: str | None) -> tuple[list, int, dict]:
    """Run the worker job on `ranks` ranks, sampling every rank from the moment all are ready
    (each wrote its pid and baseline) until the job ends or says it `measured`: (each
    rank's peak extra, the system's MemAvailable drop, the job's result)."""
    signals.mkdir()
    done: dict = {}
    job = threading.Thread(target=lambda: done.update(
        result=run_worker(__file__, ranks, args, what, pythonpath_first=code)[0]))
    job.start()
    peaks, baselines, available_before, available_min = {}, {}, None, None
    while job.is_alive() and not (signals / "measured").exists():
        ready = sorted(p for p in signals.glob("ready-*") if p.suffix != ".tmp")
        if len(ready) == ranks and not baselines:
            for path in ready:
                pid, baseline = json.loads(path.read_text())
                baselines[pid] = baseline
            available_before = available_min = _mem_available()
            (signals / "go").touch()
        for pid in baselines:
            rss = _status(pid)
            if rss is not None:
                peaks[pid] = max(peaks.get(pid, 0), rss)
        if baselines:
            available_min = min(available_min, _mem_available())
        time.sleep(0.003)
    job.join()
    if "result" not in done:
        raise SystemExit(f"bench_memory: the {what} job failed")
    return [peaks[pid] - baselines[pid] for pid in baselines], available_before - available_min, done["result"]


def _chunk_args(chunk_mib: float | None) -> list[str]:
    return ["--chunk-mib", str(chunk_mib)] if chunk_mib is not None else []


def measure(variant: str, size_gib: float, ranks: int, checkpoints: int, chunk_mib: float | None,
            code: str | None = None) -> dict:
    """One run of `variant`, sampled from here."""
    with tempfile.TemporaryDirectory(prefix="bench_memory_", dir=os.environ.get("BENCH_DIR")) as tmp:
        args = ["--variant", variant, "--size", str(size_gib), "--dir", tmp, "--checkpoints", str(checkpoints),
                *_chunk_args(chunk_mib)]
        extras, drop, result = sampled(ranks, args, variant, Path(tmp) / "signals", code)
        return {**_figures(extras, drop, size_gib * GIB / ranks, "x_shard"), "durable_s": result["durable_s"],
                "rss_after": result["rss_after"]}


def _figures(extras: list, drop: int, shard: float, per_shard: str) -> dict:
    """The table's memory columns from each rank's peak extra and the MemAvailable drop."""
    return {"extra_per_rank_gib": max(extras) / GIB, per_shard: max(extras) / shard,
            "node_extra_gib": sum(extras) / GIB, "mem_available_drop_gib": drop / GIB}


def measure_restore(scenario: str, saved: Path, size_gib: float, chunk_mib: float | None,
                    code: str | None = None) -> dict:
    """One restart of `scenario` from a copy of the run directory `saved`, sampled from here."""
    ranks, _, lost, replica_gone = RESTORES[scenario]
    with tempfile.TemporaryDirectory(prefix="bench_memory_", dir=os.environ.get("BENCH_DIR")) as tmp:
        shutil.copytree(saved, Path(tmp) / "run")
        if lost is not None:
            shutil.rmtree(Path(tmp) / "run" / "local" / f"node{lost}")
        for replica in (Path(tmp) / "run" / "local").glob(f"node*/run-*/v*/replica-of-r{replica_gone:05d}-*") \
                if replica_gone is not None else ():
            replica.unlink()
        args = ["--restore", scenario, "--size", str(size_gib), "--dir", tmp, *_chunk_args(chunk_mib)]
        extras, drop, result = sampled(ranks, args, scenario, Path(tmp) / "signals", code)
        return {**_figures(extras, drop, size_gib * GIB / ranks, "x_new_shard"), "restart_s": result["restart_s"]}


# -- the worker (each rank) --------------------------------------------------------------
def _ready_and_wait(comm, directory: str) -> None:
    """Tell the sampler this rank's pid and baseline; wait until it samples."""
    signals = Path(directory) / "signals"
    ready = signals / f"ready-{comm.rank}"
    ready.with_suffix(".tmp").write_text(json.dumps([os.getpid(), _status(os.getpid())]))
    ready.with_suffix(".tmp").rename(ready)  # whole, for the sampler
    while not (signals / "go").exists():
        time.sleep(0.01)
    comm.Barrier()


def _initial_state(size_gib: float):
    import numpy as np

    state = np.empty(int(size_gib * GIB) // 4, dtype=np.float32)
    state[:] = np.arange(state.size, dtype=np.float32) % 1000  # touched: resident before the baseline
    return state


def worker(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.restore:
        restore_worker(comm, args)
        return
    state = _initial_state(args.size)
    # The saver is made (its imports, torch's process group, the Checkpointer and protect(), whose
    # buffers are not touched yet) before the baseline: what counts is what checkpoints take.
    save = {"h5py": _h5py_saver, "torch DCP async_save": _dcp_saver}.get(args.variant, _hpcckpt_saver)(comm, state, args)
    _ready_and_wait(comm, args.dir)
    times, rss = [], []
    for step in range(1, args.checkpoints + 1):
        state += 1.0
        comm.Barrier()
        started = time.perf_counter()
        save(step)
        times.append(comm.allreduce(time.perf_counter() - started, op=MPI.MAX))
        rss.append(comm.allreduce(_status(os.getpid()), op=MPI.MAX))  # does it stay flat over many?
    close = getattr(save, "close", None)
    if close is not None:
        close()
    if comm.rank == 0:
        write_json(args.out, {"durable_s": statistics.median(times), "rss_after": rss})


def _config(comm, args, levels):
    from hpcckpt import load_config

    overrides = [f"run.dir={args.dir}/run", f"cluster.simulated_nodes={comm.size}",
                 f"resilience.levels={json.dumps(levels)}", "resilience.group_size=4",
                 "resilience.parity=2", "storage.pfs_every=1", "checkpoint.keep_local=1", "checkpoint.keep_pfs=1"]
    if args.chunk_mib is not None:
        overrides.append(f"checkpoint.chunk_mib={args.chunk_mib}")
    return load_config(None, overrides)


def restore_worker(comm, args) -> None:
    """One restart of a scenario (RESTORES), checked: the state as saved, each rank's shard
    from the level the scenario names."""
    import numpy as np

    from hpcckpt import Checkpointer

    _, levels, _, _ = RESTORES[args.restore]
    state = np.empty(int(args.size * GIB) // 4, dtype=np.float32)
    state.fill(0)  # touched: resident before the baseline
    ckpt = Checkpointer(comm, _config(comm, args, levels))
    ckpt.protect("state", state)
    _ready_and_wait(comm, args.dir)
    started = time.perf_counter()
    step = ckpt.restart("require")
    took = _slowest(comm, time.perf_counter() - started)
    if comm.rank == 0:
        (Path(args.dir) / "signals" / "measured").touch()  # the check below allocates: not the restore's
    expected = _initial_state(args.size) + 1.0
    if step != 1 or not np.array_equal(state, expected):
        raise SystemExit(f"bench_memory: restart of {args.restore} returned step {step} or a state unlike the "
                         "saved one")
    wanted = SOURCE[args.restore.split(", ")[-1]]
    sources = tuple(getattr(ckpt, "restored_sources", ()))
    if wanted not in sources:
        raise SystemExit(f"bench_memory: {args.restore} restored from {sources}, not from {wanted}")
    ckpt.close()
    if comm.rank == 0:
        write_json(args.out, {"restart_s": took, "sources": sources})


def _slowest(comm, seconds: float) -> float:
    from mpi4py import MPI

    return comm.allreduce(seconds, op=MPI.MAX)


def save_once(size_gib: float, chunk_mib: float | None, code: str | None, directory: Path) -> Path:
    """The run directory of one checkpoint (step 1) of the state on 4 ranks, all four levels."""
    args = ["--variant", "all four", "--size", str(size_gib), "--dir", str(directory), "--checkpoints", "1",
            *_chunk_args(chunk_mib)]
    sampled(4, args, "save", directory / "signals", code)
    return directory / "run"


def _hpcckpt_saver(comm, state, args):
    from hpcckpt import Checkpointer

    ckpt = Checkpointer(comm, _config(comm, args, LEVELS[args.variant]))
    ckpt.protect("state", state)

    def save(step):
        ckpt.checkpoint(step)
        ckpt.wait()
    save.close = ckpt.close
    return save


def _h5py_saver(comm, state, args):
    import h5py  # noqa: F401  (imported before the baseline)

    lo, hi = shard_bounds(state.size, comm.rank, comm.size)
    mine = state[lo:hi]

    def save(step):
        path = Path(args.dir) / f"h5-{step}-r{comm.rank}.h5"
        # Rank 0 syncs every file system once its own file is written, as a plain sharded save does.
        h5py_save(path, [("state", mine)], durable="os" if comm.rank == 0 else None)
        (Path(args.dir) / f"h5-{step - 1}-r{comm.rank}.h5").unlink(missing_ok=True)
    return save


def _dcp_saver(comm, state, args):
    dcp = Dcp(comm)
    tensor = dcp.torch.from_numpy(state)

    def save(step):
        dcp.async_save({"state": tensor}, checkpoint_id=str(Path(args.dir) / f"dcp-{step}")).result()

    save.close = gloo_close
    return save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=None, help="checkpoint.chunk_mib for hpcckpt's runs")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1.0], help="state sizes in GiB")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--code", default=None,
                        help="another checkout of hpcckpt for the ranks (e.g. a git worktree of the version before)")
    parser.add_argument("--restore", nargs="*", default=None,
                        help=f"measure restarts instead (all scenarios, or those named: {', '.join(RESTORES)})")
    args = parser.parse_args()
    if args.worker:
        args.restore = args.restore[0] if args.restore else None
        worker(args)
        return
    if args.restore is not None:
        main_restore(args, args.restore or list(RESTORES))
        return
    variants = args.variants or [*LEVELS, "h5py"] + (["torch DCP async_save"] if available("torch") else [])
    results = {}
    host = machine(directory=os.environ.get("BENCH_DIR"))
    print_machine(host)
    print(f"{args.ranks} ranks, {args.checkpoints} checkpoints each, median of {args.repeats} runs; "
          f"MemTotal {mem_total() / GIB:.1f} GiB", flush=True)
    print("| state | variant | extra per rank | x shard | node extra | MemAvailable drop | durable s |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for variant in variants:
            runs = [measure(variant, size, args.ranks, args.checkpoints, args.chunk_mib, args.code)
                    for _ in range(args.repeats)]
            row = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "rss_after"}
            row["rss_after_gib"] = [max(r["rss_after"][i] for r in runs) / GIB for i in range(args.checkpoints)]
            results[f"{size} GiB / {variant}"] = row
            print(f"| {size:g} GiB | {variant} | {row['extra_per_rank_gib']:.3f} GiB | {row['x_shard']:.2f}x | "
                  f"{row['node_extra_gib']:.2f} GiB | {row['mem_available_drop_gib']:.2f} GiB | "
                  f"{row['durable_s']:.2f} |", flush=True)
    if args.checkpoints >= 10:  # flat over many checkpoints? the largest rank's RSS after each
        for key, row in results.items():
            after = row["rss_after_gib"]
            marks = sorted({1, 3, 10, len(after) // 2, len(after)})
            print(f"{key}: RssAnon + RssShmem of the largest rank after checkpoint "
                  + ", ".join(f"{n}: {after[n - 1]:.3f} GiB" for n in marks)
                  + f"; the most after any from the 3rd on: {max(after[2:]):.3f} GiB")
    if args.json:
        write_json(args.json, results, host)


def main_restore(args, scenarios: list[str]) -> None:
    results = {}
    host = machine(directory=os.environ.get("BENCH_DIR"))
    print_machine(host)
    print(f"restarts of a 4-rank checkpoint (all four levels), median of {args.repeats} runs; "
          f"MemTotal {mem_total() / GIB:.1f} GiB", flush=True)
    print("| state | restart | extra per rank | x new shard | node extra | MemAvailable drop | restart s |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench_memory_saved_", dir=os.environ.get("BENCH_DIR")) as saved:
            run_dir = save_once(size, args.chunk_mib, args.code, Path(saved))
            for scenario in scenarios:
                runs = [measure_restore(scenario, run_dir, size, args.chunk_mib, args.code)
                        for _ in range(args.repeats)]
                row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                results[f"{size} GiB / restart {scenario}"] = row
                print(f"| {size:g} GiB | {scenario} | {row['extra_per_rank_gib']:.3f} GiB | "
                      f"{row['x_new_shard']:.2f}x | "
                      f"{row['node_extra_gib']:.2f} GiB | {row['mem_available_drop_gib']:.2f} GiB | "
                      f"{row['restart_s']:.2f} |", flush=True)
    if args.json:
        write_json(args.json, results, host)


if __name__ == "__main__":
    main()
