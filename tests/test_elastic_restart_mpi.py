"""Restart after node loss on the nodes that are left (and onto more): the version is
assembled from the old job's shards wherever they survived (L1 on the surviving nodes, L2
replicas, L3 rebuilds), L4 only for what no node-local level holds, on real mpiexec ranks.

Node 3 of 4 is lost inside the snapshot of step 50: version 40 is committed everywhere (the
snapshot waited for its persist), version 50 was never started, and L4 (every 3rd
checkpoint) holds only version 30.
"""

import json
import re
import shutil

import h5py
import numpy as np
import pytest
from conftest import assert_ok, node_local, read_metrics, run_mpi, small_job

ALL_LEVELS = ["local", "partner", "erasure", "pfs"]


def job(tmp_path, levels=ALL_LEVELS, nodes=4, chunk_bytes=None):
    chunks = {"chunk_mib": chunk_bytes / (1 << 20)} if chunk_bytes else {}
    return small_job(
        tmp_path,
        run={"steps": 60, "log_every": 20},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 10, "keep_local": 2, "split_threshold_kb": 2, **chunks},
        storage={"pfs_every": 3},
        resilience={"levels": levels, "group_size": 4, "parity": 2},
        cluster={"simulated_nodes": nodes},
    )


def train(tmp_path, config, ranks, nodes, *extra):
    return run_mpi(ranks, ["train", "-c", str(config), "--set", f"cluster.simulated_nodes={nodes}", *extra],
                   cwd=tmp_path, timeout=240)


def lose_node_3_before_l4_has_40(tmp_path, config, ranks=4):
    crashed = train(tmp_path, config, ranks, 4, "--inject", "node-loss:node=3:step=50:phase=snapshot")
    assert crashed.returncode != 0
    assert not (tmp_path / "run" / "local" / "node3").exists()
    if '"pfs"' in config.read_text():
        assert sorted(p.name for p in (tmp_path / "run" / "pfs").glob("v*")) == ["v000000000030"]


