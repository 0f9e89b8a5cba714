"""hpcckpt plan: what the library would do on a site's machine, and what it would buy there.

A site gives its nodes, GPUs per node, the job's state, its storage bandwidths and how often
failures come (flags, or a [plan] table in a TOML file); whatever it leaves out is taken from
the simulate package's machine (machine.py: an H100 cluster as Llama 3 ran it), and said so.
From that one Machine:

- the levels and intervals: the "hpcckpt" scenario (approaches.py), which is the library's
  own schedule/level_intervals.choose_level_intervals fed the modelled costs and rates;
- the goodput and its split: `project` over a stated number of seeded runs;
- the spares: Machine.spares, a Poisson quantile over the repair window;
- the lines for the job's TOML that make the library choose the same at run time: the same
  failure rates as resilience.mtbf_*_hours (job-wide, as the library reads them).
"""

from __future__ import annotations

import math
import re
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpcckpt.errors import ConfigError
from hpcckpt.simulate.approaches import Projection, Scenario, project, scenario
from hpcckpt.simulate.machine import GB, HOUR, FailureRates, Machine
from hpcckpt.simulate.plan_params import BY_NAME, PARAMS, Param

DAY = 86400.0
OUT_OF_SPARES = 0.01
# Past this many simulated failures per run the goodput is as well known as it gets; a longer
# run only costs time (20-70 us of Python per failure), so a run is cut once its wall time holds
# that many failures, the work kept by then counted. A job whose restarts take so long against
# its failures that one would need more tries than that is not simulated: the simulator retries a
# restart until one completes, about exp(rate x restart) times, which would take hours.
MAX_FAILURES_PER_RUN = 10_000
LEVEL_KEYS = {"L1": "local", "L2": "partner", "L3": "erasure", "L4": "pfs"}

SIZE_UNITS = {"B": 1.0, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15,
              "KiB": 2.0 ** 10, "MiB": 2.0 ** 20, "GiB": 2.0 ** 30, "TiB": 2.0 ** 40, "PiB": 2.0 ** 50}
