"""Restore time of a replicated model state: hpcckpt restart against the usual baselines.

One command runs everything: this script (the parent) writes one checkpoint of a replicated
float32 state (default 1 GiB: 16 tensors of 64 MiB, the same on every rank) with every
method, then launches itself as `mpiexec -n N python perf/bench_restart.py --worker ...` to
time the restores, and prints one table (and writes a flat JSON with --json).

    python perf/bench_restart.py                    # 1 GiB, 4 ranks (and 4 -> 2), 5 repeats
    python perf/bench_restart.py --quick            # 256 MiB, 3 repeats, < 2 minutes on 2 cores
    python perf/bench_restart.py --size-mib 512 --ranks 4 --to-ranks 2 --json out.json

Approaches (every rank ends with the full state in the same preallocated NumPy arrays):

  (a) hpcckpt_l1      `Checkpointer.restart()` on N ranks: each rank reads only its own shard
                      from its node-local (L1) directory, then allgather.
  (b) hpcckpt_l4      the same with empty node-local directories (a fresh `storage.local_dir`
                      per repeat, i.e. every node-local copy lost): own shard from the PFS (L4).
  (c) hpcckpt_4to2    `restart()` on M ranks from the N-rank checkpoint: each rank reads the
                      byte ranges of the old L4 shards its new pieces need, then allgather.
  (d) h5py_all_ranks  rank 0 wrote one HDF5 file (h5py, contiguous datasets, fsynced); every
                      rank opens it and `read_direct`s every dataset (the usual practice).
      h5py_rank0_bcast  (extra) rank 0 reads the file, MPI Bcast tensor by tensor.
  (e) dcp             torch.distributed.checkpoint save + load of the same tensors (plain
                      replicated tensors aliasing the NumPy arrays, gloo over a TCP store on
                      localhost, rank/size from MPI). Skipped when torch is not installed.
                      On M ranks (the 4 -> 2 launch) DCP and h5py run again, as "*_Mranks".

Timing: a restore is timed from a quiet barrier (non-blocking barrier polled with a 0.5 ms
sleep: MPICH's blocking barrier spins and would steal a core from the ranks doing I/O) to the
same barrier after it; the value of one repeat is the slowest rank's, the reported value the
median over repeats. Only the restore call is timed: Checkpointer construction, protect() and
DCP's process group start-up are outside (reported separately for hpcckpt as setup_s).
Repeats of all approaches are interleaved (repeat 1 of a, b, d, e, then repeat 2 ...) so slow
phases of this shared machine hit every approach alike. Every restore is checked (xxh3 of every
array against the written state; arrays are zeroed before each restore).

Cache: "cold" repeats first evict every file of the run directory from the page cache (fsync,
then posix_fadvise(DONTNEED) per file: no root needed, and it leaves other jobs' cache alone;
`--cold-method drop_caches` uses `sync; echo 3 > /proc/sys/vm/drop_caches` instead, root only).
Coldness is checked: disk_read_mib is the bytes the block layer actually read during the
restore (read_bytes of /proc/self/io, summed over ranks). "warm" repeats follow with the files
in the page cache. bytes_read_per_rank is rchar of /proc/self/io (bytes returned by read
system calls, any file) over the timed region, the largest over ranks.

hpcckpt breakdown (timing probes wrapped around the module functions of hpcckpt.restore.flow and
hpcckpt/restore/ by this script, restored after each restore; nothing in hpcckpt is changed):
read = read + verify shard bytes (fetch.read_pieces: on the L4 path the L4 shard is read
whole, then written back as this rank's L1 copy), L1 back = writing that L1 copy
(fetch._land_copy) + re-protection (recovery._protect_again), allgather = exchange of every
tensor (load minus place), place = copies into the protected arrays (write_in_place), other =
the rest (Checkpointer()
and protect() = setup, discover, agree, waits, close). Each is the largest over ranks,
median over repeats.

JSON keys (flat): hpcckpt_l1_restore_s, hpcckpt_l4_restore_s, hpcckpt_4to2_restore_s,
h5py_all_ranks_read_s, h5py_rank0_bcast_s, dcp_load_s hold the cold medians when eviction
worked (else warm; "cache" says which), every one also as *_cold_s and *_warm_s, plus
breakdowns, bytes, ratios ("<x>_speedup_vs_h5py" = h5py time / x time, same for dcp) and the
write-side timings of the one save (informational).
"""

