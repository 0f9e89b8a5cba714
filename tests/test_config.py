from pathlib import Path

import pytest

from hpcckpt.config import JobConfig, load_config, parse_override
from hpcckpt.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_embedded_default_job_is_valid():
    config = load_config(None, environ={})
    assert config.cluster.simulated_nodes == 4
    assert config.data.source == "digits"
    assert config.model.kind == "mlp"


def test_defaults_fill_missing_keys(tmp_path):
    config = load_config(write(tmp_path, "[run]\nsteps = 7\n"), environ={})
    assert config.run.steps == 7
    assert config.run.dir == "run"
    assert config.storage.local_dir == "{run_dir}/local/node{node}"
    assert config.resilience.levels == ("local", "pfs")
    assert isinstance(config, JobConfig)


def test_precedence_set_over_env_over_file(tmp_path):
    path = write(tmp_path, "[run]\nsteps = 7\nseed = 1\nlog_every = 3\n")
    env = {"HPCCKPT_RUN_STEPS": "11", "HPCCKPT_RUN_SEED": "5"}
    config = load_config(path, ["run.steps=13"], environ=env)
    assert config.run.steps == 13  # --set beats environment
    assert config.run.seed == 5  # environment beats file
    assert config.run.log_every == 3  # file beats default


def test_set_parses_toml_values_lists_and_bare_words(tmp_path):
    config = load_config(
        write(tmp_path, ""),
        ['resilience.levels=["local","partner","pfs"]', "run.dir=/tmp/x y", "optimizer.lr=1e-3",
         "model.hidden=[8]"],
        environ={},
    )
    assert config.resilience.levels == ("local", "partner", "pfs")
    assert config.run.dir == "/tmp/x y"
    assert config.optimizer.lr == 1e-3
    assert config.model.hidden == (8,)


def test_env_with_underscored_key(tmp_path):
    config = load_config(write(tmp_path, ""), environ={"HPCCKPT_CHECKPOINT_EVERY_STEPS": "5",
                                                       "HPCCKPT_ATTEMPT": "2", "OTHER_RUN_STEPS": "x"})
    assert config.checkpoint.every_steps == 5


def test_the_projects_own_variables_are_not_read_as_config(tmp_path):
    """ulfm_mpiexec's own error tells the user to set HPCCKPT_ULFM_PREFIX: every rank then
    stopped with exit 2 reading it as a config override of section 'ulfm'."""
    from hpcckpt.env_names import NOT_CONFIG

    config = load_config(write(tmp_path, ""), environ={name: "/somewhere" for name in NOT_CONFIG})
    assert config.run.steps == load_config(write(tmp_path, ""), environ={}).run.steps


def test_every_hpcckpt_variable_the_repository_names_is_a_config_key_or_the_projects_own():
    """A variable a launcher or job script sets that is neither would stop every rank with
    exit 2 ('unknown section'): each one the code, the job scripts and the docs name is either
    HPCCKPT_<SECTION>_<KEY> of a real key or listed in hpcckpt/env_names.py."""
    import re

    from hpcckpt.config import SECTIONS, _field_types
    from hpcckpt.env_names import NOT_CONFIG

    repo = Path(__file__).resolve().parent.parent
    files = [*repo.glob("hpcckpt/**/*.py"), *repo.glob("jobs/*"), *repo.glob("docs/*.md"), repo / "README.md",
             *repo.glob("perf/*.py"), *repo.glob("examples/*.py")]
    names = {m for f in files if f.is_file() for m in re.findall(r"\bHPCCKPT_[A-Z][A-Z0-9_]*[A-Z0-9]\b", f.read_text())}
    keys = {f"HPCCKPT_{section.upper()}_{key.upper()}" for section, cls in SECTIONS.items() for key in _field_types(cls)}
    placeholders = {"HPCCKPT_SECTION_KEY"}
    strays = sorted(names - keys - set(NOT_CONFIG) - placeholders)
    assert not strays, f"HPCCKPT_* variables that are no config key and not in hpcckpt/env_names.py: {strays}"


