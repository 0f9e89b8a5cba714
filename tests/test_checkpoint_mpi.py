"""Checkpoint/restart of the trainer on real ranks: crashes, lost storage, N->M, corruption."""

import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import assert_ok, final_record, needs_gpu, node_local, run_mpi, small_job

STEPS = 30


def ckpt_job(tmp_path, **sections):
    base = dict(
        run={"steps": STEPS, "log_every": 5},
        checkpoint={"every_steps": 5, "keep_local": 2, "keep_pfs": 3, "split_threshold_kb": 4},
        storage={"pfs_every": 2},
        resilience={"levels": ["local", "pfs"]},
        cluster={"simulated_nodes": 2},
    )
    for key, values in sections.items():
        base.setdefault(key, {}).update(values)
    return small_job(tmp_path, **base)


def train(tmp_path, job, n=4, *extra):
    return run_mpi(n, ["train", "-c", str(job), *extra], cwd=tmp_path)


def export(tmp_path, job, name, version="latest"):
    out = tmp_path / name
    assert_ok(run_mpi(1, ["export", "-c", str(job), "--version", version, "-o", str(out)], cwd=tmp_path))
    with h5py.File(out, "r") as f:
        tensors = {}
        f.visititems(lambda n, obj: tensors.__setitem__(n, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        return tensors, dict(f.attrs)


def rank_logs(tmp_path):
    return {p.name: p.read_text() for p in sorted((tmp_path / "run" / "log").glob("rank*.log"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its final weights and export."""
    tmp_path = tmp_path_factory.mktemp("reference")
    job = ckpt_job(tmp_path)
    assert_ok(train(tmp_path, job))
    tensors, attrs = export(tmp_path, job, "ref.h5")
    return final_record(tmp_path / "run")["weights_digest"], tensors, attrs


def assert_same_export(tensors, reference_tensors):
    assert sorted(tensors) == sorted(reference_tensors)
    for name, array in tensors.items():
        assert array.dtype == reference_tensors[name].dtype
        assert array.tobytes() == reference_tensors[name].tobytes(), name


@pytest.mark.parametrize("fault", [
    "rank-kill:rank=1:step=12",                 # between checkpoints
    "rank-kill:rank=2:step=15:phase=snapshot",  # inside each phase of a checkpoint
    "rank-kill:rank=1:step=15:phase=local",
    "rank-kill:rank=3:step=20:phase=pfs",
    "rank-kill:rank=0:step=20:phase=commit",
    "rank-kill:rank=1:step=16",                 # right after a checkpoint
])
def test_killed_run_resumes_bit_identically(tmp_path, reference, fault):
    digest, ref_tensors, ref_attrs = reference
    job = ckpt_job(tmp_path)
    crashed = train(tmp_path, job, 4, "--inject", fault)
    assert crashed.returncode != 0
    assert "injected rank-kill" in crashed.stderr
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    assert "restored version" in resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == digest
    tensors, attrs = export(tmp_path, job, "resumed.h5")
    assert_same_export(tensors, ref_tensors)
    assert attrs["step"] == ref_attrs["step"] == STEPS


@pytest.mark.parametrize("fault, levels", [
    ("rank-kill:rank=1:step=5:phase=partner", ["local", "partner", "pfs"]),  # shards written, no replicas
    ("rank-kill:rank=1:step=5:phase=commit", ["local", "partner", "pfs"]),   # rank 1's replica is there
    ("rank-kill:rank=1:step=5:phase=commit", ["local", "pfs"]),  # the others commit; rank 1 has nothing
])
def test_a_job_killed_in_its_first_checkpoint_starts_again(tmp_path, reference, fault, levels):
    """The next start either begins from scratch or, where the other ranks committed and
    rank 1's replica holds its shard, resumes from that version: it must neither call the
    half-written version lost (exit 4, and the restart loop gives up) nor trip over its files
    when it writes that step again."""
    job = ckpt_job(tmp_path, resilience={"levels": levels})
    crashed = train(tmp_path, job, 4, "--inject", fault)
    assert crashed.returncode != 0 and "injected rank-kill" in crashed.stderr
    again = train(tmp_path, job)
    assert_ok(again)
    assert "starting from scratch" in again.stdout or "restored version 5" in again.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference[0]


def test_garbled_commit_records_on_a_live_node_do_not_lose_its_intact_shards(tmp_path):
    """A commit record is metadata: with node 1's records unreadable, its shards are still
    checked against node 0's record of the same writing, loaded, and the version written
    again with good records (not taken for an unfinished version, nor a lost one)."""
    job = ckpt_job(tmp_path, run={"steps": 10}, resilience={"levels": ["local"]})
    assert_ok(train(tmp_path, job))
    node1 = node_local(tmp_path / "run", 1)
    for record in node1.glob("v*/commit-r*.json"):
        record.write_text("{garbage")
    resumed = train(tmp_path, job, 4, "--set", "run.steps=15")
    assert_ok(resumed)
    assert "restored version 10 (written by 4 ranks) onto 4 rank(s): old shards 4 from L1 local" in resumed.stdout
    assert "version 10 protected again on local" in resumed.stdout
    for record in node1.glob("v*/commit-r*.json"):
        json.loads(record.read_text())


def test_damage_on_a_live_node_is_not_taken_for_an_unfinished_version(tmp_path):
    """Only a rank that wrote its shard and stopped before committing it makes a version
    'never complete'. A node whose directory holds only an earlier job's spares is a loss:
    the restart must stop and say so, and delete nothing (a fresh start would have deleted
    node 0's intact versions)."""
    job = ckpt_job(tmp_path, run={"steps": 10}, resilience={"levels": ["local"]})
    assert_ok(train(tmp_path, job))
    node1 = node_local(tmp_path / "run", 1)
    for version in node1.glob("v*"):
        shutil.rmtree(version)
    (node1 / ".spare").mkdir(exist_ok=True)
    before = sorted(p.relative_to(tmp_path) for p in (node_local(tmp_path / "run", 0)).rglob("*"))
    resumed = train(tmp_path, job, 4, "--set", "run.steps=15")
    assert resumed.returncode == 4, resumed.stdout + resumed.stderr
    assert "checkpoint version 10 cannot be recovered" in resumed.stderr
    assert sorted(p.relative_to(tmp_path) for p in (node_local(tmp_path / "run", 0)).rglob("*")) == before


def test_every_version_lost_stops_by_default_and_starts_over_where_allowed(tmp_path, reference):
    """A node lost with the only copies of its ranks' shards (L1 alone, no L4): by default the
    restart stops (exit 4) and names the setting that would start over; with
    resilience.unrecoverable = "start_over" it says the versions are lost, clears what they
    left on the surviving node, records it, and runs from step 0 to the failure-free weights."""
    job = ckpt_job(tmp_path, resilience={"levels": ["local"]})
    assert_ok(train(tmp_path, job, 4, "--set", "run.steps=15"))
    shutil.rmtree(node_local(tmp_path / "run", 1))
    stopped = train(tmp_path, job)
    assert stopped.returncode == 4, stopped.stdout + stopped.stderr
    assert "checkpoint version 15 cannot be recovered" in stopped.stderr
    assert 'resilience.unrecoverable = "start_over" starts the run again' in stopped.stderr
    assert sorted(p.name for p in node_local(tmp_path / "run", 0).glob("v*")) == \
        ["v000000000010", "v000000000015"]  # the stop deleted nothing
    resumed = train(tmp_path, job, 4, "--set", "resilience.unrecoverable=start_over")
    assert_ok(resumed)
    assert "every stored version is lost, and the run starts again from its beginning" in resumed.stdout + \
        resumed.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lost_up_to"] for r in records if r.get("event") == "started_over"] == [15]
    restart = [r for r in records if r.get("event") == "restart"][-1]
    assert (restart["step"], restart["lost_steps"]) == (0, 15), restart
    assert final_record(tmp_path / "run")["weights_digest"] == reference[0]


def test_all_node_local_storage_lost_restarts_from_pfs(tmp_path, reference):
    digest = reference[0]
    job = ckpt_job(tmp_path)
    # The last step of a run always reaches L4; the interrupted job stops at 20 of 30.
    assert_ok(train(tmp_path, job, 4, "--set", "run.steps=20"))
    shutil.rmtree(tmp_path / "run" / "local")
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    assert "restored version 20: 4 rank(s) from L4 pfs" in resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == digest


def test_node_loss_injection_deletes_that_nodes_directory(tmp_path, reference):
    job = ckpt_job(tmp_path)
    crashed = train(tmp_path, job, 4, "--inject", "node-loss:node=1:step=17")
    assert crashed.returncode != 0
    assert not (node_local(tmp_path / "run", 1)).exists()
    assert (node_local(tmp_path / "run", 0)).exists()
    on_l4_after_the_crash = (tmp_path / "run" / "pfs" / "v000000000015" / "manifest.json").exists()
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    # Step 15 is due on L1 only (PFS every 2nd checkpoint) and node 1 lost it; step 10 is on L4
    # for certain (the snapshot of 15 waited for it), so the job agrees on step 10. When the node
    # died while version 15's node-local write was still running, the save kept that version on
    # L4 instead and the job restarts from there. (The warning that says so may not get out: the
    # launcher kills the survivors as soon as node 1's ranks are dead.)
    restored = re.search(r"restored version (\d+): .*from L4 pfs", resumed.stdout)
    assert restored, resumed.stdout
    assert restored.group(1) in ("10", "15"), resumed.stdout
    if restored.group(1) == "15":
        assert on_l4_after_the_crash, "version 15 restored from L4, but L4 had no manifest of it after the crash"
    assert final_record(tmp_path / "run")["weights_digest"] == reference[0]


@pytest.mark.parametrize("new_ranks", [2, 6])
def test_restart_on_a_different_number_of_ranks(tmp_path, new_ranks):
    job = ckpt_job(tmp_path, run={"steps": 20})
    assert_ok(train(tmp_path, job))
    four_rank = final_record(tmp_path / "run")["weights_digest"]
    resumed = train(tmp_path, job, new_ranks)  # same run.steps: nothing left to train
    assert_ok(resumed)
    # The old shards are on node-local storage: read there, not from L4.
    assert f"restored version 20 (written by 4 ranks) onto {new_ranks} rank(s): old shards 4 from L1 local" \
        in resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == four_rank
    # Each old shard was read once, by one rank, and moved from there.
    logs = rank_logs(tmp_path)
    read = [int(m) for text in logs.values() for m in re.findall(r"this rank read (\d+) and received", text)]
    assert len(read) == new_ranks and 0 < sum(read) <= 4 * max(read)
    # ...and training continues from there on the new rank count.
    more = train(tmp_path, job, new_ranks, "--set", "run.steps=26")
    assert_ok(more)
    assert final_record(tmp_path / "run")["weights_identical_on_ranks"] is True


def test_same_size_restart_reads_only_own_shard(tmp_path):
    job = ckpt_job(tmp_path, run={"steps": 10})
    assert_ok(train(tmp_path, job))
    assert_ok(train(tmp_path, job, 4, "--set", "run.steps=12"))
    for rank in range(4):
        text = rank_logs(tmp_path)[f"rank{rank}.log"]
        line = [l for l in text.splitlines() if "restore read" in l][-1]
        assert "1 file(s)" in line and f"shard-r{rank:05d}.hck" in line, line


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_payload_falls_through_and_header_flip_is_corrected(tmp_path, reference):
    job = ckpt_job(tmp_path)
    assert_ok(train(tmp_path, job, 4, "--set", "run.steps=20"))
    v20 = "v000000000020"
    shard1 = node_local(tmp_path / "run", 0) / v20 / "shard-r00001.hck"
    _flip(shard1, shard1.stat().st_size - 3)  # payload byte
    shard2 = node_local(tmp_path / "run", 1) / v20 / "shard-r00002.hck"
    _flip(shard2, 20)  # header byte: corrected by Reed-Solomon
    verify = run_mpi(1, ["verify", "-c", str(job)], cwd=tmp_path)
    assert verify.returncode == 1 and "shard-r00001.hck" in verify.stdout
    resumed = train(tmp_path, job)
    assert_ok(resumed)
    assert "restored version 20: 3 rank(s) from L1 local, 1 rank(s) from L4 pfs" in resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == reference[0]


def test_restart_on_more_ranks_never_loads_a_corrupted_piece(tmp_path):
    """New ranks need parts of old pieces; a checksum covers a whole piece, so each is read
    and checked whole, and a flipped bit sends the restart to the older version."""
    job = ckpt_job(tmp_path, run={"steps": 20})
    assert_ok(train(tmp_path, job))
    from hpcckpt.format.shardfile import read_shard_table

    shard = tmp_path / "run" / "pfs" / "v000000000020" / "shard-r00001.hck"
    piece = read_shard_table(shard).entry("model/dense0.weight")  # rows split 4 ways, then 6 ways
    _flip(shard, piece.offset + piece.nbytes // 2 + 1)
    shutil.rmtree(tmp_path / "run" / "local")  # only L4 is left to read
    resumed = train(tmp_path, job, 6, "--set", "run.steps=22")
    assert_ok(resumed)
    # Version 15 reached L4 in the final drain (keep_pfs = 3).
    assert "restored version 15 (written by 4 ranks) onto 6 rank(s): old shards 4 from L4 pfs" in resumed.stdout, \
        resumed.stdout
    assert "checksum" in "".join(rank_logs(tmp_path).values())


def test_version_without_commit_record_is_never_loaded(tmp_path):
    job = ckpt_job(tmp_path, run={"steps": 20})
    assert_ok(train(tmp_path, job))
    # Remove every commit record of step 20 (L1 copies and the L4 manifest); shards stay.
    for path in (tmp_path / "run").rglob("v000000000020/*"):
        if path.name.startswith("commit-") or path.name == "manifest.json":
            path.unlink()
    resumed = train(tmp_path, job, 4, "--set", "run.steps=22")
    assert_ok(resumed)
    assert "restored version 15" in resumed.stdout


def test_export_equals_weights_in_memory(tmp_path):
    job = ckpt_job(tmp_path, run={"steps": 10})
    assert_ok(train(tmp_path, job))
    tensors, attrs = export(tmp_path, job, "out.h5")
    import xxhash

    digest = xxhash.xxh3_128()
    final = final_record(tmp_path / "run")
    names = [n for n in tensors if n.startswith("model/")]
    # Parameter order is input->output: dense0.weight, dense0.bias, dense1...
    order = sorted(names, key=lambda n: (int(n.split("dense")[1].split(".")[0]), n.endswith("bias")))
    for name in order:
        digest.update(name[len("model/"):].encode())
        digest.update(np.ascontiguousarray(tensors[name]).view(np.uint8))
    assert digest.hexdigest() == final["weights_digest"]
    assert attrs["step"] == 10 and "metric_val_loss" in attrs
    assert (tmp_path / "out.h5").exists()
    again = run_mpi(1, ["export", "-c", str(job), "-o", str(tmp_path / "out.h5")], cwd=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr


def _storage_snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and "log" not in p.parts and p.name != "metrics.jsonl"}


def test_bad_storage_path_and_incompatible_model_fail_clearly_and_delete_nothing(tmp_path):
    job = ckpt_job(tmp_path, run={"steps": 10})
    assert_ok(train(tmp_path, job))
    before = _storage_snapshot(tmp_path / "run")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad_path = train(tmp_path, job, 4, "--set", f"storage.pfs_dir={blocker}/pfs")
    assert bad_path.returncode == 3, bad_path.stderr
    errors = [l for l in bad_path.stderr.splitlines() if "hpcckpt: error" in l]
    assert len(errors) == 1 and "storage.pfs_dir" in errors[0]
    incompatible = train(tmp_path, job, 4, "--set", "model.hidden=[48, 16]", "--set", "run.steps=12")
    assert incompatible.returncode == 4, incompatible.stderr
    errors = [l for l in incompatible.stderr.splitlines() if "hpcckpt: error" in l]
    assert len(errors) == 1 and "incompatible" in errors[0] and "dense0.weight" in errors[0]
    refused = train(tmp_path, job, 4, "--restart", "never")
    assert refused.returncode == 2 and "--restart never" in refused.stderr
    assert _storage_snapshot(tmp_path / "run") == before


def test_restart_require_without_checkpoint_fails(tmp_path):
    job = ckpt_job(tmp_path)
    proc = train(tmp_path, job, 2, "--restart", "require")
    assert proc.returncode == 4 and "--restart require" in proc.stderr


def test_inspect_lists_levels_and_retention(tmp_path):
    job = ckpt_job(tmp_path)
    assert_ok(train(tmp_path, job))
    proc = run_mpi(1, ["inspect", "-c", str(job), "--json"], cwd=tmp_path)
    assert_ok(proc)
    versions = {v["step"]: v for v in json.loads(proc.stdout)}
    # keep_local = 2; L4 every 2nd checkpoint plus the last, keep_pfs = 3, and at the end the
    # drain puts 25 (only node-local) on L4 too, which retires 10.
    assert {step: v["levels"] for step, v in versions.items()} == {
        20: ["pfs"], 25: ["local", "pfs"], 30: ["local", "pfs"]}
    assert {step: v["survives"] for step, v in versions.items()} == {20: None, 25: None, 30: None}
    final = final_record(tmp_path / "run")
    # An evaluation-only job on another rank count gives the training run's own numbers.
    evaluate = run_mpi(2, ["evaluate", "-c", str(job), "--version", "latest", "--set", "cluster.simulated_nodes=2"],
                       cwd=tmp_path)
    assert_ok(evaluate)
    assert f"version 30: val_loss {final['val_loss']:.4f}" in evaluate.stdout, evaluate.stdout


def test_background_failure_surfaces_on_every_rank_and_in_the_log(tmp_path):
    from conftest import REPO, run_script

    proc = run_script(4, REPO / "tests" / "scripts" / "background_failure.py", [str(tmp_path / "run")], cwd=tmp_path)
    assert_ok(proc)
    import re

    lines = re.findall(r"rank \d: surfaced: [^|]*\|", proc.stdout)
    assert sorted(l[:6] for l in lines) == ["rank 0", "rank 1", "rank 2", "rank 3"], proc.stdout
    assert all("StorageError: no level could hold versions [2] (1 checkpoints in a row" in l for l in lines), lines
    assert all("node-local L1 write of step 2 failed on all 4 ranks: L1 local write: " in l for l in lines), lines
    for rank in range(4):
        assert "checkpoint of step 2 failed" in (tmp_path / "run" / "log" / f"rank{rank}.log").read_text()


@pytest.mark.parametrize("group_size,parity", [(4, 2), (2, 1)], ids=["one-group", "two-groups"])
def test_a_rank_failing_before_its_transfers_fails_the_checkpoint_on_every_rank_without_a_hang(
        tmp_path, group_size, parity):
    """With two erasure groups, the group without the failing rank must not be left waiting
    for the others, and the failure names the job's rank, not its place in the group."""
    from conftest import REPO, run_script, script_results

    proc = run_script(4, REPO / "tests" / "scripts" / "fails_before_exchange.py",
                      [str(tmp_path / "run"), str(group_size), str(parity)], cwd=tmp_path, timeout=180)
    assert "HANG" not in proc.stdout, proc.stdout[-3000:]
    assert_ok(proc)
    records = script_results(proc)
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    expected = {1: ("L2 partner copy of step 1 failed on rank(s) [1]: MemoryError", [1]),
                2: ("L3 erasure coding of step 2 failed on rank(s) [2]: RuntimeError", [2]),
                3: ("L3 erasure coding of step 3 failed on rank(s) [3]: OSError", [3]),
                4: ("L1-L3 commit of step 4 failed on rank(s) [0]: OSError", [0])}
    for record in records:
        for step, message, failed in record["outcomes"]:
            if step in expected:
                assert message is not None and message.startswith(expected[step][0]), (record["rank"], message)
                assert failed == expected[step][1]
            else:
                assert message is None, message
        # The failed versions are committed nowhere (no rank kept its record of step 4, which
        # retention would count); the next one is, everywhere.
        assert record["committed"] == [5]


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=needs_gpu)])
def test_snapshot_taken_during_backprop_equals_weights_of_that_step(tmp_path, device):
    """Shards are copied right after each layer's update, while lower layers are still in
    backward: the version of step 12 must equal the weights of a run that stopped at 12. On a
    GPU the copies run on a side stream while the next kernels go on."""
    stop = tmp_path / "stop"
    stop.mkdir()
    assert_ok(train(stop, ckpt_job(stop, run={"steps": 12, "device": device})))
    weights_at_12 = final_record(stop / "run")["weights_digest"]
    job = ckpt_job(tmp_path, run={"steps": 20, "device": device}, checkpoint={"every_steps": 4, "keep_local": 5})
    assert_ok(train(tmp_path, job))
    tensors, attrs = export(tmp_path, job, "v12.h5", version="12")
    stop_tensors, _ = export(stop, ckpt_job(stop, run={"steps": 12, "device": device}), "stop.h5")
    assert attrs["step"] == 12
    assert_same_export(tensors, stop_tensors)
    assert weights_at_12 == final_record(stop / "run")["weights_digest"]


def test_auto_interval_is_logged_and_kept_across_restart(tmp_path):
    job = ckpt_job(tmp_path, run={"steps": 40}, checkpoint={"every_steps": "auto"})
    first = train(tmp_path, job)
    assert_ok(first)
    assert "checkpoint interval now" in first.stdout and "overhead <= 3.5 %" in first.stdout
    again = train(tmp_path, job, 4, "--set", "run.steps=50")
    assert_ok(again)
    assert "kept from the checkpoint's profile" in again.stdout


def test_end_of_run_drains_node_local_versions_that_l4_keeps(tmp_path):
    # L4 gets only the final checkpoint (pfs_every is large); with keep_pfs = 2 the version
    # before it is only on node-local storage, which goes with the allocation: it is drained.
    job = ckpt_job(tmp_path, storage={"pfs_every": 100}, checkpoint={"keep_pfs": 2, "keep_local": 2})
    proc = train(tmp_path, job)
    assert_ok(proc)
    assert "drained version 25 from node-local storage to L4" in proc.stdout
    listing = run_mpi(1, ["inspect", "-c", str(job), "--json"], cwd=tmp_path)
    assert_ok(listing)
    versions = {v["step"]: v["levels"] for v in json.loads(listing.stdout)}
    assert versions == {25: ["local", "pfs"], 30: ["local", "pfs"]}
    verify = run_mpi(1, ["verify", "-c", str(job)], cwd=tmp_path)
    assert_ok(verify)
    # The drained copy restores on its own, from L4, with the node-local storage gone.
    import shutil

    shutil.rmtree(tmp_path / "run" / "local")
    evaluate = run_mpi(2, ["evaluate", "-c", str(job), "--version", "25", "--set", "cluster.simulated_nodes=2"],
                       cwd=tmp_path)
    assert_ok(evaluate)


def test_copies_behind_the_step_hold_the_values_at_capture(tmp_path):
    from conftest import REPO, run_script, script_results

    proc = run_script(2, REPO / "tests" / "scripts" / "copy_behind.py", [str(tmp_path / "run")], cwd=tmp_path)
    assert_ok(proc)
    results = script_results(proc)
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout
    for result in results:
        assert (result["first"], result["step"]) == (1, 2)  # version 3 was abandoned, never committed
        assert result["equal"], result
        assert result["twice_changed_holds_capture"], result
        assert result["background_copy_s"] > 0  # the copies ran on the worker, behind the step
        # Their wake-ups must not preempt training (checkpoint.background_policy = "batch").
        assert result["batch_policy"] == [["hpcckpt-copy", True], ["hpcckpt-persist", True]]


def test_bandwidth_caps_hold_every_level_to_its_rate(tmp_path):
    from conftest import REPO, run_script, script_results

    proc = run_script(2, REPO / "tests" / "scripts" / "throttled.py", [str(tmp_path / "run")], cwd=tmp_path)
    assert_ok(proc)
    for result in script_results(proc)[0]:
        durable = result["durable_s"]
        # 4 MiB at 8 MB/s: >= 0.52 s per level, each level after the one before it.
        assert durable["local"] >= 0.5, result
        assert durable["partner"] - durable["local"] >= 0.5, result
        assert durable["pfs"] - durable["partner"] >= 0.5, result
        # Capped writes go one at a time, so each level starts once the one before is durable,
        # and each level's own time (durable - started) holds its cap.
        started = result["started_s"]
        assert set(started) == set(durable), result
        assert started["partner"] >= durable["local"] and started["pfs"] >= durable["partner"], result
        assert all(durable[level] - started[level] >= 0.5 for level in durable), result
        # CPU of the background threads, not their wall time: the caps are sleeps.
        cpu = result["cpu_s"]
        assert set(cpu) == {"persist", "l1_write"}, result  # no background copies in checkpoint()
        assert 0 < cpu["persist"] < durable["pfs"] - 1.0, result
        assert 0 < cpu["l1_write"] < durable["local"], result


def test_l1_failure_while_l3_encodes_fails_the_version_on_every_rank(tmp_path):
    """L1's write runs on its own thread while L3 sends and encodes the same bytes; a failed
    L1 write on one rank must still fail the version everywhere and commit nothing."""
    from conftest import REPO, run_script, script_results

    proc = run_script(4, REPO / "tests" / "scripts" / "l1_fails_during_l3.py", [str(tmp_path / "run")], cwd=tmp_path)
    assert_ok(proc)
    results = script_results(proc)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], proc.stdout
    for r in results:
        assert "L1 local write of step 2 failed on rank(s) [1]" in r["error"], r
        assert "already exists" in r["error"], r
        assert r["failed_ranks"] == [1]
        assert r["parity_of_2"], r  # L3 did run alongside
        assert not r["committed_2"], r
        assert r["restored"] == 1 and r["weights_back"], r
    assert next(r for r in results if r["rank"] == 1)["in_the_way"] == "not a shard"


@pytest.mark.parametrize("pfs_recycle", [False, True])
def test_retired_files_become_spares_node_local_always_l4_only_when_asked(tmp_path, pfs_recycle):
    config = small_job(tmp_path, checkpoint={"every_steps": 5, "keep_local": 1, "keep_pfs": 1},
                       resilience={"levels": ["local", "pfs"]},
                       storage={"pfs_every": 1, "pfs_recycle_files": pfs_recycle})
    assert_ok(run_mpi(2, ["train", "-c", str(config)], cwd=tmp_path))
    run = tmp_path / "run"
    for node in (0, 1):
        assert [p.name for p in (node_local(run, node) / ".spare").iterdir()] == [f"shard-r{node:05d}.hck"]
    pfs_spares = run / "pfs" / ".spare"
    expected = ["shard-r00000.hck", "shard-r00001.hck"] if pfs_recycle else []
    assert (sorted(p.name for p in pfs_spares.iterdir()) if pfs_spares.exists() else []) == expected
    assert sorted(p.name for p in (run / "pfs").iterdir() if p.name.startswith("v")) == ["v000000000030"]


def test_spares_a_later_job_cannot_reuse_are_deleted_when_it_starts(tmp_path):
    config = small_job(tmp_path, checkpoint={"every_steps": 5, "keep_local": 1, "keep_pfs": 1},
                       resilience={"levels": ["local", "partner", "pfs"]},
                       storage={"pfs_every": 1, "pfs_recycle_files": True}, cluster={"simulated_nodes": 2})
    assert_ok(run_mpi(4, ["train", "-c", str(config)], cwd=tmp_path))
    run = tmp_path / "run"
    spares = {node: node_local(run, node) / ".spare" for node in (0, 1)}
    pfs_spares = run / "pfs" / ".spare"

    def names(directory):
        return sorted(p.name for p in directory.iterdir())

    # Ranks 0, 1 on node 0 and 2, 3 on node 1; each holds the replica of its partner on the other node.
    assert [n for n in names(spares[0]) if n.startswith("shard")] == ["shard-r00000.hck", "shard-r00001.hck"]
    assert len([n for n in names(spares[0]) if n.startswith("replica")]) == 2
    assert names(pfs_spares) == [f"shard-r{r:05d}.hck" for r in range(4)]
    (pfs_spares / "notes.txt").write_text("not a spare")
    # Two ranks now, one per node, from L4: ranks 2 and 3 are gone, rank 1 moved to node 1, and
    # the partners changed. What is left is what this job writes, and nothing else.
    resumed = run_mpi(2, ["train", "-c", str(config), "--set", "run.steps=40"], cwd=tmp_path)
    assert_ok(resumed)
    assert "restored version 30" in resumed.stdout
    assert names(spares[0]) == ["replica-of-r00001-held-by-r00000.hck", "shard-r00000.hck"]
    assert names(spares[1]) == ["replica-of-r00000-held-by-r00001.hck", "shard-r00001.hck"]
    assert names(pfs_spares) == ["notes.txt", "shard-r00000.hck", "shard-r00001.hck"]
    log = (run / "log" / "rank0.log").read_text()
    assert "deleted 2 spare file(s)" in log and str(pfs_spares) in log
    # Evaluating leaves the run as it is, even with other levels.
    evaluate = run_mpi(1, ["evaluate", "-c", str(config), "--set", "cluster.simulated_nodes=1",
                           "--set", "resilience.levels=[\"pfs\"]"], cwd=tmp_path)
    assert evaluate.returncode == 0, evaluate.stderr
    assert names(spares[0]) == ["replica-of-r00001-held-by-r00000.hck", "shard-r00000.hck"]
    assert names(pfs_spares) == ["notes.txt", "shard-r00000.hck", "shard-r00001.hck"]
    # Node-local recycling turned off: the node's spares go when the next training job starts.
    off = run_mpi(2, ["train", "-c", str(config), "--set", "run.steps=45", "--set", "storage.recycle_files=false"],
                  cwd=tmp_path)
    assert_ok(off)
    assert names(spares[0]) == [] and names(spares[1]) == []


def test_starting_a_finished_job_again_leaves_its_versions_good(tmp_path):
    """A resumed run with nothing left to do takes no step and no checkpoint; its clean end
    must confirm the restart, or the next start marks the newest version failed and rolls back."""
    job = ckpt_job(tmp_path, run={"steps": 20}, checkpoint={"every_steps": 10})
    for _ in range(3):
        proc = train(tmp_path, job, 2)
        assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "restored version 20" in out and "marked failed" not in out, out[-3000:]
    ledger = tmp_path / "run" / "restarts.json"
    assert not ledger.exists() or not json.loads(ledger.read_text())["failed"], ledger.read_text()
    assert not list((tmp_path / "run" / "pfs").glob("*.failed*"))


def test_retention_keeps_the_newest_partner_protected_version_when_partner_copies_are_sparse(tmp_path):
    from conftest import REPO, run_script, script_results

    script = REPO / "tests" / "scripts" / "sparse_partner_retention.py"
    run_dir = tmp_path / "run"
    saved = run_script(2, script, [str(run_dir), "save"], cwd=tmp_path)
    assert_ok(saved)
    # Versions 4 and 5 by count, and 3: the newest with partner copies.
    assert [r["committed"] for r in script_results(saved)] == [[3, 4, 5], [3, 4, 5]]
    shutil.rmtree(node_local(run_dir, 1))  # node 1 is lost, and nothing went to L4
    restored = run_script(2, script, [str(run_dir), "restore"], cwd=tmp_path)
    assert_ok(restored)
    records = script_results(restored)
    assert [(r["restored"], r["values"]) for r in records] == [(3, [3.0]), (3, [3.0])]
    assert records[0]["sources"] == ["local", "partner"]


def test_parity_is_decoded_with_the_geometry_that_cut_it(tmp_path):
    """Parity cut for parity = 1 is decoded as such after the config says parity = 2 (the
    commit record keeps the geometry; decoding it as parity 2 crashed the rebuild once), and
    the version is then protected under the new parity at once."""
    from hpcckpt.format.shardfile import read_shard_table

    job = ckpt_job(tmp_path, run={"steps": 10}, cluster={"simulated_nodes": 4},
                   resilience={"levels": ["local", "erasure"], "group_size": 4, "parity": 1})
    assert_ok(train(tmp_path, job))
    shutil.rmtree(node_local(tmp_path / "run", 1))
    other = run_mpi(4, ["train", "-c", str(job), "--set", "resilience.parity=2", "--set", "run.steps=10"],
                    cwd=tmp_path, timeout=120)
    assert_ok(other)
    assert "restored version 10 (written by 4 ranks) onto 4 rank(s): old shards 3 from L1 local, 1 from L3 " \
           "erasure" in other.stdout
    parity = node_local(tmp_path / "run", 1) / "v000000000010" / "parity-r00001.hck"
    assert read_shard_table(parity).extra["parity"] == 2


def test_a_step_written_by_two_runs_is_restored_from_one_writing_only(tmp_path):
    from conftest import REPO, run_script, script_results

    script = REPO / "tests" / "scripts" / "rewritten_step.py"
    run_dir = str(tmp_path / "run")
    assert_ok(run_script(4, script, [run_dir, "1", "3", "1", "2"], cwd=tmp_path, timeout=120))
    # Step 3 cannot be assembled (one shard gone, L4 has only 2): the 2-rank job resumes from
    # 2, writes it again node-locally (L4 keeps the 4-rank writing) and then step 3: two
    # writings of step 2, and the second run's step 3.
    (node_local(run_dir, 0) / "v000000000003" / "shard-r00001.hck").unlink()
    assert_ok(run_script(2, script, [run_dir, "3", "3", "10", "1"], cwd=tmp_path, timeout=120))
    proc = run_script(4, script, [run_dir, "4", "4", "1", "2"], cwd=tmp_path, timeout=120)
    assert "HANG" not in proc.stdout, proc.stdout[-3000:]
    assert_ok(proc)
    assert [(r["restored"], r["values"]) for r in script_results(proc)] == [(3, [30.0])] * 4


def test_offline_commands_see_missing_shards_damaged_headers_geometry_and_moved_runs(tmp_path):
    """verify checks every rank's shard is there and every shard, replica and parity file;
    inspect counts node losses with the parity that cut the version; export reads a run that
    was moved; evaluate repairs nothing."""
    from hpcckpt.format.shardfile import read_shard_table

    job = ckpt_job(tmp_path, run={"steps": 10}, cluster={"simulated_nodes": 4}, checkpoint={"keep_pfs": 1},
                   resilience={"levels": ["local", "erasure", "pfs"], "group_size": 4, "parity": 1})
    assert_ok(train(tmp_path, job))
    run = tmp_path / "run"
    listing = run_mpi(1, ["inspect", "-c", str(job), "--json", "--set", "resilience.parity=2"], cwd=tmp_path)
    assert_ok(listing)
    survives = {v["step"]: v["survives"] for v in json.loads(listing.stdout)}
    assert survives == {5: 1, 10: None}  # 5: L1 + L3 with parity 1, whatever the config says now
    clean = run_mpi(1, ["verify", "-c", str(job)], cwd=tmp_path)
    assert_ok(clean)
    # 2 node-local versions x (4 shards + 4 parity files) + L4's 4 shards of version 10.
    assert "verified 20 checkpoint file(s): all good" in clean.stdout, clean.stdout

    (run / "pfs" / "v000000000010" / "shard-r00002.hck").unlink()
    parity = node_local(run, 1) / "v000000000010" / "parity-r00001.hck"
    _flip(parity, 20)  # a header byte: repaired on read, but the medium is failing
    damaged = run_mpi(1, ["verify", "-c", str(job)], cwd=tmp_path)
    assert damaged.returncode == 1
    assert "pfs version 10: the shard file of rank(s) [2] is missing" in damaged.stdout, damaged.stdout
    assert f"{parity}: header damaged: Reed-Solomon repaired" in damaged.stdout

    moved = tmp_path / "moved"
    shutil.move(run, moved)
    exported = run_mpi(1, ["export", "-c", str(job), "--version", "5", "-o", str(tmp_path / "v5.h5"),
                           "--set", f"run.dir={moved}"], cwd=tmp_path)
    assert_ok(exported)  # node-local copies found under the run's new place, not the recorded one
    nowhere = run_mpi(1, ["verify", "-c", str(job), "--set", f"run.dir={tmp_path / 'nothing'}"], cwd=tmp_path)
    assert nowhere.returncode == 1 and "no checkpoint version found" in nowhere.stdout

    shard = node_local(moved, 0) / "v000000000010" / "shard-r00000.hck"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: rank 0 reads version 10 from L4
    evaluate = run_mpi(4, ["evaluate", "-c", str(job), "--version", "10", "--set", f"run.dir={moved}"], cwd=tmp_path)
    assert_ok(evaluate)
    assert shard.stat().st_size == 100  # evaluating read L4 and wrote nothing back
    assert read_shard_table(run.parent / "moved" / "pfs" / "v000000000010" / "shard-r00000.hck").step == 10
