"""The per-level interval choice (schedule/level_intervals.py): pure arithmetic, table-driven."""

import math

import pytest

from hpcckpt.schedule.level_intervals import MAX_EVERY, FailureClass, LevelCost, choose_level_intervals

HOUR = 3600.0


def stack(l1=0.05, l2=0.05, l3=0.10, l4=2.0, parity=2, l4_durable=None):
    """L1-L4 with their costs (training seconds per version); durable and restart times
    proportional to them, L4 at its own pace."""
    return [LevelCost("local", 0, l1, 2 * l1, 2 * l1),
            LevelCost("partner", 1, l2, 2 * l2, 4 * l2),
            LevelCost("erasure", parity, l3, 2 * l3, 4 * l3),
            LevelCost("pfs", None, l4, l4_durable or 10 * l4, 10 * l4, own_pace=True)]


def rates(crash=0.0, node=0.0, two=0.0, all_nodes=0.0):
    """Failure classes by MTBF in hours (0: none of that class)."""
    classes = [(0, crash), (1, node), (2, two), (99, all_nodes)]
    return [FailureClass(n, 1 / (h * HOUR) if h else 0.0) for n, h in classes]


def test_the_first_level_takes_every_version_and_the_rest_powers_of_two():
    chosen = choose_level_intervals(stack(), rates(crash=1, node=4, two=24, all_nodes=100), 0.2)
    assert chosen.every["local"] == 1
    assert all(k in (1, 2, 4, 8, 16, 32, 64) for k in chosen.every.values())
    assert chosen.interval_s >= 0.2 and math.isfinite(chosen.interval_s)
    assert chosen.recovered_by["rank crash"] == "local"  # every level covers it; L1 is read first


def test_cheap_levels_are_taken_more_often_than_expensive_ones_that_cover_the_same():
    # L2 and L4 both cover a node loss; L2 costs 1/40 of L4: L2 at least as often as L4.
    chosen = choose_level_intervals(stack(l2=0.05, l4=2.0), rates(crash=2, node=2, all_nodes=50), 0.2)
    assert chosen.every["partner"] < chosen.every["pfs"]
    assert chosen.recovered_by["loss of 1 node(s)"] == "partner"


def test_a_class_only_l4_covers_drives_l4s_interval():
    # Without L2/L3, node losses are L4's alone: more of them, L4 more often.
    levels = [stack()[0], stack()[3]]
    rare = choose_level_intervals(levels, rates(crash=1, node=100), 0.2)
    often = choose_level_intervals(levels, rates(crash=1, node=1), 0.2)
    assert often.every["pfs"] * often.interval_s < rare.every["pfs"] * rare.interval_s
    assert often.recovered_by["loss of 1 node(s)"] == "pfs"
    # ...and crashes, which L1 covers, do not: L1's own period follows the crash rate.
    fewer_crashes = choose_level_intervals(levels, rates(crash=10, node=1), 0.2)
    assert fewer_crashes.interval_s > often.interval_s


@pytest.mark.parametrize("zero", ["two", "all_nodes"])
def test_a_class_at_rate_zero_changes_nothing(zero):
    base = dict(crash=1, node=4, two=24, all_nodes=100)
    without = dict(base)
    del without[zero]
    with_zero = dict(base, **{zero: 0})
    assert choose_level_intervals(stack(), rates(**with_zero), 0.2) == \
        choose_level_intervals(stack(), rates(**without), 0.2)


def test_a_level_that_covers_nothing_more_is_taken_as_rarely_as_allowed():
    # No two-node losses: L3 covers nothing L2 does not, so it costs without paying back.
    chosen = choose_level_intervals(stack(l3=0.2), rates(crash=1, node=4, all_nodes=100), 0.2)
    assert chosen.every["erasure"] == MAX_EVERY
    # With two-node losses L3 is the cheapest cover: taken far more often.
    two_nodes = choose_level_intervals(stack(l3=0.2), rates(crash=1, node=4, two=2, all_nodes=100), 0.2)
    assert two_nodes.every["erasure"] < MAX_EVERY
    assert two_nodes.recovered_by["loss of 2 node(s)"] == "erasure"


def test_one_level_one_class_is_youngs_interval():
    level = [LevelCost("pfs", None, cost_s=4.0, durable_s=0.0, restart_s=0.0)]
    mtbf = 2 * HOUR
    chosen = choose_level_intervals(level, [FailureClass(1, 1 / mtbf)], 0.0)
    assert chosen.interval_s == pytest.approx(math.sqrt(2 * 4.0 * mtbf))


