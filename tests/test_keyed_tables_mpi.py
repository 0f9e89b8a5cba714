"""Keyed tables (Checkpointer.protect_table) on real ranks: rows placed by the hash of their id,
saved whole or as the rows changed since the version before, restored onto any rank count from
whatever levels survived, every row byte-equal and on the rank its hash names."""

import json
import shutil

import h5py
from hpcckpt.format.keyed_rows import digest_text, rows_digest
from conftest import REPO, assert_ok, node_local, run_mpi, run_script, script_results

SCRIPT = REPO / "tests" / "scripts" / "table_job.py"
ROWS = 100_000


def table_job(tmp_path, n, run, mode, *args):
    proc = run_script(n, SCRIPT, [str(tmp_path / run), mode, str(ROWS), *args], cwd=tmp_path)
    assert_ok(proc)
    (result,) = script_results(proc)
    return result, proc.stdout + proc.stderr


def manifests(run_dir, node=0):
    """The node-local commit records of rank 0, by step."""
    return {int(v.name[1:]): json.loads((v / "commit-r00000.json").read_text())["body"]
            for v in sorted(node_local(run_dir, node).glob("v*")) if (v / "commit-r00000.json").exists()}


def test_a_table_of_100000_rows_comes_back_onto_3_and_6_ranks_after_a_node_loss(tmp_path):
    # Five versions, whole every third: 5 whole, 10 and 15 deltas, 20 whole, 25 a delta holding
    # the rows changed and the 100 ids added since 20.
    written, _ = table_job(tmp_path, 4, "run", "write", "5", "checkpoint.table_full_every=3")
    records = manifests(tmp_path / "run")
    assert records[25]["tables"]["chain"] == [20, 25]
    # Node 1 (ranks 1 and 3) is lost with its node-local directory; the partners on node 0 hold
    # copies of its shards of both versions of the chain.
    shutil.copytree(tmp_path / "run", tmp_path / "run6", symlinks=True)
    for run in ("run", "run6"):
        shutil.rmtree(tmp_path / run / "local" / "node1")
    for ranks, run in ((3, "run"), (6, "run6")):
        restored, out = table_job(tmp_path, ranks, run, "restore", "cluster.simulated_nodes=3")
        assert restored == {"restored": 25, "digest": written["digests"]["25"], "placed": True, "weights": 75.0}, out
        assert "tables restored from 2 version(s) of their chain ([20, 25])" in \
            "".join(p.read_text() for p in (tmp_path / run / "log").glob("rank*.log"))


def test_deltas_hold_the_rows_changed_and_the_chain_stays_whole_on_every_level(tmp_path):
    # L4 takes every second version: a delta it takes brings the versions of its chain it lacks
    # first. L1 keeps one version, and the chain of the one it keeps.
    settings = ['resilience.levels=["local","partner","pfs"]', "storage.pfs_every=2", "checkpoint.keep_local=1",
                "checkpoint.keep_pfs=1", "checkpoint.table_full_every=4"]
    written, _ = table_job(tmp_path, 4, "run", "write", "6", *settings)
    # Whole every fourth version: 5, then deltas 10, 15, 20; 25 whole again, 30 a delta.
    records = manifests(tmp_path / "run")
    assert sorted(records) == [25, 30], "L1 keeps the newest version and its chain"
    assert records[30]["tables"]["chain"] == [25, 30]
    pfs = sorted(int(v.name[1:]) for v in (tmp_path / "run" / "pfs").glob("v*"))
    assert pfs == [25, 30]  # 25 was due on L1 alone: copied to L4 before 30, whose tables build on it
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "log").glob("rank*.log"))
    for before, version in ((5, 10), (15, 20), (25, 30)):
        assert f"version {before} copied to L4 before version {version}, whose tables build on it" in logs
    full, delta = (records[step]["shards"][0]["size"] for step in (25, 30))
    assert delta * 10 < full, (delta, full)  # 1 % of the rows changed and 100 added: ~1 % of the bytes
    # The export of the delta version holds the whole table, as the writer had it.
    exported = tmp_path / "v30.h5"
    assert_ok(run_mpi(1, ["export", "--version", "30", "-o", str(exported), "--set", f"run.dir={tmp_path / 'run'}",
                          "--set", "cluster.simulated_nodes=2"], cwd=tmp_path))
    with h5py.File(exported) as f:
        ids, rows = f["table/emb/ids"][()], f["table/emb/rows"][()]
    assert digest_text(*rows_digest(ids, rows)) == written["digests"]["30"]
    # Every node-local directory lost: L4 alone gives the table back, chain applied.
    shutil.rmtree(tmp_path / "run" / "local")
    restored, _ = table_job(tmp_path, 4, "run", "restore", *settings)
    assert restored == {"restored": 30, "digest": written["digests"]["30"], "placed": True, "weights": 105.0}


def test_a_damaged_table_piece_falls_through_and_a_table_that_does_not_fit_is_refused(tmp_path):
    written, _ = table_job(tmp_path, 4, "run", "write", "3", 'resilience.levels=["local","partner","pfs"]')
    # One byte of rank 1's rows of version 15 flipped in its L1 file: its partner's copy serves.
    from hpcckpt.format.shardfile import read_shard_table

    shard = next(node_local(tmp_path / "run", 0).glob("v000000000015/shard-r00001.hck"))
    entry = read_shard_table(shard).entry("table/emb/rows")
    with open(shard, "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    restored, _ = table_job(tmp_path, 4, "run", "restore", 'resilience.levels=["local","partner","pfs"]')
    assert restored == {"restored": 15, "digest": written["digests"]["15"], "placed": True, "weights": 30.0}
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "log").glob("rank*.log"))
    assert "the local copy of old rank 1's shard is unusable" in logs and "'table/emb/rows' checksum mismatch" in logs
    # A job whose table has another dim: one clear error, and every version stays.
    proc = run_script(4, SCRIPT, [str(tmp_path / "run"), "restore", str(ROWS), 'resilience.levels=["local","partner","pfs"]'],
                      cwd=tmp_path, env={"TABLE_DIM": "4"})
    assert proc.returncode != 0
    assert "keyed tables differ: checkpoint {emb: 8 x float32}, now {emb: 4 x float32}" in proc.stderr, proc.stderr[-2000:]
    assert sorted(v.name for v in (tmp_path / "run" / "pfs").glob("v*")) == ["v000000000005", "v000000000010",
                                                                            "v000000000015"]

