"""Failure domains on real ranks (simulated nodes and domains on this machine): a whole domain
lost is restored from partner copies placed in the other domain, where placement by node only
loses the same ranks' copies with them; `inspect` counts domain losses."""

import json
import shutil

from conftest import assert_ok, node_local, run_mpi, small_job

STEPS = 20


def job(tmp_path, domains: int):
    # 4 ranks on 4 simulated nodes in 2 domains of 2; L1 and L2 only: nothing else to fall back on.
    return small_job(tmp_path, run={"steps": STEPS}, checkpoint={"every_steps": 5, "keep_local": 2},
                     resilience={"levels": ["local", "partner"]},
                     cluster={"simulated_nodes": 4, "simulated_domains": domains})


def lose_domain_1(tmp_path) -> None:
    for node in (2, 3):
        shutil.rmtree(node_local(tmp_path / "run", node))


def test_a_lost_domain_is_restored_from_partners_in_the_other_domain(tmp_path):
    config = job(tmp_path, domains=2)
    first = run_mpi(4, ["train", "-c", str(config)], cwd=tmp_path)
    assert_ok(first)
    assert "failure domains: 2 (domain 0 (2 node(s)), domain 1 (2 node(s))), L2 partner copies in another domain " \
           "for 4 of 4 rank(s)" in first.stdout
    shown = run_mpi(1, ["inspect", "-c", str(config)], cwd=tmp_path)
    assert_ok(shown)
    assert "1 node loss(es), 1 of 2 domains" in shown.stdout, shown.stdout
    listed = json.loads(run_mpi(1, ["inspect", "-c", str(config), "--json"], cwd=tmp_path).stdout)
    assert listed[-1]["step"] == STEPS and (listed[-1]["survives_domains"], listed[-1]["domains"]) == (1, 2)
    lose_domain_1(tmp_path)
    again = run_mpi(4, ["train", "-c", str(config), "--restart", "require", "--set", f"run.steps={STEPS + 5}"],
                    cwd=tmp_path)
    assert_ok(again)
    assert f"restored version {STEPS}: 2 rank(s) from L1 local, 2 rank(s) from L2 partner" in again.stdout, \
        again.stdout[-3000:]


def test_the_same_loss_with_placement_by_node_only_loses_those_ranks(tmp_path):
    config = job(tmp_path, domains=0)
    assert_ok(run_mpi(4, ["train", "-c", str(config)], cwd=tmp_path))
    lose_domain_1(tmp_path)
    again = run_mpi(4, ["train", "-c", str(config), "--restart", "require"], cwd=tmp_path)
    assert again.returncode == 4, again.stdout[-3000:] + again.stderr[-3000:]
    assert "are on no surviving level" in again.stdout + again.stderr


def test_a_version_placed_across_other_domains_is_restored_through_its_own_record(tmp_path):
    # Written with partners across 2 domains (node 2's copies on node 0); restarted with domains
    # off, where node 2's partner would be node 3: the restart must read the record's map.
    config = job(tmp_path, domains=2)
    assert_ok(run_mpi(4, ["train", "-c", str(config)], cwd=tmp_path))
    shutil.rmtree(node_local(tmp_path / "run", 2))
    again = run_mpi(4, ["train", "-c", str(config), "--restart", "require", "--set", "cluster.simulated_domains=0",
                        "--set", f"run.steps={STEPS + 5}"], cwd=tmp_path)
    assert_ok(again)
    assert f"restored version {STEPS} (written by 4 ranks) onto 4 rank(s): old shards 3 from L1 local, 1 from L2 " \
           "partner" in again.stdout, again.stdout[-3000:]
