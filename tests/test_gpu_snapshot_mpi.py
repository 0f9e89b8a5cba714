"""GPU snapshots on real ranks (mpiexec -n 2): side-stream copies hold the values at capture in
both buffer modes, and GPU memory stays flat. Skips where no GPU is present."""

from conftest import REPO, assert_ok, needs_gpu, run_script, script_results


@needs_gpu
def test_gpu_snapshot_holds_the_values_at_capture_in_both_modes(tmp_path):
    proc = run_script(2, REPO / "tests" / "scripts" / "gpu_snapshot.py", [str(tmp_path / "run")], cwd=tmp_path)
    assert_ok(proc)
    results = script_results(proc)
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout
    for result in results:
        for mode in ("device", "pinned"):
            got = result[mode]
            assert got["mode"] == mode
            for step, arrays in got["equal"].items():
                assert all(arrays.values()), (mode, step, arrays)
            assert got["used_after"] == got["used_before"], got  # nothing kept per checkpoint