def exported(tmp_path, config, step: int) -> dict:
    out = tmp_path / f"v{step}-{len(list(tmp_path.glob('*.h5')))}.h5"
    assert_ok(run_mpi(1, ["export", "-c", str(config), "--version", str(step), "-o", str(out)], cwd=tmp_path))
    tensors = {}
    with h5py.File(out) as f:
        f.visititems(lambda name, obj: tensors.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return tensors


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def restart_assembles_40(tmp_path, config, ranks, nodes, message, expected) -> None:
    """A restart on `ranks` ranks of `nodes` nodes, run to step 40, says `message`, and its
    version 40 then exports as `expected`, byte for byte."""
    resumed = train(tmp_path, config, ranks, nodes, "--set", "run.steps=40")
    assert_ok(resumed)
    assert message in resumed.stdout, resumed.stdout
    assert_same_tensors(exported(tmp_path, config, 40), expected)


@pytest.fixture(scope="module")
def saved_40(tmp_path_factory):
    """Version 40 as the uninterrupted 4-rank job saved it, exported."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    config = job(tmp_path)
    assert_ok(train(tmp_path, config, 4, 4, "--set", "checkpoint.keep_local=10"))
    return exported(tmp_path, config, 40)


@pytest.mark.parametrize("levels, from_redundancy, chunk_bytes", [
    (ALL_LEVELS, "1 from L2 partner", None),
    (["local", "erasure"], "1 from L3 erasure", None),
    # The rebuild's rounds (and every L2/L3 transfer) in 997-byte chunks, which divide
    # neither a shard nor a segment: the same bytes.
    (["local", "erasure"], "1 from L3 erasure", 997),
])
def test_four_ranks_shrink_to_three_from_node_local_levels(tmp_path, saved_40, levels, from_redundancy, chunk_bytes):
    config = job(tmp_path, levels, chunk_bytes=chunk_bytes)
    lose_node_3_before_l4_has_40(tmp_path, config)
    # inspect and verify see what the restart will do: version 40 is whole on no level, yet
    # assembled from the surviving nodes, onto any rank count.
    listing = run_mpi(1, ["inspect", "-c", str(config), "--json"], cwd=tmp_path)
    assert_ok(listing)
    v40 = next(v for v in json.loads(listing.stdout) if v["step"] == 40)
    assert (v40["levels"], v40["assembled_from"], v40["restart_ranks"]) == \
        ([], f"3 from L1 local, {from_redundancy}", "any")
    verify = run_mpi(1, ["verify", "-c", str(config)], cwd=tmp_path)
    assert_ok(verify)
    assert f"local version 40: not every rank's copy is reachable here (a lost node); a restart assembles it: " \
           f"old shards 3 from L1 local, {from_redundancy}" in verify.stdout
    # The unchanged config: group_size 4 is a target, fitted to 3 nodes with one warning.
    resumed = train(tmp_path, config, 3, 3, "--set", "run.steps=40")
    assert_ok(resumed)
    out = resumed.stdout + resumed.stderr
    assert "erasure groups of 3+ ranks with parity 2 instead" in out
    assert f"restored version 40 (written by 4 ranks) onto 3 rank(s): old shards 3 from L1 local, {from_redundancy}" \
        in resumed.stdout, out
    assert "protected again" in resumed.stdout
    assert_same_tensors(exported(tmp_path, config, 40), saved_40)
    finished = train(tmp_path, config, 3, 3)
    assert_ok(finished)
    assert "restored version 40 (written by 3 ranks) onto 3 rank(s)" not in finished.stdout  # same geometry now
    assert "restored version 40: 3 rank(s) from L1 local" in finished.stdout
    report = run_mpi(1, ["report", "-c", str(config)], cwd=tmp_path)
    assert_ok(report)
    level = from_redundancy.split(" from ")[1]
    assert f"resumed from step 40 (3 rank(s) from L1 local, 1 rank(s) from {level}) written by 4 ranks, onto 3; " \
           f"rebuilt: old rank 3: {level}" in report.stdout, report.stdout


def test_eight_ranks_on_four_nodes_shrink_to_six_on_three(tmp_path):
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    assert_ok(train(reference, job(reference), 8, 4, "--set", "checkpoint.keep_local=10", "--set", "run.steps=40"))
    saved_40 = exported(reference, job(reference), 40)
    config = job(tmp_path)
    lose_node_3_before_l4_has_40(tmp_path, config, ranks=8)
    restart_assembles_40(tmp_path, config, 6, 3, "restored version 40 (written by 8 ranks) onto 6 rank(s): old shards "
                         "6 from L1 local, 2 from L2 partner", saved_40)


def test_fewer_ranks_per_node_than_the_writer_read_every_record_left_on_a_node(tmp_path):
    # 8 ranks on 4 nodes wrote version 40 (L1 + L2, nothing on L4); node 3 is lost; 3 ranks go
    # on on the 3 nodes left. Each node's directory holds two old ranks' commit records, but
    # one new rank reads it: that rank reads both, or old ranks' shards go unlisted.
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    levels = ["local", "partner"]
    assert_ok(train(reference, job(reference, levels), 8, 4, "--set", "checkpoint.keep_local=10", "--set",
                    "run.steps=40"))
    saved_40 = exported(reference, job(reference, levels), 40)
    config = job(tmp_path, levels)
    lose_node_3_before_l4_has_40(tmp_path, config, ranks=8)
    restart_assembles_40(tmp_path, config, 3, 3, "restored version 40 (written by 8 ranks) onto 3 rank(s): old shards "
                         "6 from L1 local, 2 from L2 partner", saved_40)


def test_two_ranks_grow_to_four_from_node_local_levels(tmp_path):
    config = job(tmp_path, nodes=2)
    assert_ok(train(tmp_path, config, 2, 2, "--set", "run.steps=40", "--set", "storage.pfs_every=100"))
    before = exported(tmp_path, config, 40)
    shutil.rmtree(tmp_path / "run" / "pfs")  # node-local levels alone must do
    restart_assembles_40(tmp_path, config, 4, 4, "restored version 40 (written by 2 ranks) onto 4 rank(s): old shards "
                         "2 from L1 local", before)


def test_a_second_loss_right_after_a_shrink_is_survived(tmp_path, saved_40):
    config = job(tmp_path, ["local", "partner"])
    lose_node_3_before_l4_has_40(tmp_path, config)
    assert_ok(train(tmp_path, config, 3, 3, "--set", "run.steps=40"))
    # Version 40 was written again for 3 ranks: losing another node before any new
    # checkpoint is survived by its new partner copies.
    shutil.rmtree(tmp_path / "run" / "local" / "node2")
    restart_assembles_40(tmp_path, config, 2, 2, "restored version 40 (written by 3 ranks) onto 2 rank(s): old shards "
                         "2 from L1 local, 1 from L2 partner", saved_40)


def test_the_version_written_again_behind_the_resumed_steps_is_the_restored_one(tmp_path, saved_40):
    """The write under the new geometry runs behind the resumed run's steps (its partner
    store slowed by 2 s so that steps 41-49 change the arrays meanwhile); the next snapshot
    waits for it, and the job dies in that checkpoint's L1 write. What the new partner copies
    hold is version 40 as restored, not the arrays the steps changed nor the next snapshot:
    another loss then restores it byte for byte."""
    config = job(tmp_path, ["local", "partner"])
    lose_node_3_before_l4_has_40(tmp_path, config)
    crashed = train(tmp_path, config, 3, 3, "--inject", "slow-level:level=partner:seconds=2:step=40:until=40",
                    "--inject", "rank-kill:rank=1:step=50:phase=local")
    assert crashed.returncode != 0
    assert "injected rank-kill on rank 1 (node 1) at step 50 in phase local" in crashed.stderr
    assert "version 40 protected again on local, partner" in crashed.stdout, crashed.stdout
    # Steps 41-49 ran while the version was written: the snapshot of step 50 waited for it.
    log = (tmp_path / "run" / "log" / "rank0.log").read_text()
    assert re.search(r"rank0/3 INFO step 50's snapshot waited \d+\.\d+ s for writing restored version 40 again", log), \
        log[-3000:]
    shutil.rmtree(tmp_path / "run" / "local" / "node2")
    restart_assembles_40(tmp_path, config, 2, 2, "restored version 40 (written by 3 ranks) onto 2 rank(s): old shards "
                         "2 from L1 local, 1 from L2 partner", saved_40)


def test_a_storage_failure_in_the_version_written_again_keeps_the_older_versions_as_the_fallback(tmp_path):
    """The new partner copies of restored version 40 fail (no space) while the first steps
    run, so its write under the new geometry fails on every rank (the node-local stage is
    one), after the old job's copies of 40 gave way. The run is told, as for any checkpoint,
    and that the version is not written again; the old job's older versions stay (they were
    deleted as if the write had worked, and a crash before the next checkpoint then found no
    version at all). The job dies in the next checkpoint's L1 write (step 50's snapshot waited
    for the rewrite): the restart loads version 30 over the old job's shards."""
    config = job(tmp_path, ["local", "partner"])
    lose_node_3_before_l4_has_40(tmp_path, config)
    crashed = train(tmp_path, config, 3, 3, "--inject", "storage-error:level=partner:step=40",
                    "--inject", "rank-kill:rank=0:step=50:phase=local")
    assert crashed.returncode != 0
    out = crashed.stdout + crashed.stderr
    assert "restored version 40 (written by 4 ranks) onto 3 rank(s)" in out, out
    assert "No space left on device" in out, out
    assert "version 40 is restored but could not be written again under this job's levels" in out, out
    assert "version 40 protected again" not in out, out
    events = [(r["event"], r["step"]) for r in read_metrics(tmp_path / "run") if r.get("event", "").startswith("level_")]
    assert events == [("level_failing", 40)], events
    resumed = train(tmp_path, config, 3, 3)
    assert_ok(resumed)
    assert "restored version 30 (written by 4 ranks) onto 3 rank(s)" in resumed.stdout, resumed.stdout


