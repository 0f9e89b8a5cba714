"""The schedule behind Checkpointer.due() (schedule/checkpoint_schedule.py): checkpoints
numbered, the run's final one, the levels each takes, the steps that confirm a resumed run.
Its collectives (the stop exchange, the costs' agreement) run on one real rank."""

from types import SimpleNamespace

import pytest

from hpcckpt.schedule.checkpoint_schedule import CheckpointSchedule
from hpcckpt.schedule.policy import levels_due

STACK = (("local", 0, False), ("partner", 1, False), ("erasure", 2, False), ("pfs", 99, True))
NAMES = tuple(name for name, _, _ in STACK)


def checkpoint_config(every):
    return SimpleNamespace(every_steps=every, max_overhead=0.035, mtbf_hours=0.0)


@pytest.fixture
def make_schedule():
    from mpi4py import MPI

    made = []

    def make(every=5, **options):
        options.setdefault("levels", STACK)
        schedule = CheckpointSchedule(MPI.COMM_SELF, checkpoint_config(every), catch_signals=False, **options)
        made.append(schedule)
        return schedule

    yield make
    for schedule in made:
        schedule.close()


def test_each_checkpoint_is_numbered_and_goes_to_the_levels_its_number_makes_due(make_schedule):
    schedule = make_schedule(fixed_every={"partner": 1, "erasure": 2, "pfs": 3})
    taken = [schedule.next_checkpoint(step, None) for step in (5, 10, 15, 20, 25, 30)]
    assert [ordinal for ordinal, _, _ in taken] == [1, 2, 3, 4, 5, 6]
    assert [final for _, final, _ in taken] == [False] * 6
    assert [levels for _, _, levels in taken] == [
        ("local", "partner"),
        ("local", "partner", "erasure"),
        ("local", "partner", "pfs"),
        ("local", "partner", "erasure"),
        ("local", "partner"),
        ("local", "partner", "erasure", "pfs"),
    ]
    assert schedule.ordinal == 6


def test_a_level_without_an_interval_takes_every_version(make_schedule):
    schedule = make_schedule(fixed_every={})
    assert [schedule.next_checkpoint(step, None)[2] for step in (1, 2)] == [NAMES, NAMES]


def test_the_final_checkpoint_goes_to_every_level(make_schedule):
    schedule = make_schedule(fixed_every={"partner": 2, "erasure": 4, "pfs": 8})
    assert schedule.next_checkpoint(5, None) == (1, False, ("local",))
    assert schedule.next_checkpoint(7, True) == (2, True, NAMES)  # asked for: checkpoint(final=True)


def test_the_step_due_said_is_the_last_is_the_final_checkpoint(make_schedule):
    schedule = make_schedule(fixed_every={"pfs": 8})
    assert schedule.final_step is None
    assert schedule.step_done(3, None, last=False) is False and schedule.final_step is None
    schedule.step_done(4, "SIGTERM received", last=False)  # a stop agreed after step 4
    assert schedule.final_step == 4
    assert schedule.next_checkpoint(4, None) == (1, True, NAMES)
    schedule.step_done(9, None, last=True)  # due(9, last=True)
    assert schedule.next_checkpoint(8, None)[1] is False  # another step than the last
    assert schedule.next_checkpoint(9, False) == (3, False, ("local", "partner", "erasure"))  # final=False overrides


def test_a_resumed_run_is_confirmed_once_after_its_confirm_steps(make_schedule):
    schedule = make_schedule(confirm_after_steps=3)
    assert [schedule.step_done(step, None, False) for step in range(11, 16)] == [False, False, True, False, False]
    assert schedule.steps_run == 5
    never = make_schedule(confirm_after_steps=0)
    assert not any(never.step_done(step, None, False) for step in range(1, 5))


def test_planned_follows_the_fixed_interval_and_the_last_step(make_schedule):
    schedule = make_schedule(every=5)
    assert [step for step in range(1, 13) if schedule.planned(step)] == [5, 6, 7, 8, 9, 10, 11, 12]
    schedule.checkpoint_taken(5, blocked=0.001, waited=0.0, durable=None)  # the interval counts from here
    assert [step for step in range(6, 13) if schedule.planned(step)] == [10, 11, 12]
    assert schedule.planned(7, last=True)
    off = make_schedule(every=0)
    assert not off.planned(50) and off.planned(50, last=True)


def test_a_restart_counts_the_interval_from_the_version_loaded(make_schedule):
    schedule = make_schedule(every=5)
    assert schedule.begin(restored_step=40) is None  # a fixed interval: nothing to say
    assert [step for step in range(41, 47) if schedule.planned(step)] == [45, 46]


def test_a_fixed_interval_shorter_than_a_persist_is_said_once(make_schedule):
    schedule = make_schedule(every=5)
    assert schedule.checkpoint_taken(5, blocked=0.2, waited=0.15, durable=None) is not None
    assert schedule.checkpoint_taken(10, blocked=0.2, waited=0.15, durable=None) is None
    calm = make_schedule(every=5)
    assert calm.checkpoint_taken(5, blocked=0.2, waited=0.05, durable=None) is None  # waited less than half


