"""Blocks of a global array (#23 item 1) on real mpiexec ranks: saved on 4 ranks (4 nodes,
all four levels), restored byte for byte onto 6, 3 (after a node loss, from the node-local
levels), 1 (from L4, every node-local copy gone) and 4 ranks in another decomposition; bad
blocks and a checkpoint that does not match give one clear error on every rank."""

import shutil
from pathlib import Path

import pytest
from conftest import assert_ok, run_script, script_results

SCRIPT = Path(__file__).parent / "scripts" / "block_arrays.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("blocks")
    assert_ok(run_script(4, SCRIPT, [str(tmp_path / "run"), "4", "save"], cwd=tmp_path))
    return tmp_path / "run"


def restored(saved: Path, tmp_path: Path, ranks: int, nodes: int, lose=(), mode="restore") -> list:
    run = tmp_path / "run"
    shutil.copytree(saved, run)  # each restart writes the version again under its own geometry
    for node in lose:
        shutil.rmtree(run / "local" / f"node{node}")
    proc = run_script(ranks, SCRIPT, [str(run), str(nodes), mode], cwd=tmp_path)
    assert_ok(proc)
    results = script_results(proc)
    assert len(results) == ranks
    for result in results:
        assert result["step"] == 10 and result["field"] and result["mask"] and result["w"], result
    assert sum(r["held"] for r in results) == 29 * 17 * 6  # every element on exactly one new rank
    return results[0]["sources"]


@pytest.mark.parametrize("ranks, nodes, lose, mode, sources", [
    (6, 3, (), "restore", {"local", "partner"}),            # node 3's directory is on no new node
    (3, 3, (1,), "restore", {"local", "partner"}),          # node 1 lost: its shard from a replica
    (1, 1, (0, 1, 2, 3), "restore", {"pfs"}),              # no node-local copy left
    (4, 4, (), "restore-reordered", {"local"}),             # as many ranks, other blocks
])
def test_blocks_saved_on_4_ranks_come_back_on_another_decomposition(saved, tmp_path, ranks, nodes, lose, mode,
                                                                    sources):
    assert set(restored(saved, tmp_path, ranks, nodes, lose, mode)) == sources


def errors(proc, code: int) -> set:
    assert proc.returncode == code, proc.stdout + proc.stderr
    results = script_results(proc)
    assert len(results) == 4 and all("error" in r for r in results), results
    return {r["error"] for r in results}


def test_overlapping_blocks_are_one_error_on_every_rank_before_anything_is_written(tmp_path):
    """Bad input: exit 2, with what to do about halo cells."""
    [message] = errors(run_script(4, SCRIPT, [str(tmp_path / "run"), "4", "overlap"], cwd=tmp_path), 2)
    assert "ConfigError: the protected block arrays do not fit together: array 'field': the blocks of ranks 0 and 1 " \
           "overlap in [8:10, 0:6, 0:6]" in message and "protect the interior without them" in message
    assert not list((tmp_path / "run").rglob("v0*"))


def test_a_checkpoint_of_another_dtype_or_global_shape_is_refused_on_every_rank(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    [message] = errors(run_script(4, SCRIPT, [str(run), "4", "restore-wrong"], cwd=tmp_path), 4)
    assert "tensor 'field': dtype float64 in the checkpoint, float32 in the current model" in message
    assert "tensor 'mask': shape (40,) in the checkpoint, (41,) in the current model" in message
    assert (run / "pfs" / "v000000000010").is_dir()  # nothing saved is lost


SLABS = Path(__file__).parent / "scripts" / "replicated_slabs.py"


@pytest.mark.parametrize("ranks, chunk_bytes", [(4, 1000), (3, 1000), (4, 8 << 20)])
def test_replicated_arrays_are_gathered_back_a_slab_at_a_time(tmp_path, ranks, chunk_bytes):
    """Saved on 4 ranks, restored onto 4 or 3 with chunks of 1000 bytes (arrays of up to 24 KB
    in 2-25 slabs) and of 8 MiB (one slab each): every array byte for byte, a strided target's
    neighbours untouched."""
    run = str(tmp_path / "run")
    assert_ok(run_script(4, SLABS, [run, "save", str(chunk_bytes)], cwd=tmp_path))
    proc = run_script(ranks, SLABS, [run, "restore", str(chunk_bytes)], cwd=tmp_path)
    assert_ok(proc)
    results = script_results(proc)
    assert len(results) == ranks
    for result in results:
        assert result == {"rank": result["rank"], "step": 7, "untouched": True,
                          "same": ["cube", "lead_one", "row", "scalar", "tall", "wide"]}, result
