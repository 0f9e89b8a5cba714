"""Which node each rank runs on, learned over MPI (all ranks call these collectively)."""

from __future__ import annotations

import os
import pwd
import socket

from hpcckpt.cluster.collectives import fold_at_root
from hpcckpt.cluster.topology import (
    Topology,
    expand_dir_template,
    job_id,
    node_ids_from_hostnames,
    simulated_node_of_rank,
)
from hpcckpt.format.compact import pack_ints, unpack_ints


def discover_topology(comm, simulated_nodes: int = 0) -> Topology:
    """(all ranks) Node of every rank: simulated blocks, or real shared-memory domains.

    On a cluster a node is what MPI calls a shared-memory domain; its name is the host name of
    its first rank, gathered at rank 0, which numbers the nodes and hands every rank the node
    of each as a rule (format/compact.py: O(1) where a node's ranks are consecutive).
    """
    if simulated_nodes:
        return Topology(simulated_node_of_rank(comm.Get_size(), simulated_nodes))
    from mpi4py import MPI

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        leader_name = node_comm.bcast(socket.gethostname() if node_comm.Get_rank() == 0 else None, root=0)
    finally:
        node_comm.Free()
    packed = fold_at_root(comm, leader_name, lambda names: pack_ints(node_ids_from_hostnames(names)))
    return Topology(tuple(unpack_ints(packed)))


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