@pytest.mark.parametrize("name,fragment", [
    ("HPCCKPT_CHECKPONT_EVERY_STEPS", "unknown section 'checkpont'"),
    ("HPCCKPT_UNRELATED", "unknown section 'unrelated'"),
    ("HPCCKPT_RUN", "names no key"),
    ("HPCCKPT_RUN_STEPZ", "unknown key run.stepz"),
])
def test_misspelt_env_variable_is_an_error(tmp_path, name, fragment):
    with pytest.raises(ConfigError) as excinfo:
        load_config(write(tmp_path, ""), environ={name: "5"})
    message = str(excinfo.value)
    assert f"environment {name}" in message and fragment in message
    if "section" in fragment:
        assert "run, model, data, optimizer, eval, checkpoint, storage, resilience, cluster" in message


def test_only_the_winning_value_is_checked(tmp_path):
    path = write(tmp_path, "[run]\nsteps = \"many\"\n")
    env = {"HPCCKPT_RUN_STEPS": "-4", "HPCCKPT_RUN_SEED": "x"}
    config = load_config(path, ["run.steps=13", "run.seed=2"], environ=env)
    assert (config.run.steps, config.run.seed) == (13, 2)
    with pytest.raises(ConfigError, match="environment HPCCKPT_RUN_STEPS: run.steps: must be > 0"):
        load_config(path, environ=env)


@pytest.mark.parametrize("override,expected", [
    ("run.dir=2024-05-01", "2024-05-01"),
    ("run.dir=2024-05-01T10:00:00", "2024-05-01T10:00:00"),
    ("run.dir=10:30:00", "10:30:00"),
    ("run.dir=2024", "2024"),
    ('run.dir="quoted"', "quoted"),
])
def test_string_key_takes_a_bare_override_as_typed(tmp_path, override, expected):
    assert load_config(write(tmp_path, ""), [override], environ={}).run.dir == expected
    key, value = override.split("=", 1)
    if not value.startswith('"'):
        assert load_config(write(tmp_path, ""), environ={"HPCCKPT_RUN_DIR": value}).run.dir == expected


@pytest.mark.parametrize("overrides,env,origin", [
    (["checkpoint.every_steps=-5"], {}, "--set checkpoint.every_steps=-5: "),
    ([], {"HPCCKPT_CHECKPOINT_EVERY_STEPS": "-5"}, "environment HPCCKPT_CHECKPOINT_EVERY_STEPS: "),
    (["resilience.levels=[]"], {}, "--set resilience.levels=[]: "),
    (['resilience.levels=["pfs","local"]'], {}, '--set resilience.levels=["pfs","local"]: '),
    (["data.val_fraction=1.5"], {}, "--set data.val_fraction=1.5: "),
    (["storage.pfs_dir={x}"], {}, "--set storage.pfs_dir={x}: "),
    (["checkpoint.mtbf_hours=2", "checkpoint.every_steps=0"], {},
     "--set checkpoint.mtbf_hours=2 and --set checkpoint.every_steps=0: "),
    (["resilience.mtbf_node_hours=-1"], {}, "--set resilience.mtbf_node_hours=-1: "),
])
def test_errors_found_after_merging_name_the_override(tmp_path, overrides, env, origin):
    path = write(tmp_path, "[run]\nsteps = 7\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, overrides, environ=env)
    message = str(excinfo.value)
    assert message.startswith(origin), message
    assert str(path) not in message


def test_error_on_two_keys_names_both_origins(tmp_path):
    path = write(tmp_path, "[resilience]\ngroup_size = 3\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, ["resilience.parity=3"], environ={})
    assert str(excinfo.value).startswith(f"--set resilience.parity=3 and {path}: resilience.parity (3)")


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("[run]\nstepz = 3\n", "unknown key run.stepz"),
        ("[runn]\nsteps = 3\n", "unknown section [runn]"),
        ("[run]\nsteps = \"many\"\n", "run.steps: expected an integer, got 'many'"),
        ("[checkpoint]\nevery_steps = 1.5\n", "checkpoint.every_steps: expected an integer or string"),
        ("[data]\nclasses = 1\n", "data.classes: must be >= 2, got 1"),
        ("[resilience]\nlevels = []\n", "resilience.levels is empty; list at least one of local, partner, "
                                         "erasure, pfs"),
        ("[run]\ndir = 2024-05-01\n", 'run.dir: expected a string, got the TOML date/time 2024-05-01; '
                                       'quote it: "2024-05-01"'),
        ("[run]\nsteps = 0\n", "run.steps: must be > 0"),
        ("[run]\ndevice = \"tpu\"\n", "use one of auto, gpu, cpu"),
        ("[checkpoint]\ngpu_snapshot = \"gpu\"\n", "use one of auto, device, pinned"),
        ("[storage]\nlocal_bandwidth_mb = -1\n", "storage.local_bandwidth_mb"),
        ("[storage]\ndirect_io = \"yes\"\n", "storage.direct_io: expected a boolean"),
        ("[model]\nhidden = 3\n", "model.hidden: expected a list of integers"),
        ("[resilience]\nlevels = [\"pfs\", \"local\"]\n", "must be in the order"),
        ("[resilience]\nlevels = [\"tape\"]\n", "unknown level 'tape'"),
        ("[resilience]\ngroup_size = 2\nparity = 2\n", "parity (2) must be smaller"),
        ("[data]\nsource = \"hdf5\"\npath = \"/nonexistent/x.h5\"\n", "does not exist"),
        ("[storage]\nlocal_dir = \"{scratch}/x\"\n", "bad template field"),
        ("[run\n", "not valid TOML"),
    ],
)
def test_bad_config_names_file_key_and_allowed(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path, environ={})
    message = str(excinfo.value)
    assert fragment in message
    assert str(path) in message


