"""The inputs of LLNL's SCR model (Moody et al., SC10; github.com/LLNL/SCR-model) as a run plan.

SCR's model takes L levels, each with a checkpoint time c_l (a recovery from it takes as long:
modelSCR.py sets checkRecoverTimes = checkWriteTimes), failure rates lambda_i by class (a class-i
failure needs a checkpoint of level >= i), the compute time t between two checkpoints and the
counts V = [v_1, ..., v_{L-1}, 1]: v_1 level-1 checkpoints before each level-2 one, v_2 level-2
checkpoints before each level-3 one, ... A checkpoint is written to its level alone, costs its
own c_l whole (blocking) and serves any class up to its level: here `exclusive` levels with
every_l = prod_{i<l} (v_i + 1) (a level with v = 0 below it takes every version the next one
would), class i as i - 1 domains lost, level l surviving l - 1 (the top one every class), the
"scr" semantics for failures during a restart, and no re-protection after it. SCR's efficiency
is the compute per period over the period's expected time: the simulated work over wall time of
a run long enough to hold many periods.
"""

from __future__ import annotations

import math
from typing import Sequence

from hpcckpt.simulate.events import SCR, RunPlan, SimFailure, SimLevel


def scr_model_plan(costs_s: Sequence[float], rates_per_s: Sequence[float], counts: Sequence[int],
                   interval_s: float, work_s: float) -> RunPlan:
    """`costs_s[l]`, `rates_per_s[l]`: level l + 1's checkpoint time and class l + 1's rate;
    `counts`: v_1 ... v_{L-1} (the top level's count, 1, is implied)."""
    if not len(costs_s) == len(rates_per_s) == len(counts) + 1:
        raise ValueError(f"{len(costs_s)} costs and {len(rates_per_s)} rates need {len(costs_s) - 1} counts, "
                         f"got {len(counts)}")
    if any(v < 0 for v in counts):
        raise ValueError(f"counts must be >= 0, got {list(counts)}")
    top = len(costs_s) - 1
    every = [math.prod(v + 1 for v in counts[:level]) for level in range(len(costs_s))]
    levels = tuple(SimLevel(f"L{level + 1}", None if level == top else level, cost, cost, every[level])
                   for level, cost in enumerate(costs_s))
    failures = tuple(SimFailure(f"class {i + 1}", i, rate) for i, rate in enumerate(rates_per_s))
    restart = {(f.name, level.name): level.cost_s for f in failures for level in levels}
    return RunPlan(work_s, interval_s, levels, failures, restart, exclusive=True, reprotect=False,
                   during_restart=SCR)
