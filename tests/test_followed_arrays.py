"""Protection by reference without processes: a getter is read again when the object it
returns is another one, its geometry follows; an array protected by value that only the
checkpointer still holds is told apart from one the application keeps."""

import numpy as np
import pytest

from hpcckpt.ckpt.registry import ArrayRegistry
from hpcckpt.ckpt.snapshot import _left_behind
from hpcckpt.errors import ConfigError


def test_a_getter_is_followed_when_the_name_is_rebound_and_its_geometry_with_it():
    app = {"W": np.zeros((4, 2))}
    registry = ArrayRegistry()
    registry.protect("W", lambda: app["W"], True)
    assert registry.followed and registry.arrays["W"].array is app["W"]
    before = registry.geometry
    registry.refresh()
    assert registry.geometry == before  # the same object: nothing read again
    app["W"] = app["W"] * 2 + 1
    registry.refresh()
    assert registry.arrays["W"].array is app["W"] and registry.geometry == before
    app["W"] = np.zeros((5, 2))
    registry.refresh()
    assert registry.geometry != before  # another shape: the arrays are laid out again


def test_a_getter_that_returns_what_cannot_be_protected_is_refused_naming_it():
    registry = ArrayRegistry()
    with pytest.raises(ConfigError, match=r"protect\('W'\): expected a NumPy or CuPy array.*got set"):
        registry.protect("W", lambda: {1, 2}, True)


def test_an_array_protected_by_value_is_left_behind_once_the_application_rebinds_it():
    registry = ArrayRegistry()
    app = {"W": np.zeros(8), "view": np.zeros(10)}
    registry.protect("W", app["W"], True)
    registry.protect("interior", app["view"][1:-1], True)  # a view: not judged
    protected = registry.arrays["W"]
    assert not registry.followed
    # Plain bools in the asserts: an assert's own temporaries would hold the arrays too.
    left = _left_behind(protected, False)
    assert not left
    held = {"W": protected.array}  # the step held in memory for in-job recovery
    left = _left_behind(protected, True)
    assert not left
    app["W"] = app["W"] * 2
    left = _left_behind(protected, True)
    assert left
    del held
    left = _left_behind(protected, False)
    assert left
    app["view"] = None
    left = _left_behind(registry.arrays["interior"], False)
    assert not left


def test_a_torch_tensor_protected_by_value_is_left_behind_once_the_application_drops_it():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    registry = ArrayRegistry()
    model = {"w": torch.zeros(6)}
    registry.protect("w", model["w"], True)
    assert not _left_behind(registry.arrays["w"], False)
    model["w"] = model["w"] * 3
    assert _left_behind(registry.arrays["w"], False)
