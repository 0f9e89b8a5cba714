"""The inputs `hpcckpt plan` takes, as flags and as [plan] keys: apart from the simulator,
so that the command line names them without importing it (every rank of every job parses
the command line; only `hpcckpt plan` simulates)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    name: str  # key of the [plan] table; the flag is --name with dashes
    kind: str  # count, size, rate, duration, mtbf, scope
    help: str
    example: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


PARAMS = (
    Param("nodes", "count", "nodes the job runs on, spares not counted", "2048"),
    Param("gpus_per_node", "count", "GPUs (ranks) per node", "8"),
    Param("state", "size", "the job's whole state: weights and optimizer state", "1.12TB"),
    Param("local_bw", "rate", "node-local write per node: the GPUs' state into host memory", "512GB/s"),
    Param("network_bw", "rate", "network bandwidth per node", "400GB/s"),
    Param("pfs_write_bw", "rate", "the parallel file system's write bandwidth, all nodes together", "2TB/s"),
    Param("pfs_read_bw", "rate", "the parallel file system's read bandwidth, all nodes together", "2TB/s"),
    Param("mtbf", "mtbf", "the mean time between failures of any class (split as Llama 3's causes)", "6335h"),
    Param("mtbf_crash", "mtbf", "the MTBF of rank crashes (the node stays up), or none", "100000h"),
    Param("mtbf_node", "mtbf", "the MTBF of node losses (the node and its local storage gone), or none", "40000h"),
    Param("mtbf_switch", "mtbf", "the MTBF of leaf switch losses (every node under it), or none", "500000h"),
    Param("mtbf_per", "scope", "node (the MTBFs given are each node's) or job (the whole job's)", "job"),
    Param("repair_window", "duration", "how long a lost node is missing until it is back or replaced", "24h"),
    Param("days", "duration", "the training time the job needs without failures or checkpoints", "54d"),
    Param("seeds", "count", "how many simulated runs the goodput is summed over", "3"),
    Param("group_size", "count", "nodes per erasure group, parity included (resilience.group_size)", "6"),
    Param("parity", "count", "parity pieces per group: node losses each group survives (resilience.parity)", "2"),
)
BY_NAME = {p.name: p for p in PARAMS}
