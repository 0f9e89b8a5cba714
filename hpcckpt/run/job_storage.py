"""Where this run's checkpoints live, seen from one rank: the run's identity and lease, the
node-local and PFS directories, the ordered level stack, and the checks before the first
checkpoint. Built once by the Checkpointer (ckpt/engine.py), collectively."""

from __future__ import annotations

from collections import Counter

import os
import socket
from pathlib import Path

from hpcckpt.run.lease import RunLease
from hpcckpt.run.run_identity import (
    RUN_FILE,
    RunIdentity,
    claim_pfs_dir,
    establish_run_identity,
    other_runs_in,
    pfs_owner,
    read_run_identity,
)
from hpcckpt.cluster.collectives import decide_at_root, fold_at_root, on_root, quiet_any, raise_if_any_failed
from hpcckpt.cluster.placement import local_dir_of, pfs_dir_of, user_name
from hpcckpt.cluster.topology import fit_redundancy, job_id
from hpcckpt.errors import ConfigError, DamagedRecordError, HpcckptError, StorageError
from hpcckpt.faults import NO_FAULTS
from hpcckpt.faulty_levels import with_faults
from hpcckpt.format.compact import pack_dirs, unpack_dirs
from hpcckpt.levels import dir_safety
from hpcckpt.runlog import bytes_text
from hpcckpt.levels.base import LevelStack, ensure_writable_dir
from hpcckpt.levels.erasure import ErasureLevel
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.node_places import RAM_FILE_SYSTEMS, NodePlaces, file_system_type, total_bytes
from hpcckpt.levels.naming import NODE_LOCAL_LEVELS
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.spares import SpareFiles


class RunClaim:
    """(all ranks) Which run this is (run/run_identity.py). A writing job: rank 0 takes the
    run directory's lease, creates or reads the run's identity and claims the PFS directory
    for it; a reading one (read_only) only reads the identity. Rank 0's refusal fails every
    rank alike."""

    def __init__(self, comm, config, pfs_dir: str, log, read_only: bool):
        self.lease = None
        self.identity: RunIdentity = self._claim(comm, config, pfs_dir, log, read_only)
        # Every rank knows who holds the lease, so that survivors of its death can take it.
        self.holder: tuple[str, int] | None = comm.bcast(
            (self.lease.me.host, self.lease.me.pid) if self.lease is not None else None, root=0)

    def _claim(self, comm, config, pfs_dir: str, log, read_only: bool) -> RunIdentity:
        run_dir = Path(config.run_dir)
        warn = log.warning if log else None

        def on_rank0() -> RunIdentity:
            try:
                if read_only:
                    identity = readable_run_identity(run_dir, pfs_dir)
                    if identity is None:
                        raise ConfigError(f"run.dir {str(run_dir)!r} holds no run ({RUN_FILE} is missing): point "
                                          "run.dir (-c, --set run.dir=...) at the directory of the run to read")
                    return identity
                dir_safety.check_path(run_dir, "run.dir")
                run_dir.mkdir(parents=True, exist_ok=True)
                self.lease = RunLease(run_dir, job_id(os.environ), user_name(), log).acquire()
                identity, created = establish_run_identity(run_dir, user_name(), pfs_dir, warn)
            except OSError as exc:
                raise StorageError(f"run.dir {str(run_dir)!r}: cannot take the run's lease or record its identity: "
                                   f"{exc.strerror or exc}; point run.dir at a writable directory") from None
            if log:
                log.info(("started " if created else "this is ") + identity.describe())
            if "pfs" in config.resilience.levels:
                dir_safety.check_path(pfs_dir, "storage.pfs_dir")
                try:
                    claim_pfs_dir(pfs_dir, identity, foreign_pfs_steps(pfs_dir, identity), warn)
                except OSError as exc:
                    raise StorageError(f"storage.pfs_dir {str(pfs_dir)!r} is not usable: {exc.strerror or exc}; "
                                       "point it at a writable directory") from None
            return identity

        try:
            return on_root(comm, "claiming the run", on_rank0)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def foreign_pfs_steps(pfs_dir: str, identity: RunIdentity) -> list[int]:
    """Committed versions in a PFS directory no run has claimed yet that another run (or an
    hpcckpt without run identities) wrote."""
    try:
        if pfs_owner(pfs_dir) is not None:
            return []
    except DamagedRecordError:
        pass  # no owner to go by: the versions' records tell (claim_pfs_dir sets it aside)
    probe = PfsLevel(pfs_dir, 0)
    foreign = []
    for step in probe.committed_steps():
        try:
            if probe.manifest(step).run_id != identity.run_id:
                foreign.append(step)
        except DamagedRecordError:
            continue  # tells nothing about whose it is; a restart sets it aside
        except (HpcckptError, OSError):
            foreign.append(step)
    return foreign


