"""Starting a new run from another run's state (--init-from): the arrays picked are read from
a version on that run's L4 directory, re-partitioned onto this job's ranks and verified;
nothing else is taken, and nothing is written there."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from hpcckpt.run.run_identity import RunIdentity, read_run_identity
from hpcckpt.cluster.collectives import agree, on_root
from hpcckpt.errors import CheckpointError, ConfigError, DamagedRecordError, IncompatibleCheckpointError
from hpcckpt.format.layout import Layout
from hpcckpt.format.manifest import Manifest
from hpcckpt.levels.naming import PFS_COMMIT_NAME, list_version_steps, version_dir_name
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.restore.load import assemble
from hpcckpt.restore.repartitioned import read_repartitioned


def init_from(ctx, source: str, select) -> Manifest:
    """(all ranks) Start a new run from another run's state: the arrays `select(name)` picks
    are read from a version on that run's L4 (re-partitioned onto this job's ranks) and
    verified; nothing else is taken (step, data position, RNG and the arrays not picked start
    fresh), and nothing is written there. `source`: a run directory (its newest complete L4
    version), a PFS directory, or one version directory in it."""
    root, data = on_root(ctx.job.comm, f"--init-from {source}: finding the version", lambda: _init_source(source))
    manifest = Manifest.from_bytes(data, f"--init-from {source}")
    names = [tl.name for tl in ctx.job.layout.tensors if select(tl.name)]
    stored = {tl.name for tl in manifest.layout.tensors}
    wanted_old = Layout(manifest.world_size, tuple(t for t in manifest.layout.tensors if t.name in names))
    wanted_new = Layout(ctx.job.world_size, tuple(t for t in ctx.job.layout.tensors if t.name in names))
    problems = [f"tensor {n!r} is not in version {manifest.step}" for n in names if n not in stored]
    problems += wanted_old.same_tensors(wanted_new, f"version {manifest.step}", "current model") if not problems else []
    if not names:
        problems.append("no protected array was selected to load")
    if problems:
        raise IncompatibleCheckpointError(
            f"--init-from {source}: version {manifest.step} does not fit this job: " + "; ".join(problems),
            collective=True)

    def read_pieces():
        source_level = PfsLevel(root, ctx.job.rank)
        try:
            return read_repartitioned(ctx, lambda old_rank: source_level.shard_path(manifest.step, old_rank),
                                      replace(manifest, layout=wanted_old), wanted_new)
        except OSError as exc:
            raise CheckpointError(str(exc)) from None

    pieces = agree(ctx.job.comm, f"--init-from {source}: reading", read_pieces, step=manifest.step)
    assemble(ctx, wanted_new, pieces)
    return manifest


def _init_source(source: str) -> tuple[str, bytes]:
    """(rank 0) The L4 directory and the commit record of the version `source` names."""
    path = Path(source).expanduser()
    step = None
    try:
        identity = read_run_identity(path)
    except DamagedRecordError as exc:  # the source run's own files are left as they are
        _warn_init(f"--init-from {source}: {exc}; its L4 directory is taken as {path / 'pfs'}")
        identity = RunIdentity("", str(path), "", "", 0.0)
    if identity is not None:
        root = Path(identity.pfs_dir) if identity.pfs_dir else path / "pfs"
    elif path.name.startswith("v") and path.name[1:].isdigit() and (path / PFS_COMMIT_NAME).is_file():
        root, step = path.parent, int(path.name[1:])
    elif list_version_steps(path):
        root = path
    else:
        raise ConfigError(f"--init-from {source}: not a run directory (no run.json), an L4 (PFS) directory (no "
                          f"v<step> directories) or an L4 version directory (v{0:012d} with a manifest.json)")
    level = PfsLevel(root, 0)
    committed = level.committed_steps()
    if step is not None and step not in committed:
        raise ConfigError(f"--init-from {source}: version {step} is not complete on L4 ({version_dir_name(step)} "
                          "has no readable commit record)")
    for candidate in [step] if step is not None else sorted(committed, reverse=True):
        try:
            return str(root), level.manifest(candidate).to_bytes()
        except DamagedRecordError as exc:
            if step is not None:
                raise ConfigError(f"--init-from {source}: {exc}; name another version of that run") from None
            _warn_init(f"--init-from {source}: {exc}; taking the newest intact version before it")
        except OSError as exc:
            raise ConfigError(f"--init-from {source}: cannot read the commit record of version {candidate}: "
                              f"{exc.strerror or exc}") from None
    raise ConfigError(f"--init-from {source}: no complete version with an intact commit record in {str(root)!r}; "
                      "another run starts only from an L4 (PFS) version: drain the source run to L4 first")


def _warn_init(message: str) -> None:
    """(rank 0, before the job's log exists for it) What --init-from passes over, on stderr."""
    print(f"hpcckpt: warning: {message}", file=sys.stderr, flush=True)
