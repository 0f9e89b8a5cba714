"""Rewinding in process (Checkpointer.rewind, schedule/rewind.py) on real ranks."""

import json

from conftest import REPO, assert_ok, run_script, script_results

SCRIPT = REPO / "tests" / "scripts" / "rewind_solver.py"


def test_a_solver_that_meets_a_nan_rewinds_in_process_and_ends_on_the_undisturbed_grid(tmp_path):
    straight = run_script(2, SCRIPT, [str(tmp_path / "straight"), "40", "0"], cwd=tmp_path)
    assert_ok(straight)
    disturbed = run_script(2, SCRIPT, [str(tmp_path / "run"), "40", "23"], cwd=tmp_path)
    assert_ok(disturbed)
    (result,) = script_results(disturbed)
    (reference,) = script_results(straight)
    # The NaN entered at 23 and was seen there: back to version 20, nothing written after it.
    assert result["rewinds"] == [[23, 20, 20]]
    assert result["grid"] == reference["grid"]
    assert "rewound from step 23 to version 20: non-finite grid at iteration 23" in disturbed.stdout + disturbed.stderr
    ledger = json.loads((tmp_path / "run" / "restarts.json").read_text()) \
        if (tmp_path / "run" / "restarts.json").exists() else {}
    # Nothing at or after 23 had been written, so nothing was marked bad.
    assert not ledger.get("failed")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m.get("event") == "rewind"] == [20]


def test_a_version_marked_bad_is_never_restarted_from(tmp_path):
    assert_ok(run_script(2, SCRIPT, [str(tmp_path / "run"), "20", "0"], cwd=tmp_path))
    marker = tmp_path / "mark.py"
    marker.write_text(
        "import sys\nfrom mpi4py import MPI\nimport numpy as np\nfrom hpcckpt import Checkpointer, load_config\n"
        "config = load_config(None, [f'run.dir={sys.argv[1]}', 'cluster.simulated_nodes=2', "
        "'resilience.levels=[\"local\",\"partner\",\"pfs\"]'], environ={})\n"
        "ckpt = Checkpointer(MPI.COMM_WORLD, config)\n"
        "ckpt.protect('grid', np.zeros(1000), replicated=False)\n"
        "ckpt.register_state('solver', lambda: {}, lambda s: None)\n"
        "ckpt.mark_bad(20, 'a wrong result found by hand')\n"
        "print('RESULT', ckpt.restart('require'), flush=True)\nckpt.close()\n")
    proc = run_script(2, marker, [str(tmp_path / "run")], cwd=tmp_path)
    assert_ok(proc)
    assert "RESULT 15" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


VOUCHED = REPO / "tests" / "scripts" / "vouched_state.py"


def test_a_version_whose_finite_loss_vouches_for_arrays_holding_nan_falls_back_on_every_route(tmp_path):
    for name in ("same", "fewer", "unchecked"):
        assert_ok(run_script(4, VOUCHED, [str(tmp_path / name), "write"], cwd=tmp_path))
    written = (tmp_path / "same" / "log" / "rank0.log").read_text()
    assert "step 15 is not checkpointed: its metrics loss are not finite" in written
    assert not list((tmp_path / "same" / "pfs").glob("v*15"))
    # As written: version 10's copy on every level (L1, the partner's replica, L4) holds NaN
    # under a finite loss, so each fails like a checksum mismatch and version 5 is loaded.
    same = run_script(4, VOUCHED, [str(tmp_path / "same"), "restore"], cwd=tmp_path)
    assert_ok(same)
    assert script_results(same) == [{"restored": 5, "finite": True}]
    logs = "".join(p.read_text() for p in (tmp_path / "same" / "log").glob("rank*.log"))
    assert "'weights' holds NaN or inf, but version 10 recorded a finite loss (0.1)" in logs
    for level in ("L1 local", "L2 partner", "L4 pfs"):
        assert f"version 10 from {level}" in logs, level
    # Onto another rank count, assembled from the old shards: the same.
    fewer = run_script(3, VOUCHED, [str(tmp_path / "fewer"), "restore"], cwd=tmp_path)
    assert_ok(fewer)
    assert script_results(fewer) == [{"restored": 5, "finite": True}]
    # An application whose arrays hold NaN on purpose turns the check off.
    unchecked = run_script(4, VOUCHED, [str(tmp_path / "unchecked"), "restore", "checkpoint.verify_finite=false"],
                           cwd=tmp_path)
    assert_ok(unchecked)
    assert script_results(unchecked) == [{"restored": 10, "finite": False}]
