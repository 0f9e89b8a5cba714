"""Offline view of a run's checkpoints, for one process (inspect, export, verify).

It sees the PFS directory and whichever node-local directories this machine can reach: all of
them with simulated nodes on one machine, only the ones of the node it runs on in a cluster.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcckpt.save.retention import best_step
from hpcckpt.run.ledger import LEDGER_NAME
from hpcckpt.run.run_identity import LOCAL_SUBDIR_PREFIX, PFS_OWNER_FILE, RUN_FILE, pfs_owner, read_run_identity
from hpcckpt.cluster.placement import pfs_dir_of, user_name
from hpcckpt.cluster.topology import expand_dir_template, job_id
from hpcckpt.errors import ConfigError, DamagedRecordError, HpcckptError, UnrecoverableError
from hpcckpt.format.manifest import Manifest
from hpcckpt.format.shardfile import read_shard_table, read_tensor, verify_shard
from hpcckpt.levels.naming import (
    COMMIT_GLOB,
    COMMIT_NAME,
    GLOBAL_LEVELS,
    PFS_COMMIT_NAME,
    list_version_steps,
    shard_file_name,
    version_dir_name,
)
from hpcckpt.levels.spares import spare_kind
from hpcckpt.levels.whole_copies import further_losses_covered, levels_holding_whole, node_losses_covered


# Where a version's files are, as the storage configuration names the directories (and the
# messages of verify say: "pfs version 20", "local version 20").
ON_PFS, ON_NODES = "pfs", "local"


@dataclass(frozen=True)
class VersionEntry:
    place: str  # ON_PFS (the PFS directory) or ON_NODES (the node-local directories)
    step: int
    complete: bool
    size: int  # bytes on this level that this process can see
    world_size: int | None
    metrics: dict
    location: str


def pfs_root(config) -> Path:
    return Path(pfs_dir_of(config.storage.pfs_dir, str(config.run.dir)))


def run_id_of(config) -> str | None:
    """The run whose versions the offline commands show: the run directory's, else the owner
    recorded in the PFS directory (an archived copy of it); None for a run stored by an hpcckpt
    without run identities (then every version there is shown)."""
    for read in (lambda: read_run_identity(config.run.dir), lambda: pfs_owner(pfs_root(config))):
        try:
            identity = read()
        except DamagedRecordError:  # verify says so; the other copy tells the same run
            continue
        if identity is not None:
            return identity.run_id
    return None


def local_roots(config) -> list[Path]:
    """This run's node-local roots reachable from here: the templates (storage.memory_dir's
    first, then storage.local_dir's) with {node}, {rank} and {host} as wildcards, and the run's
    own directory in each (run/run_identity.py)."""
    bases = []
    for template in filter(None, (config.storage.memory_dir, config.storage.local_dir)):
        pattern = expand_dir_template(template, run_dir=str(config.run.dir), node="*", rank="*",
                                      host="*", job=job_id(os.environ), user=user_name())
        bases += sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())
    run_id = run_id_of(config)
    if run_id is None:
        return bases
    return [base / (LOCAL_SUBDIR_PREFIX + run_id) for base in bases if (base / (LOCAL_SUBDIR_PREFIX + run_id)).is_dir()]


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0


def list_versions(config) -> list[VersionEntry]:
    entries = []
    root = pfs_root(config)
    run_id = run_id_of(config)
    for step in list_version_steps(root):
        directory = root / version_dir_name(step)
        manifest = _try_manifest(directory / PFS_COMMIT_NAME)
        if manifest is not None and run_id is not None and manifest.run_id != run_id:
            continue  # another run's: left alone, as a restart leaves it
        entries.append(VersionEntry(ON_PFS, step, manifest is not None, _dir_size(directory),
                                    manifest.world_size if manifest else None,
                                    manifest.metrics if manifest else {}, str(directory)))
    by_step: dict[int, list[Path]] = {}
    for local_root in local_roots(config):
        for step in list_version_steps(local_root):
            by_step.setdefault(step, []).append(local_root / version_dir_name(step))
    for step, directories in sorted(by_step.items()):
        manifest = None
        for directory in directories:
            for commit in sorted(directory.glob(COMMIT_GLOB)):
                manifest = manifest or _try_manifest(commit)
        complete = False
        if manifest is not None:
            committed_ranks = {int(COMMIT_NAME.match(p.name).group(1)) for d in directories
                               for p in d.glob(COMMIT_GLOB)}
            complete = committed_ranks >= set(range(manifest.world_size))
        entries.append(VersionEntry(ON_NODES, step, complete, sum(_dir_size(d) for d in directories),
                                    manifest.world_size if manifest else None,
                                    manifest.metrics if manifest else {},
                                    ", ".join(str(d) for d in directories)))
    return sorted(entries, key=lambda e: (e.step, e.place))


@dataclass(frozen=True)
class VersionOverview:
    """One version across levels, as this process sees it: which levels hold all of it, and
    how many simultaneous node losses it survives (None: any number, thanks to L4)."""

    step: int
    levels: tuple[str, ...]
    world_size: int | None
    size: int
    survives: int | None
    metrics: dict
    # Where a restart takes each old rank's shard from, as seen from here ("3 from L1 local,
    # 1 from L2 partner"), or "" when it cannot be assembled from what is reachable here; a
    # version no level holds whole after a node loss may still be assembled from L2/L3.
    assembled_from: str = ""
    restart_ranks: str = ""  # "any" number of ranks, or the one count per-rank arrays need
    # Where its record names failure domains (several nodes to one): how many whole domains
    # lost at once it survives (None: any number), and how many domains there were.
    survives_domains: int | None = 0
    domains: int = 0


def assembly_plan(config, step: int, manifest: Manifest, surveys: list[dict], pfs_complete: bool):
    """(repartition/plan.py) How a restart would assemble `step` from the node-local directories
    reachable here (one view each) and L4."""
    from hpcckpt.levels.survey import Writing
    from hpcckpt.repartition.plan import plan_repartition

    views = [by_step.get(step) for by_step in surveys]
    return plan_repartition(step, Writing.of(manifest), views, pfs_complete)


def _surveys(config) -> list[dict]:
    from hpcckpt.levels.survey import survey

    return [survey(root) for root in local_roots(config)]


def version_overview(config) -> list[VersionOverview]:
    by_step: dict[int, list[VersionEntry]] = {}
    for entry in list_versions(config):
        by_step.setdefault(entry.step, []).append(entry)
    overview = []
    surveys = _surveys(config)
    for step, entries in sorted(by_step.items()):
        complete = {e.place: e for e in entries if e.complete}
        manifest = None
        try:
            manifest = manifest_of(config, step)
        except HpcckptError:
            manifest = None
        on_nodes = next((e for e in entries if e.place == ON_NODES), None)
        directories = [Path(d) for d in on_nodes.location.split(", ")] if on_nodes else []
        levels = levels_holding_whole(directories, manifest, ON_NODES in complete, ON_PFS in complete)
        survives, survives_domains = 0, 0
        by_domain = manifest is not None and bool(manifest.domain_of_rank)
        if manifest is not None and levels:
            # The geometry that cut this version's parity where its files say, not today's config.
            geometry = (config.resilience.group_size, config.resilience.parity)
            survives = node_losses_covered(manifest, levels, directories, geometry)
            if by_domain:
                survives_domains = node_losses_covered(manifest, levels, directories, geometry, by_domain=True)
        first = (complete.get(ON_PFS) or complete.get(ON_NODES) or entries[0])
        assembled, ranks = "", ""
        if manifest is not None:
            plan = assembly_plan(config, step, manifest, surveys, ON_PFS in complete)
            assembled = plan.summary() if plan.complete else ""
            ranks = str(manifest.world_size) if manifest.local_arrays else "any"
            if assembled and not levels and on_nodes is not None:
                committed = {int(COMMIT_NAME.match(p.name).group(1)) for d in directories for p in d.glob(COMMIT_GLOB)}
                survives = further_losses_covered(manifest, committed)
                if by_domain:
                    survives_domains = further_losses_covered(manifest, committed, by_domain=True)
        overview.append(VersionOverview(step, tuple(levels), first.world_size or (manifest and manifest.world_size),
                                        sum(e.size for e in entries), survives,
                                        first.metrics or (manifest.metrics if manifest else {}), assembled, ranks,
                                        survives_domains, len(set(manifest.domain_of_rank)) if by_domain else 0))
    return overview


def l4_lag(versions: list[VersionOverview]) -> str:
    """How far L4 is behind the node-local levels, for `inspect`: L4 copies at its own pace
    (storage.pfs_async) and skips versions while a copy runs, so the newest version may not
    be on the PFS yet; a node loss beyond what L2/L3 cover falls back that far."""
    node_local = [v.step for v in versions if set(v.levels) - set(GLOBAL_LEVELS) or (not v.levels and v.assembled_from)]
    on_pfs = [v.step for v in versions if set(v.levels) & set(GLOBAL_LEVELS)]
    if not on_pfs:
        return "L4 holds no version yet" + (f"; node-local levels hold up to step {max(node_local)}"
                                             if node_local else "")
    newest_pfs = max(on_pfs)
    newer = [step for step in node_local if step > newest_pfs]
    if not newer:
        return f"L4 is up to date: it holds the newest version (step {newest_pfs})"
    return (f"L4 lags: newest there is step {newest_pfs}, {len(newer)} newer version(s) only on node-local "
            f"levels (up to step {max(newer)}, {max(newer) - newest_pfs} step(s) ahead)")


def _try_manifest(path: Path) -> Manifest | None:
    try:
        return Manifest.read(path)
    except (HpcckptError, OSError):
        return None


def resolve_version(config, spec: str) -> int:
    """'latest', 'best' (by checkpoint.keep_best, default val_loss) or a step number."""
    complete = [e for e in list_versions(config) if e.complete]
    if not complete:
        raise UnrecoverableError(f"no complete checkpoint version under {pfs_root(config)} or the node-local "
                                 "directories; train with checkpoint.every_steps > 0 first")
    if spec == "latest":
        return max(e.step for e in complete)
    if spec == "best":
        metric = config.checkpoint.keep_best or "val_loss"
        best = best_step({e.step: e.metrics for e in complete}, metric)
        if best is None:
            raise UnrecoverableError(f"no complete version has the metric {metric!r}; evaluate at checkpoint "
                                     "steps (eval.every_steps) or pick --version latest")
        return best
    try:
        step = int(spec)
    except ValueError:
        raise ConfigError(f"--version {spec!r}: use latest, best or a step number") from None
    if step not in {e.step for e in complete}:
        raise UnrecoverableError(f"--version {step}: no complete version with that step; complete ones: "
                                 f"{sorted({e.step for e in complete})}")
    return step


def manifest_of(config, step: int) -> Manifest:
    """A version's record with its whole table: L4's, else the node-local copies merged (each
    lists its node's part)."""
    manifest = _try_manifest(pfs_root(config) / version_dir_name(step) / PFS_COMMIT_NAME)
    if manifest is not None and manifest.lists_every_shard:
        return manifest
    paths = [path for local_root in local_roots(config)
             for path in sorted((local_root / version_dir_name(step)).glob(COMMIT_GLOB))]
    merged = _merged_records(paths, manifest)
    if merged is None:
        raise UnrecoverableError(f"no readable commit record for version {step}")
    return merged


def _merged_records(paths, first: Manifest | None = None) -> Manifest | None:
    """The commit records at `paths` of the same writing as the first readable one, their
    shard tables merged."""
    merged = first
    for path in paths:
        if merged is not None and merged.lists_every_shard:
            break
        manifest = _try_manifest(path)
        if manifest is None:
            continue
        if merged is None:
            merged = manifest
        elif manifest.identity == merged.identity:
            merged = merged.with_shards(manifest.shards)
    return merged


def shard_candidates(config, manifest: Manifest, rank: int) -> list[Path]:
    """Where rank's shard of this version may be: its node-local copy first, then L4. The
    node-local one is looked for under this config's directories (where inspect and
    --version look), and under the path recorded at checkpoint time only if none has it: a
    run directory that was moved, or a relative one seen from elsewhere, still reads right."""
    name = shard_file_name(rank)
    version = version_dir_name(manifest.step)
    paths = [root / version / name for root in local_roots(config) if (root / version / name).is_file()]
    if not paths and rank < len(manifest.local_dirs) and manifest.local_dirs[rank]:
        paths.append(Path(manifest.local_dirs[rank]) / version / name)
    paths.append(pfs_root(config) / version / name)
    return paths


def _first_good_copy(config, manifest: Manifest, rank: int, read, what: str):
    """read(path, shard table) of the first copy of `rank`'s shard that reads without error
    (checked against the commit record); UnrecoverableError naming `what` when none does."""
    problems = []
    for path in shard_candidates(config, manifest, rank):
        try:
            table = read_shard_table(path)
            manifest.check_shard_table(table, rank, path)
            with open(path, "rb") as f:
                return read(f, table, path)
        except (HpcckptError, OSError) as exc:
            problems.append(str(exc))
    raise UnrecoverableError(f"{what}: no good copy of rank {rank}'s shard is reachable from here: "
                             f"{'; '.join(problems)}")


def read_full_tensors(config, manifest: Manifest) -> dict[str, np.ndarray]:
    """Every replicated tensor and block array of a version, reassembled from the first good
    copy of each shard (zeros where blocks left gaps)."""
    from hpcckpt.format.layout import insert_piece

    tensors = {tl.name: np.zeros(tl.spec.shape, dtype=tl.spec.dtype) for tl in manifest.layout.tensors}
    for rank in range(manifest.world_size):
        pieces = manifest.layout.rank_pieces(rank)
        if not pieces:
            continue
        read = _first_good_copy(config, manifest, rank, lambda f, table, path: {
            tl.name: read_tensor(f, table, tl.name) for tl in pieces}, f"version {manifest.step}")
        for tl in pieces:
            insert_piece(tensors[tl.name], tl, rank, read[tl.name])
    return tensors


def read_full_tables(config, manifest: Manifest) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every keyed table of a version as (ids, rows), sorted by id: the rows of every rank's
    shard of each version of its chain (format/keyed_rows.py), applied oldest first."""
    from hpcckpt.format.keyed_rows import TableSpec, check_pieces, merge_rows, piece_names

    specs = {name: TableSpec.from_dict(name, spec) for name, spec in manifest.tables.items()}
    tables = {name: (np.empty(0, np.int64), np.empty((0, spec.dim), spec.dtype)) for name, spec in specs.items()}

    def read(f, table, path) -> dict:
        pieces = {name: [read_tensor(f, table, piece) for piece in piece_names(name)] for name in specs}
        for name, (ids, rows) in pieces.items():
            check_pieces(name, specs[name], ids, rows, str(path))
        return pieces

    for step in manifest.table_chain:
        record = manifest if step == manifest.step else manifest_of(config, step)
        if record.table_chain != manifest.table_chain[:manifest.table_chain.index(step) + 1]:
            raise UnrecoverableError(f"version {manifest.step}: the version {step} found here is not the one its "
                                     "tables were written on")
        for rank in range(record.world_size):
            pieces = _first_good_copy(config, record, rank, read,
                                      f"version {step} (of version {manifest.step}'s table chain)")
            for name, (ids, rows) in pieces.items():
                tables[name] = merge_rows(*tables[name], ids, rows)
    return tables


def verify_all(config) -> tuple[int, list[str], list[str]]:
    """Check every stored file of every version: shards, replicas and parity against their own
    checksums, shards and replicas against the commit record too; that every rank's shard is
    there; and which headers Reed-Solomon had to repair (the file loads, the medium is
    failing). A node-local version whose lost shards a restart can assemble from L2/L3 (or L4)
    is a note, not a problem. (files checked, problems, notes)"""
    problems, notes, checked = [], [], 0
    damaged = _damaged_records(config, problems, notes)
    entries = [e for e in list_versions(config) if (e.place, e.step) not in damaged]
    if not entries and not damaged:
        templates = " or ".join(repr(t) for t in (config.storage.local_dir, config.storage.memory_dir) if t)
        problems.append(f"no checkpoint version found under {pfs_root(config)} or node-local directories "
                        f"matching {templates}; check run.dir and the storage paths")
    surveys = _surveys(config)
    on_l4 = {e.step for e in entries if e.place == ON_PFS and e.complete}
    for entry in entries:
        plan = None
        if not entry.complete:
            plan = _plan_for_incomplete(config, entry, surveys, entry.step in on_l4)
            if plan is None or not plan.complete:
                problems.append(f"{entry.place} version {entry.step}: not every rank's commit record is reachable "
                                "from here, and what is cannot be assembled into the whole version (a checkpoint "
                                "that did not finish, or a loss beyond what its levels survive)")
                continue
            notes.append(f"{entry.place} version {entry.step}: not every rank's copy is reachable here (a lost "
                         f"node); a restart assembles it: old shards {plan.summary()}")
        manifest = _entry_manifest(entry) if plan is None else manifest_of(config, entry.step)
        shard_ranks = set()
        for directory in entry.location.split(", "):
            for path in sorted(Path(directory).glob("*.hck")):
                parsed = spare_kind(path.name)
                if parsed is None:
                    continue
                kind, writer, source = parsed
                checked += 1
                found = verify_shard(path)
                if not found:
                    table = read_shard_table(path)
                    if table.corrected_bytes:
                        found.append(f"header damaged: Reed-Solomon repaired {table.corrected_bytes} byte(s) on "
                                     "read (the file still loads; check the storage device)")
                    if kind != "parity":  # parity pieces are checked by their own checksums alone
                        rank = writer if kind == "shard" else source
                        listed = {record.rank: record for record in manifest.shards}
                        expected = listed[rank].checksums if rank in listed else {}
                        found.extend(f"{e.name}: checksum differs from the commit record"
                                     for e in table.entries if expected.get(e.name) != e.checksum)
                if kind == "shard":
                    shard_ranks.add(writer)
                problems.extend(f"{path}: {p}" for p in found)
        missing = sorted(set(range(manifest.world_size)) - shard_ranks)
        if missing and plan is None:
            problems.append(f"{entry.place} version {entry.step}: the shard file of rank(s) {missing} is missing "
                            f"from {entry.location}")
    return checked, problems, notes


SET_ASIDE_WHY = {".damaged": "a damaged commit record", ".failed": "restarts from it crashed",
                 ".unusable": "it could not be loaded"}


def _damaged_records(config, problems: list[str], notes: list[str]) -> set[tuple[str, int]]:
    """Records that cannot be read as written (run/records.py), and versions set aside: each
    said once. Returns the (level, step) whose record is damaged, which the file checks skip."""
    damaged = set()
    for name, read in ((RUN_FILE, lambda path: read_run_identity(path.parent)),
                       (LEDGER_NAME, lambda path: json.loads(path.read_text()))):
        path = Path(config.run.dir) / name
        try:
            read(path)
        except (ValueError, HpcckptError) as exc:
            problems.append(f"{path}: damaged ({exc}); the next start sets it aside"
                            + (" and rewrites it from the PFS directory's record of the run" if name == RUN_FILE
                               else ""))
        except OSError:
            pass
    root = pfs_root(config)
    try:
        pfs_owner(root)
    except HpcckptError as exc:
        problems.append(f"{root / PFS_OWNER_FILE}: damaged ({exc}); the next start rewrites it from run.json")
    for step in list_version_steps(root):
        path = root / version_dir_name(step) / PFS_COMMIT_NAME
        try:
            Manifest.read(path)
        except DamagedRecordError as exc:
            damaged.add((ON_PFS, step))
            problems.append(f"pfs version {step}: {exc}; the next start sets it aside (and writes it again from "
                            "node-local storage where that holds it)")
        except (HpcckptError, OSError):
            pass
    for directory in sorted({Path(config.run.dir), root}):
        for aside in sorted(directory.glob("*.damaged*")) if directory.is_dir() else ():
            if aside.is_file():
                notes.append(f"{aside}: a damaged record set aside (rewritten or started afresh since); kept for "
                             "inspection: delete it when done")
    if root.is_dir():
        for aside in sorted(root.glob("v*.*")):
            why = next((why for suffix, why in SET_ASIDE_WHY.items() if suffix in aside.name), None)
            if why is not None and aside.is_dir():
                (problems if "damaged" in why else notes).append(
                    f"{aside}: set aside ({why}); kept for inspection, never loaded: delete it when done")
    for local_root in local_roots(config):
        for step in list_version_steps(local_root):
            for record in sorted((local_root / version_dir_name(step)).glob(COMMIT_GLOB)):
                try:
                    Manifest.read(record)
                except DamagedRecordError as exc:
                    problems.append(f"{exc}; a restart rewrites it from an intact copy of the version's record")
                except (HpcckptError, OSError):
                    pass
    return damaged


def _plan_for_incomplete(config, entry: VersionEntry, surveys: list[dict], on_l4: bool):
    if entry.place != ON_NODES:
        return None
    try:
        return assembly_plan(config, entry.step, manifest_of(config, entry.step), surveys, on_l4)
    except HpcckptError:
        return None


def _entry_manifest(entry: VersionEntry) -> Manifest:
    """The commit record of one level's copy of a version (not another level's: two runs may
    have written the same step)."""
    if entry.place == ON_PFS:
        manifest = _try_manifest(Path(entry.location) / PFS_COMMIT_NAME)
    else:
        manifest = _merged_records([path for directory in entry.location.split(", ")
                                    for path in sorted(Path(directory).glob(COMMIT_GLOB))])
    if manifest is not None:
        return manifest
    raise UnrecoverableError(f"{entry.place} version {entry.step}: no readable commit record in {entry.location}")
