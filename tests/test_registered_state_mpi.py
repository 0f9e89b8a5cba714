"""Registered state comes back by one rule, whatever level it is read from (tests/scripts/
library_app.py on real ranks): state registered per rank goes back to the rank that wrote it
from L1, a partner's copy, an erasure rebuild and L4 alike; onto another rank count it is
refused unless the application says what each rank gets (reshard); state registered as shared
that differs between ranks is refused at the first checkpoint, naming it and the ranks."""

import shutil

import pytest

from conftest import REPO, assert_ok, node_local, run_script, script_results

APP = REPO / "tests" / "scripts" / "library_app.py"


def app(tmp_path, ranks: int, steps: int, *extra: str):
    return run_script(ranks, APP, [str(tmp_path / "run"), str(ranks), str(steps), *extra], cwd=tmp_path)


def own_states(ranks: int, step: int) -> list[dict]:
    return [{"owner": rank, "count": step * (rank + 1)} for rank in range(ranks)]


@pytest.mark.parametrize("levels, lost_node, read_from", [
    ('["local"]', None, "4 rank(s) from L1"),
    ('["local","partner"]', 1, "1 rank(s) from L2"),
    ('["local","erasure"]', 2, "1 rank(s) from L3"),
    ('["pfs"]', None, "4 rank(s) from L4"),
], ids=["L1", "L2", "L3", "L4-only"])
def test_per_rank_state_comes_back_to_the_rank_that_wrote_it_from_every_level(tmp_path, levels, lost_node,
                                                                              read_from):
    settings = ["--set", f"resilience.levels={levels}", "--set", "resilience.partner_every=1",
                "--set", "resilience.erasure_every=1", "--set", "resilience.parity=1", "--rank-state"]
    saved = app(tmp_path, 4, 6, *settings, "--no-due", "--explicit", "6")
    assert_ok(saved)
    if lost_node is not None:
        shutil.rmtree(node_local(tmp_path / "run", lost_node))
    restored = app(tmp_path, 4, 6, *settings, "--no-due")
    assert_ok(restored)
    [result] = script_results(restored)
    assert result["restored"] == 6
    assert result["rank_states"] == own_states(4, 6)
    assert read_from in restored.stdout, restored.stdout


def test_per_rank_state_onto_another_rank_count_is_refused_without_reshard_and_handed_out_with_it(tmp_path):
    settings = ["--set", 'resilience.levels=["local","pfs"]', "--rank-state", "--no-due"]
    assert_ok(app(tmp_path, 4, 5, *settings, "--explicit", "5"))

    refused = app(tmp_path, 3, 5, *settings)
    assert refused.returncode == 4, refused.stderr
    assert "state 'mine' is per rank and was saved by 4 ranks, this job has 3" in refused.stderr

    handed = app(tmp_path, 3, 5, *settings, "--reshard")
    assert_ok(handed)
    [result] = script_results(handed)
    assert result["restored"] == 5
    counts = [5 * (rank + 1) for rank in range(4)]
    assert result["rank_states"] == [{"owner": 0, "count": counts[0] + counts[3], "from": [0, 3]},
                                     {"owner": 1, "count": counts[1], "from": [1]},
                                     {"owner": 2, "count": counts[2], "from": [2]}]


def test_shared_state_that_differs_between_ranks_is_refused_at_the_first_checkpoint(tmp_path):
    proc = app(tmp_path, 4, 4, "--no-due", "--explicit", "2", "--state-differs")
    assert proc.returncode == 2, proc.stderr
    assert "registered state not the same on every rank: 'rank' (ranks 0 vs ranks 1 vs ranks 2 vs ranks 3)" \
        in proc.stderr
    assert "per_rank=True" in proc.stderr