def test_a_stop_requested_is_agreed_after_the_next_step(make_schedule):
    schedule = make_schedule()
    schedule.begin(None)  # posts the first step's exchange
    assert schedule.step_over(0.01, observe=True) is None
    schedule.stops.request("asked by the test")
    assert schedule.step_over(0.01, observe=True) is None  # requested during this step: agreed after the next
    reason = schedule.step_over(0.01, observe=True)
    assert reason is not None and "asked by the test" in reason
    assert schedule.stopping == reason
    assert schedule.step_over(0.01, observe=True) == reason  # once agreed, it stays


def test_an_adaptive_interval_profiles_then_chooses_from_the_costs_agreed(make_schedule):
    schedule = make_schedule(every="auto")
    assert schedule.profiling and not schedule.planned(3)
    schedule.restart_clock(False)
    schedule.step_over(0.9, observe=True)  # the process's first step: it sets up, not timed
    schedule.step_over(0.1, observe=True)
    schedule.step_over(0.5, observe=False)  # a snapshot was open during this step: not timed
    assert schedule.policy.step_time == pytest.approx(0.1)
    said = schedule.checkpoint_taken(6, blocked=0.002, waited=0.0, durable=0.3)
    assert said is not None and not schedule.profiling
    # The persist bound: the next snapshot never waits for this persist (0.3 s of 0.1 s steps).
    assert schedule.policy.interval >= 3
    restored = make_schedule(every="auto")
    restored.load_state(schedule.state())  # saved with every version: a restart does not profile again
    assert not restored.profiling and restored.policy.interval == schedule.policy.interval


def test_with_failure_rates_each_level_takes_the_share_of_versions_chosen_for_it(make_schedule):
    rates = SimpleNamespace(mtbf_crash_hours=1.0, mtbf_node_hours=24.0, mtbf_two_nodes_hours=240.0)
    schedule = make_schedule(every="auto", resilience=rates, fixed_every={"partner": 1, "erasure": 1, "pfs": 1})
    assert schedule.policy.per_level
    schedule.restart_clock(False)
    schedule.step_over(0.9, observe=True)  # the process's first step
    schedule.step_over(0.1, observe=True)
    schedule.restart_clock(True)  # this step runs beside a persist: 50 % slower
    schedule.step_over(0.15, observe=True)
    level_times = {"local": (0.01, 0.01), "partner": (0.05, 0.04), "erasure": (0.2, 0.15), "pfs": (5.0, 4.0)}
    schedule.checkpoint_taken(6, blocked=0.005, waited=0.0, durable=5.0, level_times=level_times)
    every = schedule.policy.every
    # L4's writing slows the steps most and guards against the rarest failures: it takes the fewest versions.
    assert every["local"] == 1 and 1 < every["partner"] <= every["erasure"] <= every["pfs"]
    taken = [schedule.next_checkpoint(step, None) for step in range(10, 10 + every["partner"] + 1)]
    # The chosen intervals, not the fixed ones (fixed_every would put every level on every version).
    assert [levels for _, _, levels in taken] == [levels_due(NAMES, ordinal, False, every) for ordinal, _, _ in taken]
    assert taken[0][2] == ("local",) and "partner" in taken[every["partner"] - 1][2]
    assert schedule.next_checkpoint(99, True)[2] == NAMES


def test_without_rates_the_fixed_intervals_choose_even_when_adaptive(make_schedule):
    schedule = make_schedule(every="auto", fixed_every={"pfs": 2})
    assert not schedule.policy.per_level
    assert [schedule.next_checkpoint(step, None)[2] for step in (1, 2)] == [
        ("local", "partner", "erasure"), NAMES]


def test_what_the_steps_beside_a_versions_work_lost_is_that_versions_cost(make_schedule):
    """The steps beside the persist of one version add up to its node-local levels' cost; a
    copy to L4 at its own pace that runs past the next checkpoint is counted whole, once over;
    steps beside the copy are not clean steps."""
    rates = SimpleNamespace(mtbf_crash_hours=1.0, mtbf_node_hours=24.0, mtbf_two_nodes_hours=0.0)
    schedule = make_schedule(every="auto", resilience=rates, fixed_every={})
    policy = schedule.policy

    def step(seconds, persisting=False, copying=None):
        schedule.restart_clock(persisting, copying)
        schedule.step_over(seconds, observe=True)

    def checkpoint(at):
        levels = schedule.next_checkpoint(at, None)[2]
        schedule.checkpoint_taken(at, blocked=0.001, waited=0.0, durable=0.2, level_times=times)
        return levels

    times = {"local": (0.05, 0.05), "partner": (0.2, 0.15), "erasure": (0.2, 0.2), "pfs": (3.0, 3.0)}
    for _ in range(5):
        step(0.1)
    written = checkpoint(6)  # profiling: waited for, so no step runs beside its persist
    assert written == NAMES and policy.level_loss == {}
    step(0.1, copying=6)  # L4 copies version 6 at its own pace
    step(0.3, copying=6)
    assert policy.step_time == pytest.approx(0.1)  # a step beside the copy is not a clean one
    written_by_9 = [name for name in checkpoint(9) if name != "pfs"]  # the copy of 6 still runs: not counted yet
    assert len(written_by_9) > 1, written_by_9
    assert "pfs" not in policy.level_loss
    step(0.5, persisting=True, copying=6)  # beside both: half to each
    step(0.2, persisting=True)
    step(0.1)
    checkpoint(12)
    # Version 9's persist: 0.2 + 0.1 s over 0.1 s steps, shared over the levels it wrote.
    shares = {"local": 0.05, "partner": 0.15, "erasure": 0.2}
    total = sum(shares[name] for name in written_by_9)
    for name in written_by_9:
        assert policy.level_loss[name] == pytest.approx(0.3 * shares[name] / total)
    assert policy.level_loss["pfs"] == pytest.approx(0.0 + 0.2 + 0.2)  # the whole copy of version 6


