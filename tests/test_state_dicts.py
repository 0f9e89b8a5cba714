"""A framework's state dict cut into the arrays protected in place and the other values saved
as registered state (ckpt/state_dicts.py), and a block's offset given as slices."""

import numpy as np
import pytest

from hpcckpt.ckpt.state_dicts import split_state_dict
from hpcckpt.errors import ConfigError


def optimizer_like() -> dict:
    return {"model": {"w": np.ones((2, 3)), "b": np.zeros(3)},
            "optim": {"state": {0: {"exp_avg": np.zeros(3), "step": 4}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}]}}


def test_arrays_are_named_by_their_path_and_the_rest_is_found_by_it():
    tree = optimizer_like()
    parts = split_state_dict("train", tree)
    assert [name for name, _ in parts.arrays] == ["train/model/w", "train/model/b", "train/optim/state/0/exp_avg"]
    assert parts.arrays[0][1] is tree["model"]["w"]  # the array itself: restored in place
    assert parts.get() == {"optim/state/0/step": 4, "optim/param_groups": [{"lr": 0.1, "betas": (0.9, 0.99),
                                                                            "params": ["w", "b"]}]}


def test_restored_values_are_written_back_into_the_dict_where_they_were():
    tree = optimizer_like()
    parts = split_state_dict("train", tree)
    saved = parts.get()
    tree["optim"]["state"][0]["step"] = 0
    tree["optim"]["param_groups"] = [{"lr": 1.0}]
    parts.set(saved)
    assert tree["optim"]["state"][0]["step"] == 4 and tree["optim"]["param_groups"][0]["lr"] == 0.1


@pytest.mark.parametrize("tree, says", [
    ({"pair": (np.zeros(2), 3)}, "pair is a tuple that holds arrays beside other values"),
    ({1: np.zeros(1), "1": np.zeros(1)}, "two entries have the same path"),
    ([np.zeros(1)], "expected a mapping (a state dict), got list"),
])
def test_what_a_restart_could_not_write_back_is_refused(tree, says):
    with pytest.raises(ConfigError, match=r"protect_state_dict\('train'\)") as caught:
        split_state_dict("train", tree)
    assert says in str(caught.value)


def test_a_blocks_offset_may_be_the_slices_a_framework_hands():
    from hpcckpt.ckpt.registry import _block_of

    block = np.zeros((3, 4))
    where = (slice(np.int64(2), np.int64(5), None), slice(4, 8))
    assert _block_of("u", block, True, (10, 8), where, False).offset == (2, 4)
    assert _block_of("u", block, True, (10, 8), (2, slice(4, None)), False).offset == (2, 4)
    with pytest.raises(ConfigError, match=r"offset slice\(2, 6, None\) on axis 0 spans 4 element\(s\), but the array "
                                          r"protected is 3 long there"):
        _block_of("u", block, True, (10, 8), (slice(2, 6), 0), False)
    with pytest.raises(ConfigError, match=r"has step 2; a block is a contiguous part"):
        _block_of("u", block, True, (10, 8), (slice(2, 8, 2), 0), False)
    with pytest.raises(ConfigError, match=r"starts before the global array \(a block with halo cells"):
        _block_of("u", block, True, (10, 8), (slice(-1, 2), 0), False)


def test_another_rank_count_alters_the_meaning_only_of_per_rank_arrays():
    from hpcckpt.run.settings_record import changed_settings

    [portable] = changed_settings({"a.b": 1}, {"a.b": 1}, 4, 2)
    assert str(portable) == "world_size 4 -> 2" and not portable.changes_meaning
    [per_rank] = changed_settings({}, {}, 4, 2, per_rank_arrays=True)
    assert per_rank.changes_meaning
    model = changed_settings({"model.hidden": [8]}, {"model.hidden": [16]}, 4, 4)
    assert [c.changes_meaning for c in model] == [True]
