"""Job configuration: one TOML file per job, read into frozen dataclasses.

Precedence, highest first: ``--set section.key=VALUE`` > ``HPCCKPT_SECTION_KEY`` environment
variables > the file > the defaults below. Every problem is a ConfigError naming the source
(file, --set or environment variable), the key and what is allowed, so a job script fails
before any rank starts training.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence, get_args, get_origin, get_type_hints

from hpcckpt.cluster.topology import LOCAL_DIR_FIELDS, PFS_DIR_FIELDS
from hpcckpt.errors import ConfigError
from hpcckpt.env_names import NOT_CONFIG
from hpcckpt.levels.naming import LEVEL_ORDER


@dataclass(frozen=True)
class RunConfig:
    dir: str = "run"
    steps: int = 300
    seed: int = 0
    device: str = "auto"
    log_every: int = 20
    # Stop cleanly (final checkpoint on the PFS, exit 75) once fewer than halt_seconds remain
    # before end_time, the allocation's end in seconds since the epoch (0: unknown; job scripts set it).
    halt_seconds: float = 0.0
    end_time: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "mlp"
    hidden: tuple[int, ...] = (128, 64)
    activation: str = "relu"
    conv_channels: tuple[int, ...] = (16, 32)
    kernel_size: int = 5
    pool: int = 2
    dtype: str = "float32"
    # The embedding model: values per embedding row (one keyed table, rows placed by id hash).
    embedding_dim: int = 8


@dataclass(frozen=True)
class DataConfig:
    source: str = "digits"
    path: str = ""
    samples: int = 4096
    features: int = 64
    classes: int = 10
    # The clicks source (train/clicks.py): categorical fields per sample, ids per field.
    fields: int = 8
    vocabulary: int = 20000
    val_fraction: float = 0.2
    batch_size: int = 64


@dataclass(frozen=True)
class OptimizerConfig:
    kind: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    bucket_kb: int = 256


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 50


@dataclass(frozen=True)
class CheckpointConfig:
    # 0 turns checkpoints off; "auto" picks the interval from measured costs (see schedule/policy.py).
    every_steps: int | str = 0
    keep_local: int = 2
    keep_pfs: int = 3
    keep_best: str = ""
    max_overhead: float = 0.035
    mtbf_hours: float = 0.0
    split_threshold_kb: int = 1024
    # Replicas (L2) and parity (L3) travel and are written in chunks of this many MiB, through
    # reused chunk buffers (2 for L2; group size + parity for L3): the snapshot is the only
    # buffer the size of a shard.
    chunk_mib: float = 8.0
    # The persist thread's nice value. 0 by default: a niced thread that holds the GIL or
    # MPICH's lock when it is preempted makes training wait for it (perf/log/2026-11-23.md).
    persist_nice: int = 0
    # Linux scheduling policy of the copy and persist threads: "batch" (SCHED_BATCH) keeps
    # their many wake-ups from preempting training, at an unchanged share of the CPU.
    background_policy: str = "batch"
    # Where snapshots of CuPy arrays go: "device" (device-to-device into preallocated GPU
    # buffers, brought to host by the persist), "pinned" (straight into pinned host memory),
    # or "auto": device while the buffers take at most half of the free GPU memory.
    gpu_snapshot: str = "auto"
    # A restart counts as good after this many steps (or its next checkpoint); a crash before
    # marks the version it loaded failed, and the next restart falls back to an older one.
    confirm_after_steps: int = 1
    # A version whose metrics record a finite loss vouches for finite floating-point arrays: a
    # copy that restores NaN or inf there fails like a checksum mismatch (the restore falls
    # through to another level, then an older version). false: for applications whose arrays
    # hold NaN or inf on purpose.
    verify_finite: bool = True
    # Keyed tables (Checkpointer.protect_table) go whole every this many versions and as the
    # rows changed since the version before in between; 1: every version whole.
    table_full_every: int = 8

    @property
    def chunk_bytes(self) -> int:
        return max(1, round(self.chunk_mib * (1 << 20)))


@dataclass(frozen=True)
class StorageConfig:
    local_dir: str = "{run_dir}/local/node{node}"
    # Node-local versions kept in memory first: a directory on a RAM file system (e.g.
    # "/dev/shm/hpcckpt-{user}/node{node}"; the same fields as local_dir), whose files outlive
    # a crashed rank and go with the node. Versions that do not fit memory_budget_mb per node
    # go to local_dir (levels/node_places.py). "" (the default): every version on local_dir.
    memory_dir: str = ""
    # The node's versions in memory_dir take at most this many MB (0: half of that file
    # system's size as the job starts).
    memory_budget_mb: float = 0.0
    pfs_dir: str = "{run_dir}/pfs"
    pfs_every: int = 1
    # L4 copies each version from L1 on a thread of its own and skips versions while it is
    # busy (save/flush.py); false: every version due waits for L4 before the next checkpoint.
    pfs_async: bool = True
    pfs_bandwidth_mb: float = 0.0
    # Each rank's L4 read rate at a restart, MB/s (0: unlimited): a share of a contended PFS.
    pfs_read_bandwidth_mb: float = 0.0
    local_bandwidth_mb: float = 0.0
    # Checkpoint data files bypass the page cache (O_DIRECT) where the file system allows.
    direct_io: bool = True
    # Retired node-local data files are overwritten by the next checkpoint (levels/spares.py);
    # L4's only on request: users copy and archive versions there while a job runs.
    recycle_files: bool = True
    pfs_recycle_files: bool = False
    # Node-local directories and files hpcckpt creates are private to the user (0700/0600);
    # true: readable by the user's group too (0750/0640). The PFS directory keeps the umask.
    share_with_group: bool = False


@dataclass(frozen=True)
class ResilienceConfig:
    levels: tuple[str, ...] = ("local", "pfs")
    group_size: int = 4
    parity: int = 2
    partner_every: int = 1
    erasure_every: int = 1
    # Mean time between failures by class, hours (0: none known): a rank crash, the loss of one
    # node with its local storage, of two nodes at once. Any of them set: the interval and each
    # level's share of the versions are chosen to minimise the expected waste
    # (schedule/level_intervals.py), instead of every_steps' overhead bound and the *_every settings.
    mtbf_crash_hours: float = 0.0
    mtbf_node_hours: float = 0.0
    mtbf_two_nodes_hours: float = 0.0
    # Checkpoints in a row that no level could hold before training stops (a level that fails
    # is otherwise only warned about and tried again at its next version due).
    max_unprotected_checkpoints: int = 3
    # A step that diverged is never checkpointed: its gradients or loss not finite, or (with
    # divergence_factor F > 0) its loss above F times the median of the recent steps' (the
    # allreduced values, the same on every rank). With rewind_on_divergence the run goes back
    # in process to the newest version before it and skips the skip_batches_on_rewind batches
    # that led to it, and retention keeps the newest version known good (the one before the
    # newest) on every level; more than max_rewinds rewinds within rewind_window_steps steps
    # stop the run (exit 2). Without it, a divergence stops the run (exit 2).
    rewind_on_divergence: bool = False
    divergence_factor: float = 0.0
    skip_batches_on_rewind: int = 1
    max_rewinds: int = 3
    rewind_window_steps: int = 1000
    # After ranks die in the job (ULFM), the survivors go on from the finished step they hold
    # in memory where everything protected is replicated and the application calls
    # commit_step (restore/from_memory.py); false: they always read a version.
    in_job_from_memory: bool = True
    # Ranks started beside the job's that wait idle and take dead ranks' places in the job, so
    # it goes on at its size (run/spares.py; needs in-job recovery, ULFM): the last that many
    # of `mpiexec -n`. More deaths than spares: the job shrinks for the rest.
    spares: int = 0
    # What deaths no spare is left for do: "shrink" (the job goes on in the job on fewer ranks)
    # or "relaunch" (it ends for the job script's relaunch at its size from its newest version:
    # the run stays the failure-free run's, whatever the number of ranks means to it).
    out_of_spares: str = "shrink"
    # What a restart does when versions were stored but none of them can be recovered any
    # more (more nodes lost at once than the redundancy covers, before L4 held one): "stop"
    # (exit 4, for the operator to look) or "start_over" (said on the console and in the run's
    # records, what the lost versions left is cleared, the run starts again from its
    # beginning; after a recovery in the job, whose processes hold the lost run's state, the
    # job ends for the job script's relaunch, which starts over in new processes).
    unrecoverable: str = "stop"


@dataclass(frozen=True)
class ClusterConfig:
    # 0: nodes are the real shared-memory domains; N > 0: ranks placed on N simulated nodes.
    simulated_nodes: int = 0
    # The sets of nodes one fault takes at once, for placing L2 partners and L3 groups across
    # them (cluster/domains.py): "auto" (the scheduler's topology, e.g. Slurm's switches),
    # "nodes" (each node alone), "PATTERN=DOMAIN,..." host name patterns, or a file of them.
    failure_domains: str = "auto"
    # With simulated nodes: N > 0 failure domains of consecutive simulated nodes.
    simulated_domains: int = 0


@dataclass(frozen=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    source: str = "<defaults>"
    # ("section.key", origin) for every key a source set: the file, "--set ..." or
    # "environment NAME". An error caused by an override must name it, not the file.
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    def replace(self, **sections) -> "JobConfig":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("origins")
        return out

    def origin(self, *keys: str) -> str:
        """Where the values of these "section.key"s came from, for error messages; keys left at
        their defaults count as the file's (the file is where to set them)."""
        known = dict(self.origins)
        found = list(dict.fromkeys(known[k] for k in keys if k in known))
        return " and ".join(found) if found else self.source


