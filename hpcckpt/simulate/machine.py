"""A machine and a job on it, as the numbers the checkpoint schedule and the simulator need.

The job's state (`state_bytes`, all of it: weights and optimizer state) is spread evenly over
the nodes: b = state_bytes / nodes per node. What each level costs one version, with the
node's bandwidths (bytes per second per node) and the PFS's aggregate ones (shared by every
writer, so L4's time grows with the job while the node-local levels' shrink):

    snapshot   b / snapshot_bw                       blocking: the GPUs' state copied to host memory
    L1         the snapshot itself (a version held in host memory survives a rank crash)
    L2         b / network_bw                        the copy to a partner in another failure domain
    L3         b / rs_encode_bw + (m/k) b / network_bw      Reed-Solomon parity (k data, m parity)
    L4         max(state_bytes / pfs_write_bw, b / network_bw) + files / pfs_creates_per_s

Only the snapshot blocks; L2-L4 run beside training, which loses `interference` of the seconds
each keeps the node's network busy (the same fraction for every approach that writes in the
background). Durable: the snapshot plus the level's own time.

Restores: L1 b / snapshot_bw; L2 b / network_bw; L3 k b / network_bw (k pieces fetched) plus a
decode at the encode rate; L4 max(state_bytes / pfs_read_bw, b / network_bw) plus the metadata.

Failures per node, as Poisson rates that add up over the job's nodes: a rank crash (the node
and its memory survive), the loss of a node, the loss of a leaf switch. Failure domains are
leaf switches (cluster.failure_domains = "auto" takes them from the scheduler), so partners and
parity groups sit under different switches and a switch takes one domain, as a node does.
Recovery: detection, then in the job (`in_job_s`: shrink, a spare in a dead node's place, the
state read) or a relaunch (`relaunch_s`: the scheduler, start-up and communicators, growing with
the job), then the read from the level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

HOUR = 3600.0
GB = 1e9

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, table 5): 419 unexpected interruptions in
# 54 days on 2,048 nodes of 8 H100: software bugs 54, NCCL watchdog timeouts 7 and dependency
# failures 2 leave the node up (a rank crash); network switches and cables 35 (a switch); the
# remaining 321 (GPU, HBM3, host maintenance, NIC, SSD, power ...) take a node.
LLAMA3_INTERRUPTIONS = {"rank crash": 54 + 7 + 2, "node": 321, "switch": 35}
LLAMA3_NODE_HOURS = 54 * 24 * 2048


@dataclass(frozen=True)
class FailureRates:
    """Per-node failure rates (per second) by class."""

    rank_crash: float
    node: float
    switch: float

    @classmethod
    def llama3(cls, factor: float = 1.0) -> "FailureRates":
        rates = {name: factor * count / (LLAMA3_NODE_HOURS * HOUR) for name, count in LLAMA3_INTERRUPTIONS.items()}
        return cls(rates["rank crash"], rates["node"], rates["switch"])

    @property
    def total(self) -> float:
        return self.rank_crash + self.node + self.switch


@dataclass(frozen=True)
class Machine:
    nodes: int
    state_bytes: float
    gpus_per_node: int = 8
    snapshot_bw: float = 8 * 64 * GB  # H100 SXM: PCIe Gen5 x16, 64 GB/s each way, per GPU (nominal)
    network_bw: float = 8 * 50 * GB  # DGX H100: 8 ConnectX-7 at 400 Gb/s (nominal)
    rs_encode_bw: float = 16 * 2.2 * GB  # 16 cores at this project's measured 2.2 GB/s (perf/RESULTS.md)
    rs_data: int = 4
    rs_parity: int = 2
    pfs_write_bw: float = 2000 * GB  # Llama 3's Tectonic: 2 TB/s sustained (7 TB/s peak)
    pfs_read_bw: float = 2000 * GB
    pfs_creates_per_s: float = 20000.0  # assumption: one metadata server's file creates per second
    interference: float = 0.1  # assumption: seconds of training lost per second of background transfer
    detection_s: float = 30.0  # assumption: a heartbeat's timeout
    # FT-HSDP (Meta, arXiv 2602.00277): at O(100K) GPUs (12,500 nodes) a failure stalls the job
    # 10 min with a relaunch, 3 min recovered within the job; start-up is taken as linear in the
    # nodes from a minute (relaunch) and 10 s (in the job) on a few nodes to those figures.
    relaunch_base_s: float = 60.0
    relaunch_per_node_s: float = (600.0 - 30.0 - 60.0) / 12500
    in_job_base_s: float = 10.0
    in_job_per_node_s: float = (180.0 - 30.0 - 10.0) / 12500
    step_s: float = 1.0  # assumption: a training step; versions are taken between steps, at most one each
    spare_repair_hours: float = 24.0  # assumption: a dead node is back (or replaced) within a day
    failures: FailureRates = FailureRates.llama3()

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes ({self.nodes}) and gpus_per_node ({self.gpus_per_node}) must be >= 1")
        positive = ("state_bytes", "snapshot_bw", "network_bw", "rs_encode_bw", "pfs_write_bw", "pfs_read_bw",
                    "pfs_creates_per_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"Machine.{name} must be > 0, got {getattr(self, name)}")
        if self.rs_data < 1 or self.rs_parity < 1:
            raise ValueError(f"rs_data ({self.rs_data}) and rs_parity ({self.rs_parity}) must be >= 1")
        if self.step_s < 0 or self.detection_s < 0:
            raise ValueError(f"step_s ({self.step_s}) and detection_s ({self.detection_s}) must be >= 0")
        if not 0 <= self.interference <= 1:
            raise ValueError(f"interference must be within [0, 1], got {self.interference}")

    def scaled(self, nodes: int) -> "Machine":
        return replace(self, nodes=nodes)

    @property
    def per_node_bytes(self) -> float:
        return self.state_bytes / self.nodes

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def snapshot_s(self) -> float:
        return self.per_node_bytes / self.snapshot_bw

    @property
    def partner_s(self) -> float:
        return self.per_node_bytes / self.network_bw

    @property
    def erasure_s(self) -> float:
        b = self.per_node_bytes
        return b / self.rs_encode_bw + self.rs_parity / self.rs_data * b / self.network_bw

    @property
    def metadata_s(self) -> float:
        return (self.ranks + 1) / self.pfs_creates_per_s  # a file per rank and the commit record

    @property
    def pfs_write_s(self) -> float:
        return max(self.state_bytes / self.pfs_write_bw, self.partner_s) + self.metadata_s

    @property
    def pfs_read_s(self) -> float:
        return max(self.state_bytes / self.pfs_read_bw, self.partner_s) + self.metadata_s

    def read_s(self, level: str) -> float:
        """Seconds to read a version back from `level` (L1, L2, L3, L4)."""
        b = self.per_node_bytes
        reads = {"L1": b / self.snapshot_bw, "L2": b / self.network_bw,
                 "L3": self.rs_data * b / self.network_bw + b / self.rs_encode_bw, "L4": self.pfs_read_s}
        if level not in reads:
            raise ValueError(f"no level {level!r}: one of {sorted(reads)}")
        return reads[level]

    @property
    def relaunch_s(self) -> float:
        return self.relaunch_base_s + self.relaunch_per_node_s * self.nodes

    @property
    def in_job_s(self) -> float:
        return self.in_job_base_s + self.in_job_per_node_s * self.nodes

    def job_rates(self) -> dict[str, float]:
        """Failures per second of the whole job, by class (the per-node rates times the nodes)."""
        f = self.failures
        return {"rank crash": f.rank_crash * self.nodes, "node": f.node * self.nodes, "switch": f.switch * self.nodes}

    @property
    def job_mtbf_s(self) -> float:
        return 1 / (self.failures.total * self.nodes)

    def spares(self, out_of_spares: float = 0.01) -> int:
        """Spare nodes to hold so that a repair window's node losses run out of them with
        probability under `out_of_spares` (a Poisson quantile)."""
        expected = self.failures.node * self.nodes * self.spare_repair_hours * HOUR
        return poisson_quantile(expected, 1 - out_of_spares)


def poisson_quantile(mean: float, probability: float) -> int:
    """The smallest k with P(Poisson(mean) <= k) >= probability (terms summed in log space, so a
    large mean does not underflow)."""
    if mean < 0 or not 0 < probability < 1:
        raise ValueError(f"mean ({mean}) must be >= 0 and probability ({probability}) within (0, 1)")
    if mean == 0:
        return 0
    k, cumulative = 0, 0.0
    while True:
        cumulative += math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))
        if cumulative >= probability:
            return k
        k += 1
