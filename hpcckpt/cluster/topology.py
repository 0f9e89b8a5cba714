"""Where ranks live: node of each rank, partner map and erasure groups.

Pure functions over a list "node of rank r", no MPI, so every shape can be tested without
processes. A node is a failure domain: its ranks die together and its local storage with them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from hpcckpt.errors import TopologyError


def simulated_node_of_rank(world_size: int, nodes: int) -> tuple[int, ...]:
    """Place ranks on `nodes` simulated nodes in blocks; the first world % nodes get one more."""
    if nodes < 1:
        raise TopologyError(f"cluster.simulated_nodes must be >= 1, got {nodes}")
    if nodes > world_size:
        raise TopologyError(
            f"cluster.simulated_nodes = {nodes} but only {world_size} ranks run; "
            f"use at most {world_size} simulated nodes or start more ranks"
        )
    base, extra = divmod(world_size, nodes)
    placement: list[int] = []
    for node in range(nodes):
        placement.extend([node] * (base + (1 if node < extra else 0)))
    return tuple(placement)


def node_ids_from_hostnames(hostnames: Sequence[str]) -> tuple[int, ...]:
    """Number nodes in order of their first rank, so node 0 holds rank 0."""
    numbering: dict[str, int] = {}
    return tuple(numbering.setdefault(name, len(numbering)) for name in hostnames)


@dataclass(frozen=True)
class Topology:
    node_of_rank: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def node_count(self) -> int:
        return len(set(self.node_of_rank))

    @functools.cached_property
    def _ranks_by_node(self) -> dict[int, tuple[int, ...]]:
        """Each node's ranks, found in one pass: the maps below are O(ranks), not O(ranks^2),
        which at 16,384 ranks is the difference between milliseconds and half a minute."""
        by_node: dict[int, list[int]] = {}
        for rank, node in enumerate(self.node_of_rank):
            by_node.setdefault(node, []).append(rank)
        return {node: tuple(ranks) for node, ranks in by_node.items()}

    @functools.cached_property
    def _local_indices(self) -> tuple[int, ...]:
        indices = [0] * self.world_size
        for ranks in self._ranks_by_node.values():
            for index, rank in enumerate(ranks):
                indices[rank] = index
        return tuple(indices)

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        return self._ranks_by_node.get(node, ())

    def local_index(self, rank: int) -> int:
        """Position of `rank` among the ranks of its node."""
        return self._local_indices[rank]

    def partner_of(self) -> tuple[int, ...]:
        """partner_of()[r] stores rank r's replica: same local index on the next node (wrapping
        within that node's ranks when it has fewer), so a replica never shares r's node and the
        load stays even when nodes have equal rank counts."""
        nodes = sorted(set(self.node_of_rank))
        if len(nodes) < 2:
            raise TopologyError(
                "partner replication needs ranks on at least 2 nodes, but all ranks run on one node; "
                "remove 'partner' from resilience.levels or set cluster.simulated_nodes >= 2"
            )
        following = {node: nodes[(i + 1) % len(nodes)] for i, node in enumerate(nodes)}
        partners = []
        for rank, node in enumerate(self.node_of_rank):
            next_node = following[node]
            candidates = self.ranks_on_node(next_node)
            partners.append(candidates[self.local_index(rank) % len(candidates)])
        return tuple(partners)

    def erasure_groups(self, group_size: int, parity: int) -> tuple[tuple[int, ...], ...]:
        """Groups of at least `group_size` ranks, each on distinct nodes (SCR redset style).

        Ranks are dealt round-robin over G = world // group_size groups, node after node, so a
        node with at most G ranks never puts two in one group; leftover ranks make the last
        groups larger instead of going unprotected.
        """
        if parity < 1 or parity >= group_size:
            raise TopologyError(
                f"resilience.parity = {parity} must be >= 1 and smaller than resilience.group_size = {group_size}"
            )
        if group_size > self.node_count:
            raise TopologyError(
                f"resilience.group_size = {group_size} needs ranks on {group_size} distinct nodes, but the job "
                f"has {self.node_count} node(s); lower group_size or run on more nodes"
            )
        group_count = self.world_size // group_size
        busiest = max(len(ranks) for ranks in self._ranks_by_node.values())
        if group_count == 0 or busiest > group_count:
            raise TopologyError(
                f"cannot build erasure groups of {group_size} ranks on distinct nodes: a node holds {busiest} "
                f"ranks but only {group_count} group(s) fit in {self.world_size} ranks; lower "
                "resilience.group_size or spread ranks more evenly over nodes"
            )
        members: list[list[int]] = [[] for _ in range(group_count)]
        cursor = 0
        for node in sorted(set(self.node_of_rank)):
            for rank in self.ranks_on_node(node):
                # Deal from the last group backwards so the extra ranks land in the last groups.
                members[group_count - 1 - cursor % group_count].append(rank)
                cursor += 1
        return tuple(tuple(sorted(g)) for g in members)

    def group_of(self, groups: Sequence[Sequence[int]], rank: int) -> int:
        for index, group in enumerate(groups):
            if rank in group:
                return index
        raise KeyError(rank)


@dataclass(frozen=True)
class Redundancy:
    """The redundancy a job can actually have: partner copies (L2) and erasure groups (L3)
    fitted to the nodes it runs on. `warnings` say, once each, what was reduced and what
    protection is left."""

    partner: bool
    group_size: int  # 0: no erasure groups
    parity: int
    warnings: tuple[str, ...] = ()


def fit_redundancy(topology: Topology, partner: bool, erasure: bool, group_size: int, parity: int) -> Redundancy:
    """resilience.group_size and parity are targets, not preconditions: a job restarted on
    fewer nodes (no spare after a node loss) gets the largest groups its nodes allow, parity
    at most members-1 and at least 1, and on one node neither L2 nor L3 (nothing off the node
    could hold them). Settings no job can use (parity >= group_size) are config errors,
    checked before (config.py)."""
    nodes = topology.node_count
    warnings = []
    if partner and nodes < 2:
        warnings.append("partner copies (L2) are off: all ranks run on one node, so a copy could not survive "
                        "that node")
        partner = False
    fitted_size, fitted_parity = 0, 0
    if erasure:
        busiest = max(len(topology.ranks_on_node(n)) for n in set(topology.node_of_rank))
        size = min(group_size, nodes)
        # Groups on distinct nodes: a node's ranks must fit one per group.
        while size >= 2 and topology.world_size // size < busiest:
            size -= 1
        if size < 2:
            why = ("all ranks run on one node, so parity could not survive that node" if nodes < 2 else
                   f"a node holds {busiest} of the {topology.world_size} ranks, too many for groups on distinct "
                   "nodes")
            warnings.append(f"erasure coding (L3) is off: {why}")
        else:
            fitted_size, fitted_parity = size, max(1, min(parity, size - 1))
            if (fitted_size, fitted_parity) != (group_size, parity):
                warnings.append(
                    f"resilience.group_size = {group_size}, parity = {parity} do not fit {topology.world_size} "
                    f"rank(s) on {nodes} node(s): erasure groups of {fitted_size}+ ranks with parity {fitted_parity} "
                    f"instead (each group survives the loss of {fitted_parity} of its nodes)")
    return Redundancy(partner, fitted_size, fitted_parity, tuple(warnings))


# Fields of storage.local_dir; storage.pfs_dir takes only those every rank expands alike.
LOCAL_DIR_FIELDS = ("run_dir", "node", "rank", "job", "host", "user")
PFS_DIR_FIELDS = ("run_dir", "job", "user")


def expand_dir_template(template: str, **fields) -> str:
    """Fill a storage template; every field of LOCAL_DIR_FIELDS must be given (a wildcard "*"
    for offline globbing is fine). `host` tells nodes apart where one directory tree is seen
    by several nodes (a test cluster on one machine, a shared burst buffer); `user` keeps
    users' directories apart on shared scratch."""
    return template.format(**fields)