def test_a_loss_beyond_the_levels_falls_back_to_l4_or_stops_naming_what_is_missing(tmp_path):
    config = job(tmp_path, ["local", "pfs"])
    lose_node_3_before_l4_has_40(tmp_path, config)
    # Old rank 3's shard of 40 is gone with its node: version 30 is assembled, L4 read only for rank 3.
    resumed = train(tmp_path, config, 3, 3, "--set", "run.steps=30")
    assert_ok(resumed)
    assert "restored version 30 (written by 4 ranks) onto 3 rank(s): old shards 3 from L1 local, 1 from L4 pfs" \
        in resumed.stdout, resumed.stdout

    other = tmp_path / "no-pfs"
    other.mkdir()
    config = job(other, ["local"])
    crashed = train(other, config, 4, 4, "--inject", "node-loss:node=3:step=50:phase=snapshot")
    assert crashed.returncode != 0
    stopped = train(other, config, 3, 3)
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    assert "checkpoint version 40 (written by 4 ranks) cannot be assembled onto 3: the shards of old rank(s) [3] " \
           "are on no surviving level" in stopped.stderr
    assert (node_local(other / "run", 0) / "v000000000040").is_dir()  # nothing deleted


def test_two_neighbouring_nodes_lost_onto_two_ranks_takes_what_no_node_lists_from_l4(tmp_path):
    # Old rank 2's shard, replica and every node-local copy of its checksums were on nodes 2
    # and 3 (its partner's and its metadata neighbour's): only L4's record lists it.
    config = job(tmp_path, ["local", "partner", "pfs"])
    assert_ok(train(tmp_path, config, 4, 4, "--set", "run.steps=30"))
    before = exported(tmp_path, config, 30)
    for node in (2, 3):
        shutil.rmtree(node_local(tmp_path / "run", node))
    resumed = train(tmp_path, config, 2, 2, "--set", "run.steps=30")
    assert_ok(resumed)
    assert "restored version 30 (written by 4 ranks) onto 2 rank(s): old shards 2 from L1 local, 1 from L2 " \
           "partner, 1 from L4 pfs" in resumed.stdout, resumed.stdout
    assert_same_tensors(exported(tmp_path, config, 30), before)


