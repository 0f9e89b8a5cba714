"""A checkpoint belongs to its run and its user (run/run_identity.py, levels/dir_safety.py),
on real mpiexec ranks: runs sharing one node-local directory (one machine, no job id, the
`mpirun with a config file` case) never load or delete each other's versions; another run's
PFS directory is refused; --init-from is the explicit way to start from another run; what
another user planted on the job's path is refused, and the job's files are private.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import assert_ok, final_record, mpi_env, mpiexec_prefix, read_metrics, run_mpi, run_script, small_job

from hpcckpt.format.manifest import Manifest

RANKS = 4
OTHER_USER = "hpcckpt-other"


def job(directory: Path, shared_local: Path, **sections) -> Path:
    """A run in `directory`/run whose node-local directory is `shared_local` (no {run_dir},
    no {job}): every run given the same one shares it, as runs on one machine do."""
    directory.mkdir(parents=True, exist_ok=True)
    base = dict(
        checkpoint={"every_steps": 10, "keep_local": 2, "keep_pfs": 2, "split_threshold_kb": 4},
        storage={"local_dir": str(shared_local / "node{node}"), "pfs_every": 3},
        resilience={"levels": ["local", "partner", "pfs"]},
    )
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return small_job(directory, **base)


def train(config: Path, *extra: str, n: int = RANKS) -> subprocess.CompletedProcess:
    return run_mpi(n, ["train", "-c", str(config), *extra], cwd=config.parent)


def digest(config: Path) -> str:
    return final_record(config.parent / "run")["weights_digest"]


def run_id(config: Path) -> str:
    return json.loads((config.parent / "run" / "run.json").read_text())["run_id"]


@pytest.fixture(scope="module")
def solo(tmp_path_factory) -> dict:
    """Digests of run A (seed 3, 30 steps) and run B (seed 7, 30 and 60 steps), each alone."""
    root = tmp_path_factory.mktemp("solo")
    digests = {}
    for name, seed, steps in (("A30", 3, 30), ("B30", 7, 30), ("B60", 7, 60)):
        config = job(root / name, root / name / "local", run={"seed": seed, "steps": steps})
        assert_ok(train(config))
        digests[name] = digest(config)
    return digests


def test_a_new_run_never_restores_another_runs_versions_and_the_other_resumes_its_own(tmp_path, solo):
    shared = tmp_path / "node-local"
    run_b = job(tmp_path / "B", shared, run={"seed": 7, "steps": 30})
    assert_ok(train(run_b))
    run_a = job(tmp_path / "A", shared, run={"seed": 3, "steps": 30})
    started = train(run_a)
    assert_ok(started)
    assert "starting from scratch" in started.stdout, started.stdout
    assert "restored" not in started.stdout
    assert f"node-local directories also hold other runs' versions (run-{run_id(run_b)})" in started.stdout
    assert digest(run_a) == solo["A30"]
    # B's versions were left as they were: B resumes from its own L1 copy of step 30.
    resumed = train(run_b, "--set", "run.steps=60")
    assert_ok(resumed)
    assert "restored version 30: 4 rank(s) from L1 local" in resumed.stdout, resumed.stdout
    assert digest(run_b) == solo["B60"]
    for node in (0, 1):
        assert sorted(p.name for p in (shared / f"node{node}").iterdir()) == sorted(
            [f"run-{run_id(run_a)}", f"run-{run_id(run_b)}"])


def test_two_runs_at_once_in_one_node_local_directory_both_finish_as_alone(tmp_path, solo):
    shared = tmp_path / "node-local"
    configs = {"A30": job(tmp_path / "A", shared, run={"seed": 3}), "B30": job(tmp_path / "B", shared, run={"seed": 7})}
    procs = {name: subprocess.Popen([*mpiexec_prefix(), "-n", str(RANKS), sys.executable, "-m", "hpcckpt", "train",
                                     "-c", str(config)], cwd=config.parent, env=mpi_env(), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, config in configs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {out}\n{err}"
        assert digest(configs[name]) == solo[name]


def test_a_pfs_directory_of_another_run_is_refused_and_left_alone(tmp_path):
    pfs = tmp_path / "shared-pfs"
    first = job(tmp_path / "first", tmp_path / "first" / "local", storage={"pfs_dir": str(pfs)})
    assert_ok(train(first))
    before = sorted(p.name for p in pfs.iterdir())
    second = job(tmp_path / "second", tmp_path / "second" / "local", storage={"pfs_dir": str(pfs)})
    refused = train(second)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"storage.pfs_dir {str(pfs)!r} holds the checkpoints of another run {run_id(first)}" in refused.stderr
    assert "--init-from" in refused.stderr
    assert sorted(p.name for p in pfs.iterdir()) == before


def test_init_from_starts_a_new_run_at_step_0_with_the_loaded_weights(tmp_path):
    source = job(tmp_path / "source", tmp_path / "source" / "local", run={"steps": 30})
    assert_ok(train(source))
    new = job(tmp_path / "new", tmp_path / "new" / "local", run={"steps": 20}, optimizer={"lr": 0.01})
    started = train(new, "--init-from", str(source.parent / "run"), n=3)  # and from 4 ranks to 3
    assert_ok(started)
    assert (f"new run {run_id(new)} starting at step 0 from the model weights of version 30"
            in started.stdout), started.stdout
    assert final_record(new.parent / "run")["step"] == 20
    manifests = sorted((new.parent / "run" / "pfs").glob("v*/manifest.json"))
    assert [p.parent.name for p in manifests] == ["v000000000010", "v000000000020"]
    assert all(Manifest.read(p).run_id == run_id(new) for p in manifests)
    assert run_id(source) != run_id(new)
    # The same run from scratch is far worse after 10 steps than one that started trained.
    fresh = job(tmp_path / "fresh", tmp_path / "fresh" / "local", run={"steps": 20}, optimizer={"lr": 0.01})
    assert_ok(train(fresh, n=3))

    def val_loss_at_10(config):
        return [r["val_loss"] for r in read_metrics(config.parent / "run") if r.get("step") == 10 and "val_loss" in r][0]
    assert val_loss_at_10(new) < 0.7 * val_loss_at_10(fresh)
    # A restart of the new run resumes its own version; --init-from is not applied again.
    again = train(new, "--init-from", str(source.parent / "run"), "--set", "run.steps=30", n=3)
    assert_ok(again)
    assert "restored version 20" in again.stdout
    assert "resumes from its own version 20" in again.stdout


INIT_FROM_SCRIPT = """
import sys
import numpy as np
from mpi4py import MPI
from hpcckpt import Checkpointer, load_config

