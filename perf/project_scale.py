"""Goodput of one training job from 64 to 16,384 nodes, simulated with the library's own choice
of levels and intervals, against single-level checkpointing to the PFS (hpcckpt/simulate/).

    python perf/project_scale.py                                  # the table, markdown
    python perf/project_scale.py --json /tmp/scale.json --png /tmp/scale.png
    python perf/project_scale.py --in-job-at-12500-s 60           # what if in-job recovery took 1 min

The job: a model of --params parameters at --bytes-per-param bytes each (70B, 16 B: fp32
weights and gradients and Adam's two moments), its state spread evenly over every GPU, 8 per
node, --days days of training. The machine and the failures are hpcckpt/simulate/machine.py's
(docs/simulation.md gives each parameter's public source): failures per node at the Llama 3
rate (419 interruptions in 54 days on 2,048 nodes) and at --factors times it. Each cell sums
--seeds seeded runs. The goodput is per node held (spares count as held); the waste terms are
the same fractions and, with the goodput, add up to 1.

The picture needs matplotlib (pip install matplotlib); without it the table is still printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpcckpt.simulate.approaches import APPROACHES, project  # noqa: E402
from hpcckpt.simulate.machine import HOUR, FailureRates, Machine  # noqa: E402

DEFAULT_NODES = tuple(64 * 2 ** i for i in range(9))  # 64 ... 16,384
GOALS = ((16384, 0.95), (2048, 0.985))  # the goodput hpcckpt aims at under the Llama 3 rate
TERMS = ("checkpoints", "redone", "recovery", "idle_spares")
TERM_TITLES = {"checkpoints": "checkpoints", "redone": "work redone", "recovery": "detection + recovery",
               "idle_spares": "idle spares"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=lambda s: tuple(int(n) for n in s.split(",")), default=DEFAULT_NODES,
                        help="comma-separated node counts (default 64,128,...,16384)")
    parser.add_argument("--factors", type=lambda s: tuple(float(f) for f in s.split(",")), default=(1.0, 4.0),
                        help="failure rates as multiples of Llama 3's per node (default 1,4)")
    parser.add_argument("--params", type=float, default=70e9)
    parser.add_argument("--bytes-per-param", type=float, default=16.0)
    parser.add_argument("--days", type=float, default=54.0, help="training time without failures or checkpoints")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--approaches", type=lambda s: tuple(s.split(",")), default=APPROACHES)
    parser.add_argument("--in-job-at-12500-s", type=float, default=None,
                        help="detection + in-job recovery at 12,500 nodes (default FT-HSDP's 180 s)")
    parser.add_argument("--relaunch-at-12500-s", type=float, default=None,
                        help="detection + relaunch at 12,500 nodes (default FT-HSDP's 600 s)")
    parser.add_argument("--interference", type=float, default=None,
                        help="training seconds lost per second of background transfer (default 0.1)")
    parser.add_argument("--json", type=Path, help="write every cell here")
    parser.add_argument("--png", type=Path, help="draw goodput against nodes here (needs matplotlib)")
    args = parser.parse_args(argv)
    unknown = [a for a in args.approaches if a not in APPROACHES]
    if unknown:
        parser.error(f"unknown approach(es) {', '.join(unknown)}: choose from {', '.join(APPROACHES)}")
    if any(n < 1 for n in args.nodes) or any(f <= 0 for f in args.factors) or args.seeds < 1:
        parser.error("--nodes, --factors and --seeds must be positive")
    return args


def base_machine(args) -> Machine:
    machine = Machine(nodes=args.nodes[0], state_bytes=args.params * args.bytes_per_param)
    changes = {}
    if args.in_job_at_12500_s is not None:
        changes["in_job_per_node_s"] = (args.in_job_at_12500_s - machine.detection_s - machine.in_job_base_s) / 12500
    if args.relaunch_at_12500_s is not None:
        changes["relaunch_per_node_s"] = (args.relaunch_at_12500_s - machine.detection_s
                                          - machine.relaunch_base_s) / 12500
    if args.interference is not None:
        changes["interference"] = args.interference
    if any(v < 0 for k, v in changes.items() if k.endswith("per_node_s")):
        raise SystemExit("--in-job-at-12500-s / --relaunch-at-12500-s must exceed detection plus the base start-up")
    return replace(machine, **changes)


def run(args) -> list[dict]:
    machine = base_machine(args)
    cells = []
    for factor in args.factors:
        for nodes in args.nodes:
            sized = replace(machine, nodes=nodes, failures=FailureRates.llama3(factor))
            for approach in args.approaches:
                started = time.perf_counter()
                result = project(approach, sized, args.days * 86400, seeds=args.seeds)
                cells.append({"factor": factor, "seconds": time.perf_counter() - started, **asdict(result)})
    return cells


def markdown(cells: list[dict], args) -> str:
    lines = []
    for factor in args.factors:
        rows = [c for c in cells if c["factor"] == factor]
        per_node_mtbf_h = 1 / FailureRates.llama3(factor).total / HOUR
        lines += [f"### Failures at {factor:g}x the Llama 3 rate per node "
                  f"({per_node_mtbf_h:,.0f} h between failures per node)", "",
                  "| nodes | " + " | ".join(args.approaches) + " |",
                  "|---:|" + "---:|" * len(args.approaches)]
        for nodes in args.nodes:
            goodputs = {c["approach"]: c["goodput"] for c in rows if c["nodes"] == nodes}
            best = max(goodputs.values())
            lines.append(f"| {nodes:,} | " + " | ".join(
                (f"**{100 * goodputs[a]:.2f} %**" if goodputs[a] == best else f"{100 * goodputs[a]:.2f} %")
                for a in args.approaches) + " |")
        lines += ["", "| nodes | approach | goodput | " + " | ".join(TERM_TITLES[t] for t in TERMS)
                  + " | interval | levels (every k-th version) | spares | failures per run |",
                  "|---:|---|---:|" + "---:|" * len(TERMS) + "---:|---|---:|---:|"]
        for c in rows:
            every = ", ".join(f"{name} {k}" for name, k in c["every"].items())
            lines.append(f"| {c['nodes']:,} | {c['approach']} | {100 * c['goodput']:.2f} % | "
                         + " | ".join(f"{100 * c[t]:.2f} %" for t in TERMS)
                         + f" | {c['interval_s']:.3g} s | {every} | {c['spares']} | {c['failures']:.0f} |")
        lines.append("")
    lines += goal_lines(cells)
    return "\n".join(lines)


def goal_lines(cells: list[dict]) -> list[str]:
    lines = ["### Goals (Llama 3 rate)", ""]
    for nodes, goal in GOALS:
        cell = [c for c in cells if c["factor"] == 1.0 and c["nodes"] == nodes]
        ours = [c for c in cell if c["approach"] == "hpcckpt"]
        if not ours:
            continue
        ours = ours[0]
        others = [c for c in cell if c["approach"] != "hpcckpt"]
        above = all(ours["goodput"] > c["goodput"] for c in others)
        worst = max(TERMS, key=lambda t: ours[t])
        verdict = "met" if ours["goodput"] >= goal and above else "missed"
        lines.append(f"- {nodes:,} nodes: hpcckpt {100 * ours['goodput']:.2f} % against the goal {100 * goal:.1f} %"
                     f" ({verdict}; {'above' if above else 'not above'} every other approach); its largest waste "
                     f"term: {TERM_TITLES[worst]} {100 * ours[worst]:.2f} %")
    return lines


def draw(cells: list[dict], args) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no picture: matplotlib is not installed (pip install matplotlib), the table above is complete"
    figure, axes = plt.subplots(1, len(args.factors), figsize=(6 * len(args.factors), 4.5), squeeze=False)
    for axis, factor in zip(axes[0], args.factors):
        for approach in args.approaches:
            rows = sorted((c for c in cells if c["factor"] == factor and c["approach"] == approach),
                          key=lambda c: c["nodes"])
            axis.plot([c["nodes"] for c in rows], [100 * c["goodput"] for c in rows], marker="o", label=approach)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("nodes (8 GPUs each)")
        axis.set_ylabel("goodput (%)")
        axis.set_title(f"{factor:g}x the Llama 3 failure rate per node")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(f"{args.params / 1e9:g}B parameters x {args.bytes_per_param:g} B, {args.days:g} days of training")
    figure.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.png, dpi=120)
    return f"picture: {args.png}"


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    cells = run(args)
    elapsed = time.perf_counter() - started
    print(markdown(cells, args))
    slowest = max(cells, key=lambda c: c["seconds"])
    print(f"\n{len(cells)} cells x {args.seeds} seeds simulated in {elapsed:.1f} s; slowest cell "
          f"{slowest['seconds']:.2f} s ({slowest['approach']}, {slowest['nodes']:,} nodes, {slowest['factor']:g}x, "
          f"{slowest['failures']:.0f} failures per run)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()}, "cells": cells}, indent=1))
        print(f"json: {args.json}")
    if args.png:
        print(draw(cells, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
