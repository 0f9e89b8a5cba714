"""Surviving node loss on real ranks: 8 ranks on 4 simulated nodes, partner and erasure levels."""

import itertools
import shutil

import pytest
from conftest import assert_ok, final_record, node_local, run_mpi, small_job

STEPS = 24


def job(tmp_path, levels, **extra):
    sections = dict(
        run={"steps": STEPS, "log_every": 6},
        eval={"every_steps": 12},
        checkpoint={"every_steps": 4, "keep_local": 2, "split_threshold_kb": 2},
        resilience={"levels": levels, "group_size": 4, "parity": 2},
        storage={"pfs_every": 3},
        cluster={"simulated_nodes": 4},
    )
    for key, values in extra.items():
        sections.setdefault(key, {}).update(values)
    return small_job(tmp_path, **sections)


def train(tmp_path, config, *extra):
    return run_mpi(8, ["train", "-c", str(config), *extra], cwd=tmp_path, timeout=300)


def lose(nodes, step, phase=None):
    where = f":phase={phase}" if phase else ""
    return [arg for n in nodes for arg in ("--inject", f"node-loss:node={n}:step={step}{where}")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reference")
    assert_ok(train(tmp_path, job(tmp_path, ["local", "erasure"])))
    return final_record(tmp_path / "run")["weights_digest"]


@pytest.fixture(scope="module")
def stopped_at_12(tmp_path_factory):
    """A run stopped after its checkpoint of step 12, every node's files in place."""
    tmp_path = tmp_path_factory.mktemp("stopped")
    assert_ok(train(tmp_path, job(tmp_path, ["local", "erasure"], run={"steps": 12})))
    return tmp_path / "run"


@pytest.mark.parametrize("lost", list(itertools.combinations(range(4), 2)))
def test_any_two_nodes_lost_restart_from_erasure(tmp_path, reference, stopped_at_12, lost):
    """Each pair of the four nodes lost after version 12 (its files deleted, as with a lost
    node's disk; the loss inside a running job is tested below): L3 rebuilds their ranks.
    One stopped run serves the six cases."""
    shutil.copytree(stopped_at_12, tmp_path / "run")
    for node in lost:
        shutil.rmtree(node_local(tmp_path / "run", node))
    resumed = train(tmp_path, job(tmp_path, ["local", "erasure"]))
    assert_ok(resumed)
    assert "restored version 12: 4 rank(s) from L1 local, 4 rank(s) from L3 erasure" in resumed.stdout, resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference


def test_reprotected_version_survives_a_second_loss(tmp_path, reference):
    config = job(tmp_path, ["local", "erasure"])
    assert train(tmp_path, config, *lose((0, 1), 13)).returncode != 0
    # Restart, then lose the two other nodes before the next checkpoint is taken: only the
    # re-protected version (rebuilt parity on nodes 0 and 1) can bring nodes 2 and 3 back.
    second = train(tmp_path, config, *lose((2, 3), 14))
    assert second.returncode != 0
    assert "from L3 erasure" in second.stdout
    resumed = train(tmp_path, config)
    assert_ok(resumed)
    assert "4 rank(s) from L3 erasure" in resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference


def test_three_nodes_lost_falls_back_to_pfs_or_fails_clearly(tmp_path, reference):
    # L4 written by the persist, not at its own pace: a snapshot waits for the previous
    # version's persist, L4 included (at its own pace, how far its copy got is a race).
    config = job(tmp_path, ["local", "erasure", "pfs"], storage={"pfs_async": False})
    # As step 20's snapshot opens: version 12 (every 3rd checkpoint goes to L4) is durable
    # there, version 16 on L1/L3 only (lost earlier, while its own persist ran, its node-local
    # write fails and the version goes to L4 instead), and 3 nodes are gone.
    assert train(tmp_path, config, *lose((0, 1, 2), 20, "snapshot")).returncode != 0
    resumed = train(tmp_path, config)
    assert_ok(resumed)
    assert "restored version 12: 2 rank(s) from L1 local, 6 rank(s) from L4 pfs" in resumed.stdout, \
        resumed.stdout + resumed.stderr
    assert final_record(tmp_path / "run")["weights_digest"] == reference

    other = tmp_path / "no-pfs"
    other.mkdir()
    config = job(other, ["local", "erasure"])
    assert train(other, config, *lose((1, 2, 3), 17)).returncode != 0
    failed = train(other, config)
    assert failed.returncode == 4
    errors = [l for l in failed.stderr.splitlines() if "hpcckpt: error" in l]
    assert len(errors) == 1, failed.stderr
    # Ranks 0 and 1 on node 0 may have been writing version 16 when the job stopped; the
    # message names those apart, so the lost ranks and nodes read the same either way.
    assert "cannot be recovered" in errors[0]
    assert "the shards of rank(s) [2, 3, 4, 5, 6, 7] on node(s) [1, 2, 3] are on no surviving level" in errors[0]


def test_partner_covers_one_node_then_erasure_covers_node_and_partner(tmp_path, reference):
    config = job(tmp_path, ["local", "partner", "erasure"])
    # As the snapshot of step 16 opens: version 12 is durable everywhere (the snapshot waits
    # for it), its L2 copies too. A loss right after step 13 could cut the copies of the lost
    # node's shards short (the persist runs behind the steps), leaving them to L3.
    assert train(tmp_path, config, *lose((2,), 16, "snapshot")).returncode != 0
    resumed = train(tmp_path, config, "--set", "run.steps=16")
    assert_ok(resumed)
    assert "restored version 12: 6 rank(s) from L1 local, 2 rank(s) from L2 partner" in resumed.stdout, resumed.stdout
    # Node 1 and the node holding its replicas (node 2) go together: L2 cannot help node 1,
    # whose ranks are rebuilt by L3; node 2's replicas on node 3 survive.
    assert train(tmp_path, config, *lose((1, 2), 17)).returncode != 0
    resumed = train(tmp_path, config)
    assert_ok(resumed)
    assert "restored version 16: 4 rank(s) from L1 local, 2 rank(s) from L2 partner, 2 rank(s) from L3 erasure" \
        in resumed.stdout, resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference


def test_corrupted_replica_and_parity_are_detected_and_not_used(tmp_path, reference):
    config = job(tmp_path, ["local", "partner", "erasure", "pfs"], run={"steps": 12})
    assert_ok(train(tmp_path, config))
    version = "v000000000012"
    run = tmp_path / "run"
    # Version 4 was retired after 12's commit: each rank's shard, the replica it holds and its
    # parity wait in its node's spares, and version 12 overwrote none of them (it came first).
    for node in range(4):
        node_ranks = [r for r in range(8) if (node_local(run, node) / version / f"shard-r{r:05d}.hck").exists()]
        assert len(node_ranks) == 2
        spares = sorted(p.name for p in (node_local(run, node) / ".spare").iterdir())
        assert [n for n in spares if n.startswith("shard-")] == [f"shard-r{r:05d}.hck" for r in node_ranks]
        assert [n for n in spares if n.startswith("parity-")] == [f"parity-r{r:05d}.hck" for r in node_ranks]
        assert sorted(n[-10:-4] for n in spares if n.startswith("replica-")) == [f"r{r:05d}" for r in node_ranks]
        assert sorted(p.name for p in (node_local(run, node)).iterdir()) == [".spare", "v000000000008", version]
    shutil.rmtree(node_local(run, 1))  # ranks 2, 3 lost; their replicas live on node 2
    for replica in (node_local(run, 2) / version).glob("replica-of-*"):
        data = bytearray(replica.read_bytes())
        data[-5] ^= 0x55
        replica.write_bytes(bytes(data))
    parity = node_local(run, 0) / version / "parity-r00000.hck"
    data = bytearray(parity.read_bytes())
    data[-9] ^= 0x55
    parity.write_bytes(bytes(data))
    resumed = train(tmp_path, config, "--set", f"run.steps={STEPS}")
    assert_ok(resumed)
    # Replicas fail their checksums; the group of rank 2 still has 3 good members of 4 (parity
    # of rank 0 is bad but rank 0 is in the other group), so L3 rebuilds both lost ranks.
    assert "2 rank(s) from L3 erasure" in resumed.stdout, resumed.stdout
    assert "L2 partner" not in resumed.stdout.split("restored version")[1].splitlines()[0]
    assert final_record(tmp_path / "run")["weights_digest"] == reference


def test_a_damaged_shard_on_a_live_node_is_rebuilt_by_erasure(tmp_path, reference):
    """Rank 2's own shard fails its checksum while its node and parity file are fine: L3
    rebuilds the shard, and its parity file is replaced by the rebuilt pieces, not refused
    for existing (which failed the rebuild and sent the job back a version)."""
    config = job(tmp_path, ["local", "erasure"], run={"steps": 12})
    assert_ok(train(tmp_path, config))
    shard = node_local(tmp_path / "run", 1) / "v000000000012" / "shard-r00002.hck"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x55  # payload byte
    shard.write_bytes(bytes(data))
    resumed = train(tmp_path, config, "--set", f"run.steps={STEPS}")
    assert_ok(resumed)
    assert "restored version 12: 7 rank(s) from L1 local, 1 rank(s) from L3 erasure" in resumed.stdout, \
        resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference
