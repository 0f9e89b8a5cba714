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

And a restart after one node is lost (restore/plan.py), per rank count, 3 versions on
L1-L3 and one on L4:

  holdings_mib  what each rank received when every rank's holdings were allgathered (before)
  root_mib      what rank 0 receives now: every rank's holdings, gathered
  outlook_kib   what each rank receives now: rank 0's decision (broadcast) and its own
                sources (scattered)
  table_kib     the shard records each rank is handed back to verify and rebuild its shard
                (before: the whole table, l4_mib)
  decide_s      plan_restore() at rank 0, over every rank's holdings

Medians of --repeats runs (1 for rows above 1,024 ranks: they take seconds each). No MPI,
no files: the sizes and times are those of the functions the engine calls.

    PYTHONPATH=. python perf/bench_scale.py                             # 64 .. 16,384 ranks, ~2 min
    PYTHONPATH=. python perf/bench_scale.py --ranks 64 1024 --json scale.json
"""

from __future__ import annotations

import argparse
import gc
import time

from harness import machine, median, print_machine, write_json  # perf/ is on sys.path: the scripts run from it

import copyreg
import io
import pickle
from types import SimpleNamespace

from hpcckpt.cluster.topology import Topology
from hpcckpt.format.layout import TensorSpec, plan_layout
from hpcckpt.format.manifest import Manifest, ShardRecord, shard_digest, version_id_of
from hpcckpt.levels.base import LevelStack
from hpcckpt.levels.erasure import ErasureLevel
from hpcckpt.levels.local import LocalLevel
from hpcckpt.levels.partner import PartnerLevel
from hpcckpt.levels.pfs import PfsLevel
from hpcckpt.levels.survey import NodeLocalView, Writing
from hpcckpt.restore.discover import Holdings
from hpcckpt.restore.plan import plan_restore

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
            "job_gib": (record * ranks + l4) / 2**30, "l4_mib": l4 / 2**20, **one_restart(manifest),
            "table_kib": record / 1024}


def _pickled_size(value, writings_as_rules: bool = True) -> int:
    """Bytes of `value` pickled; without `writings_as_rules`, a Writing carries its groups
    rank by rank, as it did before #27."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    if not writings_as_rules:
        pickler.dispatch_table = copyreg.dispatch_table.copy()
        pickler.dispatch_table[Writing] = lambda w: (Writing, (w.identity, w.created, w.world_size, w.run_id,
                                                               w.groups, w.parity))
    pickler.dump(value)
    return buffer.tell()


def one_restart(manifest: Manifest) -> dict:
    """Every rank's holdings as restore/discover.py lists them after node 1 is lost, and rank
    0's decision over them."""
    ranks = manifest.world_size
    writing = Writing.of(manifest)
    steps = (800, 900, 1000)
    node_of = manifest.node_of_rank
    on_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of):
        on_node.setdefault(node, []).append(rank)
    sources_of = {holder: [] for holder in range(ranks)}
    for source, holder in enumerate(manifest.partner_of):
        sources_of[holder].append(source)
    views = {node: {step: NodeLocalView(step, f"/local/n{node}/v{step}", writing, frozenset(members),
                                        frozenset(members),
                                        frozenset((s, h) for h in members for s in sources_of[h]),
                                        frozenset(members)) for step in steps}
             for node, members in on_node.items()}
    group_of = {m: g for g in manifest.groups for m in g}
    everyone = []
    for rank in range(ranks):
        on_l4 = {1000: writing}
        if node_of[rank] == 1:  # lost: its directory is gone
            everyone.append(Holdings(written={"pfs": on_l4}, supplies={"pfs": {1000: frozenset({rank})}}))
            continue
        node_local = {s: writing for s in steps}
        members = frozenset(group_of[rank])
        everyone.append(Holdings(
            written={"local": node_local, "partner": node_local, "erasure": node_local, "pfs": on_l4},
            supplies={"local": {s: frozenset({rank}) for s in steps},
                      "partner": {s: frozenset(sources_of[rank]) for s in steps},
                      "erasure": {s: members for s in steps}, "pfs": {1000: frozenset({rank})}},
            node_files=True, views=views[node_of[rank]]))
    topology = Topology(node_of)
    levels = LevelStack([LocalLevel("/local", 0), PartnerLevel("/local", 0, manifest.partner_of, None),
                         ErasureLevel("/local", 0, group_of[0], None, manifest.parity, groups=manifest.groups),
                         PfsLevel("/pfs", 0)])
    geometry = SimpleNamespace(rank=0, world_size=ranks, topology=topology,
                               layout=SimpleNamespace(digest=writing.layout_digest))
    ctx = SimpleNamespace(job=geometry, levels=levels, log=None, run=SimpleNamespace(pfs_dir="/pfs"))
    started = time.perf_counter()
    outlook, answers = plan_restore(ctx, everyone, "auto", None, None)
    decide_s = time.perf_counter() - started
    assert outlook.candidates[0].step == 1000 and outlook.candidates[0].route == "same", outlook.candidates[:1]
    holdings = sum(_pickled_size(h, writings_as_rules=False) for h in everyone)
    at_root = sum(_pickled_size(h) for h in everyone)
    received = _pickled_size((None, outlook)) + max(_pickled_size(a) for a in answers)
    return {"holdings_mib": holdings / 2**20, "root_mib": at_root / 2**20, "outlook_kib": received / 1024,
            "decide_s": decide_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    parser.add_argument("--tensors", type=int, default=576)
    parser.add_argument("--wide", type=int, nargs=2, default=[1024, 10000], metavar=("RANKS", "TENSORS"),
                        help="one more row: RANKS ranks with TENSORS tensors (0 0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    host = machine()
    print_machine(host)
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
    print(f"\nrestart after one node lost:\n{'ranks':>7} {'tensors':>8} {'holdings MiB':>13} {'root MiB':>9} "
          f"{'outlook KiB':>12} {'table MiB':>10} {'table KiB':>10} {'decide s':>9}")
    for row in results:
        print(f"{row['ranks']:>7,d} {row['tensors']:>8,d} {row['holdings_mib']:>13.2f} {row['root_mib']:>9.2f} "
              f"{row['outlook_kib']:>12.1f} {row['l4_mib']:>10.1f} {row['table_kib']:>10.1f} {row['decide_s']:>9.3f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": results}, host)


if __name__ == "__main__":
    main()
