"""The restore's keyed tables (format/keyed_rows.py): the rows of a version's tables, applied
along its chain and handed to the ranks their ids hash to, on this job's rank count.

For each version of the chain, oldest first, every old rank's table pieces are read where
they survived, by the repartition machinery (repartition/exchange.py): an old shard is read
by the rank that holds it on its node (its L1 file, an L2 replica) or rebuilds it from L3
parity, which verifies only the table pieces; one that only a global level holds is read by
new rank old_rank % ranks. That rank routes each row to the rank its id hashes to: one
all-to-all of counts, then of ids and of rows (MPI datatypes of a whole row). Each rank
applies the rows in chain order, a later row of an id replacing an earlier one, and loads
its tables once every version of the chain was read; a version none of whose copies of some
old rank is readable fails the candidate (the restore goes on to an older version).
"""

from __future__ import annotations

import numpy as np

from hpcckpt.cluster.collectives import agree_before_exchange, route_rows
from hpcckpt.errors import HpcckptError
from hpcckpt.format.keyed_rows import TableSpec, check_pieces, is_table_piece, merge_rows, owner_of, piece_names
from hpcckpt.format.layout import Layout
from hpcckpt.format.manifest import Manifest
from hpcckpt.levels.naming import PFS
from hpcckpt.repartition.exchange import OldPieceReader, RepartitionJob
from hpcckpt.repartition.plan import RepartitionPlan
from hpcckpt.restore.context import warn


def load_tables(ctx, manifest: Manifest, members: tuple, shared_manifest) -> bool:
    """(all ranks) Load the protected tables from `manifest`'s version; `members`: each
    version of its chain (restore/plan.py's TableMember), oldest first; `shared_manifest(step)`
    the whole commit record of a version (every shard listed). False (said) when some version
    of the chain cannot be read; the tables are then left as they were."""
    tables = ctx.targets.tables
    if not tables:
        return True
    specs = {name: TableSpec.from_dict(name, manifest.tables[name]) for name in tables}
    merged = {name: (np.empty(0, np.int64), np.empty((0, spec.dim), spec.dtype)) for name, spec in specs.items()}
    chain = manifest.table_chain
    if tuple(m.step for m in members) != tuple(chain):
        _say(ctx, manifest.step, f"its tables need versions {list(chain)}, and not every one is held")
        return False
    for position, member in enumerate(members):
        record = shared_manifest(member.step)  # collective: every rank asks, whatever its own copy lists
        if record is None or record.table_chain != chain[:position + 1]:
            _say(ctx, manifest.step, f"version {member.step} of its tables' chain is not the one it was written on")
            return False
        rows = _gather(ctx, record, member, specs)
        if rows is None:
            _say(ctx, manifest.step, f"version {member.step} of its tables' chain cannot be read")
            return False
        for name, (ids, values) in rows.items():
            merged[name] = merge_rows(*merged[name], ids, values)
    for name, table in tables.items():
        table.load(*merged[name])
    if ctx.log:
        counts = ", ".join(f"{name} {len(table)}" for name, table in tables.items())
        ctx.log.info(f"version {manifest.step}: tables restored from {len(chain)} version(s) of their chain "
                     f"({list(chain)}); this rank holds rows: {counts}")
    return True


def _say(ctx, step: int, why: str) -> None:
    if ctx.job.rank == 0:
        warn(ctx, f"version {step} cannot be loaded: {why}; trying an older one")


def _gather(ctx, record: Manifest, member, specs: dict) -> dict | None:
    """(all ranks) This rank's rows of each table in one version of the chain, or None."""
    whole = ctx.levels.level(member.whole_on) if member.whole_on else None
    path_of = (lambda old_rank: whole.shard_path(record.step, old_rank)) if whole is not None else None
    job = RepartitionJob(ctx.job.comm, record, Layout(ctx.job.world_size, ()), {}, (), member.views, path_of,
                         lambda message: warn(ctx, message), scratch_dir=ctx.run.node_dir,
                         chunk_bytes=ctx.chunk_bytes, verify=is_table_piece)
    router = _Router(ctx.job.comm, record, specs, path_of, lambda message: warn(ctx, message))
    outcome = job.run(member.writing, whole is not None, move=router.move)
    if isinstance(outcome, RepartitionPlan):
        return None
    return outcome.pieces


class _Router:
    """The move stage of one version's table rows: each old rank's rows, read by its router,
    sent to the ranks their ids hash to."""

    def __init__(self, comm, record: Manifest, specs: dict, path_of, warn):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.record = record
        self.specs = specs
        self.path_of = path_of
        self.warn = warn

    def move(self, plan: RepartitionPlan, held: dict):
        outgoing = {name: [] for name in self.specs}  # name -> [(owners, ids, rows)] in old-rank order
        bad = set()
        from_l4 = OldPieceReader(self.record, self.path_of) if self.path_of is not None else None
        failure = None
        try:
            for old_rank in range(self.record.world_size):
                source = plan.sources[old_rank]
                provider = source.provider if source is not None else None
                if (provider if provider is not None else old_rank % self.size) != self.rank:
                    continue
                try:
                    for name, spec in self.specs.items():
                        ids, rows = self._pieces(name, spec, old_rank, held.get(old_rank) if provider is not None
                                                 else None, from_l4)
                        outgoing[name].append((owner_of(ids, self.size), ids, rows))
                except (HpcckptError, OSError, ValueError) as exc:
                    level = source.level if provider is not None else PFS
                    self.warn(f"version {self.record.step}: old rank {old_rank}'s table rows ({level}) are unusable: "
                              f"{exc}")
                    bad.add((level, old_rank))  # agreed after the exchange: the round is planned again
        except Exception as exc:  # not a bad source (memory, a bug): every rank stops before the exchange
            failure = exc
        finally:
            if from_l4 is not None:
                from_l4.close()
        agree_before_exchange(self.comm, failure, "routing the tables' rows")
        # Every rank takes part in the exchanges, also after a bad source (the result is then dropped).
        received = {name: self._exchange(spec, outgoing[name]) for name, spec in self.specs.items()}
        return received, bad

    def _pieces(self, name: str, spec: TableSpec, old_rank: int, held, from_l4):
        ids_name, rows_name = piece_names(name)
        if held is not None:
            ids_bytes, rows_bytes = held.piece(ids_name), held.piece(rows_name)
        elif from_l4 is not None:
            ids_bytes = np.array(from_l4.piece(old_rank, ids_name))
            rows_bytes = from_l4.piece(old_rank, rows_name)
        else:
            raise HpcckptError(f"no copy of old rank {old_rank}'s shard was planned")
        ids = np.frombuffer(ids_bytes, dtype=np.int64)
        rows = np.frombuffer(rows_bytes, dtype=np.dtype(spec.dtype)).reshape(-1, spec.dim)
        check_pieces(name, spec, ids, rows, f"old rank {old_rank}'s shard of step {self.record.step}")
        return ids, rows

    def _exchange(self, spec: TableSpec, outgoing: list) -> tuple[np.ndarray, np.ndarray]:
        """(all ranks) The rows routed to this rank: their ids, then the rows, the same order."""
        dtype = np.dtype(spec.dtype)
        if outgoing:
            owners = np.concatenate([o for o, _, _ in outgoing])
            ids = np.concatenate([i for _, i, _ in outgoing])
            rows = np.concatenate([r for _, _, r in outgoing])
        else:
            owners, ids, rows = np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, spec.dim), dtype)
        got_ids, counts = route_rows(self.comm, ids, owners)
        got_rows, _ = route_rows(self.comm, rows, owners, sizes_known=counts)
        return got_ids, got_rows
