"""jobs/slurm.sbatch under a real Slurm: a 5-node cluster on this machine (tests/slurm/up.sh:
slurmctld, munge and one slurmd per node, each in its own UTS namespace so every node has its
own host name). Jobs are submitted with sbatch and followed with scontrol, nodes are failed
with tests/slurm/fail-node.sh as a crash fails them, and node-local directories are per host
({host} in the template), so a lost node's files are gone with it as on a real cluster. The
failure-domain tests at the end start the cluster again as 8 nodes under two leaf switches.

Needs root and Debian's slurm packages (installed by up.sh with apt-get); skips, saying why,
where they cannot be had.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, final_record, mpi_env, mpiexec_prefix, read_metrics

SLURM = REPO / "tests" / "slurm"
SLURM_RUN = Path("/run/hpcckpt-slurm")  # up.sh's pid files
NODES = 5
STEPS = 2000  # ~1.5 ms each: long enough to fail a node mid-run, short enough for CI
JOB_CONFIG = f"""
[run]
dir = "run"
steps = {STEPS}
log_every = 1000
seed = 5
device = "cpu"
[model]
kind = "mlp"
hidden = [32, 16]
[data]
source = "digits"
batch_size = 32
[eval]
every_steps = 0
[checkpoint]
every_steps = 50
keep_local = 2
keep_pfs = 2
split_threshold_kb = 4
[storage]
pfs_every = 4
[resilience]
levels = ["local", "partner", "erasure", "pfs"]
group_size = 4
parity = 1
[cluster]
simulated_nodes = 0
"""


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


class TestCluster:
    """The one Slurm test cluster of this machine (its daemons, /run/hpcckpt-slurm), in the
    shape the running test needs: NODES plain nodes for most, SWITCHED_NODES under leaf
    switches for the failure-domain tests at the end of this module. The shape changes once,
    and every Slurm test runs in this one module, on one xdist worker, beside the others'
    tests (a module of its own would wait for this one's cluster and then run alone)."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self):
        self.shape = None

    def use(self, nodes: int, env: dict | None = None) -> None:
        """Every node of the shape up, whatever the test before did to them; the cluster
        started again in this shape if it had another."""
        shape = (nodes, (env or {}).get("SWITCH_SIZE"))
        if shape == self.shape:
            ensure_all_nodes_up(nodes, lambda: _run(["bash", str(SLURM / "up.sh"), str(nodes)], timeout=300, env=env))
            return
        if self.shape is not None:
            _run(["bash", str(SLURM / "down.sh")], timeout=120)
        self.shape = None
        up = _run(["bash", str(SLURM / "up.sh"), str(nodes)], timeout=600, env=env)
        if up.returncode != 0:
            if shutil.which("slurmctld") is None:
                pytest.skip(f"Slurm could not be installed here (apt-get): {up.stderr.strip()[-300:]}")
            pytest.fail(f"tests/slurm/up.sh failed:\n{up.stdout}\n{up.stderr}")
        self.shape = shape


@contextlib.contextmanager
def the_test_cluster():
    """This machine's test cluster, held while the block runs (a lock: another process's
    tests that want it wait), then down."""
    if os.geteuid() != 0:
        pytest.skip("a Slurm test cluster needs root (slurmctld, slurmd and munge run as root)")
    with open(CLUSTER_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield TestCluster()
        finally:
            _run(["bash", str(SLURM / "down.sh")], timeout=120)


CLUSTER_LOCK = "/tmp/hpcckpt-test-slurm.lock"


@pytest.fixture(scope="module")
def slurm():
    """The test cluster, held for this module; down at its end."""
    with the_test_cluster() as held:
        yield held


def ensure_all_nodes_up(nodes: int, start_cluster) -> None:
    """All `nodes` nodes idle (or finishing a job) with their slurmd alive: nodes a test failed
    come back with revive.sh, nodes Slurm drained are resumed, and only if that fails is the
    cluster started again (`start_cluster()`, an up.sh run)."""
    # Every node listed and usable, and its slurmd alive (fail-node.sh removes the pid file):
    # an sinfo that did not answer must not pass for a healthy cluster.
    states = dict(line.split()[:2] for line in _run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.splitlines()
                  if len(line.split()) >= 2)
    healthy = all(re.fullmatch(r"(idle|mix|alloc|comp)", states.get(f"n{i}", "missing")) and
                  (SLURM_RUN / f"slurmd-n{i}.pid").exists() for i in range(1, nodes + 1))
    if not healthy and _run(["bash", str(SLURM / "revive.sh"), str(nodes)], timeout=120).returncode != 0:
        up = start_cluster()
        assert up.returncode == 0, up.stdout + up.stderr


@pytest.fixture
def cluster(slurm):
    """Every test starts with all NODES nodes up, whatever the test before did to them."""
    slurm.use(NODES)


def workdir(tmp_path: Path, name: str = "submit") -> Path:
    """A submit directory as a user has one: the job scripts (copied, links resolved) and a config."""
    directory = tmp_path / name
    directory.mkdir()
    shutil.copytree(REPO / "jobs", directory / "jobs", symlinks=False)
    (directory / "job.toml").write_text(JOB_CONFIG)
    return directory


def submit(directory: Path, *sbatch_args: str, **settings) -> int:
    env = mpi_env()
    env.update(HPCCKPT=f"{sys.executable} -m hpcckpt", CONFIG="job.toml", RESTART_DELAY="1", START_TIMEOUT="60",
               LOCAL_SCRATCH=str(directory / "scratch"))
    env.update({k: str(v) for k, v in settings.items()})
    proc = _run(["sbatch", "--parsable", "--output=job-%j.out", *sbatch_args, "jobs/slurm.sbatch"],
                cwd=directory, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def job_info(job: int) -> dict:
    text = _run(["scontrol", "show", "job", "-o", str(job)]).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait_for(job: int, directory: Path, timeout: float = 240, completing_is_done: bool = True) -> tuple[int, str]:
    """(exit code of the job script, its output) once the job has ended; a job still running
    after `timeout` is a hang: cancelled, and the test fails with its output.

    A job whose script has ended is COMPLETING while Slurm releases its nodes, which after a
    failed node takes Slurm up to a minute of resent terminate requests: the script's exit code
    and output are final by then. A requeued job shows COMPLETING too, on its way back to
    PENDING: a test of requeueing waits for the end proper (completing_is_done=False)."""
    ended = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"]
    if completing_is_done:
        ended.append("COMPLETING")
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(job)
        if info.get("JobState") in ended:
            time.sleep(0.5)  # the output file is complete once the batch step is
            return int(info["ExitCode"].split(":")[0]), output(job, directory)
        time.sleep(0.5)
    _run(["scancel", str(job)])
    raise AssertionError(f"job {job} still running after {timeout} s (a hang):\n{output(job, directory)}"
                         f"{cluster_state(job)}")


def job_nodes(job: int) -> list[str]:
    """The job's nodes in Slurm's order (rank r of a --ntasks-per-node=1 job runs on the r-th):
    tests name nodes by what Slurm allocated, not by which nodes they expect it to pick."""
    nodes = _run(["scontrol", "show", "hostnames", job_info(job)["NodeList"]]).stdout.split()
    assert nodes, job_info(job)
    return nodes


def cluster_state(job: int) -> str:
    """Why a job may be waiting: its state and reason, and the nodes Slurm has taken out."""
    info = job_info(job)
    return (f"\n(job {job}: {info.get('JobState')}, reason {info.get('Reason')}; nodes down or drained:\n"
            f"{_run(['sinfo', '-N', '-R']).stdout})")


def output(job: int, directory: Path) -> str:
    path = directory / f"job-{job}.out"
    return path.read_text() if path.exists() else ""


def wait_for_step(directory: Path, job: int, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if int((directory / "run" / "heartbeat").read_text().split()[0]) >= step:
                return
        except (OSError, ValueError, IndexError):
            pass
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), output(job, directory)
        time.sleep(0.1)
    raise AssertionError(f"job {job} did not reach step {step} in {timeout} s:\n{output(job, directory)}"
                         f"{cluster_state(job)}")


def finished_after_one_restart(out: str) -> bool:
    """The job finished on its second attempt, or on its third where the second could not even
    get its step: the restart loop placed it before slurmctld had marked the failed node down
    (the first attempt's ranks saw it gone first), and srun refused the node."""
    if "finished after 2 attempt(s)" in out:
        return True
    return "finished after 3 attempt(s)" in out and \
        "Unable to create step" in out.split("attempt 2 (at most")[1].split("attempt 3 (at most")[0]


def fail_node(node: str, job: int, directory: Path) -> None:
    """Crash `node` (all its processes, slurmd included) and lose its disk: this job's
    node-local directory on that host is deleted."""
    proc = _run(["bash", str(SLURM / "fail-node.sh"), node], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.rmtree(directory / "scratch" / "hpcckpt-root" / str(job) / node, ignore_errors=True)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> str:
    """The weights digest of the job run on 4 nodes without any failure."""
    slurm.use(NODES)
    directory = workdir(tmp_path_factory.mktemp("uninterrupted"))
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1")
    code, out = wait_for(job, directory)
    assert code == 0 and "finished after 1 attempt(s)" in out, out
    return final_record(directory / "run")["weights_digest"]


def test_the_readme_example_trains_the_default_job_on_the_cluster(cluster, tmp_path):
    """README's command as a user types it: jobs/local.toml with real node identity.

    Slurm's pmi2 plugin takes one read() of at most 1024 bytes for a whole PMI-1 request. The
    mpich wheel's UCX netmod sent its address in segmented puts of up to ~1080 characters
    whose length depends on memory contents: some runs hung in MPI_Init. PMI_DEBUG=1 makes
    MPICH print every request it sends, so the test sees the lengths themselves, not only
    whether this run was lucky."""
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=5", "--ntasks-per-node=1", CONFIG="jobs/local.toml",
                 HPCCKPT_CLUSTER_SIMULATED_NODES=0, SPARE_NODES=1, PMI_DEBUG=1)
    code, out = wait_for(job, directory)
    assert code == 0, out
    assert "mpi/pmi2" not in out, out
    requests = re.findall(r"send to fd=\d+ pmi: (cmd=[^\n]*)", out)
    assert len(requests) >= 4 * 5, out  # init, maxes, appnum, kvsname, put: every rank
    assert not [request for request in requests if "-seg-" in request], "segmented PMI-1 puts:\n" + out
    assert max(len(request) + 1 for request in requests) < 1024, out
    assert "uses its ofi netmod (MPIR_CVAR_CH4_NETMOD=ofi)" in out
    assert f"placement: 4 rank(s) on 4 host(s) ({', '.join(job_nodes(job)[:4])})" in out
    assert "finished after 1 attempt(s)" in out


def test_a_bad_config_fails_once_with_exit_code_2(cluster, tmp_path):
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1", TRAIN_ARGS="--set run.steps=-1")
    code, out = wait_for(job, directory)
    assert code == 2, out
    assert "--set run.steps=-1: run.steps: must be > 0, got -1" in out
    assert "attempt 1 failed with exit code 2" in out and "not retrying" in out
    assert "attempt 2" not in out


def test_a_killed_rank_restarts_in_the_same_allocation(cluster, tmp_path, uninterrupted):
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1",
                 TRAIN_ARGS="--inject rank-kill:rank=1:step=1050:phase=snapshot:attempt=1")
    code, out = wait_for(job, directory)
    assert code == 0, out
    assert "injected rank-kill on rank 1" in out and "attempt 1 failed with exit code" in out
    assert "restored version 1000: 4 rank(s) from L1 local" in out
    assert "finished after 2 attempt(s)" in out
    assert final_record(directory / "run")["weights_digest"] == uninterrupted


def test_a_failed_node_without_a_spare_shrinks_the_job(cluster, tmp_path):
    """The unchanged config (erasure groups of 4) goes on with 3 nodes: the groups are fitted
    to them, and the newest version is assembled from the surviving nodes' L1 shards and the
    lost rank's partner copy, not from L4."""
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1")
    wait_for_step(directory, job, 600)
    nodes = job_nodes(job)
    fail_node(nodes[2], job, directory)
    code, out = wait_for(job, directory)
    assert code == 0, out
    assert f"node {nodes[2]} failed or left the allocation and no spare node is left: going on without it" in out
    assert f"next attempt on 3 node(s): {nodes[0]} {nodes[1]} {nodes[3]}" in out
    assert "hpcckpt train: 3 ranks on 3 node(s)" in out
    assert "erasure groups of 3+ ranks with parity 1 instead" in out
    assert re.search(r"restored version \d+ \(written by 4 ranks\) onto 3 rank\(s\): old shards 3 from L1 local, "
                     r"1 from L2 partner", out), out
    assert finished_after_one_restart(out), out
    assert final_record(directory / "run")["step"] == STEPS


def test_under_the_ulfm_launcher_a_spare_rank_takes_a_killed_rank_s_place_and_a_failed_node_is_relaunched(
        cluster, tmp_path, uninterrupted):
    """LAUNCHER=ulfm: Open MPI's mpiexec with fault tolerance starts the ranks inside the
    allocation instead of srun; SPARE_RANKS=1 starts one more, idle, on the spare node. A rank
    killed on its node costs no relaunch: the spare takes its place in the same attempt, handed
    the step the survivors hold (the trainer's state is all replicated), and the run ends on 4
    ranks on the failure-free weights. A failed node ends the job (Open MPI's runtime cannot
    survive its lost daemon), and the loop relaunches it with the spare node in the lost one's
    place (the spare rank beside the last node's ranks): 4 ranks restore the newest version
    from the nodes' L1 and the lost rank's partner copy or parity, and end on the same
    weights."""
    ulfm = {"LAUNCHER": "ulfm", "ULFM_MPIEXEC": f"{sys.executable} -m hpcckpt.cluster.ulfm_mpiexec",
            "SPARE_NODES": "1", "SPARE_RANKS": "1"}
    killed = workdir(tmp_path, "killed")
    job = submit(killed, "--nodes=5", "--ntasks-per-node=1",
                 TRAIN_ARGS="--inject rank-kill:rank=1:step=1050:attempt=1", **ulfm)
    code, out = wait_for(job, killed)
    nodes = job_nodes(job)
    assert code == 0, out
    assert f"placement: 4 rank(s) on 4 host(s) ({', '.join(nodes[:4])})" in out, out
    assert f"1 spare rank(s) on {nodes[4]}" in out, out
    assert "rank(s) 1 of 4 died; spare(s) took place(s) 1: going on in the job on 4 rank(s), 0 spare(s) left" in out
    assert "went on from step 1050, held in memory by the 3 survivor(s) and handed to 1 spare(s)" in out, out
    assert "finished after 1 attempt(s)" in out, out
    assert final_record(killed / "run")["weights_digest"] == uninterrupted

    lost = workdir(tmp_path, "lost")
    job = submit(lost, "--nodes=5", "--ntasks-per-node=1", **ulfm)
    wait_for_step(lost, job, 600)
    nodes = job_nodes(job)
    failed_at = time.time()
    fail_node(nodes[2], job, lost)
    reached = int((lost / "run" / "heartbeat").read_text().split()[0])
    wait_for_step(lost, job, reached + 1, timeout=240)
    print(f"a failed node under LAUNCHER=ulfm with a spare node: {time.time() - failed_at:.1f} s from the failure to "
          f"the next step after step {reached}")
    code, out = wait_for(job, lost)
    assert code == 0, out
    assert "attempt 1 failed with exit code" in out, out
    assert f"node {nodes[2]} failed or left the allocation: spare node {nodes[4]} takes its place" in out, out
    assert f"1 spare rank(s) on {nodes[3]}" in out, out
    assert re.search(r"restored version \d+: 3 rank\(s\) from L1 local, 1 rank\(s\) from (L2 partner|L3 erasure)",
                     out), out
    assert re.search(r"finished after [23] attempt\(s\)", out), out
    assert final_record(lost / "run")["weights_digest"] == uninterrupted


def test_under_the_ulfm_launcher_a_rank_dead_before_mpi_start_up_costs_a_few_start_ups(cluster, tmp_path):
    """A rank that dies before MPI_Init leaves the others there for good under ULFM: the loop,
    having seen one attempt of the job through start-up, stops that attempt after a few times
    its start-up (START_TIMEOUT_MIN here 2 s) and starts the next, on the same nodes."""
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1", LAUNCHER="ulfm",
                 ULFM_MPIEXEC=f"{sys.executable} -m hpcckpt.cluster.ulfm_mpiexec", START_TIMEOUT="200",
                 START_TIMEOUT_MIN="2",
                 APP=f"{sys.executable} {REPO / 'tests' / 'scripts' / 'start_up_death.py'} --nodes 0")
    code, out = wait_for(job, directory)
    assert code == 0, out
    stopped = re.search(r"attempt 2 did not get through MPI start-up in (\d+) s \(its longest so far took (\d+) s", out)
    assert stopped and int(stopped.group(1)) < 60, out
    assert "finished after 3 attempt(s)" in out, out
    assert out.count("attempt 3 rank") == 4, out


def test_a_failed_node_without_a_spare_stops_the_job_with_allow_shrink_0(cluster, tmp_path):
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1", ALLOW_SHRINK=0)
    wait_for_step(directory, job, 600)
    lost = job_nodes(job)[2]
    fail_node(lost, job, directory)
    code, out = wait_for(job, directory, timeout=120)
    assert code != 0, out
    assert f"node {lost} failed or left the allocation, no spare node is left and ALLOW_SHRINK=0: stopping" in out
    assert "attempt 2" not in out


def test_the_time_limit_signal_stops_cleanly_and_a_resubmitted_job_resumes_there(cluster, tmp_path):
    directory = workdir(tmp_path)
    assert "#SBATCH --signal=B:USR1@300" in (directory / "jobs" / "slurm.sbatch").read_text()
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1", TRAIN_ARGS=f"--set run.steps={10 * STEPS}")
    wait_for_step(directory, job, 500)
    # What Slurm sends at --signal=B:USR1@N before the time limit: USR1 to the batch shell.
    assert _run(["scancel", "--signal=USR1", "--batch", str(job)]).returncode == 0
    code, out = wait_for(job, directory)
    assert code == 0, out
    assert "got SIGUSR1: asking the job to checkpoint, drain to the PFS and stop" in out
    assert "stopped cleanly after step" in out
    assert "stopped cleanly after a final checkpoint on the PFS; submit the job again to continue" in out
    halted = [r for r in read_metrics(directory / "run") if r.get("event") == "halted"][-1]
    stop = halted["step"]
    assert (directory / "run" / "pfs" / f"v{stop:012d}" / "manifest.json").is_file()
    # The next job has new node-local directories (another job id): it resumes from L4.
    again = submit(directory, "--nodes=4", "--ntasks-per-node=1", TRAIN_ARGS=f"--set run.steps={stop + 100}")
    code, out = wait_for(again, directory)
    assert code == 0, out
    assert f"restored version {stop}: 4 rank(s) from L4 pfs" in out
    assert final_record(directory / "run")["step"] == stop + 100


CLICKS_STEPS = 1000
CLICKS_CONFIG = JOB_CONFIG.replace(f"steps = {STEPS}", f"steps = {CLICKS_STEPS}").replace(
    'kind = "mlp"', 'kind = "embedding"\nembedding_dim = 8').replace(
    'source = "digits"', 'source = "clicks"\nsamples = 3000\nfeatures = 4\nfields = 6\nvocabulary = 4000').replace(
    "split_threshold_kb = 4", "split_threshold_kb = 4\ntable_full_every = 4")


def test_the_embedding_model_loses_a_node_and_ends_bit_identical_on_a_spare(cluster, tmp_path):
    """A failed node replaced by a spare node, with keyed tables under the real scheduler:
    the embedding model (rows placed by id hash, saved whole and as deltas) loses a node
    mid-run; the spare node takes its place in rank order (every other rank stays with its
    files), the newest version and its tables' chain come back from the node-local levels, and
    the run ends on the weights and table of a run without the failure."""
    straight = workdir(tmp_path, "straight")
    (straight / "job.toml").write_text(CLICKS_CONFIG)
    code, out = wait_for(submit(straight, "--nodes=4", "--ntasks-per-node=1"), straight)
    assert code == 0, out
    reference = final_record(straight / "run")
    directory = workdir(tmp_path)
    (directory / "job.toml").write_text(CLICKS_CONFIG)
    job = submit(directory, "--nodes=5", "--ntasks-per-node=1", SPARE_NODES=1)
    wait_for_step(directory, job, 300)
    nodes = job_nodes(job)
    fail_node(nodes[2], job, directory)
    code, out = wait_for(job, directory)
    assert code == 0, out
    assert f"running on {' '.join(nodes[:4])}; spare node(s): {nodes[4]}" in out
    assert f"node {nodes[2]} failed or left the allocation: spare node {nodes[4]} takes its place" in out
    assert f"next attempt on 4 node(s): {nodes[0]} {nodes[1]} {nodes[4]} {nodes[3]}" in out
    assert re.search(r"restored version \d+: 3 rank\(s\) from L1 local, 1 rank\(s\) from (L2 partner|L3 erasure)",
                     out), out
    assert finished_after_one_restart(out), out
    scratch = directory / "scratch" / "hpcckpt-root" / str(job)
    assert sorted(p.name for p in scratch.iterdir()) == sorted(set(nodes) - {nodes[2]})
    logs = "".join(p.read_text() for p in (directory / "run" / "log").glob("rank*.log"))
    assert re.search(r"tables restored from \d version\(s\) of their chain", logs)
    final = final_record(directory / "run")
    assert final["step"] == CLICKS_STEPS
    assert (final["weights_digest"], final["table_digest"]) == (reference["weights_digest"], reference["table_digest"])


HEAT2D = REPO / "examples" / "heat2d.py"
HEAT2D_ARGS = "--run-dir run --shape 200 200 --iterations 2500 --tol 0 --every 100 --dump grids"


@pytest.fixture(scope="module")
def heat2d_uninterrupted(tmp_path_factory) -> Path:
    """The final grid of heat2d run straight through (4 ranks, mpiexec on this machine: the
    grid is bit-identical whatever the rank count and placement)."""
    directory = tmp_path_factory.mktemp("heat2d-straight")
    command = [*mpiexec_prefix(), "-n", "4", sys.executable, str(HEAT2D), *HEAT2D_ARGS.split(), "--nodes", "4"]
    proc = _run(command, cwd=directory, env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return directory / "grids" / "final.npy"


def test_an_application_survives_a_failed_node_on_the_nodes_that_are_left(cluster, tmp_path, heat2d_uninterrupted):
    """APP: heat2d through jobs/slurm.sbatch on 4 real nodes; the third fails mid-run; the loop
    starts it again on the other three, it restores its newest version from the node-local levels
    (the lost rank's shard from its partner copy or an erasure rebuild) and ends on the same grid."""
    import numpy as np

    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1",
                 APP=f"{sys.executable} {HEAT2D} {HEAT2D_ARGS} --nodes 0")
    wait_for_step(directory, job, 600)
    nodes = job_nodes(job)
    fail_node(nodes[2], job, directory)
    code, out = wait_for(job, directory)
    assert code == 0, out
    assert f"exec -- {sys.executable} {HEAT2D}" in out
    assert f"next attempt on 3 node(s): {nodes[0]} {nodes[1]} {nodes[3]}" in out
    assert re.search(r"restored version \d+ \(written by 4 ranks\) onto 3 rank\(s\): old shards 3 from L1 local, "
                     r"1 from (L2 partner|L3 erasure)", out), out
    assert finished_after_one_restart(out), out
    final = np.load(directory / "grids" / "final.npy")
    assert final.tobytes() == np.load(heat2d_uninterrupted).tobytes()


def test_a_bad_application_argument_is_not_retried(cluster, tmp_path):
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1",
                 APP=f"{sys.executable} {HEAT2D} --run-dir run --nodes 0 --shape 200")
    code, out = wait_for(job, directory)
    assert code == 2, out
    assert "argument --shape: expected 2 arguments" in out
    assert "attempt 1 failed with exit code 2" in out and "not retrying" in out and "attempt 2" not in out