from __future__ import annotations

from harness import pin_threads  # perf/ is on sys.path: the scripts run from it

pin_threads()  # before NumPy loads

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from harness import (Dcp, bcast_arrays, describe, gloo_close, h5py_load, h5py_save, machine,  # noqa: E402
                     run_worker, write_json)
from restore_fixtures import (MiB, cold_method_works, digests, evict, fill, proc_io, quiet_barrier,  # noqa: E402
                              state_shapes)

STEP = 1

# ------------------------------------------------------------------------------------------
# worker side (runs under mpiexec; mpi4py is imported inside functions only: DCP's process
# machinery dislikes a top-level mpi4py import)


class Worker:
    def __init__(self, args):
        from mpi4py import MPI

        self.MPI = MPI
        self.args = args
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.run_dir = Path(args.run_dir)
        self.names = [f"w{i:02d}" for i in range(args.tensors)]
        self.shapes = state_shapes(args.size_mib, args.tensors, args.layout)
        self.arrays = [np.empty(s, dtype=np.float32) for s in self.shapes]
        fill(self.arrays)
        self.expected = digests(self.arrays)
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.h5_path = self.run_dir / "baseline.h5"
        self.dcp_dir = self.run_dir / "dcp"
        self.samples: dict[str, list[dict]] = {}
        self.notes: list[str] = []
        self.dcp = None  # harness.Dcp once torch's process group is up

    # -- helpers -------------------------------------------------------------------------
    def config(self, local_dir: str | None = None):
        from hpcckpt import load_config

        # Partner copies too: a restart after a node loss onto fewer ranks then finds every
        # old shard on node-local storage (approach f).
        overrides = [f"run.dir={self.run_dir}", f"cluster.simulated_nodes={self.size}",
                     'resilience.levels=["local","partner","pfs"]']
        if local_dir:
            overrides.append(f"storage.local_dir={local_dir}")
        return load_config(None, overrides, environ={})

    def reset(self) -> None:
        for a in self.arrays:
            a.fill(0)

    def check(self, what: str) -> None:
        bad = [n for n, got, want in zip(self.names, digests(self.arrays), self.expected) if got != want]
        bad_anywhere = self.comm.allreduce(len(bad))
        if bad_anywhere:
            raise SystemExit(f"bench_restart: {what} restored wrong contents on rank {self.rank}: {bad[:4]}")

    def evict(self) -> None:
        """(all ranks) Push every file of the run directory out of the page cache."""
        evict(self.comm, self.args.cold_method, self.run_dir)

    def timed(self, key: str, cache: str, fn) -> None:
        """(all ranks) One restore: barrier, fn(), barrier; record the slowest rank's numbers."""
        self.reset()
        if cache == "cold":
            self.evict()
        extra = {}
        quiet_barrier(self.comm)
        io0 = proc_io()
        t0 = time.perf_counter()
        fn(extra)
        mine = time.perf_counter() - t0
        io1 = proc_io()
        quiet_barrier(self.comm)
        total = time.perf_counter() - t0
        rows = self.comm.gather({"rank_s": mine, "total_s": total, "rchar": io1["rchar"] - io0["rchar"],
                                 "read_bytes": io1["read_bytes"] - io0["read_bytes"], **extra}, root=0)
        self.check(f"{key} ({cache})")
        if self.rank == 0:
            sample = {
                "seconds": max(r["total_s"] for r in rows),
                "slowest_rank_s": max(r["rank_s"] for r in rows),
                "fastest_rank_s": min(r["rank_s"] for r in rows),
                "bytes_read_per_rank": max(r["rchar"] for r in rows),
                "disk_read_mib": sum(r["read_bytes"] for r in rows) / MiB,
            }
            for part in ("read_s", "l1_rewrite_s", "reprotect_s", "load_s", "place_s", "setup_s",
                         "shard_bytes_read", "bytes_received"):
                if part in rows[0]:
                    sample[part] = max(r[part] for r in rows)
            if "load_s" in sample:
                sample["allgather_s"] = max(r["load_s"] - r["place_s"] for r in rows)
                sample["other_s"] = max(r["total_s"] - r["read_s"] - r["l1_rewrite_s"] - r["reprotect_s"]
                                        - r["load_s"] - r["setup_s"] for r in rows)
            self.samples.setdefault(f"{key}|{cache}", []).append(sample)

    # -- the one save ----------------------------------------------------------------------
    def write_all(self) -> dict:
        from hpcckpt import Checkpointer

        info = {}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        quiet_barrier(self.comm)
        # hpcckpt: L1 + L4, durable when wait() returns.
        ckpt = Checkpointer(self.comm, self.config())
        for name, a in zip(self.names, self.arrays):
            ckpt.protect(name, a)
        loop = {"step": STEP}
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        quiet_barrier(self.comm)
        t0 = time.perf_counter()
        ckpt.checkpoint(STEP, final=True)
        blocking = time.perf_counter() - t0
        ckpt.wait()
        quiet_barrier(self.comm)
        info["hpcckpt_save_blocking_s"] = self.comm.allreduce(blocking, op=self.MPI.MAX)
        info["hpcckpt_save_durable_s"] = time.perf_counter() - t0
        ckpt.close()
        # h5py: rank 0 writes one file, fsync.
        quiet_barrier(self.comm)
        t0 = time.perf_counter()
        if self.rank == 0:
            h5py_save(self.h5_path, zip(self.names, self.arrays), durable="file")
        quiet_barrier(self.comm)
        info["h5py_save_durable_s"] = time.perf_counter() - t0
        # DCP save (fsyncs its files by default).
        if self.dcp is not None:
            quiet_barrier(self.comm)
            t0 = time.perf_counter()
            self.dcp.save(self.torch_state(), checkpoint_id=str(self.dcp_dir))
            quiet_barrier(self.comm)
            info["dcp_save_s"] = time.perf_counter() - t0
        return info

    # -- restores ----------------------------------------------------------------------------
    def hpcckpt_restore(self, extra: dict, local_dir: str | None = None, step: int | None = None) -> None:
        """Construct, protect, then the timed part: restart(). `step`: restore that version
        as an explicit read (evaluate's path), which writes nothing: a repartitioning restart
        of a resuming job would write the version again for M ranks and delete the N-rank
        node-local copies the next repeat reads."""
        from hpcckpt import Checkpointer
        from hpcckpt.restore import flow as recovery
        from hpcckpt.restore import fetch, load, repartitioned

        # Timing probes on the restore flow's module functions (restored afterwards).
        probes = {(fetch, "read_pieces"): "fetch_s", (fetch, "_land_copy"): "adopt_s",
                  (recovery, "_protect_again"): "reprotect_s", (recovery, "load"): "load_s",
                  (repartitioned, "load"): "load_s", (load, "write_in_place"): "place_s"}
        probes = {where: key for where, key in probes.items() if hasattr(*where)}
        times = {key: 0.0 for key in probes.values()}
        originals = {where: getattr(*where) for where in probes}

        def probe(where, key):
            original = originals[where]

            def wrapped(*a, **k):
                t = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    times[key] += time.perf_counter() - t
            return wrapped

        t_setup = time.perf_counter()
        ckpt = Checkpointer(self.comm, self.config(local_dir))
        for name, a in zip(self.names, self.arrays):
            ckpt.protect(name, a)
        loop = {"step": -1}
        ckpt.register_state("loop", lambda: dict(loop), loop.update)
        ckpt.layout  # plan the layout and allocate the shard buffers (as a fresh job does on its first call)
        setup = time.perf_counter() - t_setup
        quiet_barrier(self.comm)
        for (module, name), key in probes.items():
            setattr(module, name, probe((module, name), key))
        try:
            t0 = time.perf_counter()
            step = ckpt.restart(step=step)
            extra["restart_call_s"] = time.perf_counter() - t0
            if ckpt.restore_traffic:
                read, received = ckpt.restore_traffic
                extra["shard_bytes_read"] = self.comm.allreduce(read, op=self.MPI.MAX)
                extra["bytes_received"] = self.comm.allreduce(received, op=self.MPI.MAX)
        finally:
            for (module, name), fn in originals.items():
                setattr(module, name, fn)
        # The restore worked: without this, the restart ledger counts every repeat as a restart
        # that crashed, and marks the version failed after a few.
        ckpt.confirm_restart()
        ckpt.close()
        if step != STEP or loop["step"] != STEP:
            raise SystemExit(f"bench_restart: restart() returned {step}, loop state {loop}; expected step {STEP}")
        # read: every shard byte read (own L1 shard, or the L4 shard read whole and then from
        # the L1 copy it is written back to); l1_rewrite: writing that L1 copy back (L4 path);
        # reprotect: commit records etc. after a loss.
        adopt = times.get("adopt_s", 0.0)
        extra["read_s"] = times.get("fetch_s", 0.0) + times.get("read_file_s", 0.0)
        extra["l1_rewrite_s"] = max(adopt - times.get("fetch_s", 0.0), 0.0) if adopt else 0.0
        extra["reprotect_s"] = times.get("reprotect_s", 0.0)
        extra["load_s"] = times["load_s"]
        extra["place_s"] = times.get("place_s", 0.0)
        extra["setup_s"] = setup

    def h5py_all_ranks(self, extra: dict) -> None:
        h5py_load(self.h5_path, zip(self.names, self.arrays))

    def h5py_rank0_bcast(self, extra: dict) -> None:
        if self.rank == 0:
            h5py_load(self.h5_path, zip(self.names, self.arrays))
        bcast_arrays(self.comm, self.arrays)

    def torch_state(self) -> dict:
        return self.dcp.views(zip(self.names, self.arrays))

    def dcp_load(self, extra: dict) -> None:
        state = self.torch_state()  # aliases the NumPy arrays: DCP loads in place
        self.dcp.load(state, checkpoint_id=str(self.dcp_dir))
        for name, a in zip(self.names, self.arrays):
            if state[name].data_ptr() != a.ctypes.data:
                raise SystemExit("bench_restart: DCP replaced a tensor instead of loading in place")

    # -- driver --------------------------------------------------------------------------------
    def start_torch(self) -> None:
        if self.args.no_dcp:
            return
        try:
            self.dcp = Dcp(self.comm, threads=1)
        except ImportError as exc:
            self.notes.append(f"DCP skipped: torch not importable ({exc})")

    def run(self) -> dict:
        args = self.args
        self.start_torch()
        import h5py  # noqa: F401  (imported before any timed region)
        import hpcckpt.restore.flow  # noqa: F401
        out = {"ranks": self.size, "state_bytes": self.nbytes, "notes": self.notes}
        if args.phase == "save":
            out["write"] = self.write_all()
            # Restores on the same rank count: L1, L4, h5py, DCP, interleaved.
            plan = [("hpcckpt_l1", lambda e: self.hpcckpt_restore(e)),
                    ("hpcckpt_l4", self.l4_restore),
                    ("h5py_all_ranks", self.h5py_all_ranks),
                    ("h5py_rank0_bcast", self.h5py_rank0_bcast)]
        else:  # restore onto another rank count from the N-rank checkpoint
            suffix = f"_{self.size}ranks"
            plan = [(f"hpcckpt_{args.from_ranks}to{self.size}", lambda e: self.l4_restore(e, step=STEP)),
                    (f"hpcckpt_{args.from_ranks}to{self.size}_nodelocal",
                     lambda e: self.hpcckpt_restore(e, step=STEP)),
                    ("h5py_all_ranks" + suffix, self.h5py_all_ranks)]
        if self.dcp is not None:
            plan.append(("dcp_load" if args.phase == "save" else "dcp_load" + suffix, self.dcp_load))
        caches = ["cold", "warm"] if args.cold_method != "none" else ["warm"]
        for cache in caches:
            if cache == "warm":  # one untimed pass so every file is in the page cache
                for key, fn in plan:
                    self.reset()
                    fn({})
            for _ in range(args.repeats):
                for key, fn in plan:
                    self.timed(key, cache, fn)
        out["samples"] = self.samples
        if self.dcp is not None:
            gloo_close()
        return out

    def l4_restore(self, extra: dict, step: int | None = None) -> None:
        """restart() with an empty node-local directory: every node-local copy lost."""
        fresh = self.run_dir / "local-lost"
        try:
            self.hpcckpt_restore(extra, local_dir=str(fresh) + "/node{node}", step=step)
        finally:
            quiet_barrier(self.comm)
            if self.rank == 0:
                shutil.rmtree(fresh, ignore_errors=True)


