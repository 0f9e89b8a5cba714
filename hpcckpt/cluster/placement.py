"""Which node each rank runs on, learned over MPI (all ranks call these collectively)."""

from __future__ import annotations

import os
import pwd
import socket

from hpcckpt.cluster.collectives import fold_at_root
from hpcckpt.cluster.domains import domain_of_host, number_domains, parse_domain_rules, simulated_domain_of_node
from hpcckpt.cluster.topology import (
    Topology,
    expand_dir_template,
    job_id,
    node_ids_from_hostnames,
    simulated_node_of_rank,
)
from hpcckpt.format.compact import pack_ints, unpack_ints


def discover_topology(comm, simulated_nodes: int = 0, failure_domains: str = "auto",
                      simulated_domains: int = 0) -> Topology:
    """(all ranks) Node of every rank, simulated blocks or real shared-memory domains, and the
    failure domain of every node (cluster/domains.py).

    On a cluster a node is what MPI calls a shared-memory domain; its name is the host name of
    its first rank, gathered at rank 0 with that rank's failure domain, which numbers the
    nodes and the domains and hands every rank the node of each and the domain of each node
    as rules (format/compact.py: O(1) where a node's ranks are consecutive).
    """
    rules = parse_domain_rules(failure_domains)
    if simulated_nodes:
        from hpcckpt.cluster.fault_tolerance import inherited_topology, spares_at_start, world_ranks_after_shrink

        inherited = inherited_topology(comm.Get_size())
        if inherited is not None:
            return inherited
        world = world_ranks_after_shrink(comm)
        spares = spares_at_start()
        if world is not None:  # the survivors of dead ranks keep the nodes they were placed on
            from mpi4py import MPI

            workers = MPI.COMM_WORLD.Get_size() - spares
            placed = simulated_node_of_rank(workers, simulated_nodes) + (simulated_nodes,) * spares
            node_of_rank = tuple(placed[rank] for rank in world)
        else:
            node_of_rank = simulated_node_of_rank(comm.Get_size(), simulated_nodes)
        if not simulated_domains:
            return Topology(node_of_rank)
        names = tuple(f"domain {d}" for d in range(simulated_domains))
        domain_of_node = simulated_domain_of_node(simulated_nodes, simulated_domains)
        if spares:  # the spare node is a domain of its own
            domain_of_node, names = domain_of_node + (simulated_domains,), names + ("spare node",)
        return Topology(node_of_rank, domain_of_node, names)
    from mpi4py import MPI

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader = None
        if node_comm.Get_rank() == 0:
            host = socket.gethostname()
            leader = (host, domain_of_host(host, rules, os.environ))
        leader = node_comm.bcast(leader, root=0)
    finally:
        node_comm.Free()
    packed = fold_at_root(comm, leader, _number_nodes_and_domains)
    node_of_rank = tuple(unpack_ints(packed["nodes"]))
    if "domains" not in packed:
        return Topology(node_of_rank)
    return Topology(node_of_rank, tuple(unpack_ints(packed["domains"])), tuple(packed["names"]))


def _number_nodes_and_domains(leaders: list) -> dict:
    """(rank 0) From every rank's (host, domain) of its node's first rank: the node of each
    rank, and where some nodes share a domain, the domain of each node and the domains' names."""
    node_of_rank = node_ids_from_hostnames([host for host, _ in leaders])
    domain_of_host = {host: domain for host, domain in leaders}
    hosts_in_order = list(dict.fromkeys(host for host, _ in leaders))
    domain_of_node, names = number_domains([domain_of_host[host] for host in hosts_in_order])
    packed = {"nodes": pack_ints(node_of_rank)}
    if len(names) < len(hosts_in_order):
        packed.update(domains=pack_ints(domain_of_node), names=list(names))
    return packed


def user_name() -> str:
    """The name of the user this process runs as (its files belong to that user), not $USER."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid{os.geteuid()}"


def local_dir_of(template: str, run_dir: str, topology: Topology, rank: int, environ=None) -> str:
    """This rank's node-local directory (only this rank's: {host} is the host it runs on)."""
    environ = os.environ if environ is None else environ
    return expand_dir_template(
        template, run_dir=run_dir, node=topology.node_of_rank[rank], rank=rank, job=job_id(environ),
        host=socket.gethostname(), user=user_name(),
    )


def pfs_dir_of(template: str, run_dir: str, environ=None) -> str:
    environ = os.environ if environ is None else environ
    return template.format(run_dir=run_dir, job=job_id(environ), user=user_name())
