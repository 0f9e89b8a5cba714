"""Host memory stays flat over hundreds of checkpoints: buffers are reused, nothing accumulates."""

import json
import shutil
import tempfile
from pathlib import Path

from conftest import REPO, assert_ok, run_script


def test_rss_flat_over_500_checkpoints(tmp_path):
    """A leak of what one checkpoint holds (a 128 KiB array, a buffer, a record per version)
    grows the resident memory by more than 5 % over 450 checkpoints."""
    proc = run_script(2, REPO / "tests" / "scripts" / "rss_loop.py", [str(tmp_path / "run"), "500"], cwd=tmp_path,
                      timeout=400)
    assert_ok(proc)
    samples = json.loads(proc.stdout.split("RSS ", 1)[1])
    for per_rank in samples:
        values = {int(k): v for k, v in per_rank.items()}
        early, late = values[50], values[500]
        assert late <= early * 1.05, f"RSS grew from {early} to {late} bytes over 450 checkpoints"
    # Retention kept the disk flat too: 2 local versions per rank.
    local_versions = {p.parent.name for p in (tmp_path / "run" / "local").rglob("commit-r*.json")}
    assert local_versions == {"v000000000499", "v000000000500"}


def test_a_node_short_of_memory_is_told_before_the_first_checkpoint(tmp_path):
    """2 ranks per node, 16 MiB shards, all levels, 1 MiB chunks: each rank needs its snapshot,
    2 + 3 chunks and 2 bounce buffers; a node with 40 MiB available is told so, in one line
    with the numbers, and the job goes on; with 4 GiB nothing is said."""
    script = REPO / "tests" / "scripts" / "memory_forecast.py"
    short = run_script(4, script, [str(tmp_path / "short" / "run"), "40"], cwd=tmp_path)
    assert_ok(short)
    assert "DONE" in short.stdout
    lines = [line for line in short.stderr.splitlines() if "checkpointing will need" in line]
    assert len(lines) == 1, short.stderr
    # 2 x (16 MiB + 5 MiB + 16 MiB) = 74 MiB per node (the shard file's header rounds it up a little)
    assert "GiB of host memory on node 0 (and 1 more node(s)): 2 rank(s)" in lines[0]
    assert "0.04 GiB available" in lines[0] and "checkpoint.chunk_mib" in lines[0]
    roomy = run_script(4, script, [str(tmp_path / "roomy" / "run"), "4096"], cwd=tmp_path)
    assert_ok(roomy)
    assert "checkpointing will need" not in roomy.stderr


def test_versions_kept_in_memory_are_counted_in_what_a_node_needs(tmp_path):
    """The same job, 2 ranks per node with 16 MiB shards, on a node with 200 MiB available:
    its buffers (~74 MiB per node) fit; its versions in /dev/shm would add 3 versions x 2 ranks x
    (shard + replica + parity) = 288 MiB under a 1000 MB budget, and the node is told; under a
    50 MB budget (the rest spills to the disk) they fit again."""
    from hpcckpt.levels.node_places import RAM_FILE_SYSTEMS, file_system_type

    assert file_system_type("/dev/shm") in RAM_FILE_SYSTEMS, "this test keeps versions in /dev/shm, a RAM file system"
    script = REPO / "tests" / "scripts" / "memory_forecast.py"
    memory = Path(tempfile.mkdtemp(prefix="hpcckpt-forecast-", dir="/dev/shm"))
    try:
        said = {}
        for budget in (1000, 50):
            proc = run_script(4, script, [str(tmp_path / f"b{budget}" / "run"), "200",
                                          str(memory / f"b{budget}" / "node{node}"), str(budget)], cwd=tmp_path)
            assert_ok(proc)
            assert "DONE" in proc.stdout
            said[budget] = [line for line in proc.stderr.splitlines() if "checkpointing will need" in line]
        assert len(said[1000]) == 1, said
        assert "GiB of node-local versions in memory (storage.memory_dir)" in said[1000][0]
        assert "0.28 GiB of node-local versions in memory" in said[1000][0]  # 288 MiB
        assert said[50] == []
    finally:
        shutil.rmtree(memory, ignore_errors=True)