def worker_main(args) -> None:
    worker = Worker(args)
    out = worker.run()
    if worker.rank == 0:
        write_json(args.out, out)
    quiet_barrier(worker.comm)


# ------------------------------------------------------------------------------------------
# parent side


def _launch(args, ranks: int, phase: str, run_dir: Path) -> dict:
    worker_args = ["--phase", phase, "--run-dir", str(run_dir), "--size-mib", str(args.size_mib),
                   "--tensors", str(args.tensors), "--repeats", str(args.repeats), "--cold-method", args.cold_method,
                   "--from-ranks", str(args.ranks), "--layout", args.layout]
    if args.no_dcp:
        worker_args.append("--no-dcp")
    result, _ = run_worker(__file__, ranks, worker_args, f"{phase} job on {ranks} ranks", mpiexec=args.mpiexec)
    return result


def _summarise(samples: dict) -> dict:
    """key|cache -> medians of every field over repeats."""
    out = {}
    for key_cache, rows in samples.items():
        key, cache = key_cache.split("|")
        fields = rows[0].keys()
        out[(key, cache)] = {f: statistics.median(r[f] for r in rows) for f in fields}
        out[(key, cache)]["all_seconds"] = [round(r["seconds"], 4) for r in rows]
    return out


LABELS = [
    ("hpcckpt_l1", "hpcckpt_l1_restore", "(a) hpcckpt restart, L1 node-local, N ranks"),
    ("hpcckpt_l4", "hpcckpt_l4_restore", "(b) hpcckpt restart, L4 (node-local lost), N ranks"),
    ("hpcckpt_NtoM", "hpcckpt_4to2_restore", "(c) hpcckpt restart N -> M ranks (L4, old pieces read whole)"),
    ("hpcckpt_NtoM_nodelocal", "hpcckpt_4to2_nodelocal_restore",
     "(f) hpcckpt restart N -> M ranks after the nodes >= M are lost: node-local L1 + L2, old shards moved over MPI"),
    ("h5py_all_ranks", "h5py_all_ranks_read", "(d) h5py, one file, every rank reads all"),
    ("h5py_rank0_bcast", "h5py_rank0_bcast", "    h5py, rank 0 reads + MPI Bcast"),
    ("dcp_load", "dcp_load", "(e) torch DCP load (gloo), every rank reads all"),
    ("h5py_all_ranks_Mranks", "h5py_all_ranks_read_Mranks", "    h5py every rank reads all, M ranks"),
    ("dcp_load_Mranks", "dcp_load_Mranks", "    torch DCP load, M ranks"),
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 repeats (< 2 minutes)")
    parser.add_argument("--size-mib", type=float, help="total state size in MiB (default 1024; --quick 256)")
    parser.add_argument("--tensors", type=int, default=16, help="number of equal tensors (default 16)")
    parser.add_argument("--layout", choices=("tall", "wide"), default="tall",
                        help="tall (default): tensors cut along axis 0; wide: along axis 1 (transposing copies)")
    parser.add_argument("--ranks", type=int, default=4, help="N, ranks that save and restore (default 4)")
    parser.add_argument("--to-ranks", type=int, default=2, help="M for the N -> M restore (default 2; 0 skips)")
    parser.add_argument("--repeats", type=int, help="timed repeats per approach and cache state (default 5; --quick 3)")
    parser.add_argument("--cold-method", choices=("fadvise", "drop_caches", "none"), default="fadvise")
    parser.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    parser.add_argument("--json", help="write the flat results here")
    parser.add_argument("--run-dir", help="scratch directory (default: a new one under /tmp, removed at the end)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: next to this Python, else on PATH)")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="save", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--from-ranks", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size_mib is None:
        args.size_mib = 256 if args.quick else 1024
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    if args.worker:
        worker_main(args)
        return

    if not args.no_dcp:
        try:
            import torch  # noqa: F401
        except ImportError:
            args.no_dcp = True
            print("note: torch is not installed; (e) DCP is skipped")
    owned = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="hpcckpt-bench-restart-", dir="/tmp")) if owned else Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    host = machine(args.mpiexec, run_dir)
    started = time.perf_counter()
    try:
        cold_ok, cold_note = cold_method_works(args.cold_method, run_dir)
        if not cold_ok:
            args.cold_method = "none"
        save = _launch(args, args.ranks, "save", run_dir)
        to = _launch(args, args.to_ranks, "restore", run_dir) if args.to_ranks else None
    finally:
        if owned:
            shutil.rmtree(run_dir, ignore_errors=True)
    host["loadavg_end"] = round(os.getloadavg()[0], 2)
    elapsed = time.perf_counter() - started

    stats = _summarise(save["samples"])
    if to:
        for (key, cache), v in _summarise(to["samples"]).items():
            key = (key.replace(f"_{args.to_ranks}ranks", "_Mranks")
                   .replace(f"hpcckpt_{args.ranks}to{args.to_ranks}", "hpcckpt_NtoM"))
            stats[(key, cache)] = v
    caches = ["cold", "warm"] if cold_ok else ["warm"]
    primary = caches[0]

    flat = {"size_mib": args.size_mib, "tensors": args.tensors, "layout": args.layout,
            "tensor_shape": list(state_shapes(args.size_mib, args.tensors, args.layout)[0]), "ranks": args.ranks, "to_ranks": args.to_ranks,
            "repeats": args.repeats, "cache": primary, "cold_method": args.cold_method if cold_ok else "none",
            "cold_note": cold_note, "quick": args.quick, "wall_s": round(elapsed, 1)}
    flat.update({k: round(v, 4) for k, v in save["write"].items()})
    for key, out_key, _ in LABELS:
        for cache in caches:
            s = stats.get((key, cache))
            if s is None:
                continue
            flat[f"{out_key}_{cache}_s"] = round(s["seconds"], 4)
            flat[f"{out_key}_{cache}_all_s"] = s["all_seconds"]
            flat[f"{out_key}_{cache}_bytes_read_per_rank"] = int(s["bytes_read_per_rank"])
            flat[f"{out_key}_{cache}_disk_read_mib"] = round(s["disk_read_mib"], 1)
            for part in ("read_s", "l1_rewrite_s", "reprotect_s", "load_s", "allgather_s", "place_s", "other_s",
                         "setup_s"):
                if part in s:
                    flat[f"{out_key}_{cache}_{part}"] = round(s[part], 4)
            for part in ("shard_bytes_read", "bytes_received"):  # largest over ranks
                if part in s:
                    flat[f"{out_key}_{cache}_{part}"] = int(s[part])
            if cache == primary:
                flat[f"{out_key}_s"] = round(s["seconds"], 4)
        for cache in caches:
            s = stats.get((key, cache))
            if s is None:
                continue
            for base_key, base_name in (("h5py_all_ranks", "h5py"), ("dcp_load", "dcp")):
                if key.endswith("_Mranks") or key.startswith("hpcckpt_NtoM"):
                    base_key += "_Mranks"
                b = stats.get((base_key, cache))
                if b is not None and key != base_key:
                    flat[f"{out_key}_{cache}_speedup_vs_{base_name}"] = round(b["seconds"] / s["seconds"], 2)
    notes = save["notes"] + (to["notes"] if to else [])
    if notes:
        flat["notes"] = notes

    # -- the table ------------------------------------------------------------------------------
    gib = args.size_mib / 1024
    print(f"\nRestore of a replicated float32 state of {args.size_mib:g} MiB ({args.tensors} tensors of "
          f"{flat['tensor_shape']}, layout {args.layout}), "
          f"N={args.ranks} ranks, M={args.to_ranks}; median of {args.repeats} repeats; {cold_note}")
    print(f"machine: {describe(host)}; load avg at the end {host['loadavg_end']:.1f}")
    head = f"{'approach':52s}" + "".join(f"{c + ' s':>9s}{'GB/s':>7s}{'xh5py':>7s}{'xDCP':>7s}" for c in caches)
    print(head + f"{'MiB read/rank':>14s}{'disk MiB':>10s}")
    for key, out_key, label in LABELS:
        cols = ""
        present = False
        for cache in caches:
            s = stats.get((key, cache))
            if s is None:
                cols += f"{'-':>9s}{'':>7s}{'':>7s}{'':>7s}"
                continue
            present = True
            vh = flat.get(f"{out_key}_{cache}_speedup_vs_h5py")
            vd = flat.get(f"{out_key}_{cache}_speedup_vs_dcp")
            cols += (f"{s['seconds']:9.3f}{gib * 2**30 / 1e9 / s['seconds']:7.2f}"
                     f"{(f'{vh:.2f}' if vh else '-'):>7s}{(f'{vd:.2f}' if vd else '-'):>7s}")
        if not present:
            continue
        s = stats.get((key, caches[0]))
        print(f"{label:52s}{cols}{s['bytes_read_per_rank'] / MiB:14.1f}{s['disk_read_mib']:10.1f}")
    print("  (GB/s: state bytes / time; xh5py, xDCP: the baseline's time / this time on the same rank count "
          "and cache state; MiB read/rank: rchar of the slowest-reading rank; disk MiB: block-layer reads, "
          f"all ranks, {caches[0]} runs)")
    for key, out_key, label in LABELS:
        s = stats.get((key, caches[0]))
        if s is not None and "bytes_received" in s:
            print(f"  {label.split(')')[0]}): shard bytes read {s['shard_bytes_read'] / MiB:.1f} MiB, received over "
                  f"MPI {s['bytes_received'] / MiB:.1f} MiB (largest rank)")
    print("\nhpcckpt breakdown (largest over ranks, median over repeats), seconds:")
    print(f"{'':52s}{'cache':>6s}{'total':>8s}{'read':>8s}{'L1 back':>8s}{'allgath':>8s}{'place':>8s}"
          f"{'other':>8s}{'setup':>8s}")
    for key, out_key, label in LABELS[:3]:
        for cache in caches:
            s = stats.get((key, cache))
            if s is None:
                continue
            print(f"{label:52s}{cache:>6s}{s['seconds']:8.3f}{s['read_s']:8.3f}"
                  f"{s['l1_rewrite_s'] + s['reprotect_s']:8.3f}"
                  f"{s['allgather_s']:8.3f}"
                  f"{s['place_s']:8.3f}{s['other_s']:8.3f}{s['setup_s']:8.3f}")
    print("  (read: read + verify shard bytes (L4 path: the L4 shard, then its L1 copy); L1 back: writing the "
          "L1 copy back from L4 (+ re-protection); allgather: exchange of every tensor; place: copy into the "
          "protected arrays; other: discover/agree/waits/close; setup: Checkpointer() + protect(), in total)")
    w = save["write"]
    print("\nthe one save (informational): " + ", ".join(f"{k} {v:.3f}" for k, v in w.items()))
    for note in notes:
        print("note:", note)
    print(f"wall time {elapsed:.0f} s")
    if args.json:
        write_json(args.json, flat, host)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
