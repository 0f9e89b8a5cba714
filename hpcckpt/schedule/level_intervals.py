"""How often each level takes a version: the multi-level choice that minimises the machine
time failures waste (pure arithmetic, the same on every rank when fed agreed measurements).

Failures come in classes by how many nodes they take at once: a rank crash (0 nodes: every
node-local file survives), the loss of one node (its node-local directory gone), of two
nodes, ... each at a rate lambda_c = 1 / MTBF_c. A level covers the failures of at most as
many nodes as it survives: L1 none (a crash only), L2 one, L3 its parity, L4 any. A version
is taken every tau seconds of training on the levels due; L1 takes every one, every other
level l every k_l-th, k_l a power of two, so a version due on a rarer level is due on the
more frequent ones as well and the newest version that covers class c is the newest one of
K_c = min(k_l over the levels l that cover c).

Expected waste per second of run (a multi-level model in the manner of Di, Moody et al.,
SC'14 / IPDPS'15, and Young's first-order one per class):

    W(tau, k) = (C_1 + sum_l C_l / k_l) / tau
              + sum_c lambda_c * (K_c * tau / 2 + D_c + R_c)

C_l: training seconds one version on level l costs (C_1: also the snapshot's blocking);
D_c: seconds until a version on the level that recovers class c is durable there (a failure
sooner falls back one whole interval of that level: K_c * tau / 2 + D_c exactly while
D_c <= K_c * tau); R_c: the restart from that level. The recovering level is the one of the
covering levels with the smallest k (the newest version), the first in the stack on a tie
(a restore reads the first level that holds the version).

Failures also meet a run while it recovers: until the restart has loaded its version and
protected it again (R_c), the nodes a later failure d takes add to those c took. To second
order this is a class of its own, nodes_lost(c) + nodes_lost(d), at rate
lambda_c * (1 - exp(-lambda_d * R_c)), recovered like any other. It is what keeps a level
that survives more nodes than any single class takes (L4 above an L3 of parity 2 when two
nodes is the worst class) from being taken as rarely as the cap allows where failures are
frequent against the restart; where they are rare it adds nearly nothing.

For fixed k the best tau is Young's, generalised (the sums over the second-order classes too):

    tau*(k) = sqrt((C_1 + sum_l C_l / k_l) / (sum_c lambda_c * K_c / 2))

bounded below by the node-local persist (a snapshot never waits for the previous persist) and
by each level at its own pace (k_l * tau >= D_l: it would otherwise skip versions). The k are
searched exhaustively (MAX_EVERY: 7 powers of two for each of up to three levels, 343
choices). A class no level covers adds waste that no choice changes: it is reported, not
optimised; a class at rate 0 changes nothing.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

MAX_EVERY = 64
CHOICES = tuple(2 ** i for i in range(int(math.log2(MAX_EVERY)) + 1))


@dataclass(frozen=True)
class LevelCost:
    """What one level of the stack costs and covers, measured (agreed over ranks)."""

    name: str
    survives: int | None  # simultaneous node losses a version on it survives; None: any (L4)
    cost_s: float  # training seconds one version on it costs
    durable_s: float  # seconds from the snapshot until a version on it is durable
    restart_s: float  # seconds a restart from it takes
    own_pace: bool = False  # copies behind the run (L4 from L1's files): skips versions while busy

    def covers(self, nodes_lost: int) -> bool:
        return self.survives is None or nodes_lost <= self.survives


@dataclass(frozen=True)
class FailureClass:
    nodes_lost: int  # 0: a rank crash; 1: one node and its local storage; 2: two at once ...
    per_second: float  # rate (1 / MTBF in seconds)

    @property
    def label(self) -> str:
        return "rank crash" if self.nodes_lost == 0 else f"loss of {self.nodes_lost} node(s)"


@dataclass(frozen=True)
class LevelIntervals:
    interval_s: float  # tau: seconds of training between two versions (L1 takes each)
    every: dict  # level name -> every how many versions it takes one (the first level: 1)
    waste: float  # expected seconds wasted per second of run, checkpoints and failures together
    recovered_by: dict  # failure class label -> the level that recovers it (None: none covers it)
    reason: str
    checkpoint_waste: float = 0.0  # of `waste`, what the checkpoints cost: a run without failures wastes this


def choose_level_intervals(levels: list[LevelCost], failures: list[FailureClass], min_interval_s: float
                           ) -> LevelIntervals:
    """The intervals minimising W: `levels` in the stack's order (the first takes every
    version), `failures` the classes with their rates, `min_interval_s` the node-local
    persist's time (tau's floor)."""
    if not levels:
        raise ValueError("no level to choose intervals for")
    failing = [f for f in failures if f.per_second > 0]
    first, rest = levels[0], levels[1:]
    if not failing:
        every = {level.name: 1 for level in levels}
        return LevelIntervals(math.inf, every, 0.0, {}, "no failure rate is set: every level takes every version")
    best = None
    # Rarest first, replaced only by a choice that wastes strictly less: a level whose versions
    # change nothing (it covers no failure another level does not) is taken as rarely as allowed.
    for ks in itertools.product(CHOICES[::-1], repeat=len(rest)):
        every = {first.name: 1, **{level.name: k for level, k in zip(rest, ks)}}
        candidate = _evaluate(levels, every, failing, min_interval_s)
        if best is None or candidate[0] < best[0] - 1e-15:
            best = candidate
    waste, tau, every, recovered_by = best
    checkpoints = sum(level.cost_s / every[level.name] for level in levels) / tau if math.isfinite(tau) else 0.0
    return LevelIntervals(tau, every, waste, recovered_by,
                          _reason(levels, failing, every, tau, waste, recovered_by, checkpoints), checkpoints)


def _evaluate(levels: list[LevelCost], every: dict, failing: list[FailureClass], min_interval_s: float):
    """(waste, tau, every, recovered_by) for one choice of k."""
    cost_per_interval = sum(level.cost_s / every[level.name] for level in levels)
    recovered_by, during_restarts, loss_rate, fixed = {}, {}, 0.0, 0.0
    for failure in failing:
        recovering = _recovering_level(levels, every, failure.nodes_lost)
        recovered_by[failure.label] = recovering.name if recovering else None
        if recovering is None:
            continue
        loss_rate += failure.per_second * every[recovering.name] / 2
        fixed += failure.per_second * (recovering.durable_s + recovering.restart_s)
        # Second order: nodes lost while the run restarts from this failure add to those it
        # lost, since the restored version is protected again only once the restart is done.
        for later in failing:
            if later.nodes_lost == 0:
                continue
            during = failure.per_second * -math.expm1(-later.per_second * recovering.restart_s)
            nodes = failure.nodes_lost + later.nodes_lost
            compound = _recovering_level(levels, every, nodes)
            during_restarts[f"loss of {nodes} node(s) during a restart"] = compound.name if compound else None
            if compound is not None:
                loss_rate += during * every[compound.name] / 2
                fixed += during * (compound.durable_s + compound.restart_s)
    floor = max([min_interval_s, 1e-9] + [level.durable_s / every[level.name] for level in levels if level.own_pace])
    if loss_rate == 0:  # no level covers any failure: versions help nothing, as rarely as allowed
        tau = math.inf
    else:
        tau = max(floor, math.sqrt(cost_per_interval / loss_rate))
    waste = (cost_per_interval / tau if math.isfinite(tau) else 0.0) + (loss_rate * tau if loss_rate else 0.0) + fixed
    return waste, tau, dict(every), {**recovered_by, **during_restarts}


def _recovering_level(levels: list[LevelCost], every: dict, nodes_lost: int) -> LevelCost | None:
    """Of the levels that survive `nodes_lost`, the one holding the newest version (a restore
    reads the first level of the stack that holds it); None when no level survives them."""
    covering = [level for level in levels if level.covers(nodes_lost)]
    return min(covering, key=lambda level: every[level.name]) if covering else None


def _reason(levels, failing, every, tau, waste, recovered_by, checkpoints) -> str:
    rates = ", ".join(f"{f.label} every {1 / f.per_second / 3600:.3g} h" for f in failing)
    costs = ", ".join(f"{level.name} {1000 * level.cost_s:.1f} ms" for level in levels)
    takes = ", ".join(f"{name} every {k}" for name, k in every.items())
    by = ", ".join(f"{label} from {name or 'no level (the run starts over)'}" for label, name in recovered_by.items())
    return (f"per-level intervals minimise expected waste {100 * waste:.2f} % (checkpoints {100 * checkpoints:.2f} %, "
            f"failures {100 * (waste - checkpoints):.2f} %) with a version every "
            f"{tau:.3g} s ({takes}); failures: {rates}; recovered: {by}; cost per version: {costs}")
