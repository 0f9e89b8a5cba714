"""Time to rebuild one lost node's shard from L3 erasure coding versus reading it from L4.

One command runs everything: this script (the parent) writes one checkpoint of a replicated
float32 state (default 256 MiB: 16 equal tensors, the same on every rank) on 4 ranks placed
on 4 simulated nodes (one rank per node) with levels local + erasure + pfs (one erasure group
of 4, parity 2, so k = 2 data segments per stripe), copies the run directory aside, and then,
per repeat, restores that copy, simulates the loss and launches a fresh job
`mpiexec -n 4 python perf/bench_rebuild.py --worker ...` that times one `Checkpointer.restart()`:

  l3_rebuild   node 1's local directory deleted; levels local+erasure+pfs: rank 1's shard is
               rebuilt from the three survivors' shard segments and parity pieces (Reed-
               Solomon decode), written back to L1 with rank 1's parity file; ranks 0, 2, 3
               read their own L1 shard.
  l4_read      the same loss, but the restarting job runs with levels local+pfs: rank 1 reads
               its shard from L4 (and writes it back to L1); the others read L1.
  l1_no_loss   nothing lost (levels local+erasure+pfs): every rank reads its own L1 shard; the
               floor.

    python perf/bench_rebuild.py                     # 256 MiB, 5 repeats (about 3 minutes on 2 cores)
    python perf/bench_rebuild.py --quick             # 64 MiB, 2 repeats (under 1.5 minutes)
    python perf/bench_rebuild.py --size-mib 512 --repeats 3 --json out.json

Restoring re-protects the version (rank 1's rebuilt shard, its parity file and commit record
are written again), so every repeat starts from the same on-disk state: the run directory is
restored from the pristine copy (shutil.copytree) before each job, its file list and sizes
checked against the copy, and only then is node 1's directory deleted. The order of the three
variants rotates from repeat to repeat so slow phases of a shared machine hit each alike.

Timing: inside the job, after Checkpointer construction and protect() (not timed), the cache
is made cold (default `--cold-method fadvise`: rank 0 fsyncs every file of the run directory
and evicts it with posix_fadvise(DONTNEED), no root needed and other jobs' cache is left
alone; `drop_caches`: `sync; echo 3 > /proc/sys/vm/drop_caches`, root only, flushes and evicts
the whole machine's page cache, which disturbs any benchmark running beside this one; `none`
keeps the files warm; the parent first checks on a 64 MiB probe file that the method really
makes reads hit the disk, else it falls back to warm and says so), then a quiet barrier (non-blocking barrier polled with a 0.5 ms sleep: MPICH's
blocking barrier spins and would steal a core from the ranks doing I/O), then restart() on
every rank. One repeat's value is the slowest rank's wall time of restart(); the reported
value is the median over repeats (min and max are reported as the spread).

Checks (any failure aborts with a message): restart() returns the written step; every
restored array's xxh3 equals the written state's; the rank logs (hpcckpt.runlog.RunLog, one
directory per job) say that rank 1 restored "from L3 erasure" (l3_rebuild), "from L4 pfs"
(l4_read), and every other rank "from L1 local"; no warnings were logged; after l3_rebuild and
l4_read node 1's rebuilt shard file is byte-identical to the original (and, after
l3_rebuild, its rebuilt parity file too).

Breakdown (timing probes wrapped around hpcckpt functions by this script; hpcckpt itself is
unchanged), per rank, seconds inside restart():
  discover    restore/discover.py's discover (list the levels' versions)
  fetch       restore/fetch.py's read_pieces: read + verify own pieces from L1 (for rank 1 after a loss:
              the re-read of the shard it has just written back)
  parity_rd   ErasureLevel.read_parity (survivors read + verify their parity pieces)
  rounds      levels/rebuild_rounds.rebuild_in_rounds: the rounds of chunks (transfers of the
              surviving pieces, decodes, and writes of the rebuilt chunks, interleaved); on
              rank 1 this includes waiting for the survivors to arrive. "xfer_net": rank
              1's exit minus the last survivor's entry (wall clock).
  decode      ErasureCode.rebuild (the GF(2^8) decode of the lost blocks; inside rounds)
  parity_fin  ShardFileWriter.finish (header, fsync and publish of the rebuilt parity file)
  l4_read     restore/fetch.py's _land_copy (rank 1 copies its verified L4 shard back to L1;
              the L4 read itself is part of fetch)
  l1_write    LocalLevel.write_shard_bytes (write + fsync of the L4 shard into L1)
  l3_stage    ErasureLevel.deliver (everything L3 does, all ranks)
  l3_rest     l3_stage minus parity_rd, rounds and parity_fin (rank 1: waiting in an allgather
              while the survivors read their parity, publishing its rebuilt L1 copy)
  reprotect   recovery._protect_again (re-encode what is still missing + commit record + barrier)
  load        recovery.load (Allgatherv of every tensor + copy into the arrays)
  disk_rd/wr  read_bytes / write_bytes of /proc/self/io over restart(), MiB

JSON (--json, flat): rebuild_one_node_s, l4_one_node_s, l1_no_loss_s (medians), each also
as *_all_s (every repeat), *_min_s, *_max_s; ratios; the breakdown medians per variant for
the lost rank (rank 1) and the slowest survivor; sizes, machine and settings.
"""