def test_bad_override_and_env_name_their_source(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(ConfigError, match=r"--set run.steps=abc: run.steps"):
        load_config(path, ["run.steps=abc"], environ={})
    with pytest.raises(ConfigError, match="environment HPCCKPT_RUN_STEPS"):
        load_config(path, environ={"HPCCKPT_RUN_STEPS": "-4"})
    with pytest.raises(ConfigError, match="expected section.key=VALUE"):
        parse_override("steps=3")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


def test_config_is_frozen():
    config = load_config(None, environ={})
    with pytest.raises(Exception):
        config.run.steps = 3


def test_shipped_job_configs_are_valid(tmp_path):
    from conftest import REPO

    (tmp_path / "data.h5").write_bytes(b"")  # cluster.toml names an HDF5 file that must exist
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for path in sorted((REPO / "jobs").glob("*.toml")):
            load_config(path, environ={})
    finally:
        os.chdir(cwd)


def test_the_configuration_reference_lists_every_key_with_the_code_default():
    import dataclasses
    import re
    import tomllib

    from hpcckpt.config import SECTIONS

    reference = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| `([^`]*)` \|", reference, flags=re.MULTILINE)
    documented = {key: tomllib.loads(f"v = {value}")["v"] for key, value in rows}
    in_code = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            in_code[f"{section}.{f.name}"] = list(default) if isinstance(default, tuple) else default
    assert sorted(documented) == sorted(in_code), set(documented) ^ set(in_code)
    assert len(rows) == len(documented), "a key is documented twice"
    for key, default in in_code.items():
        assert documented[key] == default and type(documented[key]) is type(default), key


@pytest.mark.parametrize("overrides,fragment", [
    (["resilience.mtbf_node_hours=4", "checkpoint.every_steps=50"],
     'checkpoint.every_steps = 50; set checkpoint.every_steps = "auto"'),
    (["resilience.mtbf_crash_hours=1", "checkpoint.every_steps=auto", "checkpoint.mtbf_hours=2"],
     "checkpoint.mtbf_hours (one interval for every level) and resilience.mtbf_*_hours"),
    (["resilience.mtbf_two_nodes_hours=9", "checkpoint.every_steps=auto", "storage.pfs_every=4"],
     "storage.pfs_every fixed, but resilience.mtbf_*_hours choose how often each level takes a version"),
])
def test_failure_rates_and_another_choice_of_interval_are_refused(tmp_path, overrides, fragment):
    with pytest.raises(ConfigError) as excinfo:
        load_config(write(tmp_path, ""), overrides, environ={})
    assert fragment in str(excinfo.value)


def test_failure_rates_with_an_automatic_interval_are_accepted(tmp_path):
    config = load_config(write(tmp_path, ""), ["resilience.mtbf_node_hours=4", "checkpoint.every_steps=auto"],
                         environ={})
    assert config.resilience.mtbf_node_hours == 4.0
