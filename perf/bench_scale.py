"""Checkpoint metadata at scale (#27): the pure paths every rank runs per version, simulated
for large rank counts without launching them. For a model of --tensors tensors (transformer
blocks of 12 weights, each with one optimizer slot), per rank count:

  plan_s       plan_layout(): which rank stores which piece of which tensor
  record_mib   one commit record as each rank writes it (Manifest.to_bytes())
  job_gib      every rank's node-local copy plus L4's one, per version
  write_s      Manifest.to_bytes() on one rank
  parse_s      Manifest.from_bytes() on one rank (each restart, inspect, retention)

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
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord

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
    nodes = ranks // RANKS_PER_NODE or 1
    manifest = Manifest(
        step=1000, world_size=ranks, layout=layout, shards=shards, state={"step": 1000, "epoch": 3},
        metrics={"val_loss": 0.1}, node_of_rank=tuple(rank // RANKS_PER_NODE for rank in range(ranks)),
        local_dirs=tuple(f"/local/scratch/hpcckpt-user/1234567/node{n:05d}" for n in range(nodes)),
        levels=("local", "partner", "erasure", "pfs"), created=time.time(), run_id="0123456789abcdef",
        partner_of=tuple((rank + RANKS_PER_NODE) % ranks for rank in range(ranks)),
        groups=tuple(tuple(range(first, min(first + GROUP_SIZE, ranks))) for first in range(0, ranks, GROUP_SIZE)),
        parity=2)
    started = time.perf_counter()
    data = manifest.to_bytes()
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    Manifest.from_bytes(data)
    parse_s = time.perf_counter() - started
    return {"plan_s": plan_s, "write_s": write_s, "parse_s": parse_s, "record_mib": len(data) / 2**20,
            "job_gib": len(data) * (ranks + 1) / 2**30}


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
    print(f"{'ranks':>7} {'tensors':>8} {'record MiB':>11} {'job GiB':>9} {'plan s':>8} {'write s':>8} {'parse s':>8}")
    for ranks, tensors in rows:
        specs = model_specs(tensors)
        runs = []
        for _ in range(args.repeats if ranks <= 1024 and tensors <= 1000 else 1):
            runs.append(one_version(specs, ranks))
            gc.collect()
        row = {"ranks": ranks, "tensors": tensors, **{key: median([r[key] for r in runs]) for key in runs[0]}}
        results.append(row)
        print(f"{ranks:>7,d} {tensors:>8,d} {row['record_mib']:>11.1f} {row['job_gib']:>9.2f} {row['plan_s']:>8.2f} "
              f"{row['write_s']:>8.2f} {row['parse_s']:>8.2f}", flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": results})


if __name__ == "__main__":
    main()