from __future__ import annotations

from harness import pin_threads  # perf/ is on sys.path: the scripts run from it

pin_threads()  # before NumPy loads

import argparse  # noqa: E402
import filecmp  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from harness import describe, machine, rotated, run_worker, write_json  # noqa: E402
from restore_fixtures import (MiB, cold_method_works, digests, evict, fill, proc_io, quiet_barrier,  # noqa: E402
                              state_shapes)

STEP = 1
RANKS = 4
LOST_NODE = 1
LOST_RANK = 1  # one rank per node
ALL_LEVELS = '["local","erasure","pfs"]'
VARIANTS = {
    # name: (levels of the restarting job, node 1 lost?, what rank 1 must log, JSON key)
    "l3_rebuild": (ALL_LEVELS, True, "L3 erasure", "rebuild_one_node"),
    "l4_read": ('["local","pfs"]', True, "L4 pfs", "l4_one_node"),
    "l1_no_loss": (ALL_LEVELS, False, "L1 local", "l1_no_loss"),
}
LABELS = {
    "l3_rebuild": "(a) node 1 lost, rank 1 rebuilt from L3 erasure",
    "l4_read": "(b) node 1 lost, rank 1 reads L4 (levels local+pfs)",
    "l1_no_loss": "(c) nothing lost, every rank reads L1 (floor)",
}
PARTS = ["discover", "fetch", "parity_rd", "rounds", "xfer_net", "decode", "parity_fin", "l4_read",
         "l1_write", "l3_stage", "l3_rest", "reprotect", "load", "disk_rd", "disk_wr"]
DERIVED = ("xfer_net", "l3_rest", "disk_rd", "disk_wr")

# ------------------------------------------------------------------------------------------
# worker side (runs under mpiexec)


def _config(args, levels: str):
    from hpcckpt import load_config

    return load_config(None, [f"run.dir={args.run_dir}", f"cluster.simulated_nodes={RANKS}",
                              f"resilience.levels={levels}", f"resilience.group_size={RANKS}",
                              "resilience.parity=2", "checkpoint.split_threshold_kb=1024"], environ={})


