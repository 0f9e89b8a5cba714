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
    with pytest.raises(ConfigError, match=r"expected a NumPy or CuPy array, an array that speaks DLPack or the buffer protocol"):
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


class OrphanExporter:
    """Speaks DLPack like a wrapper does: each export a fresh buffer, not the data it shows."""

    def __init__(self):
        self.data = np.arange(6.0)

    def __dlpack__(self, **kwargs):
        return np.empty(6).__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return (1, 0)


class LyingExporter(OrphanExporter):
    """Exports one fixed buffer, but says through the array interface that its data is elsewhere."""

    def __init__(self):
        super().__init__()
        self.other = np.empty(6)

    def __dlpack__(self, **kwargs):
        return self.other.__dlpack__(**kwargs)

    @property
    def __array_interface__(self):
        return self.data.__array_interface__


class ShardWrapper(OrphanExporter):
    """A DTensor-like wrapper of another library: it has a local shard."""

    def __dlpack__(self, **kwargs):
        return self.data.__dlpack__(**kwargs)

    def to_local(self):
        return self.data


@pytest.mark.parametrize("exporter, says", [
    (OrphanExporter, "the OrphanExporter's DLPack export is not its own memory"),
    (LyingExporter, "the LyingExporter's DLPack export is not its own memory"),
    (ShardWrapper, "the ShardWrapper wraps a shard of a distributed tensor"),
])
def test_an_exporter_whose_dlpack_memory_is_not_its_array_is_refused_naming_it(exporter, says):
    with pytest.raises(ConfigError, match=r"protect\('w'\): ") as caught:
        protectable_array("w", exporter())
    assert says in str(caught.value), str(caught.value)


def test_an_honest_exporter_is_viewed_in_place():
    class Honest(OrphanExporter):
        def __dlpack__(self, **kwargs):
            return self.data.__dlpack__(**kwargs)

    honest = Honest()
    protectable_array("h", honest)[2] = 9.0
    assert honest.data[2] == 9.0


def test_a_tensor_subclass_without_storage_of_its_own_is_refused():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")

    class Wrapper(torch.Tensor):  # as DTensor is: a wrapper subclass around another tensor
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda t: t.inner if isinstance(t, Wrapper) else t  # noqa: E731
            return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    refused = r"protect\('w'\): the Wrapper(( has no memory of its own)|('s DLPack export is not its own memory))"
    with pytest.raises(ConfigError, match=refused):
        protectable_array("w", Wrapper(torch.ones(3)))


def test_a_tensor_whose_storage_is_replaced_after_protect_is_named():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    from hpcckpt.ckpt.foreign_arrays import protectable

    layer = torch.nn.Linear(3, 2)
    kept = protectable("layer.weight", layer.weight)
    assert kept.witness.moved("layer.weight") is None
    layer.weight.data = torch.zeros(2, 3)
    said = kept.witness.moved("layer.weight")
    assert said.startswith("protect('layer.weight'): the Parameter no longer computes on the memory hpcckpt protects "
                           "(its storage was replaced since protect(), at another address"), said
    layer.weight.data = torch.zeros(4, 3)
    assert "shape (2, 3) -> (4, 3)" in kept.witness.moved("layer.weight")


@pytest.mark.parametrize("length, parts", [(0, 3), (1, 4), (5, 4), (10, 4), (11, 3), (7, 7), (3, 5)])
def test_a_dtensor_shard_is_placed_by_torch_chunks_rule(length, parts):
    """Each rank's piece of a dimension cut over `parts` ranks: the piece torch.chunk gives it
    (none past the last chunk), at the place the pieces before it end."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch==2.13.0)")
    from torch.distributed.tensor import Shard

    from hpcckpt.ckpt.dtensors import local_shape_and_offset

    chunks = list(torch.arange(length).chunk(parts)) if length else []
    for rank in range(parts):
        shape, offset = local_shape_and_offset((length, 2), (parts,), (rank,), [Shard(0)])
        piece = chunks[rank] if rank < len(chunks) else torch.arange(0)
        assert shape == (len(piece), 2)
        if len(piece):
            assert offset == (int(piece[0]), 0)