SECTIONS: dict[str, type] = {
    f.name: f.type if isinstance(f.type, type) else get_type_hints(JobConfig)[f.name]
    for f in dataclasses.fields(JobConfig)
    if f.name not in ("source", "origins")
}

# HPCCKPT_* variables that are not config keys (env_names.py).
ENV_NOT_CONFIG = NOT_CONFIG

# Allowed values, checked after types; each entry: (predicate, description of what is allowed).
_CHOICES = {
    ("run", "device"): ("auto", "gpu", "cpu"),
    ("resilience", "out_of_spares"): ("shrink", "relaunch"),
    ("resilience", "unrecoverable"): ("stop", "start_over"),
    ("model", "kind"): ("mlp", "conv1d", "embedding"),
    ("model", "activation"): ("relu", "tanh"),
    ("model", "dtype"): ("float32", "float64"),
    ("data", "source"): ("digits", "synthetic", "clicks", "hdf5"),
    ("optimizer", "kind"): ("sgd", "adam"),
    ("checkpoint", "background_policy"): ("batch", "normal"),
    ("checkpoint", "gpu_snapshot"): ("auto", "device", "pinned"),
}
_POSITIVE = {
    ("run", "steps"), ("run", "log_every"), ("data", "samples"), ("data", "features"),
    ("data", "batch_size"), ("data", "fields"), ("data", "vocabulary"), ("model", "embedding_dim"),
    ("optimizer", "bucket_kb"), ("model", "kernel_size"), ("model", "pool"),
    ("storage", "pfs_every"), ("resilience", "group_size"), ("resilience", "parity"),
    ("resilience", "partner_every"), ("resilience", "erasure_every"), ("resilience", "max_unprotected_checkpoints"), ("resilience", "max_rewinds"),
    ("resilience", "rewind_window_steps"),
    ("checkpoint", "keep_local"),
    ("checkpoint", "keep_pfs"), ("checkpoint", "split_threshold_kb"), ("checkpoint", "confirm_after_steps"),
    ("checkpoint", "chunk_mib"), ("checkpoint", "table_full_every"),
}
_AT_LEAST = {("data", "classes"): 2}
_NON_NEGATIVE = {
    ("run", "seed"), ("eval", "every_steps"), ("resilience", "skip_batches_on_rewind"), ("resilience", "spares"),
    ("cluster", "simulated_nodes"), ("cluster", "simulated_domains"),
    ("storage", "pfs_bandwidth_mb"), ("storage", "pfs_read_bandwidth_mb"), ("storage", "local_bandwidth_mb"), ("storage", "memory_budget_mb"), ("run", "halt_seconds"), ("run", "end_time"), ("checkpoint", "mtbf_hours"), ("resilience", "mtbf_crash_hours"), ("resilience", "mtbf_node_hours"),
    ("resilience", "mtbf_two_nodes_hours"), ("checkpoint", "persist_nice"), ("optimizer", "momentum"),
    ("optimizer", "weight_decay"),
}


