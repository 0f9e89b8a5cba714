"""Per-level intervals on real ranks: failure rates by class make the library take each level
only as often as the failures it covers are worth (schedule/level_intervals.py)."""

import re

from conftest import assert_ok, final_record, read_metrics, run_mpi, small_job

ALL_LEVELS = ["local", "partner", "erasure", "pfs"]


def job(tmp_path, levels=ALL_LEVELS, **rates):
    return small_job(tmp_path, run={"steps": 300, "log_every": 50},
                     checkpoint={"every_steps": "auto", "keep_local": 2, "keep_pfs": 2},
                     resilience={"levels": levels, "group_size": 4, "parity": 2, **rates},
                     cluster={"simulated_nodes": 4}, eval={"every_steps": 1000})


def train(tmp_path, config, *extra):
    return run_mpi(4, ["train", "-c", str(config), *extra], cwd=tmp_path)


def versions_per_level(tmp_path) -> dict:
    """The steps of the versions each level took on rank 0, from its log ("step N: LEVEL done
    after ...")."""
    steps = {level: [] for level in ALL_LEVELS}
    for step, level in re.findall(r"step (\d+): (\w+) done after", (tmp_path / "run" / "log" / "rank0.log").read_text()):
        steps[level].append(int(step))
    return steps


def test_levels_that_cover_no_failure_set_take_only_the_first_and_final_versions(tmp_path):
    # Only rank crashes: L1 covers them, L2-L4 add nothing but cost.
    config = job(tmp_path, mtbf_crash_hours=0.0002)
    done = train(tmp_path, config)
    assert_ok(done)
    said = (tmp_path / "run" / "log" / "rank0.log").read_text()
    chosen = re.findall(r"checkpoint interval now \d+ steps: (.*?); per-level intervals", said)
    assert chosen and set(chosen) == {"partner every 64, erasure every 64, pfs every 64"}, chosen
    assert "rank crash from local" in said
    # The first checkpoint measures every level; after it only L1, until the final version (or
    # a 64th version, had the measured costs made the interval that short). How many versions
    # L1 took in 300 steps is the interval the measured costs gave.
    steps = versions_per_level(tmp_path)
    local = steps["local"]
    assert local == sorted(set(local)) and local[-1] == 300, steps
    rarest = [step for number, step in enumerate(local, 1) if number == 1 or number % 64 == 0 or step == 300]
    assert all(steps[level] == rarest for level in ("partner", "erasure", "pfs")), steps


def test_a_crash_restarts_from_l1_onto_the_uninterrupted_weights(tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    assert_ok(train(reference, job(reference, mtbf_crash_hours=0.0002)))
    config = job(tmp_path, mtbf_crash_hours=0.0002)
    crashed = train(tmp_path, config, "--inject", "rank-kill:rank=2:step=250")
    assert crashed.returncode != 0
    resumed = train(tmp_path, config)
    assert_ok(resumed)
    assert re.search(r"restored version \d+: 4 rank\(s\) from L1 local", resumed.stdout), resumed.stdout
    assert final_record(tmp_path / "run")["weights_digest"] == final_record(reference / "run")["weights_digest"]


def test_a_failure_class_only_l4_covers_is_recovered_from_l4(tmp_path):
    config = job(tmp_path, levels=["local", "pfs"], mtbf_crash_hours=0.001, mtbf_node_hours=0.0005)
    assert_ok(train(tmp_path, config))
    said = (tmp_path / "run" / "log" / "rank0.log").read_text()
    assert "rank crash from local, loss of 1 node(s) from pfs" in said, said[-2000:]


def test_where_mpi_allows_no_threads_the_persist_that_stalls_training_is_a_versions_cost(tmp_path):
    """Under MPI_THREAD_SERIALIZED (a user may ask for it under the fault-tolerant MPI) the persist
    runs inside end_checkpoint(): training waits for all of it. That wait is blocking time,
    and it is what a version costs the per-level choice: L1's stores made 0.3 s slower must
    show in its cost per version (they were counted as nothing: every level every version),
    from the first choice on."""
    # Long enough for three checkpoints whatever the first interval: until its loss is known
    # the persist's 0.3 s in steps of a few ms sets it, a few hundred steps.
    config = small_job(tmp_path, run={"steps": 1500, "log_every": 500},
                       checkpoint={"every_steps": "auto", "keep_local": 2, "keep_pfs": 2},
                       resilience={"levels": ALL_LEVELS, "group_size": 4, "parity": 2,
                                   "mtbf_crash_hours": 0.0002, "mtbf_node_hours": 0.0005},
                       cluster={"simulated_nodes": 4}, eval={"every_steps": 10 ** 6})
    slowed = "slow-level:level=local:seconds=0.3"
    done = run_mpi(4, ["train", "-c", str(config), "--inject", slowed], cwd=tmp_path,
                   env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    assert_ok(done)
    blocking = [r["checkpoint_blocking_s"] for r in read_metrics(tmp_path / "run") if "checkpoint_blocking_s" in r]
    assert len(blocking) >= 3 and min(blocking) >= 0.3, blocking
    said = (tmp_path / "run" / "log" / "rank0.log").read_text()
    costs = [float(ms) for ms in re.findall(r"cost per version: local ([\d.]+) ms", said)]
    # Already in the first choice, before a version's loss was measured: its writing, whole.
    assert costs and costs[0] >= 100 and costs[-1] >= 100, costs
