"""Commit records at scale (#27): format 2 stores the layout and the per-rank maps as rules and
each node-local copy lists its node's part of the shard table; format 1 records still load."""

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from conftest import assert_ok, final_record, run_mpi, run_script, script_results, small_job

from hpcckpt.cluster.topology import Topology
from hpcckpt.errors import FormatError
from hpcckpt.format.compact import pack_dirs, pack_groups, pack_ints, unpack_dirs, unpack_groups, unpack_ints
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord, record_peers, records_listed, shard_digest, version_id_of
from hpcckpt.levels.survey import Writing


def test_per_rank_maps_round_trip_whatever_they_hold():
    rng = np.random.default_rng(27)
    for n in (1, 2, 3, 7, 64):
        for values in ([r // 4 for r in range(n)], [(r + 5) % n for r in range(n)], [9 - (r % 3) for r in range(n)],
                       list(rng.integers(-3, 50, size=n)), [0] * n, list(range(n))[::-1]):
            assert unpack_ints(pack_ints(values)) == [int(v) for v in values]
    assert unpack_ints([3, 1, 2]) == [3, 1, 2]  # format 1's plain lists


def test_a_regular_placement_packs_into_a_few_numbers():
    """Ranks filled node by node, partners on the next node, groups dealt round-robin: the
    engine's own topology at 64 and 16,384 ranks packs to the same handful of numbers."""
    sizes = []
    for ranks in (64, 16384):
        node_of_rank = tuple(r // 4 for r in range(ranks))
        topology = Topology(node_of_rank)
        groups = topology.erasure_groups(8, 2)
        packed = [pack_ints(node_of_rank), pack_ints(topology.partner_of()), pack_groups(groups, ranks),
                  pack_dirs([f"/tmp/hpcckpt-u/9/node{n}" for n in node_of_rank], node_of_rank)]
        assert unpack_groups(packed[2]) == groups and unpack_ints(packed[1]) == list(topology.partner_of())
        assert unpack_dirs(packed[3], node_of_rank) == [f"/tmp/hpcckpt-u/9/node{n}" for n in node_of_rank]
        sizes.append(len(json.dumps(packed)))
    assert sizes[1] <= sizes[0] + 40, sizes  # a few more digits, nothing per rank


def test_irregular_maps_are_kept_as_they_are():
    groups = ((3, 0), (1, 2))  # members not in rank order: a stripe plan depends on that order
    assert unpack_groups(pack_groups(groups, 4)) == groups
    dirs = ["/a", "/b/x", "/a", "/c"]
    assert unpack_dirs(pack_dirs(dirs, (0, 1, 0, 2)), (0, 1, 0, 2)) == dirs
    assert unpack_dirs(pack_dirs(["/same"] * 5, (0, 0, 1, 1, 2)), (0, 0, 1, 1, 2)) == ["/same"] * 5


def manifest_at(ranks: int, group_size: int = 4, per_node: int = 2) -> Manifest:
    specs = [TensorSpec(f"w{i}", "float32", (1 << 14, 4)) for i in range(6)] + [TensorSpec("b", "float32", (3,))]
    layout = plan_layout(specs, ranks, split_threshold_bytes=1024)
    shards = tuple(ShardRecord(r, layout.bytes_of_rank(r) + 4096,
                               {t.name: f"{r:08x}{i:08x}" for i, t in enumerate(layout.rank_pieces(r))})
                   for r in range(ranks))
    node_of_rank = tuple(r // per_node for r in range(ranks))
    topology = Topology(node_of_rank)
    return Manifest(10, ranks, layout, shards, {"step": 10}, {"val_loss": 0.5}, node_of_rank,
                    tuple(f"/scratch/run/local/node{n}" for n in node_of_rank), (), ("local", "partner", "erasure"),
                    1.5, "run0", {}, topology.partner_of(), topology.erasure_groups(group_size, 2), 2,
                    version_id_of(10, ranks, [shard_digest(s.size, s.checksums) for s in shards]))


def test_a_node_local_record_lists_its_nodes_part_and_does_not_grow_with_ranks():
    small, large = manifest_at(32), manifest_at(1024)
    for manifest in (small, large):
        record = manifest.for_rank(5)
        group = next(g for g in manifest.groups if 5 in g)
        replicas_held = {s for s, holder in enumerate(manifest.partner_of) if holder == 5}
        assert {5, *group, *replicas_held} <= set(manifest.record_ranks(5))
        assert len(manifest.record_ranks(5)) <= 1 + len(group) + 2 * len(replicas_held)
        assert [r.rank for r in record.shards] == manifest.record_ranks(5)
        assert Manifest.from_bytes(record.to_bytes()) == record
        assert record.identity == manifest.identity and not record.lists_every_shard
    assert abs(len(large.for_rank(5).to_bytes()) - len(small.for_rank(5).to_bytes())) < 64
    assert len(large.to_bytes()) > 20 * len(large.for_rank(5).to_bytes())  # L4's full table


def test_the_whole_table_is_rebuilt_from_the_records_that_survive():
    manifest = manifest_at(16)
    records = [Manifest.from_bytes(manifest.for_rank(r).to_bytes()) for r in range(16)]
    survivors = [rec for rank, rec in enumerate(records) if manifest.node_of_rank[rank] != 3]  # node 3 lost
    merged = survivors[0]
    for record in survivors[1:]:
        merged = merged.with_shards(record.shards)
    assert merged.lists_every_shard and merged.shards == manifest.shards and merged.identity == manifest.identity
    with pytest.raises(FormatError, match="does not list rank"):
        records[0].shard(next(r for r in range(16) if r not in records[0].record_ranks(0)))


def format_1_bytes(manifest: Manifest) -> bytes:
    """A record as format 1 wrote it: every shard, plain lists, bounds per (tensor, rank), the
    body an escaped string inside the wrapper."""
    layout = {"format": 1, "world_size": manifest.world_size, "tensors": [
        {"name": t.name, "dtype": t.spec.dtype, "shape": list(t.spec.shape), "axis": t.axis,
         "bounds": [list(b) for b in t.bounds]} for t in manifest.layout.tensors]}
    body = {"format": 1, "step": manifest.step, "world_size": manifest.world_size, "layout": layout,
            "shards": [{"rank": s.rank, "size": s.size, "checksums": s.checksums} for s in manifest.shards],
            "state": manifest.state, "metrics": manifest.metrics, "node_of_rank": list(manifest.node_of_rank),
            "local_dirs": list(manifest.local_dirs), "local_arrays": list(manifest.local_arrays),
            "levels": list(manifest.levels), "created": manifest.created, "run_id": manifest.run_id,
            "settings": manifest.settings, "partner_of": list(manifest.partner_of),
            "groups": [list(g) for g in manifest.groups], "parity": manifest.parity}
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"checksum": xxhash.xxh3_64_hexdigest(text.encode()), "body": text}).encode()


def test_format_1_records_still_load():
    manifest = manifest_at(8)
    old = Manifest.from_bytes(format_1_bytes(manifest))
    assert old.layout == manifest.layout and old.shards == manifest.shards and old.groups == manifest.groups
    assert old.partner_of == manifest.partner_of and old.local_dirs == manifest.local_dirs
    assert old.lists_every_shard and old.identity  # computed from the table, as format 1 did
    with pytest.raises(FormatError, match="checksum mismatch"):
        Manifest.from_bytes(format_1_bytes(manifest).replace(b"val_loss", b"val_lost"))
    with pytest.raises(FormatError, match="checksum mismatch"):
        Manifest.from_bytes(manifest.to_bytes().replace(b"val_loss", b"val_lost"))


def test_a_checkpoint_written_in_format_1_keeps_loading_after_a_node_loss(tmp_path):
    """A run's records rewritten as format 1 wrote them (every shard in every record, bounds
    listed, plain lists): a restart after losing node 1 restores version 20 from node 0's L1
    files and the replicas it holds, and ends as the uninterrupted run does."""
    def job(root):
        return small_job(root, run={"steps": 30}, eval={"every_steps": 0}, checkpoint={"every_steps": 10},
                         storage={"pfs_every": 1}, resilience={"levels": ["local", "partner", "pfs"]})

    reference = tmp_path / "reference"
    reference.mkdir()
    assert_ok(run_mpi(4, ["train", "-c", str(job(reference))], cwd=reference))
    config = job(tmp_path)
    assert_ok(run_mpi(4, ["train", "-c", str(config), "--set", "run.steps=20"], cwd=tmp_path))
    rewritten = 0
    for l4_record in (tmp_path / "run" / "pfs").glob("v*/manifest.json"):
        old = format_1_bytes(Manifest.read(l4_record))
        for record in [l4_record, *(tmp_path / "run" / "local").glob(f"node*/run-*/{l4_record.parent.name}/commit-r*")]:
            record.write_bytes(old)
            rewritten += 1
    assert rewritten == 2 * (1 + 4)
    shutil.rmtree(tmp_path / "run" / "local" / "node1")
    resumed = run_mpi(4, ["train", "-c", str(config)], cwd=tmp_path)
    assert_ok(resumed)
    assert "restored version 20: 2 rank(s) from L1 local, 2 rank(s) from L2 partner" in resumed.stdout, resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == final_record(reference / "run")["weights_digest"]


SCALE_SCRIPT = Path(__file__).parent / "scripts" / "scale_restart.py"


def _version_records(run_dir: Path, version: str) -> list[Path]:
    return sorted((run_dir / "local").glob(f"node*/run-*/{version}/commit-r*.json"))


def test_32_ranks_lose_a_node_and_restart_bit_identical_with_records_that_do_not_grow(tmp_path):
    """32 ranks on 8 nodes (and 8 ranks on the same 8 nodes, groups of 4 both): each
    node-local record lists the same number of shards and is the same size within a few
    digits; after losing node 5 and version 60, the restart takes version 40 from the
    survivors' L1 files and node 5's ranks from their replicas or their groups' parity, and
    ends with the array of the uninterrupted run."""
    small, large = tmp_path / "small" / "run", tmp_path / "run"
    assert_ok(run_script(8, SCALE_SCRIPT, [str(small), "run"], cwd=tmp_path))
    ran = run_script(32, SCALE_SCRIPT, [str(large), "run"], cwd=tmp_path)
    assert_ok(ran)
    uninterrupted = {r["digest"] for r in script_results(ran)}
    assert len(uninterrupted) == 1
    listed = {}
    for run_dir in (small, large):
        records = [Manifest.read(path) for path in _version_records(run_dir, "v000000000040")]
        assert len(records) == records[0].world_size
        listed[run_dir] = ({len(r.shards) for r in records},
                           max(path.stat().st_size for path in _version_records(run_dir, "v000000000040")))
    assert listed[small][0] == listed[large][0] and max(listed[large][0]) <= 4 + 2, listed
    assert abs(listed[large][1] - listed[small][1]) <= 64, listed
    for version in list(large.rglob("v000000000060")):
        shutil.rmtree(version)
    shutil.rmtree(large / "local" / "node5")
    resumed = run_script(32, SCALE_SCRIPT, [str(large), "resume"], cwd=tmp_path)
    assert_ok(resumed)
    results = script_results(resumed)
    assert {r["restored"] for r in results} == {40}
    assert {r["digest"] for r in results} == uninterrupted
    node5 = {20, 21, 22, 23}
    assert {r["source"] for r in results if r["rank"] not in node5} == {"local"}
    assert {r["source"] for r in results if r["rank"] in node5} <= {"partner", "erasure"}


@pytest.mark.parametrize("ranks, per_node, group", [(64, 4, 8), (12, 3, 4), (10, 3, 3), (5, 5, 0)])
def test_the_records_every_rank_lists_are_each_ranks_record_peers(ranks, per_node, group):
    # Rank 0 hands each rank the records its own node-local copy lists (restore/flow.py): all
    # ranks at once must be what record_peers says for each.
    topology = Topology(tuple(r // per_node for r in range(ranks)))
    partner_of = topology.partner_of() if topology.node_count > 1 else ()
    groups = topology.erasure_groups(group, 1) if group and topology.node_count >= group else ()
    listed = records_listed(ranks, partner_of, topology.node_of_rank, groups)
    for rank in range(ranks):
        assert listed[rank] == sorted({rank, *record_peers(rank, partner_of, topology.node_of_rank, groups)[1]})


def test_a_writing_travels_with_its_groups_as_a_rule():
    # Rank 0 broadcasts the writing of each candidate at a restart: not O(ranks) bytes.
    topology = Topology(tuple(r // 4 for r in range(4096)))
    groups = topology.erasure_groups(8, 2)
    writing = Writing("id", 1.0, 4096, "run", groups, 2)
    data = pickle.dumps(writing)
    assert pickle.loads(data) == writing
    assert len(data) < 1024, len(data)
    irregular = Writing("id", 1.0, 6, "run", ((0, 5), (1, 2, 3), (4,)), 1)
    assert pickle.loads(pickle.dumps(irregular)) == irregular


def _manifest():
    layout = plan_layout([TensorSpec("a", "float64", (10, 4)), TensorSpec("b", "int64", ())], 3, 64)
    return Manifest(7, 3, layout, tuple(ShardRecord(r, 100 + r, {"a": f"{r:016x}"}) for r in range(3)),
                    state={"trainer": {"step": 7}}, metrics={"val_loss": 0.25}, node_of_rank=(0, 0, 1),
                    local_dirs=("x", "x", "y"))


def test_manifest_round_trip(tmp_path):
    manifest = _manifest()
    manifest.write(tmp_path / "m.json")
    assert Manifest.read(tmp_path / "m.json") == manifest


def test_manifest_edit_is_detected(tmp_path):
    path = tmp_path / "m.json"
    _manifest().write(path)
    path.write_text(path.read_text().replace("0.25", "0.35"))
    with pytest.raises(FormatError, match="checksum mismatch"):
        Manifest.read(path)
