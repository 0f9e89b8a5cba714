"""The commit record of each version this job writes: the version's own part (step, layout,
shard records, state, metrics, levels) and what every record of the job repeats (its rank
count and placement, node-local directories, redundancy, run identity, settings)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpcckpt.ckpt.snapshot import ProtectedArrays
from hpcckpt.format.manifest import Manifest, ShardRecord


@dataclass(frozen=True)
class CommitRecords:
    """Makes the pipeline's commit records (SavePipeline's make_manifest)."""

    arrays: ProtectedArrays
    world_size: int
    node_of_rank: tuple
    local_dirs: tuple
    partner_of: tuple
    groups: tuple
    parity: int
    run_id: str
    settings: dict
    domain_of_rank: tuple = ()
    domain_names: tuple = ()

    def __call__(self, snapshot, shard_infos, levels) -> Manifest:
        return Manifest(
            step=snapshot.step,
            world_size=self.world_size,
            layout=self.arrays.layout,
            shards=tuple(ShardRecord(r, size, checksums) for r, (size, checksums) in sorted(shard_infos.records.items())),
            state=snapshot.state,
            metrics=snapshot.metrics,
            node_of_rank=self.node_of_rank,
            local_dirs=self.local_dirs,
            local_arrays=self.arrays.local_array_names,
            levels=tuple(levels),
            created=time.time(),
            run_id=self.run_id,
            settings=self.settings,
            partner_of=self.partner_of,
            groups=self.groups,
            parity=self.parity if self.groups else 0,
            version_id=shard_infos.version_id,
            domain_of_rank=self.domain_of_rank,
            domain_names=self.domain_names,
            tables=dict(snapshot.tables),
            table_chain=tuple(snapshot.table_chain),
        )
