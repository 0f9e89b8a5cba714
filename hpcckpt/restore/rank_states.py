"""The restore's per-rank registered state (format/rank_state.py) when a version is loaded
over the old job's shards (another rank count, layout or placement): each old rank's state
piece is read where its shard survived, by the repartition machinery (repartition/exchange.py:
the rank that holds the shard on its node or rebuilds it from parity, which verifies only that
piece; one only a global level holds is read by new rank old_rank % ranks), and handed to new
rank old_rank % ranks in one all-to-all of small objects. On the same rank count every rank
thus gets its own old rank's state; onto another, the engine hands what each rank got to the
application's reshard hook.
"""

from __future__ import annotations

from hpcckpt.cluster.collectives import agree_before_exchange
from hpcckpt.errors import HpcckptError
from hpcckpt.format.layout import Layout
from hpcckpt.format.manifest import Manifest
from hpcckpt.format.rank_state import RANK_STATE_PIECE, read_rank_state_piece
from hpcckpt.levels.naming import PFS
from hpcckpt.repartition.exchange import OldPieceReader, RepartitionJob
from hpcckpt.repartition.plan import RepartitionPlan
from hpcckpt.restore.context import warn


def holds_rank_states(manifest: Manifest) -> bool:
    """The version's shards carry per-rank state (its record lists the piece)."""
    return any(RANK_STATE_PIECE in shard.checksums for shard in manifest.shards)


def gather_rank_states(ctx, manifest: Manifest, candidate) -> dict | None:
    """(all ranks) {old rank: its per-rank states (name -> encoded)} of the old ranks handed
    to this rank (old rank r to new rank r % ranks); None (said) when some old rank's cannot
    be read. `candidate`: restore/plan.py's, for where the old shards survive."""
    whole = ctx.levels.level(candidate.whole_on) if candidate.whole_on else None
    path_of = (lambda old_rank: whole.shard_path(manifest.step, old_rank)) if whole is not None else None
    job = RepartitionJob(ctx.job.comm, manifest, Layout(ctx.job.world_size, ()), {}, (), candidate.views, path_of,
                         lambda message: warn(ctx, message), scratch_dir=ctx.run.node_dir,
                         chunk_bytes=ctx.chunk_bytes, verify=lambda name: name == RANK_STATE_PIECE)
    router = _StateRouter(ctx.job.comm, manifest, path_of, lambda message: warn(ctx, message))
    outcome = job.run(candidate.writing, whole is not None, move=router.move)
    if isinstance(outcome, RepartitionPlan):
        if ctx.job.rank == 0:
            warn(ctx, f"version {manifest.step} cannot be loaded: the per-rank state of old rank(s) "
                      f"{list(outcome.missing)} is on no surviving level; trying an older one")
        return None
    return outcome.pieces


class _StateRouter:
    """The move stage: each old rank's state piece, read by its provider, sent to its new rank."""

    def __init__(self, comm, record: Manifest, path_of, warn_):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.record = record
        self.path_of = path_of
        self.warn = warn_

    def move(self, plan: RepartitionPlan, held: dict):
        outgoing: list[dict] = [{} for _ in range(self.size)]
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
                    if provider is not None:
                        data = held[old_rank].piece(RANK_STATE_PIECE)
                    elif from_l4 is not None:
                        data = from_l4.piece(old_rank, RANK_STATE_PIECE)
                    else:
                        raise HpcckptError(f"no copy of old rank {old_rank}'s shard was planned")
                    outgoing[old_rank % self.size][old_rank] = read_rank_state_piece(data)
                except (HpcckptError, OSError, ValueError) as exc:
                    level = source.level if provider is not None else PFS
                    self.warn(f"version {self.record.step}: old rank {old_rank}'s per-rank state ({level}) is "
                              f"unusable: {exc}")
                    bad.add((level, old_rank))  # agreed after the exchange: the round is planned again
        except Exception as exc:  # not a bad source (memory, a bug): every rank stops before the exchange
            failure = exc
        finally:
            if from_l4 is not None:
                from_l4.close()
        agree_before_exchange(self.comm, failure, "handing out the per-rank state")
        received: dict = {}
        for part in self.comm.alltoall(outgoing):
            received.update(part)
        return received, bad
