"""The Level protocol (levels/base.py), asked of one level on real ranks: 4 ranks on 4
simulated nodes, each with its own node-local directory. Prints one RESULT line per check
(rank 0 gathers every rank's answers); tests/test_level_conformance_mpi.py asserts them.

    python level_conformance.py <local|partner|erasure|pfs> <dir> [chunk bytes]

The chunk size (L2, L3: checkpoint.chunk_mib) may be anything: one byte, an odd number that
divides neither a shard nor a stripe's segment, larger than a shard (the default).
"""

import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.cluster.topology import Topology, simulated_node_of_rank
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord
from hpcckpt.format.shardfile import plan_shard, verify_shard
from hpcckpt.io.atomic import AtomicFile
from hpcckpt.levels.base import DeliveryRequest, VersionImage
from hpcckpt.levels.erasure import ErasureLevel
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel

kind, base = sys.argv[1], Path(sys.argv[2])
chunk = {"chunk_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
topology = Topology(simulated_node_of_rank(size, size))
local_dir = base / f"node{topology.node_of_rank[rank]}"
pfs_dir = base / "pfs"


def make_level():
    if kind == "local":
        return LocalLevel(local_dir, rank)
    if kind == "pfs":
        return PfsLevel(pfs_dir, rank)
    if kind == "partner":
        return PartnerLevel(local_dir, rank, topology.partner_of(), comm, **chunk)
    groups = topology.erasure_groups(size, 1)
    members = groups[topology.group_of(groups, rank)]
    return ErasureLevel(local_dir, rank, members, comm.Split(0, members.index(rank)), 1, **chunk)


level = make_level()
local_dir.mkdir(parents=True, exist_ok=True)
level.prepare()
# Chunks of a few bytes cost a message each: a tenth of the elements keeps those runs short
# and still spreads every shard over hundreds of chunks.
elements = size * (100 if chunk and chunk["chunk_bytes"] < 64 else 1000) + 7
layout = plan_layout([TensorSpec("w", "float32", (elements,))], size, split_threshold_bytes=1)


def version_of(step, layout=layout):
    """This rank's shard of `step`: its piece of w, filled with a value only it has."""
    piece = np.arange(layout.tensor("w").piece_shape(rank)[0], dtype=np.float32) + 1000 * step + rank
    image = plan_shard(step, rank, size, [("w", piece)], {"node": topology.node_of_rank[rank]})
    infos = comm.allgather((image.size, image.checksums))
    buffer = np.empty(image.size, np.uint8)
    version = VersionImage(step, size, tuple(s for s, _ in infos), lambda: image.copy_into(buffer), image)
    manifest = Manifest(step, size, layout, tuple(ShardRecord(r, s, c) for r, (s, c) in enumerate(infos)),
                        state={}, metrics={}, node_of_rank=topology.node_of_rank, levels=(kind,))
    return version, manifest


def report(name, value):
    answers = comm.gather(value, root=0)
    if rank == 0:
        print("RESULT " + json.dumps({"check": name, "answers": answers}), flush=True)


def as_lists(holdings):
    return {str(step): sorted(ranks) for step, ranks in holdings.items()}


originals = {}
for step in (10, 20):
    version, manifest = version_of(step)
    stored = level.store(version)
    originals[step] = bytes(version.file_bytes())
    comm.Barrier()
    level.commit(manifest)
    comm.Barrier()
    report(f"stored_{step}", stored)
# The buffers a level keeps for its transfers: chunks, never a shard's size (#26).
report("largest_buffer", max((b.size for b in getattr(level, "_receive_buffers", None)._buffers.values()), default=0)
       if hasattr(level, "_receive_buffers") else 0)
report("shard_bytes", len(originals[20]))
version, manifest = version_of(30)
level.store(version)  # never committed: a checkpoint interrupted before its commit
comm.Barrier()
report("committed", level.committed_steps())
report("uncommitted", level.uncommitted_steps())
report("holdings", as_lists(level.holdings()))
report("holdings_of_own", as_lists(level.holdings(frozenset({rank}))))
report("manifest_step", level.manifest(20).step)
# What rank 0 plans with: every rank's holdings of a version, and those with rank 2's node lost.
held = comm.allgather(level.holdings().get(20, frozenset()))
report("serves", sorted(level.serves(held, frozenset())))
report("serves_without_2", sorted(level.serves([h if r != 2 else frozenset() for r, h in enumerate(held)],
                                               frozenset({2}))))
if level.collective:
    # Rank 2 loses what it held of version 20 here; the level makes it again from the shards.
    before = {p.name: p.read_bytes() for p in level.own_files(20) if p.is_file()}
    if rank == 2:
        for path in level.own_files(20):
            path.unlink(missing_ok=True)
    comm.Barrier()
    level.protect_again(20, lambda: np.frombuffer(originals[20], np.uint8), tuple(comm.allgather(len(originals[20]))),
                        size)
    comm.Barrier()
    after = {p.name: p.read_bytes() for p in level.own_files(20) if p.is_file()}
    report("protected_again", {"same": after == before, "files": sorted(after)})


def deliver(step, needy, lacking=()):
    placed = base / f"placed-r{rank}-{step}.hck"
    placed.unlink(missing_ok=True)
    sizes = tuple(comm.allgather(len(originals[step])))
    request = DeliveryRequest(step, size, frozenset(needy), sizes, lambda nbytes, aligned: AtomicFile(placed, nbytes),
                              own_shard=lambda: np.frombuffer(originals[step], np.uint8), lacking=frozenset(lacking))
    path = level.deliver(request) if level.collective or rank in needy else None
    peak = {"peak": tracemalloc.get_traced_memory()[1]} if tracemalloc.is_tracing() else {}
    if path is None:
        return {"delivered": False, "warnings": request.warnings, **peak}
    data = Path(path).read_bytes()
    return {"delivered": True, "same_bytes": data == originals[step], "verifies": not verify_shard(path),
            "warnings": request.warnings, **peak}


report("deliver_to_2", deliver(20, {2}, {2}))
# Corruption: every copy this level holds of version 20 gets a flipped byte in its payload.
held_files = [p for p in level.own_files(20) if p.suffix == ".hck" and p.is_file()] if level.node_local else \
    ([level.shard_path(20)] if level.shard_path(20).is_file() else [])
for path in held_files:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
comm.Barrier()
report("deliver_to_2_corrupt", deliver(20, {2}, {2}))

level.remove(10)
comm.Barrier()
report("committed_after_remove", level.committed_steps())
report("own_files_left_of_10", [p.name for p in level.own_files(10) if p.exists()]
       if level.node_local else [p.name for p in level.version_dir(10).glob("*")] if level.version_dir(10).exists()
       else [])
level.withdraw(20)
comm.Barrier()
report("withdraw", level.committed_steps())
# A delivery holds chunks, never the shard it delivers (#26 item 2): a version of 4 MiB
# shards delivered to rank 2 in 16 KiB chunks whatever the run's chunk size (1-byte chunks
# would take minutes, and each chunk in flight costs some hundred bytes of Python objects),
# under tracemalloc (NumPy's buffers are traced, the mapped files a delivery reads are not).
level.chunk_bytes = 16 << 10
version, manifest = version_of(40, plan_layout([TensorSpec("w", "float32", (size * 1048576,))], size,
                                               split_threshold_bytes=1))
level.store(version)
originals[40] = bytes(version.file_bytes())
comm.Barrier()
level.commit(manifest)
comm.Barrier()
tracemalloc.start()
large = deliver(40, {2}, {2})
tracemalloc.stop()
report("large_delivery", dict(large, shard_bytes=len(originals[40])))