def test_a_second_job_on_a_running_run_is_refused(cluster, tmp_path):
    directory = workdir(tmp_path)
    first = submit(directory, "--nodes=4", "--ntasks-per-node=1", TRAIN_ARGS=f"--set run.steps={10 * STEPS}")
    wait_for_step(directory, first, 300)
    second = submit(directory, "--nodes=4", "--ntasks-per-node=1")
    code, out = wait_for(second, directory)
    assert code == 2, out
    assert re.search(rf"run.dir '.*run' is in use by job {first} \(host {job_info(first)['BatchHost']}", out), out
    assert "attempt 2" not in out
    # The first job never noticed: it stops cleanly when asked, with its checkpoints intact.
    assert job_info(first).get("JobState") == "RUNNING"
    _run(["scancel", "--signal=USR1", "--batch", str(first)])
    code, out = wait_for(first, directory)
    assert code == 0 and "stopped cleanly after a final checkpoint on the PFS" in out, out


def test_real_nodes_hold_their_own_files_and_redundancy_spans_hosts(cluster, tmp_path):
    directory = workdir(tmp_path)
    job = submit(directory, "--nodes=4", "--ntasks-per-node=1", TRAIN_ARGS="--set run.steps=500")
    code, out = wait_for(job, directory)
    assert code == 0, out
    nodes = job_nodes(job)
    assert (f"placement: 4 rank(s) on 4 host(s) ({', '.join(nodes)}); L2 partner copies on another node for 4 of 4 "
            "rank(s); L3 1 erasure group(s), each across 4+ node(s)") in out
    scratch = directory / "scratch" / "hpcckpt-root" / str(job)
    for rank in range(4):
        host = nodes[rank]
        line = next(line for line in (directory / "run" / "log" / f"rank{rank}.log").read_text().splitlines()
                    if "placement: node-local" in line)
        run_subdir = "run-" + json.loads((directory / "run" / "run.json").read_text())["run_id"]
        assert f"node-local directory {scratch / host / run_subdir} on host {host}" in line, line
        partner = (rank + 1) % 4
        assert f"L2 partner copy on rank {partner} (host {nodes[partner]})" in line, line
        assert f"L3 erasure group [0, 1, 2, 3] on {[f'host {node}' for node in nodes]}" in line, line
        # Each host's directory holds its rank's shards, the replica it keeps for its left
        # neighbour, and its parity: nothing of any other rank.
        version = sorted(p for p in (scratch / host / run_subdir).iterdir() if p.name.startswith("v"))[-1]
        names = sorted(p.name for p in version.iterdir())
        source = (rank - 1) % 4
        assert names == sorted([f"commit-r{rank:05d}.json", f"parity-r{rank:05d}.hck", f"shard-r{rank:05d}.hck",
                                f"replica-of-r{source:05d}-held-by-r{rank:05d}.hck"]), names


