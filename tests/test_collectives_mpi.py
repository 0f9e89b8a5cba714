"""The collectives that keep each rank's metadata traffic O(1) or O(group) (#27): gathered at
one root and folded, decided there with one answer per rank, or sent as distinct values and
runs of ranks. On 5 real mpiexec ranks (tests/scripts/collectives_check.py)."""

from pathlib import Path

import pytest
from conftest import assert_ok, run_script, script_results

SCRIPT = Path(__file__).parent / "scripts" / "collectives_check.py"
RANKS = 5


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    base = tmp_path_factory.mktemp("collectives")
    proc = run_script(RANKS, SCRIPT, [], base)
    assert_ok(proc)
    return {r["check"]: r["answers"] for r in script_results(proc)}


def test_a_fold_at_a_root_hands_every_rank_the_same_answer(got):
    assert got["fold_sum"] == [15] * RANKS
    assert got["fold_root_2"] == [[0, 1, 2, 3, 4]] * RANKS


def test_broadcast_and_scatter_from_any_root(got):
    assert got["bcast"] == [3] * RANKS
    assert got["scatter"] == [f"to {r}" for r in range(RANKS)]


def test_compact_allgather_gives_what_an_allgather_gives(got):
    values = [{"level": "partner"} if r in (1, 3) else {"level": "local"} for r in range(RANKS)]
    assert got["compact"] == [values] * RANKS
    assert got["compact_none"] == [[0, 1, None, 1, 0]] * RANKS


def test_failing_ranks_are_named_on_every_rank(got):
    assert got["failing_none"] == [[]] * RANKS
    assert got["failing_some"] == [[0, 4]] * RANKS


def test_one_rank_per_key_is_the_lowest(got):
    assert got["first_of_each"] == [True, False, True, False, True]


def test_a_decision_at_the_root_shares_one_part_and_scatters_the_rest(got):
    assert got["decide"] == [[100, 10 * r + 1] for r in range(RANKS)]


def test_an_error_at_the_root_is_raised_on_every_rank(got):
    assert got["decide_error"] == [["no good: [0, 1, 2, 3, 4]", True]] * RANKS


def test_a_fold_that_fails_at_the_root_raises_on_every_rank_instead_of_hanging(got):
    assert got["fold_bug"] == [["combining the ranks' answers failed on rank 0: ZeroDivisionError: division by zero",
                                True]] * RANKS


def test_an_agreed_failure_names_the_failing_rank_everywhere(got):
    for message, ranks in got["agreed"]:
        assert ranks == [3]
        assert message.startswith("stage of step 7 failed on rank(s) [3]") and "disk full here" in message
