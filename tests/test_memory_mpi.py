"""Host memory stays flat over 1,000 checkpoints: buffers are reused, nothing accumulates."""

import json

from conftest import REPO, assert_ok, run_script


def test_rss_flat_over_1000_checkpoints(tmp_path):
    proc = run_script(2, REPO / "tests" / "scripts" / "rss_loop.py", [str(tmp_path / "run"), "1000"], cwd=tmp_path,
                      timeout=400)
    assert_ok(proc)
    samples = json.loads(proc.stdout.split("RSS ", 1)[1])
    for per_rank in samples:
        values = {int(k): v for k, v in per_rank.items()}
        early, late = values[100], values[1000]
        assert late <= early * 1.05, f"RSS grew from {early} to {late} bytes over 900 checkpoints"
    # Retention kept the disk flat too: 2 local versions per rank.
    local_versions = {p.parent.name for p in (tmp_path / "run" / "local").rglob("commit-r*.json")}
    assert local_versions == {"v000000000999", "v000000001000"}