def test_the_interval_never_drops_below_the_persist_or_an_own_pace_levels_copy():
    chosen = choose_level_intervals(stack(), rates(crash=0.001), 5.0)
    assert chosen.interval_s == pytest.approx(5.0)
    # L4 at its own pace takes 40 s a copy; a node loss every 6 minutes wants it often, but it
    # cannot copy more than one version per 40 s.
    levels = [stack()[0], stack(l4_durable=40.0)[3]]
    chosen = choose_level_intervals(levels, rates(node=0.1), 0.2)
    assert chosen.every["pfs"] * chosen.interval_s >= 40.0 - 1e-9


def test_the_waste_is_the_minimum_over_every_choice():
    levels, failures = stack(), rates(crash=1, node=4, two=24, all_nodes=100)
    chosen = choose_level_intervals(levels, failures, 0.2)
    # Any other choice of k, at its own best tau, wastes at least as much.
    from hpcckpt.schedule.level_intervals import _evaluate
    failing = [f for f in failures if f.per_second > 0]
    for k in (1, 4, 64):
        other = dict(chosen.every, partner=k)
        assert _evaluate(levels, other, failing, 0.2)[0] >= chosen.waste - 1e-12


def test_a_class_no_level_covers_is_reported_not_optimised():
    levels = stack()[:2]  # L1 and L2: two-node losses are not covered
    chosen = choose_level_intervals(levels, rates(crash=1, node=4, two=2), 0.2)
    assert chosen.recovered_by["loss of 2 node(s)"] is None
    assert "no level (the run starts over)" in chosen.reason
    same = choose_level_intervals(levels, rates(crash=1, node=4), 0.2)
    assert (same.interval_s, same.every) == (chosen.interval_s, chosen.every)


def test_without_failure_rates_every_level_takes_every_version():
    chosen = choose_level_intervals(stack(), rates(), 0.2)
    assert set(chosen.every.values()) == {1} and chosen.interval_s == math.inf


def test_a_free_level_that_covers_nothing_more_is_still_taken_rarely():
    # Costs not measured yet (0): L2-L4 add nothing against crashes, L1 covers them.
    free = [LevelCost(level.name, level.survives, 0.0, level.durable_s, level.restart_s, level.own_pace)
            for level in stack()]
    chosen = choose_level_intervals(free, rates(crash=1), 0.2)
    assert chosen.every == {"local": 1, "partner": MAX_EVERY, "erasure": MAX_EVERY, "pfs": MAX_EVERY}
    # ...while a free level that covers a failure is taken with every version.
    assert choose_level_intervals(free, rates(crash=1, node=2), 0.2).every["partner"] == 1


def test_nodes_lost_during_a_restart_add_up_and_bound_the_level_that_survives_them():
    # Two nodes is the worst single failure and L3 (parity 2) survives it, so L4 covers no class
    # alone; but a node lost while the run restarts from a two-node loss makes three.
    def l4_every(mtbf_scale, restart_s):
        levels = [LevelCost("local", 0, 0.05, 0.1, restart_s), LevelCost("partner", 1, 0.05, 0.1, restart_s),
                  LevelCost("erasure", 2, 0.1, 0.2, restart_s),
                  LevelCost("pfs", None, 0.5, 5.0, restart_s, own_pace=True)]
        failures = [FailureClass(0, 1 / (30 * mtbf_scale)), FailureClass(1, 1 / (43 * mtbf_scale)),
                    FailureClass(2, 1 / (200 * mtbf_scale))]
        return choose_level_intervals(levels, failures, 0.5)
    # Failures every tens of seconds against restarts of 8 s: L4 is taken well below the cap.
    frequent = l4_every(1.0, 8.0)
    assert frequent.every["pfs"] < MAX_EVERY
    # The same mix at an hourly scale: the second order vanishes, L4 goes back to the cap.
    rare = l4_every(3600.0, 8.0)
    assert rare.every["pfs"] == MAX_EVERY
    # ...and so it does with restarts that are instantaneous, however frequent failures are.
    assert l4_every(1.0, 0.0).every["pfs"] == MAX_EVERY



def test_the_choice_says_what_its_checkpoints_cost_apart_from_what_failures_do():
    levels = stack()
    chosen = choose_level_intervals(levels, rates(crash=1, node=4, two=24), 0.2)
    per_interval = sum(level.cost_s / chosen.every[level.name] for level in levels)
    assert chosen.checkpoint_waste == pytest.approx(per_interval / chosen.interval_s)
    assert 0 < chosen.checkpoint_waste < chosen.waste
    assert f"checkpoints {100 * chosen.checkpoint_waste:.2f} %" in chosen.reason
    assert choose_level_intervals(levels, rates(), 0.2).checkpoint_waste == 0.0
