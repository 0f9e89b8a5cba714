"""Which node each rank runs on, learned over MPI (all ranks call these collectively)."""

from __future__ import annotations

import os
import socket

from hpcckpt.cluster.topology import (
    Topology,
    expand_dir_template,
    job_id,
    node_ids_from_hostnames,
    simulated_node_of_rank,
)


def discover_topology(comm, simulated_nodes: int = 0) -> Topology:
    """(all ranks) Node of every rank: simulated blocks, or real shared-memory domains.

    On a cluster a node is what MPI calls a shared-memory domain; its name is the host name of
    its first rank, gathered so every rank numbers nodes the same way.
    """
    if simulated_nodes:
        return Topology(simulated_node_of_rank(comm.Get_size(), simulated_nodes))
    from mpi4py import MPI

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader_name = node_comm.bcast(socket.gethostname() if node_comm.Get_rank() == 0 else None, root=0)
    finally:
        node_comm.Free()
    return Topology(node_ids_from_hostnames(comm.allgather(leader_name)))


def local_dir_of(template: str, run_dir: str, topology: Topology, rank: int, environ=None) -> str:
    environ = os.environ if environ is None else environ
    return expand_dir_template(
        template, run_dir=run_dir, node=topology.node_of_rank[rank], rank=rank, job=job_id(environ)
    )