# --- Failure domains: SWITCHED_NODES nodes under 2 leaf switches of SWITCH_SIZE (up.sh with
# SWITCH_SIZE and topology/tree, so every task gets SLURM_TOPOLOGY_ADDR), jobs/slurm.sbatch
# running examples/heat2d.py (its grid is bit-identical whatever the rank count, so a run that
# ends on the uninterrupted grid restored exactly what was saved).
# - A whole switch fails (its nodes, with their disks): with L2 partners placed in the other
#   switch the job goes on on the nodes left from L1/L2 alone (placement by node only loses
#   those copies with the switch: tests/test_failure_domains_mpi.py shows it on simulated nodes).
# - The node running the batch script fails: a guard job on another node requeues the job,
#   which restarts under the same job id from what the surviving nodes and L4 hold.

SWITCHED_NODES, SWITCH_SIZE = 8, 4
SWITCHED_HEAT2D_ARGS = ("--run-dir run --shape 160 160 --iterations 2000 --tol 0 --every 100 --dump grids "
                        "--set resilience.group_size=4 --set resilience.parity=1")


def _switches_env() -> dict:
    return dict(os.environ, SWITCH_SIZE=str(SWITCH_SIZE), CRED_EXPIRE="10")


@pytest.fixture
def switched_cluster(slurm):
    """SWITCHED_NODES nodes under two leaf switches, every one up."""
    slurm.use(SWITCHED_NODES, _switches_env())


