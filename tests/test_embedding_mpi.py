"""The embedding model under `hpcckpt train` on real ranks: click data from `hpcckpt make-data
--clicks`, embedding rows placed by the hash of their id across ranks and checkpointed as a
keyed table (whole, then deltas); killed and restarted it ends bit-identical to an
uninterrupted run on as many ranks, and goes on on another rank count."""

import shutil

from conftest import assert_ok, final_record, read_metrics, run_mpi, small_job

STEPS = 60


def clicks_job(tmp_path, data_path, **checkpoint):
    return small_job(tmp_path, run={"steps": STEPS, "log_every": 10},
                     model={"kind": "embedding", "hidden": [32, 16], "embedding_dim": 8},
                     data={"source": "hdf5", "path": str(data_path), "batch_size": 64},
                     optimizer={"kind": "sgd", "lr": 0.1}, eval={"every_steps": 30},
                     checkpoint={"every_steps": 10, "table_full_every": 3, **checkpoint},
                     resilience={"levels": ["local", "partner", "pfs"]})


def train(tmp_path, config, ranks=4, *extra):
    return run_mpi(ranks, ["train", "-c", str(config), *extra], cwd=tmp_path)


def test_the_embedding_model_restarts_bit_identical_and_onto_another_rank_count(tmp_path):
    data = tmp_path / "clicks.h5"
    made = run_mpi(1, ["make-data", "--clicks", "-o", str(data), "--samples", "3000", "--features", "4",
                       "--fields", "6", "--vocabulary", "4000"], cwd=tmp_path)
    assert_ok(made)
    assert "6 categorical field(s) of 4000 ids" in made.stdout
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    straight = train(straight_dir, clicks_job(straight_dir, data))
    assert_ok(straight)
    reference = final_record(straight_dir / "run")
    assert reference["table_rows"] > 1000 and reference["val_accuracy"] > 0.55
    config = clicks_job(tmp_path, data)
    # Killed as the snapshot of step 60 opens: version 50 is durable (the snapshot waits for it).
    crashed = train(tmp_path, config, 4, "--inject", "rank-kill:rank=2:step=60:phase=snapshot")
    assert crashed.returncode != 0
    shutil.copytree(tmp_path / "run", tmp_path / "run-copy", symlinks=True)
    resumed = train(tmp_path, config)
    assert_ok(resumed)
    # 50 is a delta (chain 40, 50): its rows are applied over 40's whole table.
    assert "restored version 50: 4 rank(s) from L1 local" in resumed.stdout, resumed.stdout
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "log").glob("rank*.log"))
    assert "version 50: tables restored from 2 version(s) of their chain ([40, 50])" in logs
    final = final_record(tmp_path / "run")
    assert (final["weights_digest"], final["table_digest"], final["table_rows"]) == \
        (reference["weights_digest"], reference["table_digest"], reference["table_rows"])
    # The same crash, resumed on 3 ranks: every row goes to the rank its id hashes to among 3.
    shutil.rmtree(tmp_path / "run")
    shutil.move(tmp_path / "run-copy", tmp_path / "run")
    onto_three = train(tmp_path, config, 3)
    assert_ok(onto_three)
    assert "restored version 50 (written by 4 ranks) onto 3 rank(s)" in onto_three.stdout, onto_three.stdout
    final = final_record(tmp_path / "run")
    assert final["table_rows"] == reference["table_rows"]
    assert abs(final["val_accuracy"] - reference["val_accuracy"]) < 0.05
    restarts = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "restart" and r.get("step")]
    assert restarts[-1]["ranks"] == 3


def test_ranks_with_no_validation_sample_still_take_part_in_the_lookups(tmp_path):
    # 3 validation samples on 4 ranks: rank 3 evaluates nothing, yet every lookup is collective.
    config = small_job(tmp_path, run={"steps": 4, "log_every": 2},
                       model={"kind": "embedding", "hidden": [8], "embedding_dim": 4},
                       data={"source": "clicks", "samples": 300, "features": 2, "fields": 3, "vocabulary": 50,
                             "val_fraction": 0.01, "batch_size": 6},
                       eval={"every_steps": 2}, checkpoint={"every_steps": 2})
    assert_ok(train(tmp_path, config))
