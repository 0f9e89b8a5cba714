"""A training run that diverges (an injected NaN in one rank's gradients) on real ranks: never
checkpointed, rewound in process with the batches that led to it skipped, or stopped."""

import h5py
import numpy as np
from conftest import assert_ok, read_metrics, run_mpi, small_job

STEPS = 60


def job(tmp_path, **resilience):
    return small_job(tmp_path, run={"steps": STEPS, "log_every": 10},
                     checkpoint={"every_steps": 10, "keep_local": 3, "keep_pfs": 10},
                     resilience={"levels": ["local", "partner", "pfs"], **resilience})


def train(tmp_path, config, *extra):
    return run_mpi(4, ["train", "-c", str(config), *extra], cwd=tmp_path)


def final_accuracy(run_dir):
    return [r for r in read_metrics(run_dir) if r.get("final")][-1]["val_accuracy"]


def test_a_nan_rewinds_to_the_newest_version_before_it_and_skips_its_batch(tmp_path):
    straight_dir = tmp_path / "straight"
    straight_dir.mkdir()
    assert_ok(train(straight_dir, job(straight_dir)))
    config = job(tmp_path, rewind_on_divergence=True, skip_batches_on_rewind=2)
    proc = train(tmp_path, config, "--inject", "nan:step=34:rank=2")
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "rewound from step 34 to version 30: non-finite gradients at step 34" in out, out[-3000:]
    assert "skipped 2 batch(es) that led to the divergence at step 34" in out
    events = [r for r in read_metrics(tmp_path / "run") if r.get("event") in ("diverged", "rewind")]
    assert [(e["event"], e["step"]) for e in events] == [("rewind", 30), ("diverged", 34)]
    report = run_mpi(1, ["report", "-c", str(config)], cwd=tmp_path)
    assert "rewinds after divergence: 1: step 34 back to version 30 (2 batch(es) skipped)" in report.stdout, \
        report.stdout
    # Every version written holds finite values only, and the run ends as well as one undisturbed.
    for version in sorted((tmp_path / "run" / "pfs").glob("v*/")):
        exported = tmp_path / f"{version.name}.h5"
        assert_ok(run_mpi(1, ["export", "-c", str(config), "--version", str(int(version.name[1:])), "-o",
                              str(exported)], cwd=tmp_path))
        with h5py.File(exported) as f:
            f.visititems(lambda name, obj: isinstance(obj, h5py.Dataset) and obj.dtype.kind == "f"
                         and np.testing.assert_(np.isfinite(obj[()]).all(), name))
    # Two batches fewer than the undisturbed run: no worse beyond the step-to-step noise of a
    # run this short (the accuracy still climbs some points per ten steps here).
    assert final_accuracy(tmp_path / "run") > final_accuracy(straight_dir / "run") - 0.05


def test_without_rewinds_a_nan_stops_the_run_with_exit_2_and_nothing_non_finite_saved(tmp_path):
    proc = train(tmp_path, job(tmp_path), "--inject", "nan:step=34")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step 34: the gradients are not finite (NaN or inf): the run diverged" in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "pfs" / "v000000000040").exists()


def test_too_many_rewinds_in_a_window_stop_the_run_naming_the_steps(tmp_path):
    config = job(tmp_path, rewind_on_divergence=True, max_rewinds=1)
    proc = train(tmp_path, config, "--inject", "nan:step=24", "--inject", "nan:step=36")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the run diverged 2 times within 1000 steps (at steps [24, 36]), more than resilience.max_rewinds = 1" \
        in proc.stdout + proc.stderr