comm = MPI.COMM_WORLD
phase, run_dir = sys.argv[1], sys.argv[2]
config = load_config(None, [f"run.dir={run_dir}", "cluster.simulated_nodes=" + str(comm.size),
                            "checkpoint.split_threshold_kb=1", "storage.pfs_every=1",
                            'resilience.levels=["local", "pfs"]'])
weights = np.zeros((300, 17))
moments = np.zeros(1000)
ckpt = Checkpointer(comm, config)
ckpt.protect("model/weights", weights)
ckpt.protect("optim/moments", moments)
if phase == "source":
    weights[:] = np.random.default_rng(5).standard_normal(weights.shape)
    moments[:] = 7.0
    ckpt.checkpoint(12)
else:
    step = ckpt.init_from(sys.argv[3], lambda name: name.startswith("model/"))
    expected = np.random.default_rng(5).standard_normal(weights.shape)
    print(f"rank {comm.rank} from {step} weights equal {np.array_equal(weights, expected)} "
          f"moments untouched {(moments == 0).all()}", flush=True)
    ckpt.checkpoint(1)
ckpt.close()
"""


def test_init_from_loads_exactly_the_selected_arrays_onto_another_rank_count(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(INIT_FROM_SCRIPT)
    assert_ok(run_script(4, script, ["source", str(tmp_path / "source")], cwd=tmp_path))
    loaded = run_script(3, script, ["new", str(tmp_path / "new"), str(tmp_path / "source")], cwd=tmp_path)
    assert_ok(loaded)
    for rank in range(3):
        assert f"rank {rank} from 12 weights equal True moments untouched True" in loaded.stdout, loaded.stdout
    new_id = json.loads((tmp_path / "new" / "run.json").read_text())["run_id"]
    record = json.loads((tmp_path / "new" / "pfs" / "v000000000001" / "manifest.json").read_text())["body"]
    assert record["run_id"] == new_id and record["world_size"] == 3


def test_init_from_a_model_that_does_not_fit_fails_clearly(tmp_path):
    source = job(tmp_path / "source", tmp_path / "source" / "local", run={"steps": 10})
    assert_ok(train(source))
    other = job(tmp_path / "other", tmp_path / "other" / "local", model={"hidden": [48, 16]})
    refused = train(other, "--init-from", str(source.parent / "run"))
    assert refused.returncode == 4, refused.stdout + refused.stderr
    assert "does not fit this job" in refused.stderr and "model/dense0.weight" in refused.stderr
    missing = train(other, "--init-from", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "not a run directory" in missing.stderr


def test_restart_says_which_settings_changed(tmp_path):
    config = job(tmp_path, tmp_path / "local", run={"steps": 20})
    assert_ok(train(config))
    resumed = train(config, "--set", "run.steps=30", "--set", "optimizer.lr=0.01", "--set", "data.batch_size=16")
    assert_ok(resumed)
    assert ("settings changed since version 20 was written: data.batch_size 32 -> 16; optimizer.lr 0.05 -> 0.01; "
            "run.steps 20 -> 30") in resumed.stdout, resumed.stdout
    assert "alter what the restored state means" in resumed.stderr and "data.batch_size 32 -> 16" in resumed.stderr


# -- another user on the node ---------------------------------------------------------------

@pytest.fixture(scope="module")
def other_user():
    """A second local user (created here; tests run as root in CI)."""
    if os.geteuid() != 0:
        pytest.skip("creating a second local user needs root")
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
                              capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"useradd {OTHER_USER} failed: {made.stderr.strip()}")
    return pwd.getpwnam(OTHER_USER)


@pytest.fixture
def scratch():
    """A world-writable, sticky scratch directory like /tmp, that the other user can reach
    (pytest's tmp_path is private to root)."""
    path = Path("/tmp") / f"hpcckpt-scratch-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(user, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                          capture_output=True, text=True, cwd="/")


def scratch_job(tmp_path: Path, scratch: Path) -> Path:
    return job(tmp_path, scratch / "hpcckpt-{user}", run={"steps": 10})


def test_a_directory_planted_on_the_jobs_path_is_refused(tmp_path, scratch, other_user):
    planted = scratch / "hpcckpt-root"
    assert_ok(as_user(other_user, "mkdir", "-m", "0777", str(planted)))
    refused = train(scratch_job(tmp_path, scratch))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"{str(planted)!r} belongs to {OTHER_USER}" in refused.stderr, refused.stderr
    assert list(planted.iterdir()) == []


def test_a_symlink_planted_on_the_jobs_path_is_refused(tmp_path, scratch, other_user):
    target = scratch / "theirs"
    assert_ok(as_user(other_user, "mkdir", "-m", "0777", str(target)))
    assert_ok(as_user(other_user, "ln", "-s", str(target), str(scratch / "hpcckpt-root")))
    refused = train(scratch_job(tmp_path, scratch))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "is a symlink owned by hpcckpt-other" in refused.stderr, refused.stderr
    assert list(target.iterdir()) == []


def test_the_jobs_node_local_files_are_readable_by_nobody_else(tmp_path, scratch, other_user):
    config = scratch_job(tmp_path, scratch)
    assert_ok(train(config))
    shards = sorted(scratch.glob("hpcckpt-root/node*/run-*/v*/shard-r*.hck"))
    assert shards
    for shard in shards:
        assert shard.stat().st_mode & 0o077 == 0, oct(shard.stat().st_mode)
        denied = as_user(other_user, "cat", str(shard))
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
    for directory in {scratch / "hpcckpt-root", *(s.parent.parent for s in shards)}:
        assert directory.stat().st_mode & 0o777 == 0o700, (directory, oct(directory.stat().st_mode))
    listing = as_user(other_user, "ls", str(scratch / "hpcckpt-root"))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr
