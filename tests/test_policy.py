"""When to checkpoint: the interval policy is pure arithmetic over measured costs."""

import math
from types import SimpleNamespace

import pytest

from hpcckpt.schedule.policy import PROFILE_STEPS, IntervalPolicy, daly_interval


def cfg(every, max_overhead=0.035, mtbf_hours=0.0):
    return SimpleNamespace(every_steps=every, max_overhead=max_overhead, mtbf_hours=mtbf_hours)


def test_fixed_interval_and_last_step():
    policy = IntervalPolicy.from_config(cfg(5))
    due = [s for s in range(1, 23) if policy.due(s, 22) and policy.observe_checkpoint(s, 0.0, None) is None]
    assert due == [5, 10, 15, 20, 22]
    assert not IntervalPolicy.from_config(cfg(0)).enabled


def test_auto_profiles_then_picks_shortest_interval_under_the_bound():
    policy = IntervalPolicy.from_config(cfg("auto", max_overhead=0.05))
    for step in range(1, PROFILE_STEPS + 1):
        assert not policy.due(step, 1000)
        policy.observe_step(0.010)
    assert policy.due(PROFILE_STEPS + 1, 1000)
    change = policy.observe_checkpoint(PROFILE_STEPS + 1, blocking=0.004, durable=0.030)
    # blocking / (5 % of 10 ms) = 8 steps; the persist needs 3 steps: the overhead bound wins.
    assert policy.interval == 8 and "overhead bound" in change
    assert policy.blocking / (policy.interval * policy.step_time) <= 0.05
    assert not policy.due(PROFILE_STEPS + 8, 1000) and policy.due(PROFILE_STEPS + 9, 1000)


def test_auto_never_lets_snapshots_wait_for_a_persist():
    policy = IntervalPolicy.from_config(cfg("auto"))
    policy.observe_step(0.010)
    policy.observe_checkpoint(6, blocking=0.0001, durable=0.5)
    assert policy.interval == 50 and "persist must finish first" in policy.reason


def test_auto_retunes_when_costs_rise():
    policy = IntervalPolicy.from_config(cfg("auto"))
    policy.observe_step(0.010)
    policy.observe_checkpoint(6, blocking=0.001, durable=0.01)
    first = policy.interval
    policy.observe_checkpoint(6 + first, blocking=0.02, durable=0.01)  # interference appears
    assert policy.interval > first


def test_auto_counts_what_steps_lose_while_a_persist_runs_behind_them():
    policy = IntervalPolicy.from_config(cfg("auto", max_overhead=0.05))
    policy.observe_step(0.010)
    policy.observe_checkpoint(6, blocking=0.0001, durable=0.05)
    # The snapshot alone blocks almost nothing: only the persist (5 steps) bounds the interval.
    assert policy.interval == 5 and "persist must finish first" in policy.reason
    for _ in range(5):
        policy.observe_step(0.012, persisting=True)  # steps run 2 ms slower behind the persist
    change = policy.observe_checkpoint(11, blocking=0.0001, durable=0.05)
    # cost = 0.1 ms + 2 ms x 5 steps = 10.1 ms; / (5 % of 10 ms) -> 21 steps.
    assert policy.interval == 21 and "overhead bound" in change and "2.00 ms slower" in change
    assert policy.cost / (policy.interval * policy.step_time) <= 0.05
    assert policy.step_time == 0.010  # the quiet steps' time is kept apart


def test_young_daly_interval():
    policy = IntervalPolicy.from_config(cfg(0, mtbf_hours=2.0))
    assert policy.adaptive
    policy.observe_step(0.1)
    policy.observe_checkpoint(6, blocking=0.5, durable=0.2)
    assert policy.interval == math.ceil(daly_interval(0.5, 7200) / 0.1)
    assert math.sqrt(2 * 0.5 * 7200) - 0.5 < 0.1 * policy.interval < math.sqrt(2 * 0.5 * 7200) + 0.5
    assert "Young/Daly: Daly's optimum for C = 500.00 ms and MTBF 2.0 h" in policy.reason