def test_the_steps_right_after_a_persist_are_its_versions_cost_and_not_clean_steps(make_schedule):
    """The steps right after a persist ended that still run slow count in the version's loss
    and are not taken for clean steps, whose time the losses are measured against; the steps
    after them are clean again. A process's first step (it sets up) is neither."""
    from hpcckpt.schedule.checkpoint_schedule import SETTLING_STEPS

    rates = SimpleNamespace(mtbf_crash_hours=1.0, mtbf_node_hours=24.0, mtbf_two_nodes_hours=0.0)
    schedule = make_schedule(every="auto", resilience=rates, fixed_every={"pfs": 64})
    policy = schedule.policy
    times = {"local": (0.05, 0.05), "partner": (0.2, 0.15), "erasure": (0.2, 0.2)}

    def step(seconds, persisting=False):
        schedule.restart_clock(persisting)
        schedule.step_over(seconds, observe=True)

    def checkpoint(at):
        levels = schedule.next_checkpoint(at, None)[2]
        schedule.checkpoint_taken(at, blocked=0.001, waited=0.0, durable=0.2, level_times=times)
        return levels

    step(0.9)  # the process's first step
    for _ in range(5):
        step(0.1)
    assert policy.step_time == pytest.approx(0.1)
    checkpoint(6)
    written = checkpoint(7)
    step(0.3, persisting=True)
    for _ in range(SETTLING_STEPS):
        step(0.15)  # the persist is over, the steps still pay for it
    assert policy.step_time == pytest.approx(0.1) and policy.busy_step_time == pytest.approx(0.3)
    step(0.12)  # clean again
    assert policy.step_time == pytest.approx(0.11)
    checkpoint(8)
    node_local = [name for name in written if name != "pfs"]
    loss = 0.2 + SETTLING_STEPS * 0.05
    assert sum(policy.level_loss[name] for name in node_local) == pytest.approx(loss)


def test_a_persist_run_inline_is_its_versions_whole_cost(make_schedule):
    """Where MPI allows no threads, end_checkpoint() runs the persist itself: its seconds are
    the version's loss (shared over the levels it wrote), and blocking for the other choices."""
    rates = SimpleNamespace(mtbf_crash_hours=1.0, mtbf_node_hours=24.0, mtbf_two_nodes_hours=0.0)
    schedule = make_schedule(every="auto", resilience=rates, fixed_every={})
    times = {"local": (0.1, 0.1), "partner": (0.3, 0.2), "erasure": (0.3, 0.3), "pfs": (0.5, 0.4)}
    schedule.restart_clock(False)
    schedule.step_over(0.9, observe=True)  # the process's first step
    schedule.step_over(0.1, observe=True)
    written = schedule.next_checkpoint(6, None)[2]
    schedule.checkpoint_taken(6, blocked=1.001, waited=0.0, durable=1.0, level_times=times, inline=1.0)
    assert schedule.policy.level_loss == {}  # settled at the next checkpoint, as a persist behind the steps is
    schedule.restart_clock(False)
    schedule.step_over(0.1, observe=True)  # no step runs beside anything: the persist is over
    schedule.next_checkpoint(12, None)
    schedule.checkpoint_taken(12, blocked=1.001, waited=0.0, durable=1.0, level_times=times, inline=1.0)
    node_local = [name for name in written if name != "pfs"]
    busy = {name: times[name][1] for name in node_local}
    assert schedule.policy.level_loss == pytest.approx({name: 1.0 * b / sum(busy.values()) for name, b in busy.items()})
    assert schedule.policy.blocking == pytest.approx(0.001)  # the snapshot's; the persist is the levels' cost

    fixed = make_schedule(every="auto")  # no failure rates: the overhead bound counts it as blocking
    fixed.restart_clock(False)
    fixed.step_over(0.9, observe=True)
    fixed.step_over(0.1, observe=True)
    fixed.checkpoint_taken(6, blocked=1.001, waited=0.0, durable=1.0, inline=1.0)
    assert fixed.policy.blocking == pytest.approx(1.001)