# Networks are sold in bits: a lower-case b is a bit, as in 400Gb/s.
BIT_UNITS = {"kb": 1e3 / 8, "Mb": 1e6 / 8, "Gb": 1e9 / 8, "Tb": 1e12 / 8,
             "kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8, "Tbit": 1e12 / 8}
TIME_UNITS = {"s": 1.0, "min": 60.0, "h": HOUR, "d": DAY, "w": 7 * DAY}
_NUMBER = re.compile(r"^\s*([0-9][0-9_,]*\.?[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+)\s*([A-Za-z/]*)\s*$")


@dataclass(frozen=True)
class Setting:
    value: Any
    origin: str  # "--nodes", "site.toml [plan] nodes" or "assumed: <source>"
    text: str  # as given or as assumed, for the output


@dataclass
class Plan:
    machine: Machine
    work_s: float
    max_wall_s: float
    seeds: int
    settings: dict
    chosen: Scenario
    projection: Projection | None  # None: not simulated, see `stalled`
    stalled: str
    spares_needed: int
    expected_losses: float
    p_run_out: float
    assumptions: list = field(default_factory=list)


# --- reading the inputs ---------------------------------------------------------------------

def _fail(where: str, raw: Any, problem: str, param: Param) -> ConfigError:
    shown = f"{where} {raw}" if where.startswith("--") else f"{where} = {raw!r}"
    return ConfigError(f"plan: {shown}: {problem}; give {param.help}, e.g. {param.flag} {param.example}")


def _number_and_unit(raw: Any, where: str, param: Param) -> tuple[float, str]:
    if isinstance(raw, bool):
        raise _fail(where, raw, "not a number", param)
    if isinstance(raw, (int, float)):
        return float(raw), ""
    match = _NUMBER.match(str(raw))
    if not match:
        raise _fail(where, raw, "not a number with a unit" if str(raw).strip()[:1] != "-" else "must be > 0", param)
    return float(match.group(1).replace("_", "").replace(",", "")), match.group(2)


def parse_value(param: Param, raw: Any, where: str) -> Any:
    """`raw` (a flag's text or a TOML value) as the number `param` takes: a count, bytes,
    bytes per second, seconds, a per-second rate (mtbf: 0 for "none") or a scope."""
    kind = param.kind
    if kind == "scope":
        if raw not in ("node", "job"):
            raise _fail(where, raw, "must be node or job", param)
        return raw
    if kind == "mtbf" and str(raw).strip().lower() in ("none", "inf", "never"):
        return 0.0
    number, unit = _number_and_unit(raw, where, param)
    if kind == "count":
        if unit or number != int(number) or number < 1:
            raise _fail(where, raw, "must be a whole number >= 1", param)
        return int(number)
    if kind == "size":
        scale = SIZE_UNITS.get(unit or "B")
        if scale is None:
            raise _fail(where, raw, f"unknown unit {unit!r}: use one of {', '.join(SIZE_UNITS)}", param)
    elif kind == "rate":
        if unit and not unit.endswith("/s"):
            raise _fail(where, raw, f"unknown unit {unit!r}: a bandwidth is per second, as in GB/s or Gb/s", param)
        unit = unit[:-2] if unit else "B"
        scale = SIZE_UNITS.get(unit) or BIT_UNITS.get(unit)
        if scale is None:
            raise _fail(where, raw, f"unknown unit {unit + '/s'!r}: use one of "
                        f"{', '.join(u + '/s' for u in [*SIZE_UNITS, *BIT_UNITS])}", param)
    else:
        if not unit:
            raise _fail(where, raw, f"give a unit: one of {', '.join(TIME_UNITS)}", param)
        scale = TIME_UNITS.get(unit)
        if scale is None:
            raise _fail(where, raw, f"unknown unit {unit!r}: use one of {', '.join(TIME_UNITS)}", param)
    value = number * scale
    if not value > 0 or not math.isfinite(value):
        raise _fail(where, raw, "must be > 0", param)
    return 1 / value if kind == "mtbf" else value


def read_plan_table(path: str) -> dict:
    """The [plan] table of a TOML file; its other tables (a job's) are not looked at."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"plan: -c {path}: no such file; pass a TOML file with a [plan] table") from None
    except OSError as exc:
        raise ConfigError(f"plan: -c {path}: cannot be read: {exc.strerror or exc}") from None
    try:
        table = tomllib.loads(text).get("plan")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"plan: {path}: not valid TOML: {exc}") from None
    if table is None:
        raise ConfigError(f"plan: {path} has no [plan] table; add one with any of {', '.join(BY_NAME)}")
    if not isinstance(table, dict):
        raise ConfigError(f"plan: {path}: plan must be a table ([plan]) of keys")
    unknown = [key for key in table if key not in BY_NAME]
    if unknown:
        raise ConfigError(f"plan: {path} [plan]: unknown key {unknown[0]!r}; keys: {', '.join(BY_NAME)}")
    return table


def read_settings(flags: dict, config_path: str | None = None) -> dict:
    """name -> Setting for every parameter given: a flag (not None in `flags`) over the file's
    [plan] table."""
    table = read_plan_table(config_path) if config_path else {}
    settings = {}
    for param in PARAMS:
        if flags.get(param.name) is not None:
            raw, where = flags[param.name], param.flag
        elif param.name in table:
            raw, where = table[param.name], f"{config_path} [plan] {param.name}"
        else:
            continue
        settings[param.name] = Setting(parse_value(param, raw, where), where, str(raw))
    return settings


# --- defaults, each with where it comes from --------------------------------------------------

def _assume(settings: dict, name: str, value: Any, text: str, source: str) -> None:
    if name not in settings:
        settings[name] = Setting(value, f"assumed: {source}", text)


def _fill_defaults(settings: dict) -> None:
    base = Machine(nodes=1, state_bytes=1.0)
    _assume(settings, "nodes", 2048, "2048", "Llama 3's 2,048 nodes")
    _assume(settings, "gpus_per_node", base.gpus_per_node, str(base.gpus_per_node), "DGX H100, 8 H100 per node")
    _assume(settings, "state", 70e9 * 16, "1.12TB",
            "a 70B-parameter model at 16 B each (fp32 weights and gradients, Adam's two moments)")
    gpus = settings["gpus_per_node"].value
    _assume(settings, "local_bw", gpus * 64 * GB, f"{gpus * 64}GB/s",
            "H100 SXM datasheet: PCIe Gen5 x16, 64 GB/s each way per GPU (nominal)")
    _assume(settings, "network_bw", gpus * 50 * GB, f"{gpus * 50}GB/s",
            "DGX H100 datasheet: a 400 Gb/s ConnectX-7 per GPU (nominal)")
    _assume(settings, "pfs_write_bw", base.pfs_write_bw, "2TB/s",
            "Llama 3's Tectonic: 2 TB/s sustained (7 TB/s peak)")
    write = settings["pfs_write_bw"]
    if write.origin.startswith("assumed"):
        _assume(settings, "pfs_read_bw", base.pfs_read_bw, "2TB/s", "Llama 3's Tectonic, as the write")
    else:
        _assume(settings, "pfs_read_bw", write.value, write.text, f"as the write ({write.origin})")
    _assume_failures(settings)
    _assume(settings, "mtbf_per", "node", "node", "the MTBFs given are each node's")
    _assume(settings, "repair_window", base.spare_repair_hours * HOUR, f"{base.spare_repair_hours:g}h",
            "the simulate package's: a dead node is back or replaced within a day")
    _assume(settings, "days", 54 * DAY, "54d", "Llama 3's 54-day run, as the simulate package's projections")
    _assume(settings, "seeds", 3, "3", "the simulate package's projections")
    nodes = settings["nodes"].value
    group = min(base.rs_data + base.rs_parity, nodes)
    _assume(settings, "group_size", group, str(group),
            "the simulate package's Reed-Solomon k=4, m=2" + ("" if group == 6 else f", at most the {nodes} nodes"))
    parity = min(base.rs_parity, settings["group_size"].value - 1)
    _assume(settings, "parity", parity, str(parity), "the simulate package's m=2, below the group size")


LLAMA3 = ("Llama 3 (Meta, 2024): 419 interruptions in 54 days on 2,048 nodes, split by their root causes "
          "(docs/simulation.md)")
CLASSES = (("mtbf_crash", "rank_crash"), ("mtbf_node", "node"), ("mtbf_switch", "switch"))


def _assume_failures(settings: dict) -> None:
    llama3 = FailureRates.llama3()
    given = [name for name, _ in CLASSES if name in settings]
    if "mtbf" in settings and given:
        raise ConfigError(f"plan: {settings['mtbf'].origin} and {settings[given[0]].origin} both given: --mtbf is "
                          "every class together; give it or the classes (--mtbf-crash, --mtbf-node, --mtbf-switch)")
    if "mtbf" in settings:
        return
    if not given:
        _assume(settings, "mtbf", llama3.total, f"{1 / llama3.total / HOUR:.0f}h", f"per node, {LLAMA3}")
        return
    for name, field_name in CLASSES:
        rate = getattr(llama3, field_name)
        _assume(settings, name, rate, f"{1 / rate / HOUR:.0f}h", "per node, Llama 3's rate of this class")


def _failure_rates(settings: dict) -> FailureRates:
    """Per-node rates by class: the classes given, else --mtbf split as Llama 3's causes; a
    job-wide MTBF is the nodes' together (what is assumed is always per node)."""
    nodes = settings["nodes"].value
    job_wide = settings["mtbf_per"].value == "job"

    def per_node(setting: Setting) -> float:
        return setting.value / nodes if job_wide and not setting.origin.startswith("assumed") else setting.value

    llama3 = FailureRates.llama3()
    if "mtbf" in settings:
        scale = per_node(settings["mtbf"]) / llama3.total
        return FailureRates(llama3.rank_crash * scale, llama3.node * scale, llama3.switch * scale)
    rates = {field_name: per_node(settings[name]) for name, field_name in CLASSES}
    if not any(rates.values()):
        raise ConfigError("plan: --mtbf-crash, --mtbf-node and --mtbf-switch are all none: with no failures "
                          "there is nothing to plan; give at least one MTBF")
    return FailureRates(**rates)


def _check_geometry(settings: dict) -> None:
    nodes, group, parity = (settings[name] for name in ("nodes", "group_size", "parity"))
    if nodes.value < 3:
        raise ConfigError(f"plan: {nodes.origin} {nodes.value}: the plan places a partner copy and erasure "
                          "parity on other nodes; give --nodes 3 or more")
    if group.value > nodes.value:
        raise ConfigError(f"plan: {group.origin} {group.value}: an erasure group is on distinct nodes; give "
                          f"--group-size at most --nodes ({nodes.value})")
    if not parity.value < group.value:
        raise ConfigError(f"plan: {parity.origin} {parity.value}: the parity must be below the group size "
                          f"({group.value}); give --parity at most {group.value - 1}")


def machine_of(settings: dict) -> Machine:
    _fill_defaults(settings)
    _check_geometry(settings)
    value = {name: s.value for name, s in settings.items()}
    return Machine(nodes=value["nodes"], state_bytes=value["state"], gpus_per_node=value["gpus_per_node"],
                   snapshot_bw=value["local_bw"], network_bw=value["network_bw"],
                   pfs_write_bw=value["pfs_write_bw"], pfs_read_bw=value["pfs_read_bw"],
                   rs_data=value["group_size"] - value["parity"], rs_parity=value["parity"],
                   spare_repair_hours=value["repair_window"] / HOUR, failures=_failure_rates(settings))


# --- the plan ----------------------------------------------------------------------------------

def make_plan(settings: dict) -> Plan:
    machine = machine_of(settings)
    work_s = settings["days"].value
    seeds = settings["seeds"].value
    chosen = scenario("hpcckpt", machine, work_s)
    rate = machine.failures.total * machine.nodes
    max_wall = min(20 * work_s, MAX_FAILURES_PER_RUN / rate)
    restart = max(chosen.plan.restart_s.values())
    projection, stalled = None, ""
    if rate * restart > math.log(MAX_FAILURES_PER_RUN):
        stalled = (f"a failure every {_seconds(1 / rate)} against restarts of up to {_seconds(restart)}: a restart "
                   f"would complete once in about e^{rate * restart:.0f} tries, so the job makes next to no "
                   "progress (goodput near 0); fewer nodes, rarer failures or faster recovery")
    else:
        projection = project("hpcckpt", machine, work_s, seeds=seeds, max_wall_factor=max_wall / work_s)
    needed = machine.spares(OUT_OF_SPARES)
    expected = machine.failures.node * machine.nodes * machine.spare_repair_hours * HOUR
    return Plan(machine, work_s, max_wall, seeds, settings, chosen, projection, stalled, needed, expected,
                poisson_tail(expected, needed), _model_assumptions(machine))


def poisson_tail(mean: float, k: int) -> float:
    """P(Poisson(mean) > k): more node losses in the window than `k` spares."""
    if mean == 0:
        return 0.0
    below = sum(math.exp(i * math.log(mean) - mean - math.lgamma(i + 1)) for i in range(k + 1))
    return max(0.0, 1.0 - below)


def _model_assumptions(m: Machine) -> list:
    """The machine's parameters no flag sets, at this job's size, with their sources."""
    return [
        ("Reed-Solomon encode", f"{m.rs_encode_bw / GB:g} GB/s per node",
         "16 cores at this project's measured 2.2 GB/s each (perf/RESULTS.md)"),
        ("PFS metadata", f"{m.pfs_creates_per_s:,.0f} file creates/s", "one metadata server (an assumption)"),
        ("detection", f"{m.detection_s:g} s", "a heartbeat's timeout (an assumption)"),
        ("relaunch", f"{m.relaunch_s:.0f} s at {m.nodes:,} nodes",
         "FT-HSDP (arXiv 2602.00277): 10 min a failure at O(100K) GPUs, linear in the nodes"),
        ("in-job recovery", f"{m.in_job_s:.0f} s at {m.nodes:,} nodes",
         "FT-HSDP: 3 min a failure recovered within the job, linear in the nodes"),
        ("interference", f"{m.interference:g} s lost per s of background transfer", "an assumption"),
        ("training step", f"{m.step_s:g} s (at most a version a step)", "an assumption"),
        ("failure domains", "leaf switches", "cluster.failure_domains = \"auto\": partners and parity groups under "
         "different switches"),
    ]


def job_mtbf_hours(machine: Machine) -> dict:
    """resilience.mtbf_*_hours for the job: the library's failure classes are by the failure
    domains lost, and a switch takes one domain as a node does."""
    rates = machine.job_rates()
    one_domain = rates["node"] + rates["switch"]
    return {"mtbf_crash_hours": 1 / rates["rank crash"] / HOUR if rates["rank crash"] else 0.0,
            "mtbf_node_hours": 1 / one_domain / HOUR if one_domain else 0.0}


def config_lines(plan: Plan) -> list:
    """TOML for the job's file: every key exists in hpcckpt/config.py and loads there."""
    mtbf = job_mtbf_hours(plan.machine)
    levels = ", ".join(f'"{LEVEL_KEYS[level.name]}"' for level in plan.chosen.plan.levels)
    lines = ["[checkpoint]",
             'every_steps = "auto"    # the failure rates below choose the interval; no checkpoint.mtbf_hours',
             "",
             "[resilience]",
             f"levels = [{levels}]",
             f"group_size = {plan.machine.rs_data + plan.machine.rs_parity}",
             f"parity = {plan.machine.rs_parity}"]
    for key, hours in mtbf.items():
        if hours:
            lines.append(f"{key} = {hours:.6g}")
    lines += ["# no partner_every, erasure_every nor storage.pfs_every: the rates choose how often each level is",
              "# taken, from the costs the library measures as it runs",
              "",
              "[cluster]",
              'failure_domains = "auto"    # partners and parity groups under different leaf switches']
    return lines


def job_script_line(plan: Plan) -> str:
    if plan.chosen.spares:
        return f"SPARE_NODES={plan.chosen.spares}    # jobs/slurm.sbatch, jobs/pbs.pbs: ask for nodes + spares"
    return "SPARE_NODES=0    # spares do not pay here: a relaunch after a node's loss wastes less"


# --- output ------------------------------------------------------------------------------------

def to_json(plan: Plan) -> dict:
    p, m, s = plan.projection, plan.machine, plan.chosen
    return {
        "inputs": {name: {"value": setting.value, "given": setting.text, "origin": setting.origin}
                   for name, setting in plan.settings.items()},
        "failures_per_node_per_hour": {"rank crash": m.failures.rank_crash * HOUR, "node": m.failures.node * HOUR,
                                       "switch": m.failures.switch * HOUR},
        "job_mtbf_hours": m.job_mtbf_s / HOUR,
        "choice": {
            "interval_s": s.plan.interval_s,
            "every": {level.name: level.every for level in s.plan.levels},
            "levels": [{"name": level.name, "config": LEVEL_KEYS[level.name], "survives": level.survives,
                        "cost_s": level.cost_s, "durable_s": level.durable_s, "every": level.every}
                       for level in s.plan.levels],
            "spares_held": s.spares,
            "reason": s.reason,
        },
        "goodput": {"not_simulated": plan.stalled} if p is None else {
            "goodput": p.goodput, "checkpoints": p.checkpoints, "work_redone": p.redone,
            "detection_recovery": p.recovery, "idle_spares": p.idle_spares, "seeds": plan.seeds,
            "work_days_per_run": plan.work_s / DAY, "max_wall_days_per_run": plan.max_wall_s / DAY,
            "failures_per_run": p.failures, "runs_cut_at_max_wall": p.truncated},
        "spares": {"needed": plan.spares_needed, "repair_window_h": m.spare_repair_hours,
                   "expected_node_losses": plan.expected_losses, "p_run_out": plan.p_run_out,
                   "rule": f"P(more node losses in the window than spares) < {OUT_OF_SPARES:g}",
                   "held_by_the_plan": s.spares},
        "config_toml": "\n".join(config_lines(plan)) + "\n",
        "job_script": job_script_line(plan),
        "assumed_model": [{"parameter": name, "value": value, "source": source}
                          for name, value, source in plan.assumptions],
    }


def _bytes(value: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.3g} B"


def _seconds(value: float) -> str:
    if value >= 100 * HOUR:
        return f"{value / HOUR:,.0f} h"
    if value < 1:
        return f"{1000 * value:.3g} ms"
    if value < 120:
        return f"{value:.3g} s"
    if value < 2 * HOUR:
        return f"{value / 60:.3g} min"
    return f"{value / HOUR:.3g} h"


SHOWN = {"nodes": lambda v: f"{v:,}", "gpus_per_node": str, "state": _bytes,
         "local_bw": lambda v: _bytes(v) + "/s per node", "network_bw": lambda v: _bytes(v) + "/s per node",
         "pfs_write_bw": lambda v: _bytes(v) + "/s", "pfs_read_bw": lambda v: _bytes(v) + "/s",
         "mtbf": lambda v: _seconds(1 / v), "mtbf_crash": lambda v: _seconds(1 / v) if v else "none",
         "mtbf_node": lambda v: _seconds(1 / v) if v else "none",
         "mtbf_switch": lambda v: _seconds(1 / v) if v else "none", "mtbf_per": str,
         "repair_window": _seconds, "days": lambda v: f"{v / DAY:g} days", "seeds": str,
         "group_size": str, "parity": str}


def render(plan: Plan) -> str:
    m, s, p = plan.machine, plan.chosen, plan.projection
    out = [f"hpcckpt plan: {m.nodes:,} nodes x {m.gpus_per_node} GPUs, {_bytes(m.state_bytes)} of state "
           f"({_bytes(m.per_node_bytes)} per node), {plan.work_s / DAY:.3g} days of training", "", "Inputs"]
    for param in PARAMS:
        setting = plan.settings.get(param.name)
        if setting is not None:
            shown: Callable = SHOWN[param.name]
            out.append(f"  {param.name:14} {shown(setting.value):26} {setting.origin}")
    rates = m.job_rates()
    by_class = ", ".join(f"{name} every {_seconds(1 / rate)}" for name, rate in rates.items() if rate)
    out.append(f"  failures of the job: one every {_seconds(m.job_mtbf_s)} ({by_class})")
    out.append("  modelled, not set by a flag:")
    out += [f"    {name:20} {value:40} {source}" for name, value, source in plan.assumptions]

    every = ", ".join(f"{level.name} every {'version' if level.every == 1 else f'{level.every}th'}"
                      for level in s.plan.levels)
    out += ["", "Levels and intervals (the library's choice: schedule/level_intervals.choose_level_intervals)",
            f"  a version every {_seconds(s.plan.interval_s)} of training: {every}",
            f"  {'level':5} {'config':8} {'survives':>18} {'cost a version':>15} {'durable after':>14}"]
    for level in s.plan.levels:
        survives = "any failure" if level.survives is None else "a rank crash" if level.survives == 0 else \
            f"{level.survives} domain{'s' if level.survives > 1 else ''} lost"
        out.append(f"  {level.name:5} {LEVEL_KEYS[level.name]:8} {survives:>18} {_seconds(level.cost_s):>15} "
                   f"{_seconds(level.durable_s):>14}")
    out += textwrap.wrap(f"why: {s.reason}", 116, initial_indent="  ", subsequent_indent="    ")

    if p is None:
        out += ["", "Predicted goodput: not simulated"]
        out += textwrap.wrap(plan.stalled, 116, initial_indent="  ", subsequent_indent="  ")
    else:
        out += ["", f"Predicted goodput (simulated: {plan.seeds} seeds x {plan.work_s / DAY:.3g} days of work, "
                    f"{p.failures:,.0f} failures per run)",
                f"  goodput                {100 * p.goodput:6.2f} %",
                f"  checkpoints            {100 * p.checkpoints:6.2f} %",
                f"  work redone            {100 * p.redone:6.2f} %",
                f"  detection + recovery   {100 * p.recovery:6.2f} %",
                f"  idle spares            {100 * p.idle_spares:6.2f} %"]
        if p.truncated:
            out += textwrap.wrap(f"({p.truncated} run(s) cut after {_seconds(plan.max_wall_s)} of wall time, "
                                 f"{MAX_FAILURES_PER_RUN:,} failures' worth, the work kept by then counted: the "
                                 "goodput is a rate, known well by then)", 116,
                                 initial_indent="  ", subsequent_indent="  ")

    out += ["", "Spares",
            f"  {plan.spares_needed} spare node(s): {plan.expected_losses:.3g} node losses expected in a "
            f"{_seconds(m.spare_repair_hours * HOUR)} repair window; P(more than {plan.spares_needed}) = "
            f"{100 * plan.p_run_out:.2g} % (< {100 * OUT_OF_SPARES:g} %)",
            f"  the plan {'holds them' if s.spares else 'holds none: they cost more idle time than they save'}"]

    out += ["", "For the job's TOML (merged into its sections of these names; the library measures the costs and "
                "chooses again as it runs):", ""]
    out += ["    " + line if line else "" for line in config_lines(plan)]
    out += ["", "For the job script:", "", "    " + job_script_line(plan)]
    return "\n".join(out)