def _type_name(tp, plural: bool = False) -> str:
    origin = get_origin(tp)
    if origin is tuple:
        return f"list of {_type_name(get_args(tp)[0], plural=True)}"
    if origin is not None:  # a union such as int | str
        return " or ".join(_type_name(a, plural) for a in get_args(tp))
    name = {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))
    return name + "s" if plural else name


def _expected(tp) -> str:
    name = _type_name(tp)
    return f"expected {'an' if name[0] in 'aeiou' else 'a'} {name}"


def _coerce(value: Any, tp, where: str):
    """Check `value` against the annotation `tp`; lists become tuples so configs stay frozen."""
    origin = get_origin(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {_expected(tp)}, got {value!r}")
        item_tp = get_args(tp)[0]
        return tuple(_coerce(v, item_tp, where) for v in value)
    if origin is not None:
        for alternative in get_args(tp):
            try:
                return _coerce(value, alternative, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {_expected(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (datetime.date, datetime.time)):
            # TOML reads an unquoted 2024-05-01 as a date; only quoting makes it text in a file.
            raise ConfigError(f"{where}: {_expected(tp)}, got the TOML date/time {value.isoformat()}; "
                              f"quote it: \"{value.isoformat()}\"")
    raise ConfigError(f"{where}: {_expected(tp)}, got {value!r}")


def _check_value(section: str, key: str, value: Any, where: str) -> None:
    choices = _CHOICES.get((section, key))
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not allowed; use one of {', '.join(choices)}")
    if (section, key) in _POSITIVE and isinstance(value, (int, float)) and value <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")
    if (section, key) in _NON_NEGATIVE and isinstance(value, (int, float)) and value < 0:
        raise ConfigError(f"{where}: must be >= 0, got {value!r}")
    least = _AT_LEAST.get((section, key))
    if least is not None and isinstance(value, (int, float)) and value < least:
        raise ConfigError(f"{where}: must be >= {least}, got {value!r}")


@functools.cache
def _field_types(section_cls) -> Mapping[str, Any]:
    # Cached: get_type_hints compiles every annotation string anew on each call, which made
    # each load_config cost tens of milliseconds (a recovery in the job builds one again).
    return MappingProxyType(get_type_hints(section_cls))


@dataclass(frozen=True)
class _Setting:
    value: Any
    origin: str
    raw: str | None = None  # the text as typed, for --set and environment values


def _merge_layer(merged: dict, layer: Mapping[str, Any], origin: str, raw: str | None = None) -> None:
    """Check one source's section and key names and lay its values over `merged`
    (section -> key -> _Setting). Values are checked later, once the winner of each is known."""
    for section, values in layer.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"{origin}: unknown section [{section}]; allowed sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: [{section}] must be a table of keys")
        types = _field_types(SECTIONS[section])
        for key, value in values.items():
            if key not in types:
                raise ConfigError(
                    f"{origin}: unknown key {section}.{key}; keys of [{section}]: {', '.join(types)}"
                )
            merged.setdefault(section, {})[key] = _Setting(value, origin, raw)


def _resolve(merged: dict) -> tuple[dict[str, dict[str, Any]], tuple[tuple[str, str], ...]]:
    """Type-check the winning value of every key; a value another source overrides is never
    looked at, so a bad environment default cannot stop a job whose --set corrects it."""
    values: dict[str, dict[str, Any]] = {}
    origins = []
    for section, settings in merged.items():
        types = _field_types(SECTIONS[section])
        for key, setting in settings.items():
            tp, value = types[key], setting.value
            if setting.raw is not None and tp is str and not isinstance(value, (str, list, dict)):
                # A bare word on a command line that TOML reads as a date, number or boolean
                # (run.dir=2024-05-01) is meant as the text typed, for a key that takes text.
                value = setting.raw
            where = f"{setting.origin}: {section}.{key}"
            coerced = _coerce(value, tp, where)
            _check_value(section, key, coerced, where)
            values.setdefault(section, {})[key] = coerced
            origins.append((f"{section}.{key}", setting.origin))
    return values, tuple(origins)


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=VALUE` with VALUE read as a TOML value; a bare word is taken as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=VALUE, e.g. --set run.steps=100")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    return section, key, _parse_value(raw.strip())


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        # Paths and words (run.dir=/scratch/x, run.device=cpu) need no quotes on a command line.
        return raw


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, str, str]]:
    """(variable, section, key, raw value) of each HPCCKPT_SECTION_KEY variable. Any other
    HPCCKPT_* name is an error (a misspelt section would otherwise be ignored without a word),
    except the project's own (env_names.py), which it sets for other purposes."""
    found = []
    for name in sorted(environ):
        if not name.startswith("HPCCKPT_") or name in ENV_NOT_CONFIG:
            continue
        section, _, key = name[len("HPCCKPT_"):].lower().partition("_")
        if section not in SECTIONS:
            raise ConfigError(
                f"environment {name}: unknown section {section!r}; config variables are "
                f"HPCCKPT_<SECTION>_<KEY> with SECTION one of {', '.join(SECTIONS)} "
                f"(unset {name} if it is not meant for hpcckpt)"
            )
        if not key:
            raise ConfigError(f"environment {name}: names no key; use HPCCKPT_{section.upper()}_<KEY>, "
                              f"keys of [{section}]: {', '.join(_field_types(SECTIONS[section]))}")
        found.append((name, section, key, environ[name]))
    return found


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> JobConfig:
    """Read a job config; `path` None gives the embedded default job (jobs/local.toml)."""
    environ = os.environ if environ is None else environ
    merged: dict[str, dict[str, _Setting]] = {}
    if path is None:
        origin = "<embedded jobs/local.toml>"
        text = default_job_text()
    else:
        origin = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {origin} does not exist; pass an existing TOML file with -c") from None
        except OSError as exc:
            raise ConfigError(f"config file {origin} cannot be read: {exc.strerror}") from None
    try:
        file_layer = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin}: not valid TOML: {exc}") from None
    _merge_layer(merged, file_layer, origin)
    for name, section, key, raw in env_overrides(environ):
        _merge_layer(merged, {section: {key: _parse_value(raw)}}, f"environment {name}", raw)
    for text_override in overrides:
        section, key, value = parse_override(text_override)
        raw = text_override.split("=", 1)[1].strip()
        _merge_layer(merged, {section: {key: value}}, f"--set {text_override}", raw)
    values, origins = _resolve(merged)
    sections = {name: SECTIONS[name](**values.get(name, {})) for name in SECTIONS}
    config = JobConfig(**sections, source=origin, origins=origins)
    _check_consistency(config)
    return config


FAILURE_RATE_KEYS = ("mtbf_crash_hours", "mtbf_node_hours", "mtbf_two_nodes_hours")


def failures_per_second(checkpoint: CheckpointConfig, resilience: ResilienceConfig) -> float:
    """How often the settings say failures come, every class together: the rates of
    resilience.mtbf_*_hours summed, else 1 / checkpoint.mtbf_hours; 0 where neither is set."""
    rates = [1 / (3600 * getattr(resilience, key)) for key in FAILURE_RATE_KEYS if getattr(resilience, key) > 0]
    if rates:
        return sum(rates)
    return 1 / (3600 * checkpoint.mtbf_hours) if checkpoint.mtbf_hours > 0 else 0.0


def _check_failure_rates(config: JobConfig, where) -> None:
    """resilience.mtbf_*_hours choose the interval and each level's share of the versions:
    nothing else may choose them too."""
    resilience = config.resilience
    keys = [f"resilience.{key}" for key in FAILURE_RATE_KEYS]
    rates = [getattr(resilience, key) for key in FAILURE_RATE_KEYS]
    if any(rate < 0 for rate in rates):
        raise ConfigError(f"{where(*keys)}: {', '.join(keys)} must be >= 0 (0: no failure of that class known)")
    if not any(rates):
        return
    every = config.checkpoint.every_steps
    if every != "auto":
        raise ConfigError(f"{where('checkpoint.every_steps', *keys)}: resilience.mtbf_*_hours choose the checkpoint "
                          f"interval from the failure rates, but checkpoint.every_steps = {every!r}; set "
                          "checkpoint.every_steps = \"auto\" (or remove the mtbf settings)")
    if config.checkpoint.mtbf_hours > 0:
        raise ConfigError(f"{where('checkpoint.mtbf_hours', *keys)}: checkpoint.mtbf_hours (one interval for "
                          "every level) and resilience.mtbf_*_hours (an interval per level) both set; keep one")
    fixed = [key for key in ("resilience.partner_every", "resilience.erasure_every", "storage.pfs_every")
             if key in dict(config.origins)]
    if fixed:
        raise ConfigError(f"{where(*fixed, *keys)}: {', '.join(fixed)} fixed, but resilience.mtbf_*_hours choose "
                          "how often each level takes a version; remove one or the other")


def _check_failure_domains(config: JobConfig, where) -> None:
    from hpcckpt.cluster.domains import parse_domain_rules

    cluster = config.cluster
    parse_domain_rules(cluster.failure_domains, where("cluster.failure_domains") + ": cluster.failure_domains")
    if cluster.simulated_domains and not cluster.simulated_nodes:
        raise ConfigError(f"{where('cluster.simulated_domains', 'cluster.simulated_nodes')}: "
                          f"cluster.simulated_domains = {cluster.simulated_domains} groups simulated nodes, but "
                          "cluster.simulated_nodes = 0 (real nodes); set simulated_nodes, or declare real nodes' "
                          "domains with cluster.failure_domains")
    if cluster.simulated_domains > cluster.simulated_nodes:
        raise ConfigError(f"{where('cluster.simulated_domains', 'cluster.simulated_nodes')}: "
                          f"cluster.simulated_domains = {cluster.simulated_domains} is more than the "
                          f"{cluster.simulated_nodes} simulated node(s); use at most {cluster.simulated_nodes}")


def _check_consistency(config: JobConfig) -> None:
    """Rules that involve more than one key; each message names the sources of its keys."""
    where = config.origin
    levels = config.resilience.levels
    if not levels:
        raise ConfigError(
            f"{where('resilience.levels')}: resilience.levels is empty; list at least one of "
            f"{', '.join(LEVEL_ORDER)} (e.g. [\"local\", \"pfs\"])"
        )
    for level in levels:
        if level not in LEVEL_ORDER:
            raise ConfigError(
                f"{where('resilience.levels')}: resilience.levels: unknown level {level!r}; "
                f"allowed: {', '.join(LEVEL_ORDER)}"
            )
    if len(set(levels)) != len(levels):
        raise ConfigError(f"{where('resilience.levels')}: resilience.levels lists a level twice: {list(levels)}")
    if list(levels) != sorted(levels, key=LEVEL_ORDER.index):
        raise ConfigError(
            f"{where('resilience.levels')}: resilience.levels must be in the order {', '.join(LEVEL_ORDER)}; "
            f"got {list(levels)}"
        )
    if "local" not in levels and ("partner" in levels or "erasure" in levels):
        raise ConfigError(f"{where('resilience.levels')}: resilience.levels: 'partner' and 'erasure' build on "
                          "'local'; add it")
    factor = config.resilience.divergence_factor
    if factor != 0 and not factor > 1:
        raise ConfigError(f"{where('resilience.divergence_factor')}: resilience.divergence_factor must be 0 (no "
                          f"spike check) or above 1 (a loss above that many times the recent median is a spike), "
                          f"got {factor}")
    if config.resilience.parity >= config.resilience.group_size:
        raise ConfigError(
            f"{where('resilience.parity', 'resilience.group_size')}: resilience.parity "
            f"({config.resilience.parity}) must be smaller than resilience.group_size ({config.resilience.group_size})"
        )
    every = config.checkpoint.every_steps
    if isinstance(every, str) and every != "auto":
        raise ConfigError(f"{where('checkpoint.every_steps')}: checkpoint.every_steps: use an integer >= 0 or "
                          f"\"auto\", got {every!r}")
    if isinstance(every, int) and every < 0:
        raise ConfigError(f"{where('checkpoint.every_steps')}: checkpoint.every_steps: must be >= 0 (0 = off), "
                          f"got {every}")
    if config.checkpoint.mtbf_hours > 0 and every == 0:
        raise ConfigError(f"{where('checkpoint.mtbf_hours', 'checkpoint.every_steps')}: checkpoint.mtbf_hours = "
                          f"{config.checkpoint.mtbf_hours} picks a checkpoint interval, but checkpoint.every_steps = 0 "
                          "turns checkpoints off; set one of them (mtbf_hours takes precedence over an every_steps "
                          "of N > 0)")
    _check_failure_rates(config, where)
    _check_failure_domains(config, where)
    if not 0.0 < config.checkpoint.max_overhead < 1.0:
        raise ConfigError(f"{where('checkpoint.max_overhead')}: checkpoint.max_overhead must be between 0 and 1 "
                          f"(e.g. 0.035), got {config.checkpoint.max_overhead}")
    if not 0.0 < config.data.val_fraction < 1.0:
        raise ConfigError(f"{where('data.val_fraction')}: data.val_fraction must be between 0 and 1, "
                          f"got {config.data.val_fraction}")
    if config.data.source == "hdf5" and not config.data.path:
        raise ConfigError(f"{where('data.source', 'data.path')}: data.source = 'hdf5' needs data.path "
                          "(make one with `hpcckpt make-data`)")
    if config.data.source == "hdf5" and not Path(config.data.path).is_file():
        raise ConfigError(
            f"{where('data.path')}: data.path {config.data.path!r} does not exist; "
            "write one with `hpcckpt make-data -o PATH`"
        )
    for template_key, fields in (("local_dir", LOCAL_DIR_FIELDS), ("memory_dir", LOCAL_DIR_FIELDS),
                                 ("pfs_dir", PFS_DIR_FIELDS)):
        template = getattr(config.storage, template_key)
        try:
            template.format(**{name: "x" for name in fields})
        except (KeyError, IndexError, ValueError) as exc:
            allowed = " ".join("{" + name + "}" for name in fields)
            why = (" (the PFS directory is one for all ranks)" if template_key == "pfs_dir" and isinstance(exc, KeyError)
                   and str(exc).strip("'") in LOCAL_DIR_FIELDS else "")
            raise ConfigError(
                f"{where('storage.' + template_key)}: storage.{template_key} = {template!r}: bad template field "
                f"{exc}; allowed fields: {allowed}{why}"
            ) from None


    if config.storage.memory_dir and config.storage.memory_dir == config.storage.local_dir:
        raise ConfigError(f"{where('storage.memory_dir')}: storage.memory_dir is storage.local_dir "
                          f"({config.storage.local_dir!r}): point it at a RAM file system (e.g. "
                          "'/dev/shm/hpcckpt-{user}/node{node}') or leave it empty")


def default_job_path() -> Path:
    return Path(__file__).parent / "jobs" / "local.toml"


def default_job_text() -> str:
    return default_job_path().read_text()