@pytest.fixture(scope="module")
def heat2d_straight_on_two(tmp_path_factory) -> Path:
    """heat2d's final grid on the switched jobs' grid, run straight through (mpiexec here, 2 ranks)."""
    directory = tmp_path_factory.mktemp("heat2d-straight")
    command = [*mpiexec_prefix(), "-n", "2", sys.executable, str(HEAT2D), *SWITCHED_HEAT2D_ARGS.split(),
               "--nodes", "2"]
    proc = _run(command, cwd=directory, env=mpi_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return directory / "grids" / "final.npy"


def heat2d_job(directory: Path, *sbatch_args: str, **settings) -> int:
    return submit(directory, *sbatch_args, "--ntasks-per-node=1",
                  APP=f"{sys.executable} {HEAT2D} {SWITCHED_HEAT2D_ARGS} --nodes 0", **settings)


def lose_switch(job: int, directory: Path, nodes) -> None:
    """All the switch's nodes at once, as its failure takes them, with their disks."""
    failing = [subprocess.Popen(["bash", str(SLURM / "fail-node.sh"), node], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for node in nodes]
    for proc in failing:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    for node in nodes:
        shutil.rmtree(directory / "scratch" / "hpcckpt-root" / str(job) / node, ignore_errors=True)


def same_grid(directory: Path, straight: Path) -> bool:
    import numpy as np

    return np.load(directory / "grids" / "final.npy").tobytes() == np.load(straight).tobytes()


def test_a_lost_switch_is_restored_from_partners_in_the_other_switch(switched_cluster, tmp_path,
                                                                    heat2d_straight_on_two):
    directory = workdir(tmp_path)
    job = heat2d_job(directory, "--nodes=8")
    wait_for_step(directory, job, 600)
    lose_switch(job, directory, ["n5", "n6", "n7", "n8"])
    code, out = wait_for(job, directory, timeout=300)
    assert code == 0, out
    assert "failure domains: 2 (top.s1 (4 node(s)), top.s2 (4 node(s))), L2 partner copies in another domain for " \
           "8 of 8 rank(s)" in out, out
    # Groups of 4 from two switches of 4 cannot keep a switch to parity 1: said, naming them.
    assert "L3 erasure groups of 4+ ranks with parity 1 cannot keep each failure domain to 1 member(s)" in out
    # Where an attempt is placed while slurmctld has marked only some of the switch's nodes
    # down is Slurm's timing; an attempt placed on a failed node cannot start and the loop
    # places the next one again. The attempt that finished ran on the other switch alone: on
    # all of it, unless Slurm also drained some of its nodes (a loaded machine: "Kill task
    # failed" when a step's ranks do not end in time), and then on what it left.
    placements = re.findall(r"next attempt on \d+ node\(s\): ([^\n]*)", out)
    last = placements[-1].split() if placements else []
    assert last and set(last) <= {"n1", "n2", "n3", "n4"}, out
    restored = re.findall(r"restored version \d+ \(written by 8 ranks\) onto (\d+) rank\(s\): old shards ([^\n]*)",
                          out)
    assert restored and int(restored[-1][0]) == len(last), out
    assert "failure domain(s) lost whole: top.s2" in restored[-1][1], out
    if len(last) == 4:  # the whole surviving switch: its partner copies hold the lost switch's shards
        assert "L4" not in restored[-1][1] and "4 from L2 partner" in restored[-1][1], out
    attempts = re.search(r"finished after (\d+) attempt\(s\)", out)
    assert attempts and int(attempts.group(1)) >= 2, out
    assert same_grid(directory, heat2d_straight_on_two)


def test_a_failed_batch_node_requeues_the_job_which_restarts_from_what_survived(switched_cluster, tmp_path,
                                                                               heat2d_straight_on_two):
    directory = workdir(tmp_path)
    job = heat2d_job(directory, "--nodes=4", GUARD_INTERVAL=1)
    wait_for_step(directory, job, 600)
    # Which of the 8 nodes Slurm gives a 4-node job is its choice: the one running the batch
    # script is the one to fail.
    batch_host = job_info(job)["BatchHost"]
    fail_node(batch_host, job, directory)
    code, out = wait_for(job, directory, timeout=300, completing_is_done=False)
    assert code == 0, out
    assert re.search(rf"guard job \d+ watches the batch node {batch_host} from another node: if it fails, this job is "
                     "requeued", out), out
    assert f"the node running the batch script ({batch_host}) failed: requeueing job {job}" in out
    assert "requeued (1 time(s)): restarting from the surviving checkpoint levels" in out
    # Where the requeued job runs is Slurm's choice (topology/tree prefers one whole switch):
    # the surviving nodes' files, or L4 where it got other nodes.
    assert re.search(r"restored version \d+", out), out
    assert job_info(job)["BatchHost"] != batch_host
    assert same_grid(directory, heat2d_straight_on_two)
