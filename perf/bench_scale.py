"""Checkpoint metadata at scale (#27): the pure paths every rank runs per version, simulated
for large rank counts without launching them. For a model of --tensors tensors (transformer
blocks of 12 weights, each with one optimizer slot), per rank count:

  plan_s       plan_layout(): which rank stores which piece of which tensor
  record_mib   one rank's node-local commit record (Manifest.for_rank(rank).to_bytes()),
               the largest of ranks 0, one in the middle and the last
  job_gib      every rank's node-local record plus L4's one, per version
  write_s      for_rank() and to_bytes() of one node-local record
  parse_s      Manifest.from_bytes() of one node-local record (each restart, inspect, retention)
  l4_mib       L4's one record of the version (every shard listed)

Medians of --repeats runs (1 for rows above 1,024 ranks: they take seconds each). No MPI,
no files: the sizes and times are those of the functions the engine calls.

    PYTHONPATH=. python perf/bench_scale.py                             # 64 .. 16,384 ranks, ~2 min
    PYTHONPATH=. python perf/bench_scale.py --ranks 64 1024 --json scale.json
"""

from __future__ import annotations

import argparse
import gc
import time

from harness import median, write_json

from hpcckpt.cluster.topology import Topology
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord, shard_digest, version_id_of

HIDDEN = 1024
RANKS_PER_NODE = 4
GROUP_SIZE = 8


def model_specs(tensors: int) -> list[TensorSpec]:
    """`tensors` tensors: blocks of 12 weights (4 matrices, 8 vectors), each weight followed
    by one optimizer slot of its shape, as Adam's or momentum SGD's state adds."""
    block = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN),
             (3 * HIDDEN,), (HIDDEN,), (4 * HIDDEN,), (HIDDEN,), (HIDDEN,), (HIDDEN,), (HIDDEN,), (HIDDEN,)]
    specs = []
    index = 0
    while len(specs) < tensors:
        shape = block[index % len(block)]
        name = f"block{index // len(block)}.w{index % len(block)}"
        specs.append(TensorSpec(name, "float32", shape))
        if len(specs) < tensors:
            specs.append(TensorSpec(f"{name}.momentum", "float32", shape))
        index += 1
    return specs


def one_version(specs: list[TensorSpec], ranks: int) -> dict:
    started = time.perf_counter()
    layout = plan_layout(specs, ranks)
    plan_s = time.perf_counter() - started
    digest = "0123456789abcdef"  # an xxh3_64 hex digest's length
    shards = tuple(ShardRecord(rank, layout.bytes_of_rank(rank) + 4096,
                               {piece.name: digest for piece in layout.rank_pieces(rank)})
                   for rank in range(ranks))
    node_of_rank = tuple(rank // RANKS_PER_NODE for rank in range(ranks))
    topology = Topology(node_of_rank)  # the engine's partners and groups for this placement
    manifest = Manifest(
        step=1000, world_size=ranks, layout=layout, shards=shards, state={"step": 1000, "epoch": 3},
        metrics={"val_loss": 0.1}, node_of_rank=node_of_rank,
        # jobs/cluster.toml's "/tmp/hpcckpt-{user}/{job}/{host}", one per rank, as the engine records them
        local_dirs=tuple(f"/tmp/hpcckpt-user/1234567/nid{node + 1000:06d}" for node in node_of_rank),
        levels=("local", "partner", "erasure", "pfs"), created=time.time(), run_id="0123456789abcdef",
        partner_of=topology.partner_of(), groups=topology.erasure_groups(GROUP_SIZE, 2), parity=2,
        # Each rank hashes its own shard's record; the version id combines them (engine._manifest).
        version_id=version_id_of(1000, ranks, [shard_digest(r.size, r.checksums) for r in shards]))
    started = time.perf_counter()
    data = manifest.for_rank(0).to_bytes()
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    Manifest.from_bytes(data)
    parse_s = time.perf_counter() - started
    record = max(len(data), *(len(manifest.for_rank(rank).to_bytes()) for rank in (ranks // 2, ranks - 1)))
    l4 = len(manifest.to_bytes())
    return {"plan_s": plan_s, "write_s": write_s, "parse_s": parse_s, "record_mib": record / 2**20,
            "job_gib": (record * ranks + l4) / 2**30, "l4_mib": l4 / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    parser.add_argument("--tensors", type=int, default=576)
    parser.add_argument("--wide", type=int, nargs=2, default=[1024, 10000], metavar=("RANKS", "TENSORS"),
                        help="one more row: RANKS ranks with TENSORS tensors (0 0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [(ranks, args.tensors) for ranks in args.ranks]
    if args.wide[0]:
        rows.append(tuple(args.wide))
    results = []
    print(f"{'ranks':>7} {'tensors':>8} {'record KiB':>11} {'job GiB':>9} {'plan s':>8} {'write s':>8} {'parse s':>8} "
          f"{'L4 MiB':>8}")
    for ranks, tensors in rows:
        specs = model_specs(tensors)
        runs = []
        for _ in range(args.repeats if ranks <= 1024 and tensors <= 1000 else 1):
            runs.append(one_version(specs, ranks))
            gc.collect()
        row = {"ranks": ranks, "tensors": tensors, **{key: median([r[key] for r in runs]) for key in runs[0]}}
        results.append(row)
        print(f"{ranks:>7,d} {tensors:>8,d} {row['record_mib'] * 1024:>11.1f} {row['job_gib']:>9.3f} "
              f"{row['plan_s']:>8.3f} {row['write_s']:>8.3f} {row['parse_s']:>8.3f} {row['l4_mib']:>8.1f}", flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": results})


if __name__ == "__main__":
    main()
