"""Which versions a rewind marks bad and which it restores (schedule/rewind.py): plan_rewind is
pure; versions_held and mark_versions_bad on one real rank. The rewind itself, in process,
is in tests/test_resuming.py; on several ranks, tests/test_rewind_mpi.py."""

from types import SimpleNamespace

import pytest

from hpcckpt.run.ledger import RestartLedger, ledger_path
from hpcckpt.schedule.rewind import RewindPlan, mark_versions_bad, plan_rewind, versions_held


@pytest.fixture
def world():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.mark.parametrize("held, before, rewound_to, plan", [
    # Every version from the step that diverged on is bad; the newest older one is restored.
    ([10, 20, 30], 25, None, RewindPlan((30,), 20, None)),
    ([10, 20, 30], 30, None, RewindPlan((30,), 20, None)),  # a version of the diverged step itself is bad
    ([10, 20, 30], 31, None, RewindPlan((), 30, None)),  # nothing taken since: nothing marked
    ([10, 20, 30], 5, None, RewindPlan((10, 20, 30), None, None)),  # nothing older left
    ([], 5, None, RewindPlan((), None, None)),
    # Diverged again from the version the last rewind restored, no newer one taken since:
    # that version is to blame too, and the rewind goes one further back.
    ([10, 20], 25, 20, RewindPlan((20,), 10, 20)),
    ([10, 20, 30], 35, 30, RewindPlan((30,), 20, 30)),
    ([20], 25, 20, RewindPlan((20,), None, 20)),
    # A version was taken since the last rewind: the run got past it, it is not blamed.
    ([10, 20, 30], 35, 20, RewindPlan((), 30, None)),
    ([10, 20, 30], 25, 10, RewindPlan((30,), 20, None)),
])
def test_a_rewind_marks_from_the_diverged_step_on_and_restores_the_newest_older(held, before, rewound_to, plan):
    assert plan_rewind(held, before, rewound_to) == plan


def test_the_bad_versions_come_sorted_when_the_last_rewind_is_blamed():
    plan = plan_rewind([10, 20, 30, 40], 35, 30)
    assert plan.bad == (30, 40) and plan.newest_older == 20 and plan.again == 30


def _level(*steps):
    return SimpleNamespace(committed_steps=lambda: list(steps))


def test_versions_held_are_every_levels_in_order_once(world):
    assert versions_held(world, [_level(30, 10), _level(20, 30), _level()]) == [10, 20, 30]
    assert versions_held(world, []) == []


def test_versions_marked_bad_are_in_the_restart_ledger_with_the_reason(world, tmp_path):
    mark_versions_bad(world, tmp_path, [20, 30], "the loss turned NaN")
    assert RestartLedger(ledger_path(tmp_path)).failed_steps() == {20: "the loss turned NaN",
                                                                    30: "the loss turned NaN"}


def test_marking_no_version_bad_leaves_no_ledger(world, tmp_path):
    mark_versions_bad(world, tmp_path, [], "nothing")
    assert not ledger_path(tmp_path).exists()