class Probes:
    """Accumulated seconds, first entry and last exit (wall clock) of wrapped functions."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.enter: dict[str, float] = {}
        self.exit: dict[str, float] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, key: str) -> None:
        original = getattr(owner, attr)
        probes = self

        def wrapped(*a, **k):
            t = time.perf_counter()
            probes.enter.setdefault(key, time.time())
            try:
                return original(*a, **k)
            finally:
                probes.seconds[key] = probes.seconds.get(key, 0.0) + time.perf_counter() - t
                probes.exit[key] = time.time()

        setattr(owner, attr, wrapped)
        self._undo.append((owner, attr, original))

    def remove(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def _install_probes() -> Probes:
    from hpcckpt.restore import flow as recovery
    from hpcckpt.codec.cpu import ErasureCode
    from hpcckpt.restore import discover, fetch
    from hpcckpt.format.shardfile import ShardFileWriter
    from hpcckpt.levels import erasure
    from hpcckpt.levels.erasure import ErasureLevel
    from hpcckpt.levels.local import LocalLevel

    probes = Probes()
    for owner, attr, key in [
        (recovery, "discover", "discover"), (fetch, "read_pieces", "fetch"),
        (fetch, "_land_copy", "l4_read"), (ErasureLevel, "deliver", "l3_stage"),
        (recovery, "_protect_again", "reprotect"), (recovery, "load", "load"),
        (ErasureLevel, "read_parity", "parity_rd"), (erasure, "rebuild_in_rounds", "rounds"),
        (ShardFileWriter, "finish", "parity_fin"), (ErasureCode, "rebuild", "decode"),
        (LocalLevel, "write_shard_bytes", "l1_write"),
    ]:
        probes.wrap(owner, attr, key)
    return probes


def worker_save(args) -> None:
    from mpi4py import MPI

    from hpcckpt import Checkpointer

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    arrays = [np.empty(s, dtype=np.float32) for s in state_shapes(args.size_mib, args.tensors, min_rows=RANKS)]
    fill(arrays)
    ckpt = Checkpointer(comm, _config(args, ALL_LEVELS))
    for i, a in enumerate(arrays):
        ckpt.protect(f"w{i:02d}", a)
    loop = {"step": STEP}
    ckpt.register_state("loop", lambda: dict(loop), loop.update)
    ckpt.layout
    quiet_barrier(comm)
    t0 = time.perf_counter()
    ckpt.checkpoint(STEP, final=True)
    blocking = time.perf_counter() - t0
    ckpt.wait()
    quiet_barrier(comm)
    durable = time.perf_counter() - t0
    blocking = comm.allreduce(blocking, op=MPI.MAX)
    ckpt.close()
    if rank == 0:
        write_json(args.out, {"digests": digests(arrays), "state_bytes": sum(a.nbytes for a in arrays),
                              "save_blocking_s": blocking, "save_durable_s": durable})
    quiet_barrier(comm)


def worker_restore(args) -> None:
    from mpi4py import MPI

    import hpcckpt.restore.flow  # noqa: F401  (imported before the timed region)
    from hpcckpt import Checkpointer
    from hpcckpt.runlog import RunLog

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    expected = json.loads(Path(args.expect).read_text())["digests"]
    levels = VARIANTS[args.variant][0]
    arrays = [np.zeros(s, dtype=np.float32) for s in state_shapes(args.size_mib, args.tensors, min_rows=RANKS)]
    log = RunLog(args.log_dir, rank, size, console=False)
    ckpt = Checkpointer(comm, _config(args, levels), log=log)
    for i, a in enumerate(arrays):
        ckpt.protect(f"w{i:02d}", a)
    loop = {"step": -1}
    ckpt.register_state("loop", lambda: dict(loop), loop.update)
    ckpt.layout  # plan the layout and allocate the shard buffers, as a fresh job does
    probes = _install_probes()
    evict(comm, args.cold_method, Path(args.run_dir))
    quiet_barrier(comm)
    io0 = proc_io()
    t0 = time.perf_counter()
    try:
        step = ckpt.restart()
    finally:
        mine = time.perf_counter() - t0
        probes.remove()
    io1 = proc_io()
    quiet_barrier(comm)
    total = time.perf_counter() - t0
    ckpt.close()
    log.close()
    bad = [i for i, (got, want) in enumerate(zip(digests(arrays), expected)) if got != want]
    row = {"rank": rank, "rank_s": mine, "total_s": total, "step": step, "loop_step": loop["step"], "bad": bad,
           "seconds": probes.seconds, "enter": probes.enter, "exit": probes.exit,
           "disk_rd": (io1["read_bytes"] - io0["read_bytes"]) / MiB,
           "disk_wr": (io1["write_bytes"] - io0["write_bytes"]) / MiB,
           "rchar": (io1["rchar"] - io0["rchar"]) / MiB}
    rows = comm.gather(row, root=0)
    if rank == 0:
        write_json(args.out, {"rows": rows})
    quiet_barrier(comm)


# ------------------------------------------------------------------------------------------
# parent side


def _launch(args, extra: list[str], what: str) -> dict:
    worker_args = ["--run-dir", str(args.run_dir), "--size-mib", str(args.size_mib), "--tensors", str(args.tensors),
                   "--cold-method", args.cold_method, *extra]
    result, _ = run_worker(__file__, RANKS, worker_args, f"{what} job", mpiexec=args.mpiexec)
    return result


def _listing(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under root (the log directory excluded)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if not rel.startswith("log" + os.sep):
                out[rel] = path.stat().st_size
    return out


def _restore_run_dir(run_dir: Path, pristine: Path, pristine_listing: dict) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(pristine, run_dir)
    if _listing(run_dir) != pristine_listing:
        raise SystemExit("bench_rebuild: the restored run directory differs from the pristine copy")


_RESTORED = re.compile(r"restored version (\d+) from (L\d \w+) \(rank (\d+), node (\d+)\)")


def _check_logs(log_dir: Path, variant: str) -> dict:
    """Which level each rank restored from, per its own log; abort on anything unexpected."""
    want_lost = VARIANTS[variant][2]
    sources, problems, summary = {}, [], None
    for rank in range(RANKS):
        path = log_dir / "log" / f"rank{rank}.log"
        text = path.read_text() if path.exists() else ""
        found = [m for m in _RESTORED.finditer(text)]
        if len(found) != 1:
            problems.append(f"rank {rank}: {len(found)} 'restored version ... from' lines in {path}")
            continue
        step, level, logged_rank, node = found[0].groups()
        sources[rank] = level
        want = want_lost if rank == LOST_RANK else "L1 local"
        if int(step) != STEP or int(logged_rank) != rank or level != want:
            problems.append(f"rank {rank}: logged 'restored version {step} from {level}', expected step {STEP} "
                            f"from {want}")
        for line in text.splitlines():
            if " WARNING " in line or "warning:" in line:
                problems.append(f"rank {rank} warned: {line.strip()}")
        if rank == 0:
            m = re.search(r"restored version \d+: (.*)", text)
            summary = m.group(1).strip() if m else None
    if problems:
        raise SystemExit(f"bench_rebuild: variant {variant}: the rank logs do not show the expected restore:\n  "
                         + "\n  ".join(problems))
    return {"sources": sources, "summary": summary}


def _check_files(run_dir: Path, pristine: Path, variant: str, version_dir: str) -> dict:
    """Node 1's shard (and parity) after the restore against the original bytes; `version_dir`:
    the version's directory in the run's own node-local directory (run/run_identity.py)."""
    vdir = Path(version_dir)
    shard = vdir / f"shard-r{LOST_RANK:05d}.hck"
    parity = vdir / f"parity-r{LOST_RANK:05d}.hck"
    out = {}
    if not (run_dir / shard).is_file() or not filecmp.cmp(run_dir / shard, pristine / shard, shallow=False):
        raise SystemExit(f"bench_rebuild: variant {variant}: {shard} is missing or differs from the original")
    out["shard_identical"] = True
    if variant == "l3_rebuild":
        if not (run_dir / parity).is_file():
            raise SystemExit(f"bench_rebuild: variant {variant}: the rebuilt parity file {parity} is missing")
        out["parity_identical"] = filecmp.cmp(run_dir / parity, pristine / parity, shallow=False)
    return out


def _sample(result: dict) -> dict:
    """One job's rows -> the repeat's numbers: slowest rank, lost rank, slowest survivor."""
    rows = sorted(result["rows"], key=lambda r: r["rank"])
    for r in rows:
        if r["bad"] or r["step"] != STEP or r["loop_step"] != STEP:
            raise SystemExit(f"bench_rebuild: rank {r['rank']} restored step {r['step']} (loop {r['loop_step']}), "
                             f"wrong tensors {r['bad']}")
    lost = rows[LOST_RANK]
    survivors = [r for r in rows if r["rank"] != LOST_RANK]

    def parts(r):
        p = {k: r["seconds"].get(k, 0.0) for k in PARTS if k not in DERIVED}
        p["disk_rd"], p["disk_wr"] = r["disk_rd"], r["disk_wr"]
        # The part of the L3 stage no probe covers: on rank 1 mostly the blocking allgather in which
        # it waits for the survivors to read their parity, and publishing its rebuilt L1 copy.
        p["l3_rest"] = max(0.0, p["l3_stage"] - p["parity_rd"] - p["rounds"] - p["parity_fin"]) \
            if p["l3_stage"] else 0.0
        return p

    lost_parts = parts(lost)
    if "rounds" in lost["enter"]:
        last_in = max(r["enter"].get("rounds", 0.0) for r in survivors)
        lost_parts["xfer_net"] = max(0.0, lost["exit"]["rounds"] - last_in)
    else:
        lost_parts["xfer_net"] = 0.0
    surv_parts = {k: max(parts(r)[k] for r in survivors) for k in lost_parts if k != "xfer_net"}
    surv_parts["xfer_net"] = 0.0
    return {"seconds": max(r["rank_s"] for r in rows), "with_barrier_s": max(r["total_s"] for r in rows),
            "shards_s": max(r["rank_s"] - r["seconds"].get("load", 0.0) for r in rows),
            "lost_rank_s": lost["rank_s"], "survivor_max_s": max(r["rank_s"] for r in survivors),
            "disk_rd_mib_all": sum(r["disk_rd"] for r in rows), "disk_wr_mib_all": sum(r["disk_wr"] for r in rows),
            "lost": lost_parts, "survivors": surv_parts}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 repeats (under 1.5 minutes)")
    parser.add_argument("--size-mib", type=float, help="total replicated state in MiB (default 256; --quick 64)")
    parser.add_argument("--tensors", type=int, default=16, help="number of equal tensors (default 16)")
    parser.add_argument("--repeats", type=int, help="repeats per variant (default 5; --quick 2)")
    parser.add_argument("--cold-method", choices=("fadvise", "drop_caches", "none"), default="fadvise",
                        help="how to make the files cold before each timed restart (default fadvise: only this "
                             "run's files; drop_caches: the whole page cache, root only)")
    parser.add_argument("--json", help="write the flat results here")
    parser.add_argument("--scratch", help="scratch directory (default: a new one under /tmp, removed at the end)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="restore", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="l1_no_loss", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    parser.add_argument("--expect", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = 64 if args.quick else 256
    if args.repeats is None:
        args.repeats = 2 if args.quick else 5
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    if args.worker:
        (worker_save if args.phase == "save" else worker_restore)(args)
        return

    owned = args.scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-rebuild-", dir="/tmp")) if owned else Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    args.run_dir = scratch / "run"
    pristine = scratch / "pristine"
    for p in (args.run_dir, pristine):
        shutil.rmtree(p, ignore_errors=True)
    expect = scratch / "expected.json"
    host = machine(args.mpiexec, scratch)
    started = time.perf_counter()
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    checks: dict[str, list] = {v: [] for v in VARIANTS}
    try:
        cold_ok, cold_note = cold_method_works(args.cold_method, scratch)
        if not cold_ok:
            args.cold_method = "none"
        save = _launch(args, ["--phase", "save"], "save")
        expect.write_text(json.dumps(save))
        shutil.rmtree(args.run_dir / "log", ignore_errors=True)
        shutil.copytree(args.run_dir, pristine)
        pristine_listing = _listing(pristine)
        run_subdir = "run-" + json.loads((pristine / "run.json").read_text())["run_id"]  # run/run_identity.py
        version_dir = f"local/node{LOST_NODE}/{run_subdir}/v{STEP:012d}"
        shard_bytes = pristine_listing[f"{version_dir}/shard-r{LOST_RANK:05d}.hck"]
        parity_bytes = pristine_listing[f"{version_dir}/parity-r{LOST_RANK:05d}.hck"]
        names = list(VARIANTS)
        for repeat in range(args.repeats):
            for variant in rotated(names, repeat):
                _restore_run_dir(args.run_dir, pristine, pristine_listing)
                if VARIANTS[variant][1]:
                    shutil.rmtree(args.run_dir / "local" / f"node{LOST_NODE}")
                log_dir = scratch / "logs" / f"{variant}-{repeat}"
                result = _launch(args, ["--variant", variant, "--log-dir", str(log_dir), "--expect", str(expect)],
                                 f"{variant} (repeat {repeat + 1})")
                info = _check_logs(log_dir, variant)
                if VARIANTS[variant][1]:
                    info.update(_check_files(args.run_dir, pristine, variant, version_dir))
                samples[variant].append(_sample(result))
                checks[variant].append(info)
                print(f"repeat {repeat + 1}/{args.repeats} {variant:11s} {samples[variant][-1]['seconds']:7.3f} s  "
                      f"({info['summary']})", flush=True)
    finally:
        if owned:
            shutil.rmtree(scratch, ignore_errors=True)
    host["loadavg_end"] = round(os.getloadavg()[0], 2)
    elapsed = time.perf_counter() - started

    med = statistics.median
    stats = {}
    for v, rows in samples.items():
        secs = [r["seconds"] for r in rows]
        stats[v] = {"median": med(secs), "min": min(secs), "max": max(secs), "all": secs,
                    "lost_rank_s": med(r["lost_rank_s"] for r in rows),
                    "shards": [r["shards_s"] for r in rows], "shards_s": med(r["shards_s"] for r in rows),
                    "survivor_max_s": med(r["survivor_max_s"] for r in rows),
                    "disk_rd_mib_all": med(r["disk_rd_mib_all"] for r in rows),
                    "disk_wr_mib_all": med(r["disk_wr_mib_all"] for r in rows),
                    "lost": {k: med(r["lost"][k] for r in rows) for k in PARTS},
                    "survivors": {k: med(r["survivors"][k] for r in rows) for k in PARTS}}
    parity_same = all(c.get("parity_identical", True) for c in checks["l3_rebuild"])

    cache = "cold" if cold_ok else "warm"
    flat = {"size_mib": args.size_mib, "tensors": args.tensors,
            "tensor_shape": list(state_shapes(args.size_mib, args.tensors, min_rows=RANKS)[0]), "state_bytes": save["state_bytes"],
            "ranks": RANKS, "simulated_nodes": RANKS, "group_size": RANKS, "parity": 2, "lost_node": LOST_NODE,
            "shard_mib": round(shard_bytes / MiB, 3), "parity_file_mib": round(parity_bytes / MiB, 3),
            "repeats": args.repeats, "quick": args.quick, "cache": cache, "cold_method": args.cold_method,
            "cold_note": cold_note, "save_blocking_s": round(save["save_blocking_s"], 4),
            "save_durable_s": round(save["save_durable_s"], 4), "rebuilt_parity_identical": parity_same,
            "wall_s": round(elapsed, 1)}
    for v, (_, _, _, key) in VARIANTS.items():
        s = stats[v]
        flat[f"{key}_s"] = round(s["median"], 4)
        flat[f"{key}_min_s"] = round(s["min"], 4)
        flat[f"{key}_max_s"] = round(s["max"], 4)
        flat[f"{key}_all_s"] = [round(x, 4) for x in s["all"]]
        flat[f"{key}_lost_rank_s"] = round(s["lost_rank_s"], 4)
        flat[f"{key}_before_load_s"] = round(s["shards_s"], 4)
        flat[f"{key}_before_load_min_s"] = round(min(s["shards"]), 4)
        flat[f"{key}_before_load_max_s"] = round(max(s["shards"]), 4)
        flat[f"{key}_survivor_max_s"] = round(s["survivor_max_s"], 4)
        flat[f"{key}_disk_read_mib"] = round(s["disk_rd_mib_all"], 1)
        flat[f"{key}_disk_write_mib"] = round(s["disk_wr_mib_all"], 1)
        for who in ("lost", "survivors"):
            for part, value in s[who].items():
                if value:
                    flat[f"{key}_{who}_{part}" + ("_mib" if part.startswith("disk") else "_s")] = round(value, 4)
    flat["rebuild_over_l4"] = round(stats["l3_rebuild"]["median"] / stats["l4_read"]["median"], 2)
    flat["rebuild_over_l1"] = round(stats["l3_rebuild"]["median"] / stats["l1_no_loss"]["median"], 2)
    flat["l4_over_l1"] = round(stats["l4_read"]["median"] / stats["l1_no_loss"]["median"], 2)
    flat["rebuild_over_l4_before_load"] = round(stats["l3_rebuild"]["shards_s"] / stats["l4_read"]["shards_s"], 2)
    # Repeat-paired ratios (same repeat, adjacent jobs), a check on the ratio of medians.
    flat["rebuild_over_l4_paired"] = round(med(a["seconds"] / b["seconds"] for a, b in
                                               zip(samples["l3_rebuild"], samples["l4_read"])), 2)

    # -- the tables ---------------------------------------------------------------------------
    print(f"\nRestart after losing node {LOST_NODE} of {RANKS} (one rank per simulated node): replicated float32 "
          f"state of {args.size_mib:g} MiB ({args.tensors} tensors of {flat['tensor_shape']}), shard "
          f"{flat['shard_mib']:.1f} MiB per rank, erasure group of {RANKS}, parity 2 (parity file "
          f"{flat['parity_file_mib']:.1f} MiB per rank); median of {args.repeats} repeats; {cold_note}")
    print(f"machine: {describe(host)}; load avg at the end {host['loadavg_end']:.1f}")
    print(f"{'variant':54s}{'median s':>9s}{'min':>8s}{'max':>8s}{'rank 1':>8s}{'others':>8s}{'xL1':>6s}"
          f"{'pre-load s':>11s}{'min':>7s}{'max':>7s}{'disk rd':>9s}{'disk wr':>9s}")
    floor = stats["l1_no_loss"]["median"]
    for v in VARIANTS:
        s = stats[v]
        print(f"{LABELS[v]:54s}{s['median']:9.3f}{s['min']:8.3f}{s['max']:8.3f}{s['lost_rank_s']:8.3f}"
              f"{s['survivor_max_s']:8.3f}{s['median'] / floor:6.2f}{s['shards_s']:11.3f}{min(s['shards']):7.3f}"
              f"{max(s['shards']):7.3f}{s['disk_rd_mib_all']:9.0f}"
              f"{s['disk_wr_mib_all']:9.0f}")
    print(f"  rebuild / L4 = {flat['rebuild_over_l4']:.2f} (paired per repeat: {flat['rebuild_over_l4_paired']:.2f}; "
          f"before the load: {flat['rebuild_over_l4_before_load']:.2f}); rank 1 / others: each side's own restart() "
          "time; pre-load: restart() minus recovery.load (the Allgatherv + copy every variant does alike), "
          "largest over ranks; disk rd/wr: MiB the block layer read / was sent for writing, all ranks")
    print("\nbreakdown inside restart(), seconds (medians; 'others' = the largest over ranks 0, 2, 3):")
    head = ["discover", "fetch", "parity_rd", "rounds", "xfer_net", "decode", "parity_fin", "l4_read", "l1_write",
            "l3_stage", "l3_rest", "reprotect", "load"]
    print(f"{'':26s}{'rank':>7s}" + "".join(f"{h:>10s}" for h in head) + f"{'disk_rd':>9s}{'disk_wr':>9s}")
    for v in VARIANTS:
        for who, label in (("lost", "1"), ("survivors", "others")):
            p = stats[v][who]
            print(f"{v:26s}{label:>7s}" + "".join(f"{p[h]:10.3f}" for h in head)
                  + f"{p['disk_rd']:9.0f}{p['disk_wr']:9.0f}")
    print("  (rounds on rank 1 include waiting for the survivors; xfer_net: from the last survivor entering the "
          "rounds to rank 1 leaving them; decode is inside rounds; l3_rest = l3_stage minus parity_rd, rounds and "
          "parity_fin: rank 1 waiting in an allgather for the survivors' parity reads, publishing its L1 copy; "
          "disk in MiB)")
    print(f"\nthe one save (local+erasure+pfs): blocking {flat['save_blocking_s']:.3f} s, durable "
          f"{flat['save_durable_s']:.3f} s; rebuilt shard byte-identical every time; rebuilt parity file "
          f"{'byte-identical' if parity_same else 'DIFFERS from the original (contents verified by checksums)'}")
    print(f"wall time {elapsed:.0f} s")
    if args.json:
        write_json(args.json, flat, host)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