def readable_run_identity(run_dir, pfs_dir) -> RunIdentity | None:
    """For jobs that only read a run: run.json, or where it is damaged the PFS directory's
    record of the same run (nothing is rewritten)."""
    try:
        return read_run_identity(run_dir)
    except DamagedRecordError as exc:
        try:
            owner = pfs_owner(pfs_dir)
        except DamagedRecordError:
            owner = None
        if owner is None:
            raise ConfigError(f"{exc}; the PFS directory has no intact record of the run either: restore run.json "
                              "from a backup") from None
        return owner


def _sharing(keys: list) -> tuple:
    """(rank 0) For each rank: how many ranks have its key, and whether it is the first."""
    counts, first = Counter(keys), {}
    return None, [(counts[key], first.setdefault(key, rank) == rank) for rank, key in enumerate(keys)]


class JobStorage:
    """(all ranks) This run's directories and level stack on this rank."""

    def __init__(self, comm, config, topology, run: RunIdentity, log, faults=NO_FAULTS):
        """`faults` (faults.py): injected failures, struck inside the levels."""
        self.comm = comm
        self.config = config
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.topology = topology
        self.node = topology.node_of_rank[self.rank]
        self.log = log
        self.run = run
        self.enabled = tuple(config.resilience.levels)
        run_dir = config.run_dir
        self.pfs_dir = self.pfs_dir_for(config)
        # Node-local versions live in a directory of this run's own under the configured one,
        # so runs that share a node-local directory never see each other's versions.
        self.local_base = local_dir_of(config.storage.local_dir, run_dir, topology, self.rank)
        self.local_dir = str(Path(self.local_base) / run.local_subdir)
        # Versions in memory first where a memory directory is set (levels/node_places.py);
        # its budget is measured in prepare(), once the directory exists.
        self.memory_dir = (str(Path(local_dir_of(config.storage.memory_dir, run_dir, topology, self.rank))
                               / run.local_subdir) if config.storage.memory_dir else None)
        self.places = NodePlaces(self.local_dir, self.memory_dir)
        # Ranks whose versions share this rank's memory directory (its budget is theirs
        # together) and whether this rank is the first of them: the memory template need not
        # split the ranks as the disk's does.
        self.memory_sharers, self.first_in_memory_dir = 1, True
        if self.memory_dir is not None:
            self.memory_sharers, self.first_in_memory_dir = decide_at_root(
                comm, "counting the ranks of each memory directory", (self.memory_dir, self.node), _sharing)[1]
        # Gathered at rank 0 and handed out as a rule (a template with {node}), not every
        # rank's path to every rank.
        self.local_dirs = tuple(unpack_dirs(fold_at_root(comm, self.local_dir, lambda dirs: pack_dirs(
            dirs, topology.node_of_rank)), topology.node_of_rank))
        self.dir_mode, self.file_mode = dir_safety.modes(config.storage.share_with_group)
        # Ranks whose node-local directory is this rank's: on its node, under the same path (the
        # same path on two nodes is two directories, as with a plain /local/scratch/ckpt).
        node_of = topology.node_of_rank
        self.dir_sharers = frozenset(r for r, d in enumerate(self.local_dirs)
                                     if d == self.local_dir and node_of[r] == self.node)
        # L1-L3 share the node-local directory and so its spares (levels/spares.py).
        self.node_spares = SpareFiles(self.local_dir, config.storage.recycle_files, self._reusable_node_spare)
        self.partner_of: tuple[int, ...] = ()
        self.groups: tuple[tuple[int, ...], ...] = ()
        self.placement_warnings: tuple[str, ...] = topology.single_domain_warnings()  # redundancy sharing a domain
        self.levels = with_faults(self._level_stack(), faults)

    @staticmethod
    def pfs_dir_for(config) -> str:
        return pfs_dir_of(config.storage.pfs_dir, config.run_dir)

    def _level_stack(self) -> LevelStack:
        """The enabled levels in data-flow order (levels/naming.py's LEVEL_ORDER)."""
        storage, resilience = self.config.storage, self.config.resilience
        node_local = dict(direct_io=storage.direct_io, spares=self.node_spares, file_mode=self.file_mode,
                          bandwidth_mb=storage.local_bandwidth_mb, places=self.places)
        transfers = dict(chunk_bytes=self.config.checkpoint.chunk_bytes)  # L2 and L3 stream in chunks
        self.redundancy = fit_redundancy(self.topology, "partner" in self.enabled, "erasure" in self.enabled,
                                         resilience.group_size, resilience.parity)
        stack = []
        if "local" in self.enabled:
            stack.append(LocalLevel(self.local_dir, self.rank, **node_local))
        if self.redundancy.partner:
            # Fitted on every rank alike from the same topology, so every rank builds the same
            # stack before any collective.
            self.partner_of = self.topology.partner_of()
            self.placement_warnings += self.topology.partner_placement_warnings(self.partner_of)
            stack.append(PartnerLevel(self.local_dir, self.rank, self.partner_of, self.comm, **node_local, **transfers))
        if self.redundancy.group_size:
            self.groups = self.topology.erasure_groups(self.redundancy.group_size, self.redundancy.parity)
            self.placement_warnings += self.topology.group_placement_warnings(self.groups, self.redundancy.parity)
            group_index = self.topology.group_of(self.groups, self.rank)
            members = self.groups[group_index]
            group_comm = self.comm.Split(color=group_index, key=members.index(self.rank))
            stack.append(ErasureLevel(self.local_dir, self.rank, members, group_comm, self.redundancy.parity,
                                      groups=self.groups, **node_local, **transfers))
        if "pfs" in self.enabled:
            pfs_spares = SpareFiles(self.pfs_dir, storage.pfs_recycle_files,
                                    lambda kind, writer, _: kind == "shard" and writer < self.world_size)
            stack.append(PfsLevel(self.pfs_dir, self.rank, storage.pfs_bandwidth_mb, storage.direct_io, pfs_spares,
                                  read_bandwidth_mb=storage.pfs_read_bandwidth_mb))
        return LevelStack(stack)

    def close(self) -> None:
        erasure = self.levels.erasure
        if erasure is not None and erasure.comm is not None:
            erasure.comm.Free()
            erasure.comm = None

    # -- checks before the first checkpoint --------------------------------------------------
    def prepare(self, read_only: bool) -> None:
        """(all ranks) Check every rank's storage paths (dir_safety: nothing planted), create
        this run's private node-local directory, prove each level writable; fail together."""
        error, error_type = None, StorageError
        try:
            if not self.enabled:
                raise ConfigError("resilience.levels is empty; list at least one of local, partner, erasure, pfs")
            if set(self.enabled) & set(NODE_LOCAL_LEVELS):
                if read_only:
                    dir_safety.check_path(self.local_dir, "storage.local_dir")
                else:
                    dir_safety.make_private_dirs(self.local_dir, "storage.local_dir", self.dir_mode)
                    self._keep_private(Path(self.local_dir))
                if self.memory_dir is not None:
                    self._prepare_memory(read_only)
            if "pfs" in self.enabled:
                dir_safety.check_path(self.pfs_dir, "storage.pfs_dir")
            if not read_only:  # first: stale spares may be what filled the disk the probe writes to
                self._prune_spares()
            for level in self.levels:
                level.prepare()
        except ConfigError as exc:
            error, error_type = str(exc), ConfigError
        except HpcckptError as exc:
            error = str(exc)
        if quiet_any(self.comm, error_type is ConfigError):
            error_type = ConfigError  # a refused path is the user's to fix: exit 2 on every rank
        raise_if_any_failed(self.comm, "storage check", error, error_type=error_type)

    def _prepare_memory(self, read_only: bool) -> None:
        """The memory directory checked (and made, private) like the node-local one, and its
        budget: storage.memory_budget_mb, or half of its file system's size."""
        memory = Path(self.memory_dir)
        if os.path.realpath(memory) == os.path.realpath(self.local_dir):
            raise ConfigError(f"storage.memory_dir and storage.local_dir are one directory ({self.local_dir!r}): "
                              "point storage.memory_dir at a RAM file system (e.g. /dev/shm) or leave it empty")
        if read_only:
            dir_safety.check_path(memory, "storage.memory_dir")
        else:
            dir_safety.make_private_dirs(memory, "storage.memory_dir", self.dir_mode)
            self._keep_private(memory, "storage.memory_dir")
            ensure_writable_dir(memory, "storage.memory_dir")
        budget_mb = self.config.storage.memory_budget_mb
        self.places.budget_bytes = int(budget_mb * 1e6) if budget_mb > 0 else total_bytes(memory) // 2

    def describe_memory(self) -> str | None:
        """What the placement line says of the memory directory (None: there is none)."""
        if self.memory_dir is None:
            return None
        kind = file_system_type(self.memory_dir)
        text = (f"node-local versions in memory first: {self.memory_dir} ({kind or 'file system unknown'}), "
                f"up to {self.places.budget_bytes / 1e6:.4g} MB per node, then on {self.local_dir}")
        if kind is not None and kind not in RAM_FILE_SYSTEMS:
            text += (f"; storage.memory_dir is on {kind}, not in memory: point it at a RAM file system such as "
                     "/dev/shm for versions at memory speed")
        return text

    def _keep_private(self, directory: Path, setting: str = "storage.local_dir") -> None:
        """This run's node-local directory has the mode the config asks for, also when an
        earlier start of the run made it with another storage.share_with_group."""
        try:
            if directory.stat().st_mode & 0o777 != self.dir_mode:
                os.chmod(directory, self.dir_mode)
        except OSError as exc:
            raise StorageError(f"{setting}: cannot set the mode of {str(directory)!r}: "
                               f"{exc.strerror or exc}") from None

    def _reusable_node_spare(self, kind: str, writer: int, source: int | None) -> bool:
        """Whether this job can overwrite a node-local spare: its writer is a rank of this
        directory, the level that writes it is on, and a replica's pair is still partners."""
        if writer not in self.dir_sharers:
            return False
        running = {level.name for level in self.levels}
        if kind == "replica":
            return "partner" in running and source < self.world_size and self.partner_of[source] == writer
        return ("local" if kind == "shard" else "erasure") in running

    def _prune_spares(self) -> None:
        """Spares an earlier run left that this one can never reuse (another rank count or
        placement, another partner scheme, a level or recycling turned off) would hold their
        space for good: one rank per node-local directory, and rank 0 on L4, delete them
        before the first checkpoint. Spares are never versions, so nothing saved is lost."""
        prunes = []
        if self.rank == min(self.dir_sharers) and set(self.enabled) & set(NODE_LOCAL_LEVELS):
            prunes.append(self.node_spares)
        pfs = self.levels.pfs
        if pfs is not None and pfs.prunes_here:
            prunes.append(pfs.spares)
        for spares in prunes:
            try:
                files, nbytes = spares.prune()
            except OSError as exc:  # recycling only saves time: a start that worked before still does
                if self.log:
                    self.log.warning(f"cannot clean up the spare files in {str(spares.directory)!r}: "
                                     f"{exc.strerror or exc}; delete that directory by hand")
                continue
            if files and self.log:
                self.log.info(f"deleted {files} spare file(s) ({bytes_text(nbytes)}) in {spares.directory} "
                              "that this job cannot reuse")

    # -- what the logs say about placement ------------------------------------------------
    def log_placement(self) -> None:
        """(all ranks) Where this rank's redundancy lives: an operator checks from the logs that
        partners and erasure groups really span nodes (hosts, or simulated nodes on one host);
        each rank logs its own line, rank 0 prints a summary."""
        others = other_runs_in(self.local_base, self.run.local_subdir) if self.local_base else []
        simulated = bool(self.config.simulated_nodes)
        node_of = self.topology.node_of_rank
        # Rank 0 gathers every rank's host and the other runs it saw; each rank is told the
        # hosts of its partner and group (O(group)), not every rank's.
        mine = (socket.gethostname(), others)
        peers = sorted({*([self.partner_of[self.rank]] if self.partner_of else []),
                        *(self.groups[self.topology.group_of(self.groups, self.rank)] if self.groups else [])})
        summary, hosts = decide_at_root(self.comm, "describing the placement", (mine, peers), self._placement_summary)
        if self.log is None:
            return
        if self.rank == 0:
            for warning in self.redundancy.warnings + self.placement_warnings:
                self.log.warning(warning)
        if others:
            self.log.info(f"{self.local_base} also holds {', '.join(others)}: other runs' versions, left alone")
        others_anywhere, summary = summary
        if others_anywhere:
            self.log.info(f"node-local directories also hold other runs' versions ({', '.join(others_anywhere[:4])}"
                          f"{', ...' if len(others_anywhere) > 4 else ''}): never loaded, deleted or overwritten "
                          f"by this run ({self.run.local_subdir})", console=True)

        def where(rank: int) -> str:
            return f"simulated node {node_of[rank]}" if simulated else f"host {hosts[rank]}"
        parts = [f"node-local directory {self.local_dir} on {where(self.rank)}"]
        memory = self.describe_memory()
        if memory is not None:
            parts.append(memory)
            if self.rank == 0:
                self.log.info(memory, console=True)
        if self.partner_of:
            partner = self.partner_of[self.rank]
            parts.append(f"L2 partner copy on rank {partner} ({where(partner)})")
        if self.groups:
            members = self.groups[self.topology.group_of(self.groups, self.rank)]
            parts.append(f"L3 erasure group {list(members)} on {[where(m) for m in members]}")
        self.log.info("placement: " + "; ".join(parts))
        self.log.info(summary, console=True)

    def _domains_summary(self) -> str:
        """The failure domains and how the redundancy spans them, for the placement line."""
        topology = self.topology
        if not topology.has_domains:
            return "; failure domains: the nodes"
        domain_of = topology.domain_of_rank
        nodes = Counter(topology.domain_of(node) for node in set(topology.node_of_rank))
        named = ", ".join(f"{topology.domain_name(d)} ({count} node(s))" for d, count in sorted(nodes.items())[:8])
        text = f"; failure domains: {len(nodes)} ({named}{', ...' if len(nodes) > 8 else ''})"
        if self.partner_of:
            apart = sum(domain_of[r] != domain_of[p] for r, p in enumerate(self.partner_of))
            text += f", L2 partner copies in another domain for {apart} of {self.world_size} rank(s)"
        if self.groups:
            most = max(max(Counter(domain_of[m] for m in g).values()) for g in self.groups)
            text += f", at most {most} member(s) of an L3 group in one domain (parity {self.redundancy.parity})"
        return text

    def _placement_summary(self, gathered: list) -> tuple:
        """(rank 0) From every rank's (host, other runs seen) and the ranks it asks about: the
        other runs anywhere and the job's placement line, shared; each rank's answer, the
        hosts of the ranks it asked about (its own included)."""
        hosts = [host for (host, _), _ in gathered]
        others_anywhere = sorted({name for (_, names), _ in gathered for name in names})
        simulated = bool(self.config.simulated_nodes)
        node_of = self.topology.node_of_rank
        names = sorted(set(hosts))
        summary = (f"placement: {self.world_size} rank(s) on {self.topology.node_count} simulated node(s) of host(s) "
                   if simulated else f"placement: {self.world_size} rank(s) on {len(names)} host(s) ")
        summary += f"({', '.join(names[:8])}{', ...' if len(names) > 8 else ''})"
        domain = node_of if simulated else hosts
        if self.partner_of:
            apart = sum(domain[r] != domain[p] for r, p in enumerate(self.partner_of))
            summary += f"; L2 partner copies on another node for {apart} of {self.world_size} rank(s)"
        if self.groups:
            spread = min(len({domain[m] for m in g}) for g in self.groups)
            summary += f"; L3 {len(self.groups)} erasure group(s), each across {spread}+ node(s)"
        summary += self._domains_summary()
        answers = [{peer: hosts[peer] for peer in (rank, *asked)} for rank, (_, asked) in enumerate(gathered)]
        return (others_anywhere, summary), answers
