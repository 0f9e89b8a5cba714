"""Where ranks live: node of each rank, partner map and erasure groups.

Pure functions over a list "node of rank r", no MPI, so every shape can be tested without
processes. A node is a failure domain: its ranks die together and its local storage with them.
"""

from __future__ import annotations

import functools
from collections import Counter
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
    # Failure domains (cluster/domains.py): node -> its domain's number, and the domains'
    # names; empty where every node is a domain of its own.
    domain_of_node: tuple[int, ...] = ()
    domain_names: tuple[str, ...] = ()

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

    @property
    def has_domains(self) -> bool:
        """Several nodes share a failure domain somewhere (otherwise a node is one)."""
        return bool(self.domain_of_node) and len(set(self.domain_of_node)) < len(self.domain_of_node)

    @property
    def single_domain(self) -> bool:
        """Every node of the job in one failure domain (of several nodes)."""
        return self.has_domains and len(set(self.domain_of_node)) == 1

    def single_domain_warnings(self) -> tuple[str, ...]:
        if not self.single_domain:
            return ()
        return (f"all {self.node_count} nodes of this job are in one failure domain "
                f"({self.domain_name(self.domain_of_node[0])}): L2 and L3 cover the loss of nodes, only L4 the loss "
                "of that domain",)

    def domain_of(self, node: int) -> int:
        return self.domain_of_node[node] if self.domain_of_node else node

    def domain_name(self, domain: int) -> str:
        return self.domain_names[domain] if self.domain_names else f"node {domain}"

    @functools.cached_property
    def domain_of_rank(self) -> tuple[int, ...]:
        return tuple(self.domain_of(node) for node in self.node_of_rank)

    @functools.cached_property
    def _nodes_by_domain(self) -> tuple[int, ...]:
        """The nodes in blocks of their domains (domains in order of number, nodes in order
        within): placements that deal or shift along this order cross domains."""
        return tuple(sorted(set(self.node_of_rank), key=lambda node: (self.domain_of(node), node)))

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        return self._ranks_by_node.get(node, ())

    def local_index(self, rank: int) -> int:
        """Position of `rank` among the ranks of its node."""
        return self._local_indices[rank]

    def partner_of(self) -> tuple[int, ...]:
        """partner_of()[r] stores rank r's replica: the same local index (wrapping within that
        node's ranks when it has fewer) on the node `shift` places along the nodes ordered by
        domain, so a replica never shares r's node and, where domains are known, not its
        domain either.

        The shift is the size m of the largest domain: a domain is a block of at most m
        consecutive nodes, so m on is outside it, and inside it again only past a full turn,
        which needs 2m > N nodes. A shift is a permutation of nodes: every node holds the
        copies of one other node, as many bytes as its own. Where one domain holds more than
        half the nodes, a shift of N - m still puts every other domain's copies in it and as
        many of its own outside as the others can take (partner_placement_warnings names it);
        with every node its own domain this is the next node."""
        nodes = self._nodes_by_domain
        if len(nodes) < 2:
            raise TopologyError(
                "partner replication needs ranks on at least 2 nodes, but all ranks run on one node; "
                "remove 'partner' from resilience.levels or set cluster.simulated_nodes >= 2"
            )
        shift = self._partner_shift()
        following = {node: nodes[(i + shift) % len(nodes)] for i, node in enumerate(nodes)}
        partners = []
        for rank, node in enumerate(self.node_of_rank):
            candidates = self.ranks_on_node(following[node])
            partners.append(candidates[self.local_index(rank) % len(candidates)])
        return tuple(partners)

    def _partner_shift(self) -> int:
        count = len(self._nodes_by_domain)
        largest = max(Counter(self.domain_of(node) for node in self._nodes_by_domain).values())
        return largest if 2 * largest <= count else max(1, count - largest)

    def partner_placement_warnings(self, partner_of: Sequence[int]) -> tuple[str, ...]:
        """Where partner copies share their rank's failure domain (domains known only): which
        domains, and why."""
        if not self.has_domains or self.single_domain:
            return ()
        inside = Counter(self.domain_of_rank[r] for r, p in enumerate(partner_of)
                         if self.domain_of_rank[r] == self.domain_of_rank[p])
        if not inside:
            return ()
        nodes = Counter(self.domain_of(node) for node in self._nodes_by_domain)
        named = ", ".join(f"{self.domain_name(d)} ({count} rank(s), {nodes[d]} of {len(self._nodes_by_domain)} "
                          "nodes)" for d, count in sorted(inside.items()))
        return (f"L2 partner copies stay in their own failure domain for {named}: a domain with more than half "
                "the nodes cannot send all its copies elsewhere while every node holds one node's copies; the "
                "loss of that domain needs L3 or L4 for them",)

    def erasure_groups(self, group_size: int, parity: int) -> tuple[tuple[int, ...], ...]:
        """Groups of at least `group_size` ranks, each on distinct nodes (SCR redset style).

        Ranks are dealt round-robin over G = world // group_size groups, node after node, so a
        node with at most G ranks never puts two in one group; leftover ranks make the last
        groups larger instead of going unprotected. The nodes come in blocks of their failure
        domains, so a domain's R ranks are consecutive in the deal and give each group
        ceil(R / G) members at most, the fewest any placement can (group_placement_warnings
        names the domains where that is still more than the parity).
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
        for node in self._nodes_by_domain:
            for rank in self.ranks_on_node(node):
                # Deal from the last group backwards so the extra ranks land in the last groups.
                members[group_count - 1 - cursor % group_count].append(rank)
                cursor += 1
        return tuple(tuple(sorted(g)) for g in members)

    def group_placement_warnings(self, groups: Sequence[Sequence[int]], parity: int) -> tuple[str, ...]:
        """Where one failure domain holds more members of an erasure group than its parity
        (domains known only): the domains, and what their loss leaves to other levels."""
        if not self.has_domains or self.single_domain:
            return ()
        over: dict[int, int] = {}
        for group in groups:
            for domain, count in Counter(self.domain_of_rank[m] for m in group).items():
                if count > parity:
                    over[domain] = max(over.get(domain, 0), count)
        if not over:
            return ()
        named = ", ".join(f"{self.domain_name(d)} ({count} members)" for d, count in sorted(over.items()))
        return (f"L3 erasure groups of {min(map(len, groups))}+ ranks with parity {parity} cannot keep each failure "
                f"domain to {parity} member(s) of a group: {named} of one group; the loss of such a domain "
                "needs L2 or L4 for them (raise resilience.parity, lower resilience.group_size or spread the "
                "job over more domains)",)

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
                         missing: Sequence[int] = (), partner_of: Sequence[int] | None = None,
                         groups: Sequence[Sequence[int]] | None = None,
                         domain_of_rank: Sequence[int] | None = None) -> int | None:
    """How many simultaneous node losses ANY choice of lost nodes leaves recoverable, given the
    node-local levels a version has (L1 always; L2 partner copies; L3 groups with `parity`)
    and the ranks whose node-local files of it are `missing` already (a node lost, or one that
    could not take the version): 0 where it survives no further loss, or none is recoverable.
    None: any number (an L4 copy). Exact by enumeration up to `max_nodes_checked` nodes, beyond
    that the per-level guarantee (L2: 1, L3: parity) when nothing is missing.

    `partner_of` and `groups`, where given, are the maps the version was written with (its
    commit record's); otherwise those this placement makes. With `domain_of_rank` the count is
    of failure domains lost at once (every node of each), not of nodes."""
    from itertools import combinations

    if pfs:
        return None
    units_of = tuple(domain_of_rank) if domain_of_rank else tuple(node_of_rank)
    topology = Topology(tuple(node_of_rank))
    units = sorted(set(units_of))
    if partner_of is None:
        partner_of = topology.partner_of() if partner and len(set(node_of_rank)) > 1 else ()
    partners = tuple(partner_of) or None
    if groups is None:
        groups = topology.erasure_groups(group_size, parity) if group_size and parity else ()
    missing = set(missing)
    if len(units) > max_nodes_checked:
        return 0 if missing else max(1 if partners else 0, parity if groups else 0)

    def recoverable(lost: set[int]) -> bool:
        def gone(rank: int) -> bool:
            return units_of[rank] in lost or rank in missing
        for group in groups or [[r] for r in range(len(node_of_rank))]:
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
    for count in range(1, len(units) + 1):
        if not all(recoverable(set(lost)) for lost in combinations(units, count)):
            break
        survived = count
    return survived