@pytest.mark.parametrize("mtbf_minutes, published", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_the_interval_is_dalys_optimum_as_he_published_it(mtbf_minutes, published):
    """Daly (FGCS 2006), section 5: a 5-minute checkpoint, MTBF 24 h, 6 h and 15 min: optimum
    compute intervals 117, 57 and 9.1 minutes. Young's sqrt(2 C M) gives 120, 60 and 12.2."""
    assert daly_interval(5 * 60, mtbf_minutes * 60) / 60 == pytest.approx(published, rel=0.01)


def test_a_checkpoint_costlier_than_twice_the_mtbf_is_taken_every_mtbf():
    assert daly_interval(100.0, 40.0) == 40.0


def test_profile_survives_restart():
    policy = IntervalPolicy.from_config(cfg("auto"))
    policy.observe_step(0.01)
    policy.observe_checkpoint(6, 0.002, 0.05)
    restored = IntervalPolicy.from_config(cfg("auto"))
    restored.load_state(policy.state())
    assert restored.interval == policy.interval and restored.step_time == policy.step_time
    assert restored.due(6 + policy.interval, 10_000)  # no second profiling phase


def test_no_interval_is_chosen_before_a_step_was_timed():
    for config in (cfg("auto"), cfg(0, mtbf_hours=1.0)):
        policy = IntervalPolicy.from_config(config)
        assert policy.observe_checkpoint(1, blocking=0.5, durable=0.2) is None
        assert policy.interval == 0  # still profiling, not 57 million steps


def resilience(crash=0.0, node=0.0, two=0.0):
    return SimpleNamespace(mtbf_crash_hours=crash, mtbf_node_hours=node, mtbf_two_nodes_hours=two)


STACK = (("local", 0, False), ("partner", 1, False), ("erasure", 2, False), ("pfs", None, True))


def per_level_policy(**rates):
    policy = IntervalPolicy.from_config(cfg("auto"), resilience(**rates))
    policy.levels = STACK
    return policy


def test_failure_rates_choose_an_interval_per_level_from_each_levels_measured_cost():
    policy = per_level_policy(crash=0.01, node=0.02)
    assert policy.per_level and policy.levels_due(1, False) == ("local", "partner", "erasure", "pfs")
    policy.observe_step(0.010)
    policy.observe_step(0.015, persisting=True)  # steps lose a third while a persist runs
    # L1-L3 durable within 50 ms; L4 at its own pace takes 2 s and so costs 100x L1's writing.
    policy.observe_levels({"local": 0.02, "partner": 0.03, "erasure": 0.05, "pfs": 2.0},
                          {"local": 0.02, "partner": 0.03, "erasure": 0.05, "pfs": 2.0})
    said = policy.observe_checkpoint(6, blocking=0.001, durable=2.0)
    assert said and "every" in said
    every = policy.every
    assert every["local"] == 1 and every["partner"] <= every["pfs"]
    assert every["erasure"] == max(every.values())  # no two-node losses: L3 covers nothing L2 does not
    due = [policy.levels_due(n, False) for n in range(1, 65)]
    assert all("local" in d for d in due)
    assert sum("pfs" in d for d in due) == 64 // every["pfs"]
    assert policy.levels_due(3, True) == ("local", "partner", "erasure", "pfs")  # the final one: all


def test_without_failure_rates_the_fixed_settings_decide_the_levels():
    """One decision, never None: each level every fixed_every-th checkpoint, all on the final."""
    policy = IntervalPolicy.from_config(cfg("auto"), resilience())
    policy.levels = STACK
    policy.fixed_every = {"partner": 2, "erasure": 4, "pfs": 3}
    assert not policy.per_level
    assert [policy.levels_due(n, False) for n in (1, 2, 3, 4)] == [
        ("local",), ("local", "partner"), ("local", "pfs"), ("local", "partner", "erasure")]
    assert policy.levels_due(1, True) == ("local", "partner", "erasure", "pfs")


def test_the_per_level_choice_waits_for_the_levels_the_checkpoint_writes():
    policy = per_level_policy(node=0.01)
    policy.observe_step(0.010)
    policy.observe_levels({"local": 0.02}, {"local": 0.02})
    policy.observe_checkpoint(6, blocking=0.001, durable=0.02)
    assert policy.every == {} and policy.levels_due(2, False) == ("local", "partner", "erasure", "pfs")


def test_an_untimed_level_at_its_own_pace_waits_for_the_final_version_while_the_interval_stays_short():
    """L4's first copy is still running when the profiling checkpoint's costs are agreed: the
    choice is made from L1-L3 at once, L4 takes the final version until it is timed, and the
    interval is short enough that the choice with L4 comes soon; once timed, L4 is chosen."""
    policy = per_level_policy(crash=0.01, node=0.02, two=0.05)
    policy.levels = (("local", 0, False), ("partner", 1, False), ("pfs", None, True))  # two nodes: L4 alone
    policy.observe_step(0.010)
    policy.observe_step(0.015, persisting=True)
    fast = {"local": 0.02, "partner": 0.03}
    policy.observe_levels(fast, fast)
    said = policy.observe_checkpoint(6, blocking=0.001, durable=0.05)
    assert said and "pfs not timed yet" in said, said
    assert policy.every["pfs"] == 64 and policy.interval <= 6
    assert all("pfs" not in policy.levels_due(n, False) for n in range(1, 64))
    assert "pfs" in policy.levels_due(5, True)
    policy.observe_levels({**fast, "pfs": 0.5}, {**fast, "pfs": 0.5})
    said = policy.observe_checkpoint(6 + policy.interval, blocking=0.001, durable=0.05)
    assert said is None or "not timed yet" not in said
    assert "not timed yet" not in policy.reason and policy.every["pfs"] < 64


def test_a_versions_measured_loss_is_shared_over_the_levels_it_wrote_by_their_writing():
    policy = per_level_policy(crash=0.01, node=0.02)
    policy.observe_levels({}, {"local": 0.1, "partner": 0.3, "erasure": 0.6, "pfs": 2.0})
    policy.observe_persist_loss(("local", "partner", "pfs"), persist_loss=0.8, own_pace_loss=None)
    # L4 copies at its own pace: the persist's loss is the node-local levels' alone.
    assert policy.level_loss == pytest.approx({"local": 0.2, "partner": 0.6})
    policy.observe_persist_loss(("local",), persist_loss=0.4, own_pace_loss=1.5)
    assert policy.level_loss["local"] == pytest.approx((0.2 + 0.4) / 2)  # smoothed
    assert policy.level_loss["pfs"] == pytest.approx(1.5) and "erasure" not in policy.level_loss
    policy.observe_persist_loss(("local", "erasure"), persist_loss=None, own_pace_loss=None)  # nothing ran beside
    assert policy.level_loss["local"] == pytest.approx(0.3) and "erasure" not in policy.level_loss
    policy.observe_persist_loss(("local",), persist_loss=-0.2, own_pace_loss=None)  # faster than clean: no cost
    assert policy.level_loss["local"] == pytest.approx(0.15)


def test_a_versions_measured_loss_outweighs_the_mean_slowdown_in_the_choice():
    """Steps right after a snapshot can lose far more than the mean slowdown while a persist
    runs times its writing says: once measured whole, that loss is the version's cost."""
    def chosen(loss):
        policy = per_level_policy(crash=0.01, node=0.02)
        policy.observe_step(0.100)
        policy.observe_step(0.110, persisting=True)  # 10 % slower on average
        times = {"local": 0.05, "partner": 0.1, "erasure": 0.2, "pfs": 2.0}
        policy.observe_levels(times, times)
        if loss:
            policy.observe_persist_loss(("local", "partner", "erasure"), persist_loss=loss, own_pace_loss=None)
        said = policy.observe_checkpoint(6, blocking=0.001, durable=0.2)
        return policy, said

    estimated, _ = chosen(None)
    measured, said = chosen(3.5)  # 10x the estimate: 0.1 * (0.05 + 0.1 + 0.2) s
    assert "local 501.0 ms" in said, said  # its share of the measured loss (1/7), with the blocking
    assert measured.interval > estimated.interval
    assert measured.every["partner"] >= estimated.every["partner"]
    restored = per_level_policy(crash=0.01, node=0.02)
    restored.load_state(measured.state())
    assert restored.level_loss == measured.level_loss


def test_where_the_persist_runs_inline_a_level_costs_all_its_writing_before_a_loss_is_measured():
    """Without threads (serialized MPI) training stands still for the whole persist, and no
    step ever runs beside one: the slowdown measured is 0, which made the first choice after
    the profile take every level on every version, L4 at the PFS's pace included."""
    def first_choice(inline):
        policy = per_level_policy(crash=0.01, node=0.02)
        policy.levels = tuple((name, survives, False) for name, survives, _ in STACK)  # L4 in the persist
        policy.persist_inline = inline
        policy.observe_step(0.150)
        times = {"local": 0.04, "partner": 0.07, "erasure": 0.09, "pfs": 2.0}
        policy.observe_levels(times, times)
        return policy, policy.observe_checkpoint(6, blocking=0.001, durable=2.2)

    threaded, said_threaded = first_choice(False)
    inline, said = first_choice(True)
    assert "partner 0.0 ms, erasure 0.0 ms, pfs 0.0 ms" in said_threaded  # their writing looked free
    assert "partner 70.0 ms, erasure 90.0 ms, pfs 2000.0 ms" in said, said
    assert inline.interval > threaded.interval
    assert all(inline.every[name] >= threaded.every[name] for name in inline.every)
    assert inline.every != threaded.every


def test_the_per_level_choice_survives_a_restart():
    policy = per_level_policy(crash=0.01, node=0.02)
    policy.observe_step(0.010)
    policy.observe_step(0.015, persisting=True)
    times = {"local": 0.02, "partner": 0.03, "erasure": 0.05, "pfs": 2.0}
    policy.observe_levels(times, times)
    policy.observe_checkpoint(6, blocking=0.001, durable=2.0)
    restored = per_level_policy(crash=0.01, node=0.02)
    restored.load_state(policy.state())
    assert (restored.interval, restored.every, restored.level_durable) == \
        (policy.interval, policy.every, policy.level_durable)


def test_levels_due_every_nth_and_always_the_last():
    from hpcckpt.schedule.policy import levels_due

    def due(ordinal, final=False):
        return levels_due(("local", "partner", "erasure", "pfs"), ordinal, final,
                          {"partner": 1, "erasure": 2, "pfs": 3})

    assert due(1) == ("local", "partner")
    assert due(2) == ("local", "partner", "erasure")
    assert due(3) == ("local", "partner", "pfs")
    assert due(6) == ("local", "partner", "erasure", "pfs")
    assert due(5, final=True) == ("local", "partner", "erasure", "pfs")
