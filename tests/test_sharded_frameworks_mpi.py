"""Sharded state as frameworks describe it, on real ranks: PyTorch FSDP2 models (DTensors,
protected one by one or as one state dict, on a 1-D mesh and as HSDP on a 2-D one) killed and
resumed on as many and on fewer ranks; DTensors of every placement and the ones refused; a
solver framework that starts MPI itself and hands its decomposition as slices. Nothing is
ever restored wrong in silence: what cannot be restored in place is refused, exit 2."""

import shutil

import pytest
from conftest import REPO, assert_ok, read_metrics, run_script, script_results

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

FSDP = REPO / "tests" / "scripts" / "fsdp_model.py"
CASES = REPO / "tests" / "scripts" / "dtensor_cases.py"
SOLVER = REPO / "tests" / "scripts" / "framework_solver.py"
STEPS, CRASH = 15, 12  # versions every 5 steps: the crash at 12 leaves 10 the newest
HSDP = ("--mesh", "2")  # 2 replicas x 2 shards: Replicate beside Shard(0)
ONE_CALL = ("--state-dict",)


def fsdp(ranks: int, run_dir, *args, cwd):
    return run_script(ranks, FSDP, [str(run_dir), str(STEPS), *args], cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A run killed at step 12 on 4 ranks, once per way of running it: (its run directory,
    what it saved at version 10: the gathered full state's digest and each rank's shards')."""
    runs = {}

    def run(args: tuple):
        if args not in runs:
            directory = tmp_path_factory.mktemp("crashed")
            proc = fsdp(4, directory / "run", "--crash-at", str(CRASH), *args, cwd=directory)
            assert proc.returncode != 0
            saved = {r["saved"]: r for r in script_results(proc) if "saved" in r}
            assert sorted(saved) == [5, 10], proc.stdout + proc.stderr
            runs[args] = (directory / "run", saved[10])
        return runs[args]
    return run


def resume(crashed, tmp_path, ranks: int, args: tuple, resumed_args: tuple | None = None):
    """The crashed run copied and resumed on `ranks`: its RESULT lines and output."""
    source, saved = crashed(args)
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    proc = fsdp(ranks, run_dir, *(args if resumed_args is None else resumed_args), cwd=tmp_path)
    assert_ok(proc)
    return script_results(proc), saved, proc


@pytest.mark.parametrize("args", [(), HSDP, ONE_CALL], ids=["fsdp", "hsdp", "one-call"])
def test_an_fsdp2_model_killed_resumes_on_4_ranks_as_it_was_saved(crashed, tmp_path, args):
    """Killed at step 12; resumed on 4 ranks: the full state gathered after the restore and
    every rank's own shards are version 10's, byte for byte (with HSDP the ranks that did not
    store a block got it from the one that did; in one call, the hyperparameters written back
    into the state dict and handed to set_state_dict), and the run goes on to its end."""
    results, saved, proc = resume(crashed, tmp_path, 4, args)
    assert {k: results[0][k] for k in ("restored", "digest", "locals", "ranks")} == \
        {"restored": 10, "digest": saved["digest"], "locals": saved["locals"], "ranks": 4}, proc.stdout
    assert results[-1]["final"] == STEPS
    assert [r["sources"] for r in read_metrics(tmp_path / "run") if r.get("event") == "restart"][-1] == ["local"] * 4


@pytest.mark.parametrize("ranks, args", [(2, ()), (3, ()), (2, HSDP), (3, ONE_CALL)],
                         ids=["fsdp-2", "fsdp-3", "hsdp-2", "one-call-3"])
def test_an_fsdp2_model_resumes_on_fewer_ranks_byte_equal_at_the_version_restored(crashed, tmp_path, ranks, args):
    """The same crash resumed on 2 and on 3 ranks (a 1-D mesh, uneven shards; from HSDP too):
    the blocks come back through the block path, the full state gathered equal to version 10's,
    with no warning that the run changed meaning (another rank count does not)."""
    results, saved, proc = resume(crashed, tmp_path, ranks, args, ONE_CALL if args == ONE_CALL else ())
    assert (results[0]["restored"], results[0]["digest"], results[0]["ranks"]) == (10, saved["digest"], ranks), \
        proc.stdout
    assert f"written by 4 ranks) onto {ranks} rank(s)" in proc.stdout
    assert f"world_size 4 -> {ranks}" in proc.stdout and "alter what the restored state means" not in proc.stderr


def cases(tmp_path, mode: str, code: int) -> list[dict]:
    proc = run_script(4, CASES, [str(tmp_path / "run"), mode], cwd=tmp_path, timeout=300)
    assert proc.returncode == code, proc.stdout + proc.stderr
    results = script_results(proc)
    assert len(results) == 4, proc.stdout + proc.stderr
    return results


def test_dtensors_of_every_placement_come_back_and_partial_is_refused(tmp_path):
    """Shard on either dimension, uneven and empty shards, two mesh dimensions on one tensor
    dimension, Replicate, Replicate beside Shard: placed as torch places them, restored equal;
    a Partial DTensor refused naming it."""
    for result in cases(tmp_path, "placements", 0):
        assert all(result["same_place"].values()), result
        assert result["step"] == 10 and all(result["equal"].values()) and all(result["local_equal"].values()), result
        assert result["partial"].startswith("protect('partial'): the DTensor's placement P(sum) holds partial values")


def test_a_shard_protected_as_if_replicated_is_refused_at_the_first_checkpoint(tmp_path):
    """Each rank's to_local() protected without global_shape: refused on every rank, naming
    the array and which ranks differ; nothing saved."""
    messages = {r["error"] for r in cases(tmp_path, "to-local", 2)}
    assert len(messages) == 1, messages
    [message] = messages
    assert message.startswith("ConfigError: protected as replicated but not the same on every rank that holds it: "
                              "'head.weight' (ranks 0 vs ranks 1 vs ranks 2 vs ranks 3)"), message
    assert "a DTensor itself rather than its to_local()" in message
    assert not list((tmp_path / "run").rglob("v0*"))


def test_a_tensor_given_new_storage_after_protect_is_refused_at_the_next_checkpoint(tmp_path):
    """param.data = ... after protect(): what hpcckpt holds is stale; the next checkpoint is
    refused naming it, and the version before stays the newest."""
    for result in cases(tmp_path, "moved", 2):
        assert result["error"].startswith("ConfigError: protect('layer.weight'): the Parameter no longer computes on "
                                          "the memory hpcckpt protects"), result
    assert {p.name for p in (tmp_path / "run").rglob("v0*")} == {"v000000000010"}


def solver(tmp_path, ranks: int, mode: str, run: str = "run"):
    return run_script(ranks, SOLVER, [str(tmp_path / run), mode], cwd=tmp_path, timeout=120)


def test_a_checkpointer_made_before_the_framework_starts_mpi_is_bad_input(tmp_path):
    proc = solver(tmp_path, 4, "early")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hpcckpt: error: MPI is not running: create the Checkpointer once MPI has started" in proc.stderr
    assert proc.stderr.count("hpcckpt: error") == 1, proc.stderr


def test_blocks_given_as_the_frameworks_slices_come_back_on_another_rank_count_without_a_false_alarm(tmp_path):
    """Saved on 4 ranks from the framework's slices (NumPy integers), restored onto 2: each
    part equal, the halo untouched; the rank count is said as a change, not as one that alters
    what the state means."""
    assert_ok(solver(tmp_path, 4, "save"))
    restored = solver(tmp_path, 2, "restore")
    assert_ok(restored)
    results = script_results(restored)
    assert results == [{"rank": r, "step": 10, "equal": True, "halo_untouched": True} for r in range(2)], results
    assert "settings changed since version 10 was written: world_size 4 -> 2" in restored.stdout
    assert "alter what the restored state means" not in restored.stdout + restored.stderr


@pytest.mark.parametrize("mode, says", [
    ("halo", "offset slice(np.int64(-1), np.int64(6), None) on axis 0 starts before the global array (a block with "
             "halo cells reaches past its edge"),
    ("halo-rows", "rank 3's block [16:24, 0:9] is not inside the global shape (23, 9) (a block that includes halo "
                  "cells reaches past the global array"),
])
def test_blocks_with_their_halo_are_bad_input_with_a_hint(tmp_path, mode, says):
    proc = solver(tmp_path, 4, mode)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and "protect the interior without them" in proc.stderr, proc.stderr
    assert not list((tmp_path / "run").rglob("v0*"))
