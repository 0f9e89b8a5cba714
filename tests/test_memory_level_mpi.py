"""Node-local versions kept in memory first (storage.memory_dir), within a budget, spilling to
the node's disk: on real ranks, with crashes and node losses."""

import re
import shutil
import uuid
from pathlib import Path

import pytest
from conftest import assert_ok, final_record, read_metrics, run_mpi, small_job

STEPS = 30


def memory_job(tmp_path, memory_dir: str | None, **sections):
    storage = {"pfs_every": 2}
    if memory_dir is not None:
        storage["memory_dir"] = memory_dir
    base = dict(
        run={"steps": STEPS, "log_every": 5},
        checkpoint={"every_steps": 5, "keep_local": 2, "keep_pfs": 3, "split_threshold_kb": 4},
        storage=storage,
        resilience={"levels": ["local", "partner", "pfs"]},
        cluster={"simulated_nodes": 4},
    )
    for key, values in sections.items():
        base.setdefault(key, {}).update(values)
    return small_job(tmp_path, **base)


def train(tmp_path, job, n=4, *extra):
    return run_mpi(n, ["train", "-c", str(job), *extra], cwd=tmp_path)


def run_dirs(base: Path) -> list[Path]:
    """The run's own directories (run-<id>) under each node's directory of a template base."""
    return sorted(base.glob("node*/run-*"))


def versions_in(base: Path) -> set[int]:
    return {int(v.name[1:]) for d in run_dirs(base) for v in d.glob("v[0-9]*") if v.is_dir()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run without failures and without a memory directory: the weights it ends on."""
    tmp_path = tmp_path_factory.mktemp("reference")
    assert_ok(train(tmp_path, memory_job(tmp_path, None)))
    return final_record(tmp_path / "run")["weights_digest"]


def test_versions_live_in_memory_and_a_crashed_rank_restarts_from_there(tmp_path, reference):
    memory = tmp_path / "mem"
    job = memory_job(tmp_path, str(memory / "node{node}"), storage={"memory_budget_mb": 64})
    crashed = train(tmp_path, job, 4, "--inject", "rank-kill:rank=2:step=17")
    assert crashed.returncode != 0
    # Every version so far went to memory (10 is whole for certain: the snapshot of 15 waited
    # for it); the disk's node directories hold none.
    assert 10 in versions_in(memory)
    assert versions_in(tmp_path / "run" / "local") == set()
    placed = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "version_placed"]
    assert placed and all(r["in_memory"] for r in placed)
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    assert re.search(r"restored version (10|15)\b.*L1", resumed.stdout), resumed.stdout
    assert "node-local versions in memory first: " in resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference
    assert versions_in(tmp_path / "run" / "local") == set()


def test_a_lost_node_takes_its_memory_and_the_partner_copies_restore_it(tmp_path, reference):
    memory = tmp_path / "mem"
    job = memory_job(tmp_path, str(memory / "node{node}"), storage={"memory_budget_mb": 64})
    crashed = train(tmp_path, job, 4, "--inject", "node-loss:node=1:step=17")
    assert crashed.returncode != 0
    assert not list((memory / "node1").glob("run-*/v*")), "the lost node's memory survived it"
    assert 10 in versions_in(memory)  # on the nodes that are left
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    restored = re.search(r"restored version (\d+)\b(.*)", resumed.stdout)
    assert restored, resumed.stdout
    # Version 15, or 10 where the node died in 15's write; L2 supplies the lost node's shard
    # (or L4, where a version the node-local write could not finish went to L4 instead).
    assert restored.group(1) in ("10", "15") and re.search(r"L2|L4", restored.group(2)), resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference


def test_versions_over_the_budget_go_to_the_disk_and_come_back_when_there_is_room(tmp_path, reference):
    memory = tmp_path / "mem"
    # Room for about one version per node: the next spills to the disk until retention frees memory.
    # (Without L4, so that a finished run keeps its versions in memory to be measured.)
    probe = memory_job(tmp_path, str(memory / "node{node}"), run={"steps": 5}, storage={"memory_budget_mb": 64},
                       resilience={"levels": ["local", "partner"]})
    assert_ok(train(tmp_path, probe))
    one_version = max(sum(p.stat().st_blocks * 512 for p in v.rglob("*")) + 4096
                      for d in run_dirs(memory) for v in d.glob("v[0-9]*"))
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(memory)
    budget_mb = 1.5 * one_version / 1e6
    job = memory_job(tmp_path, str(memory / "node{node}"), storage={"memory_budget_mb": budget_mb})
    crashed = train(tmp_path, job, 4, "--inject", "rank-kill:rank=1:step=27")
    assert crashed.returncode != 0
    placed = {r["step"]: r["in_memory"] for r in read_metrics(tmp_path / "run") if r.get("event") == "version_placed"}
    assert set(placed.values()) == {True, False}, placed
    assert "does not fit the memory budget" in crashed.stdout + crashed.stderr + "".join(
        p.read_text() for p in (tmp_path / "run" / "log").glob("rank*.log"))
    # Each version kept is where its placement said, in one place only.
    in_memory, on_disk = versions_in(memory), versions_in(tmp_path / "run" / "local")
    assert not in_memory & on_disk
    for step in in_memory | on_disk:
        assert (step in in_memory) == placed[step], (step, placed)
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    assert re.search(r"restored version (20|25)\b.*L1", resumed.stdout), resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference


def test_dev_shm_is_taken_for_memory_and_named_so(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    base = shm / f"hpcckpt-test-{uuid.uuid4().hex[:12]}"
    try:
        job = memory_job(tmp_path, str(base / "node{node}"), run={"steps": 10})
        done = train(tmp_path, job)
        assert_ok(done)
        line = next(line for line in done.stdout.splitlines() if "node-local versions in memory first" in line)
        assert "(tmpfs)" in line and "not in memory" not in line, line
        placed = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "version_placed"]
        assert [r["step"] for r in placed if r["in_memory"]] == [5, 10]
        # Finished, with its newest version on L4: nothing of the run holds RAM any more.
        assert versions_in(base) == set() and not run_dirs(base)
        assert versions_in(tmp_path / "run" / "local") == set()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_memory_directory_that_is_the_local_directory_is_refused(tmp_path):
    job = memory_job(tmp_path, "{run_dir}/local/node{node}")
    refused = train(tmp_path, job, 2)
    assert refused.returncode == 2
    assert "storage.memory_dir is storage.local_dir" in refused.stderr + refused.stdout
    assert not (tmp_path / "run" / "local").exists()
