"""Arrays of other frameworks protected in place (ckpt/foreign_arrays.py): PyTorch tensors and
parameters, buffer-protocol objects; clear errors for what cannot be restored in place. The
multi-rank case trains a PyTorch model on real ranks, kills it and restarts it."""

import array

import numpy as np
import pytest
from conftest import REPO, assert_ok, run_script, script_results

from hpcckpt.ckpt.foreign_arrays import protectable_array
from hpcckpt.errors import ConfigError

TORCH_MODEL = REPO / "tests" / "scripts" / "torch_model.py"


def test_numpy_arrays_are_kept_as_they_are_and_read_only_ones_refused():
    a = np.zeros((3, 4))
    assert protectable_array("a", a) is a
    view = a[:, 1:3]
    assert protectable_array("v", view) is view
    frozen = np.zeros(3)
    frozen.setflags(write=False)
    with pytest.raises(ConfigError, match=r"protect\('f'\): a read-only NumPy array cannot be restored in place"):
        protectable_array("f", frozen)


def test_buffer_protocol_objects_are_viewed_in_place():
    raw = bytearray(b"\x00" * 8)
    view = protectable_array("raw", raw)
    view[3] = 7
    assert raw[3] == 7
    doubles = array.array("d", [1.0, 2.0])
    protectable_array("d", doubles)[1] = 5.0
    assert doubles[1] == 5.0
    with pytest.raises(ConfigError, match=r"the bytes is read-only and cannot be restored in place"):
        protectable_array("b", b"abc")
    with pytest.raises(ConfigError, match=r"expected a NumPy or CuPy array, or an array that speaks DLPack"):
        protectable_array("s", {1, 2})


def test_pytorch_tensors_and_parameters_are_views_of_their_own_storage():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    tensor = torch.zeros(3, 4)
    view = protectable_array("t", tensor)
    view[1, 2] = 3.0
    assert tensor[1, 2].item() == 3.0
    parameter = torch.nn.Parameter(torch.ones(2, 2))  # requires grad: viewed through detach()
    protectable_array("p", parameter)[0, 0] = 9.0
    assert parameter[0, 0].item() == 9.0 and parameter.requires_grad
    strided = torch.zeros(4, 6).t()
    protectable_array("s", strided)[5, 3] = 1.0
    assert strided[5, 3].item() == 1.0
    with pytest.raises(ConfigError, match=r"bfloat16: protect tensor.view\(torch.int16\)"):
        protectable_array("h", torch.zeros(2, dtype=torch.bfloat16))


def test_a_pytorch_model_and_its_optimizer_state_restart_byte_equal_on_real_ranks(tmp_path):
    """Adam's moments and step count, and the parameters, protected as tensors; killed at
    step 25 (versions 10 and 20 saved), restarted: the restored tensors are those saved at
    step 20, byte for byte, and the run goes on to its end."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    crashed = run_script(4, TORCH_MODEL, [str(tmp_path / "run"), "40", "--crash-at", "25"], cwd=tmp_path)
    assert crashed.returncode != 0
    saved = {r["saved"]: r["digest"] for r in script_results(crashed) if "saved" in r}
    assert sorted(saved) == [10, 20], crashed.stdout
    resumed = run_script(4, TORCH_MODEL, [str(tmp_path / "run"), "40"], cwd=tmp_path)
    assert_ok(resumed)
    results = script_results(resumed)
    assert results[0] == {"restored": 20, "digest": saved[20]}
    assert [r["saved"] for r in results if "saved" in r] == [30, 40]
    assert results[-1]["final"] == 40 and results[-1]["digest"] != saved[20]