@pytest.mark.parametrize("stage", ["read", "move"])
def test_an_unexpected_failure_while_repartitioning_fails_every_rank_alike(tmp_path, stage):
    from conftest import REPO, run_script, script_results

    script = REPO / "tests" / "scripts" / "repartition_failure.py"
    run_dir = str(tmp_path / "run")
    assert_ok(run_script(4, script, [run_dir, "save"], cwd=tmp_path, timeout=120))
    proc = run_script(3, script, [run_dir, "restore", stage, "1"], cwd=tmp_path, timeout=120)
    assert "HANG" not in proc.stdout, proc.stdout[-3000:]
    assert_ok(proc)
    errors = [r["error"] for r in script_results(proc)]
    assert len(errors) == 3 and all(e and "failed on rank(s) [1]" in e and "injected" in e for e in errors), errors


def test_a_crash_while_the_version_is_written_again_leaves_it_on_l4(tmp_path, saved_40):
    """The old job's node-local copies of the loaded version give way to the new ones (same
    file names) only once L4 holds it: a crash in between loses nothing."""
    config = job(tmp_path)
    lose_node_3_before_l4_has_40(tmp_path, config)
    crashed = train(tmp_path, config, 3, 3, "--set", "run.steps=40", "--inject", "rank-kill:rank=0:step=40:phase=local")
    assert crashed.returncode != 0
    assert "injected rank-kill on rank 0 (node 0) at step 40 in phase local" in crashed.stderr
    # L4 took the version before the old job's node-local copies of it went.
    assert (tmp_path / "run" / "pfs" / "v000000000040" / "manifest.json").is_file()
    resumed = train(tmp_path, config, 3, 3, "--set", "run.steps=40")
    assert_ok(resumed)
    # Each shard from L4, or from a copy of this job's writing that the other ranks finished
    # before rank 0 died (their L1 shards, partner replicas): verified against L4's record
    # either way. Rank 0's L1 shard, whose write it died in, is not read.
    restored = re.search(r"restored version 40: (.*)\n", resumed.stdout)
    assert restored, resumed.stdout
    sources = re.findall(r"(\d+) rank\(s\) from (L\d \w+)", restored.group(1))
    assert sum(int(n) for n, _ in sources) == 3 and {level for _, level in sources} <= {"L4 pfs", "L2 partner",
                                                                                         "L1 local"}, \
        restored.group(0)
    [restart] = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "restart"][-1:]
    assert restart["sources"][0] != "local", restart
    assert_same_tensors(exported(tmp_path, config, 40), saved_40)
