"""Registered state as a nested pytree (#23 item 2): types intact through the commit record's
JSON, plain JSON stored as it was, and a clear error for what cannot be stored."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_ok, run_script, script_results

from hpcckpt.errors import CheckpointError
from hpcckpt.format.pytree import MAX_ARRAY_BYTES, decode, encode

SCRIPT = Path(__file__).parent / "scripts" / "nested_state.py"


def round_trip(value):
    return decode(json.loads(json.dumps(encode(value, "'s'"))))


def test_plain_json_is_stored_as_it_was():
    # Versions written before pytrees hold plain JSON: they must read back the same.
    plain = {"step": 3, "rng": {"state": {"state": 2**100, "inc": 5}}, "names": ["a", "b"], "x": None, "ok": True}
    assert encode(plain, "'s'") == plain
    assert round_trip(plain) == plain


def test_containers_keys_and_scalars_keep_their_types():
    value = {"t": (1, (2.5, "x")), "k": {1: "one", (2, 3): [None]}, "b": b"\x00\xff", "f32": np.float32(0.1),
             "i64": np.int64(-2), "flag": np.bool_(True), "inf": float("-inf"), "__hpcckpt__": "user key"}
    back = round_trip(value)
    assert back == value
    assert type(back["t"]) is tuple and type(back["t"][1]) is tuple
    assert type(back["f32"]) is np.float32 and back["f32"] == np.float32(0.1)
    assert type(back["i64"]) is np.int64 and type(back["flag"]) is np.bool_
    assert math.isinf(back["inf"]) and back["inf"] < 0
    assert math.isnan(round_trip([float("nan")])[0])


def test_arrays_keep_dtype_shape_and_bytes_even_from_a_strided_view():
    base = np.arange(24, dtype=">i4").reshape(4, 6)
    for array in (base[:, ::2], np.array(3.5, np.float16), np.zeros((0, 3), np.complex64), np.array(["ab", "c"])):
        back = round_trip({"a": array})["a"]
        assert back.dtype == array.dtype and back.shape == array.shape
        assert np.array_equal(back, array) and back.flags.writeable


@pytest.mark.parametrize("value, named", [
    ({"seen": {1, 2}}, "registered state 's'['seen']: a builtins.set cannot be stored"),
    ({"rows": [1, object()]}, "registered state 's'['rows'][1]: a builtins.object cannot be stored"),
    ({"big": np.zeros(MAX_ARRAY_BYTES // 8 + 1)}, "is too large for the state"),
    ({"o": np.array([None])}, "arrays of dtype object cannot be stored"),
    ({"k": {frozenset({1}): 0}}, "registered state 's'['k'] key: a builtins.frozenset cannot be stored"),
])
def test_what_cannot_be_stored_is_named_with_its_place(value, named):
    with pytest.raises(CheckpointError) as caught:
        encode(value, "'s'")
    assert named in str(caught.value), str(caught.value)


def test_a_nested_state_comes_back_on_real_ranks_and_a_bad_one_fails_clearly(tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_script(2, SCRIPT, [str(run_dir), "save"], tmp_path))
    restored = run_script(2, SCRIPT, [str(run_dir), "restore"], tmp_path)
    assert_ok(restored)
    results = script_results(restored)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["step"] == 10
        assert result["got"] == result["want"]
    bad = run_script(2, SCRIPT, [str(run_dir), "bad"], tmp_path)
    assert_ok(bad)
    errors = script_results(bad)
    assert len(errors) == 2 and all("a builtins.set cannot be stored" in e["error"] for e in errors), errors
    # Nothing already saved was lost: version 10 still restores.
    again = run_script(2, SCRIPT, [str(run_dir), "restore"], tmp_path)
    assert_ok(again)
    assert all(r["step"] == 10 and r["got"] == r["want"] for r in script_results(again))
