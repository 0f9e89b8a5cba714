"""Arrays of other frameworks, protected as they are: a NumPy or CuPy view of their memory.

protect() keeps an array and restores it in place, so what it keeps must share memory with
what the application computes on and must be writable. NumPy and CuPy arrays are kept as
they are. Anything else that speaks DLPack (a PyTorch tensor on the CPU or a CUDA GPU) or
the buffer protocol (bytearray, array.array, a writable memoryview) is seen through a view:
np.from_dlpack / cupy.from_dlpack / memoryview, no copy, so a restart writes into the
framework's own storage. A PyTorch parameter that requires grad is viewed through detach(),
which shares its storage. A PyTorch DTensor is protected as what it is, this rank's local
shard at its place in the global tensor (ckpt/dtensors.py).

A view is only worth keeping if it IS the object's memory. A wrapper that exports a buffer of
its own through DLPack (a DTensor hands out a fresh, uninitialised array of the global shape
on every call) would be saved as garbage and restored into an orphan: every exporter is
checked against the other ways it tells where its memory is (a tensor's data_ptr(), the
array interfaces, a second export), and refused where they disagree. The tensors keep being
watched: one whose storage the application replaced after protect() (param.data = ...,
model.to(...)) fails the next checkpoint or restore naming it (MemoryWitness).

What cannot be written in place (a read-only buffer, an immutable JAX array, a dtype NumPy
lacks such as bfloat16, a DTensor holding partial sums) is refused with what to do instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hpcckpt.errors import ConfigError

_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory)
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


@dataclass(frozen=True)
class Geometry:
    """Where a protected array lies among the ranks, when the object itself says so (a
    DTensor's placements) rather than protect()'s arguments: replicated, or a block of
    `global_shape` at `offset`. `copy_group`: the block is held whole by several ranks (a
    DTensor replicated over some mesh dimensions and sharded over others); only the group's
    `copy_owner` stores it, and a restore hands it to the others (ckpt/replicas.py)."""

    replicated: bool
    global_shape: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None
    copy_group: int | None = None  # ranks with the same value hold the same block
    copy_owner: bool = True
    copy_arrangement: tuple = ()  # how ranks fall into copy groups: the same for one mesh and placements


@dataclass(frozen=True)
class MemoryWitness:
    """Whether the application's object still computes on the memory protect() keeps:
    `current()` says (data pointer, shape) now; a change means the object's storage was
    replaced, and the kept view would save stale bytes and restore into an orphan."""

    what: str
    pointer: int
    shape: tuple[int, ...]
    current: Callable[[], tuple[int, tuple[int, ...]]]

    def moved(self, name: str) -> str | None:
        try:
            pointer, shape = self.current()
        except Exception as exc:  # a storage freed or made unreachable counts as moved
            return f"protect({name!r}): the {self.what}'s memory can no longer be reached ({exc})"
        if (pointer, tuple(shape)) == (self.pointer, self.shape):
            return None
        change = f"shape {self.shape} -> {tuple(shape)}" if tuple(shape) != self.shape else "at another address"
        return (f"protect({name!r}): the {self.what} no longer computes on the memory hpcckpt protects (its storage was "
                f"replaced since protect(), {change}: e.g. param.data = ..., model.to(...), an optimizer state "
                "created anew); saving it would keep stale "
                "bytes and a restore would not reach the application. Protect arrays once the model is built, placed "
                "and its optimizer state exists, and update them in place")


@dataclass(frozen=True)
class Protectable:
    """What protect() keeps of what it was handed: the view a snapshot copies and a restore
    writes (`array`), the geometry the object itself gives (None: protect()'s arguments
    decide), what watches its memory, and the whole local array a copy of a block receives
    at a restore (`copy_target`, with Geometry.copy_group)."""

    array: object
    geometry: Geometry | None = None
    witness: MemoryWitness | None = None
    copy_target: object = None


def protectable_array(name: str, array):
    """A NumPy or CuPy array sharing `array`'s memory, writable in place; ConfigError naming
    the problem otherwise."""
    return protectable(name, array).array


def protectable(name: str, array) -> Protectable:
    """What to keep of `array` (see the module's docstring); ConfigError naming the problem."""
    if isinstance(array, np.ndarray):
        return Protectable(_writable(name, array, "a read-only NumPy array"))
    if _is_cupy(array):
        return Protectable(array)
    kind = type(array).__module__.split(".")[0]
    if kind in ("jax", "jaxlib"):
        raise ConfigError(f"protect({name!r}): a JAX array is immutable and cannot be restored in place; protect a "
                          "NumPy copy (np.array(x)) and build the jax.Array from it after restart()")
    if _is_torch_tensor(array):
        from hpcckpt.ckpt.dtensors import is_dtensor, protectable_dtensor

        if is_dtensor(array):
            return protectable_dtensor(name, array)
        return protectable_tensor(name, array)
    if hasattr(array, "to_local") or hasattr(array, "full_tensor"):
        raise ConfigError(f"protect({name!r}): the {type(array).__name__} wraps a shard of a distributed tensor, and "
                          "what it exports is not this rank's memory; protect its local shard (to_local()) with "
                          "global_shape and this rank's offset")
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
        view = _from_dlpack(name, array)
        _check_exported_memory(name, array, view)
        return Protectable(view)
    try:
        view = memoryview(array)
    except TypeError:
        raise ConfigError(f"protect({name!r}): expected a NumPy or CuPy array, or an array that speaks DLPack or "
                          f"the buffer protocol (a PyTorch tensor, a bytearray), got {type(array).__name__}") from None
    if view.readonly:
        raise ConfigError(f"protect({name!r}): the {type(array).__name__} is read-only and cannot be restored in "
                          "place; protect a writable array (a NumPy copy, a bytearray)")
    return Protectable(np.asarray(view))


def protectable_tensor(name: str, tensor, what: str | None = None) -> Protectable:
    """A plain PyTorch tensor (or parameter): a view of its own storage, checked to be it."""
    what = what or type(tensor).__name__
    source = tensor.detach() if getattr(tensor, "requires_grad", False) else tensor  # a parameter: same storage
    view = _from_dlpack(name, source, what)
    try:
        pointer = int(tensor.data_ptr())
    except Exception as exc:  # a wrapper subclass (no storage of its own)
        raise ConfigError(f"protect({name!r}): the {what} has no memory of its own to restore into ({exc}): it wraps "
                          "other tensors, and what it exports through DLPack is a buffer of its own; protect the "
                          "tensor that holds the data") from None
    if view.size and pointer != data_pointer(view):
        raise ConfigError(f"protect({name!r}): the {what}'s DLPack export is not its own memory (a tensor subclass "
                          "that exports another buffer): what hpcckpt saved would not be what the application computes "
                          "on; protect the tensor that holds the data")
    shape = tuple(tensor.shape)
    return Protectable(view, witness=MemoryWitness(what, pointer, shape,
                                                   lambda: (int(tensor.data_ptr()), tuple(tensor.shape))))


def data_pointer(view) -> int:
    """The address of a NumPy or CuPy array's first element."""
    if isinstance(view, np.ndarray):
        return int(view.__array_interface__["data"][0])
    return int(view.data.ptr)


def _check_exported_memory(name: str, array, view) -> None:
    """An exporter other than PyTorch: its DLPack view must be the memory it reports by any
    other means, and the same on a second export (a wrapper hands out a new buffer each time)."""
    if not view.size:
        return
    pointer = data_pointer(view)
    reported = []
    for attribute in ("__array_interface__", "__cuda_array_interface__"):
        interface = getattr(array, attribute, None)
        if isinstance(interface, dict) and interface.get("data"):
            reported.append(int(interface["data"][0]))
    if callable(getattr(array, "data_ptr", None)):
        try:
            reported.append(int(array.data_ptr()))
        except Exception:
            reported.append(0)
    again = data_pointer(_from_dlpack(name, array))
    if again != pointer or any(p != pointer for p in reported):
        raise ConfigError(f"protect({name!r}): the {type(array).__name__}'s DLPack export is not its own memory (it "
                          f"exported {pointer:#x}, then {again:#x}"
                          + (f", and reports {', '.join(f'{p:#x}' for p in reported)}" if reported else "")
                          + "): what hpcckpt saved would be a buffer the application never sees, and a restore would "
                          "write into an orphan. Protect the array that holds the data (for a sharded tensor: its "
                          "local shard with global_shape and offset)")


def _from_dlpack(name: str, array, what: str | None = None):
    what = what or type(array).__name__
    if getattr(array, "requires_grad", False) and hasattr(array, "detach"):
        array = array.detach()  # a PyTorch parameter: the same storage, without autograd
    device_type, _ = array.__dlpack_device__()
    device_type = int(device_type)
    try:
        if device_type in _DLPACK_CPU:
            view = np.from_dlpack(array)
        elif device_type in _DLPACK_CUDA:
            try:
                import cupy
            except ImportError:
                raise ConfigError(f"protect({name!r}): the {what} is on a GPU, and its memory is "
                                  "reached through CuPy, which is not installed: pip install cupy-cuda12x (or "
                                  "cupy-cuda13x, to match the CUDA of the node)") from None
            view = cupy.from_dlpack(array)
        else:
            raise ConfigError(f"protect({name!r}): the {what} lives on DLPack device type "
                              f"{device_type}, neither the host nor a CUDA GPU; move it to one of them")
    except (BufferError, TypeError, RuntimeError) as exc:
        hint = " (e.g. bfloat16: protect tensor.view(torch.int16), which shares its bytes)" \
            if "dtype" in str(exc).lower() else ""
        raise ConfigError(f"protect({name!r}): the {what} cannot be viewed as an array in place: "
                          f"{exc}{hint}") from None
    if isinstance(view, np.ndarray):
        return _writable(name, view, f"the {what}'s memory is read-only and")
    return view


def _writable(name: str, array: np.ndarray, what: str) -> np.ndarray:
    if not array.flags.writeable:
        raise ConfigError(f"protect({name!r}): {what} cannot be restored in place; protect a writable array")
    return array


def _is_cupy(array) -> bool:
    return type(array).__module__.startswith("cupy") and hasattr(array, "data") and hasattr(array, "shape")


def _is_torch_tensor(array) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)
