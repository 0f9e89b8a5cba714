"""Names of everything the levels write, and of the levels themselves: one table that the
levels, retention, recovery, inspect/verify (tools/catalog.py) and the reports share.

    <root>/v<step>/shard-r<rank>.hck                          L1 and L4: a rank's shard
    <local_dir>/v<step>/commit-r<rank>.json                   L1-L3: a rank's commit record
    <local_dir>/v<step>/replica-of-r<src>-held-by-r<h>.hck    L2: a partner's replica
    <local_dir>/v<step>/parity-r<rank>.hck                    L3: a member's parity pieces
    <pfs_dir>/v<step>/manifest.json                           L4: the commit record
"""

from __future__ import annotations

import os
import re
from pathlib import Path

LEVEL_ORDER = ("local", "partner", "erasure", "pfs")  # data-flow order: cheapest to restore first
LEVEL_LABELS = {"local": "L1 local", "partner": "L2 partner", "erasure": "L3 erasure", "pfs": "L4 pfs"}
LEVEL_NUMBERS = {"local": "L1", "partner": "L2", "erasure": "L3", "pfs": "L4"}
# What each level's part of a checkpoint is called in errors and logs.
STAGE_LABELS = {"local": "L1 local write", "partner": "L2 partner copy", "erasure": "L3 erasure coding",
                "pfs": "L4 pfs write"}
NODE_LOCAL_LEVELS = ("local", "partner", "erasure")
GLOBAL_LEVELS = ("pfs",)
# The levels by name, for code that reads the files a job left rather than asking a live
# stack (repartition/'s planner, the offline catalog, reports from the run log): each kind
# of file is one level's.
LOCAL, PARTNER, ERASURE, PFS = LEVEL_ORDER

PFS_COMMIT_NAME = "manifest.json"
SHARD_GLOB = "shard-r*.hck"
REPLICA_GLOB = "replica-of-r*.hck"
PARITY_GLOB = "parity-r*.hck"
COMMIT_GLOB = "commit-r*.json"
SHARD_NAME = re.compile(r"^shard-r(\d+)\.hck$")
PARITY_NAME = re.compile(r"^parity-r(\d+)\.hck$")
REPLICA_NAME = re.compile(r"^replica-of-r(\d+)-held-by-r(\d+)\.hck$")
COMMIT_NAME = re.compile(r"^commit-r(\d+)\.json$")
_VERSION_DIR = re.compile(r"^v(\d{12})$")


def version_dir_name(step: int) -> str:
    return f"v{step:012d}"


def step_of_version_dir(name: str) -> int | None:
    match = _VERSION_DIR.match(name)
    return int(match.group(1)) if match else None


def shard_file_name(rank: int) -> str:
    return f"shard-r{rank:05d}.hck"


def replica_file_name(source_rank: int, holder_rank: int) -> str:
    return f"replica-of-r{source_rank:05d}-held-by-r{holder_rank:05d}.hck"


def replicas_held_glob(holder_rank: int) -> str:
    return f"replica-of-r*-held-by-r{holder_rank:05d}.hck"


def parity_file_name(rank: int) -> str:
    return f"parity-r{rank:05d}.hck"


def commit_file_name(rank: int) -> str:
    return f"commit-r{rank:05d}.json"


def list_version_steps(root: Path | str) -> list[int]:
    """Steps that have a version directory under `root` (complete or not), ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(s for s in map(step_of_version_dir, names) if s is not None)


def free_aside_name(path: Path, suffix: str) -> Path:
    """`path` + suffix, or + suffix.N where an earlier one took that name: where a version or
    record set aside goes (kept for inspection, never loaded or pruned)."""
    candidate = path.with_name(path.name + suffix)
    count = 1
    while candidate.exists():
        count += 1
        candidate = path.with_name(f"{path.name}{suffix}.{count}")
    return candidate
