"""The trainer on real MPI ranks (mpiexec -n N), through the CLI."""

import pytest
from conftest import REPO, assert_ok, final_record, read_metrics, run_mpi, small_job


def test_default_job_reaches_95_percent_on_4_ranks(tmp_path):
    proc = run_mpi(4, ["train", "-c", str(REPO / "jobs" / "local.toml"), "--set", f"run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path)
    assert_ok(proc)
    final = final_record(tmp_path / "run")
    assert final["val_accuracy"] >= 0.95
    assert final["weights_identical_on_ranks"] is True
    assert "val_accuracy" in proc.stdout and "samples/s" in proc.stdout
    records = read_metrics(tmp_path / "run")
    assert any("loss" in r and "step" in r for r in records)
    # The default job checkpoints every 50 steps on all four levels; each cost is recorded.
    assert [r["step"] for r in records if "checkpoint_blocking_s" in r] == list(range(50, 401, 50))
    durable = {r["step"]: r["checkpoint_durable_s"] for r in records if "checkpoint_durable_s" in r}
    assert sorted(durable) == list(range(50, 401, 50))
    assert set(durable[100]) == {"local", "partner", "erasure", "pfs"} and set(durable[50]) == {"local", "partner",
                                                                                                "erasure"}
    assert any("val_loss" in r and "val_accuracy" in r for r in records)
    # Other ranks keep their own logs.
    assert sorted(p.name for p in (tmp_path / "run" / "log").iterdir()) == [f"rank{r}.log" for r in range(4)]


def test_two_runs_give_bit_identical_weights(tmp_path):
    digests = []
    for attempt in ("a", "b"):
        (tmp_path / attempt).mkdir()
        job = small_job(tmp_path / attempt, optimizer={"kind": "adam", "lr": 0.003})
        assert_ok(run_mpi(3, ["train", "-c", str(job)], cwd=tmp_path))
        digests.append(final_record(tmp_path / attempt / "run")["weights_digest"])
    assert digests[0] == digests[1]


def test_conv1d_on_hdf5_data_with_uneven_batches(tmp_path):
    data = tmp_path / "data.h5"
    assert_ok(run_mpi(1, ["make-data", "-o", str(data), "--samples", "500", "--features", "32", "--classes", "3"],
                      cwd=tmp_path))
    job = small_job(tmp_path, model={"kind": "conv1d", "conv_channels": [4, 8], "hidden": [16]},
                    data={"source": "hdf5", "path": str(data), "batch_size": 30}, run={"steps": 40})
    proc = run_mpi(4, ["train", "-c", str(job), "--set", "cluster.simulated_nodes=3"], cwd=tmp_path)
    assert_ok(proc)
    final = final_record(tmp_path / "run")
    assert final["weights_identical_on_ranks"] is True
    assert final["val_accuracy"] > 0.6  # 3 well-separated classes; chance is 0.33


@pytest.mark.parametrize("model", [{"kind": "mlp", "hidden": [16]},
                                   {"kind": "conv1d", "conv_channels": [4], "hidden": [8]}])
def test_ranks_with_an_empty_share_of_a_batch_still_train(tmp_path, model):
    """A global batch smaller than the rank count (or an epoch's last, partial batch) leaves
    some ranks no samples: they must take part with zero gradients, not crash on reshape."""
    job = small_job(tmp_path, model=model, data={"batch_size": 3}, run={"steps": 6, "log_every": 3},
                    eval={"every_steps": 0})
    proc = run_mpi(4, ["train", "-c", str(job)], cwd=tmp_path)
    assert_ok(proc)
    assert final_record(tmp_path / "run")["weights_identical_on_ranks"] is True


def _assert_config_error(proc, tmp_path, fragment):
    assert proc.returncode == 2, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if "hpcckpt: error" in line]
    assert len(error_lines) == 1, proc.stderr  # printed once, not once per rank
    assert fragment in error_lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no training started


def test_bad_configs_fail_with_one_line_and_exit_2(tmp_path):
    job = small_job(tmp_path)
    _assert_config_error(run_mpi(4, ["train", "-c", str(job), "--set", "cluster.simulated_nodes=5"], cwd=tmp_path),
                         tmp_path, "simulated_nodes = 5 but only 4 ranks")
    _assert_config_error(run_mpi(2, ["train", "-c", str(job), "--set", "run.stepz=5"], cwd=tmp_path),
                         tmp_path, "unknown key run.stepz")
    _assert_config_error(run_mpi(2, ["train", "-c", str(job), "--set", "run.steps=\"x\""], cwd=tmp_path),
                         tmp_path, "run.steps: expected an integer")
    _assert_config_error(run_mpi(2, ["train", "-c", str(job), "--set", "data.source=\"hdf5\"",
                                     "--set", "data.path=\"missing.h5\""], cwd=tmp_path),
                         tmp_path, "missing.h5")