def job_id(environ) -> str:
    """The batch system's job id names node-local directories so concurrent jobs never collide."""
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "COBALT_JOBID"):
        value = environ.get(name)
        if value:
            return value.split(".")[0]
    return "local"


def node_losses_survived(node_of_rank: Sequence[int], *, partner: bool = False, group_size: int = 0,
                         parity: int = 0, pfs: bool = False, max_nodes_checked: int = 16,
                         missing: Sequence[int] = ()) -> int | None:
    """How many simultaneous node losses ANY choice of lost nodes leaves recoverable, given the
    node-local levels a version has (L1 always; L2 partner copies; L3 groups with `parity`)
    and the ranks whose node-local files of it are `missing` already (a node lost, or one that
    could not take the version): 0 where it survives no further loss, or none is recoverable.
    None: any number (an L4 copy). Exact by enumeration up to `max_nodes_checked` nodes, beyond
    that the per-level guarantee (L2: 1, L3: parity) when nothing is missing."""
    from itertools import combinations

    if pfs:
        return None
    topology = Topology(tuple(node_of_rank))
    nodes = sorted(set(node_of_rank))
    partners = topology.partner_of() if partner and len(nodes) > 1 else None
    groups = topology.erasure_groups(group_size, parity) if group_size and parity else ()
    missing = set(missing)
    if len(nodes) > max_nodes_checked:
        return 0 if missing else max(1 if partners else 0, parity if groups else 0)

    def recoverable(lost: set[int]) -> bool:
        def gone(rank: int) -> bool:
            return node_of_rank[rank] in lost or rank in missing
        for group_index, group in enumerate(groups or [[r] for r in range(len(node_of_rank))]):
            lost_members = sum(gone(m) for m in group)
            for rank in group:
                if not gone(rank):
                    continue
                if partners is not None and not gone(partners[rank]):
                    continue
                if groups and lost_members <= parity:
                    continue
                return False
        return True

    if not recoverable(set()):
        return 0
    survived = 0
    for count in range(1, len(nodes) + 1):
        if not all(recoverable(set(lost)) for lost in combinations(nodes, count)):
            break
        survived = count
    return survived
