"""Which run a checkpoint belongs to.

A run is its run directory. Its first start creates `<run.dir>/run.json` with a random run id
(rank 0, under the run's lease; the id is broadcast); later starts of the same run directory
read it back. Every commit record carries the id, node-local versions live in a directory
named after it (`<local_dir>/run-<id>/`), and the PFS directory records which run owns it
(`<pfs_dir>/.hpcckpt-run.json`), so two runs never load, delete or overwrite each other's
versions, even when they share a node-local directory (one machine, no job id) or a user
points two runs at one PFS directory.

A new run that should start from another run's state says so (`--init-from`); nothing is
taken over silently.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcckpt.errors import ConfigError, DamagedRecordError, HpcckptError
from hpcckpt.io.first_write import write_if_absent
from hpcckpt.levels.naming import free_aside_name

RUN_FILE = "run.json"
PFS_OWNER_FILE = ".hpcckpt-run.json"
LOCAL_SUBDIR_PREFIX = "run-"


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    run_dir: str  # absolute, where the run started (a moved run keeps its id)
    user: str
    host: str
    created: float
    pfs_dir: str = ""  # absolute: where its L4 versions are (--init-from finds them there)

    @property
    def local_subdir(self) -> str:
        """The directory under every node-local directory that holds this run's versions."""
        return LOCAL_SUBDIR_PREFIX + self.run_id

    def describe(self) -> str:
        return (f"run {self.run_id} (run.dir {self.run_dir!r}, started by {self.user} on {self.host} at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.created))})")


def _parse(path: Path) -> RunIdentity:
    try:
        fields = json.loads(path.read_text())
        return RunIdentity(str(fields["run_id"]), str(fields["run_dir"]), str(fields["user"]),
                           str(fields["host"]), float(fields["created"]), str(fields.get("pfs_dir", "")))
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedRecordError(f"{path}: not a readable run identity ({exc})") from None


def read_run_identity(run_dir: str | Path) -> RunIdentity | None:
    """The identity of the run in `run_dir`; None if no run has started there. A damaged
    record raises DamagedRecordError."""
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        return None
    return _parse(path)


def establish_run_identity(run_dir: str | Path, user: str, pfs_dir: str | Path = "",
                           warn=None) -> tuple[RunIdentity, bool]:
    """(rank 0, holding the run's lease) The run's identity, created on its first start.
    A damaged run.json is set aside and rewritten from an intact copy of the identity (the
    PFS directory's owner record, else the run id the run's L4 commit records carry),
    said through `warn`; with none left, the job stops (ConfigError). Returns (identity,
    created now)."""
    run_dir = Path(run_dir)
    try:
        existing = read_run_identity(run_dir)
    except DamagedRecordError as exc:
        existing = _rewrite_identity(run_dir, pfs_dir, exc, warn)
    if existing is not None:
        return existing, False
    identity = RunIdentity(secrets.token_hex(8), str(run_dir.resolve()), user, socket.gethostname(), time.time(),
                           str(Path(pfs_dir).resolve()) if pfs_dir else "")
    if write_if_absent(run_dir / RUN_FILE, json.dumps(asdict(identity), indent=1)):
        return identity, True
    return _parse(run_dir / RUN_FILE), False


def _rewrite_identity(run_dir: Path, pfs_dir, damage: Exception, warn) -> RunIdentity:
    path = run_dir / RUN_FILE
    identity, source = None, ""
    if pfs_dir:
        try:
            identity, source = pfs_owner(pfs_dir), f"the PFS directory's record {Path(pfs_dir) / PFS_OWNER_FILE}"
        except DamagedRecordError:
            identity = None
        if identity is None:
            run_id = _run_id_of_versions(Path(pfs_dir))
            if run_id is not None:
                identity = RunIdentity(run_id, str(run_dir.resolve()), "unknown", "unknown", time.time(),
                                       str(Path(pfs_dir).resolve()))
                source = f"the run id of the L4 versions in {pfs_dir}"
    if identity is None:
        raise ConfigError(f"{damage}; no intact copy of the run's identity is left (the PFS directory's record "
                          "and its versions' commit records are missing or damaged): restore run.json from a "
                          "backup, or give the job a new run.dir") from None
    aside = free_aside_name(path, ".damaged")
    os.replace(path, aside)
    if not write_if_absent(path, json.dumps(asdict(identity), indent=1)):
        return _parse(path)  # another start rewrote it first
    if warn is not None:
        warn(f"{damage}: set aside as {aside.name} and rewritten from {source}; this is run {identity.run_id}")
    return identity


def _run_id_of_versions(pfs_dir: Path) -> str | None:
    """The run id the newest readable L4 commit record in `pfs_dir` carries."""
    from hpcckpt.format.manifest import Manifest  # the commit record's reader, only on this rare path
    from hpcckpt.levels.naming import PFS_COMMIT_NAME, list_version_steps, version_dir_name

    for step in sorted(list_version_steps(pfs_dir), reverse=True):
        try:
            run_id = Manifest.read(pfs_dir / version_dir_name(step) / PFS_COMMIT_NAME).run_id
        except (HpcckptError, OSError):
            continue
        if run_id:
            return run_id
    return None


def claim_pfs_dir(pfs_dir: str | Path, identity: RunIdentity, foreign_steps=(), warn=None) -> None:
    """(rank 0) Record that `pfs_dir` holds this run's versions, or refuse (ConfigError) when it
    holds another run's: one run's retention would delete the other's versions, and a restart
    would load whichever is newest. `foreign_steps`: committed versions found there whose
    commit record names another run (or none), for a directory without an owner record. A
    damaged owner record is set aside (said through `warn`) and counts as none: rewritten
    for this run unless the versions there are another run's."""
    pfs_dir = Path(pfs_dir)
    marker = pfs_dir / PFS_OWNER_FILE
    try:
        owner = _parse(marker) if marker.exists() else None
    except DamagedRecordError as exc:
        aside = free_aside_name(marker, ".damaged")
        os.replace(marker, aside)
        if warn is not None:
            warn(f"{exc}: set aside as {aside.name}; the PFS directory is claimed again for this run, whose "
                 "versions it holds")
        owner = None
    if owner is None and foreign_steps:
        raise ConfigError(
            f"storage.pfs_dir {str(pfs_dir)!r} already holds checkpoint versions {sorted(foreign_steps)[:5]} of "
            "another run; give this run its own PFS directory (the default '{run_dir}/pfs' is one per run), "
            "or start from that run explicitly with --init-from")
    if owner is not None and owner.run_id != identity.run_id:
        raise ConfigError(
            f"storage.pfs_dir {str(pfs_dir)!r} holds the checkpoints of another {owner.describe()}; this is "
            f"run {identity.run_id} (run.dir {identity.run_dir!r}). Give this run its own PFS directory (the "
            "default '{run_dir}/pfs' is one per run), or start from that run explicitly with --init-from")
    if owner is None:
        pfs_dir.mkdir(parents=True, exist_ok=True)
        if not write_if_absent(marker, json.dumps(asdict(identity), indent=1)):
            claim_pfs_dir(pfs_dir, identity)  # another start won the race: check whose it is


def pfs_owner(pfs_dir: str | Path) -> RunIdentity | None:
    """The run that owns `pfs_dir`; None if none claimed it. Damaged: DamagedRecordError."""
    marker = Path(pfs_dir) / PFS_OWNER_FILE
    return _parse(marker) if marker.exists() else None


def other_runs_in(local_base: str | Path, mine: str) -> list[str]:
    """Names of other runs' directories (and versions stored without a run directory by older
    hpcckpt) under a node-local directory: seen, and left alone."""
    try:
        names = os.listdir(local_base)
    except OSError:
        return []
    return sorted(n for n in names
                  if (n.startswith(LOCAL_SUBDIR_PREFIX) and n != mine) or (n.startswith("v") and n[1:].isdigit()))
