"""A NumPy or CuPy view of another framework's array memory, and what watches it.

protect() keeps an array and restores it in place, so what it keeps must share memory with
what the application computes on and must be writable. Anything that speaks DLPack (a PyTorch
tensor on the CPU or a CUDA GPU) is seen through np.from_dlpack / cupy.from_dlpack, no copy,
so a restart writes into the framework's own storage; a PyTorch parameter that requires grad
through detach(), which shares its storage.

A view is only worth keeping if it IS the object's memory. A wrapper that exports a buffer of
its own through DLPack (a DTensor hands out a fresh, uninitialised array of the global shape
on every call) would be saved as garbage and restored into an orphan: every exporter is
checked against the other ways it tells where its memory is (a tensor's data_ptr(), the
array interfaces, a second export), and refused where they disagree. The tensors keep being
watched: one whose storage the application replaced after protect() (param.data = ...,
model.to(...)) fails the next checkpoint or restore naming it (MemoryWitness).
"""

from __future__ import annotations

import sys
import weakref
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
    owner: object = None  # a weak reference to the application's tensor: dead once the application dropped it

    @property
    def dropped(self) -> bool:
        """The application no longer holds the tensor (only the storage the view keeps is left)."""
        return self.owner is not None and self.owner() is None

    def moved(self, name: str) -> str | None:
        if self.dropped:
            return None  # not moved but left behind: ProtectedArrays.check_still_held says so
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


def protectable_tensor(name: str, tensor, what: str | None = None) -> Protectable:
    """A plain PyTorch tensor (or parameter): a view of its own storage, checked to be it."""
    what = what or type(tensor).__name__
    source = tensor.detach() if getattr(tensor, "requires_grad", False) else tensor  # a parameter: same storage
    view = view_through_dlpack(name, source, what)
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
    # Weakly: the view keeps the storage alive, and a tensor the application dropped then dies.
    owner = weakref.ref(tensor)

    def current() -> tuple[int, tuple[int, ...]]:
        held = owner()
        if held is None:
            raise ReferenceError("the tensor was dropped by the application")
        return int(held.data_ptr()), tuple(held.shape)
    return Protectable(view, witness=MemoryWitness(what, pointer, shape, current, owner))


def data_pointer(view) -> int:
    """The address of a NumPy or CuPy array's first element."""
    if isinstance(view, np.ndarray):
        return int(view.__array_interface__["data"][0])
    return int(view.data.ptr)


def check_exported_memory(name: str, array, view) -> None:
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
    again = data_pointer(view_through_dlpack(name, array))
    if again != pointer or any(p != pointer for p in reported):
        raise ConfigError(f"protect({name!r}): the {type(array).__name__}'s DLPack export is not its own memory (it "
                          f"exported {pointer:#x}, then {again:#x}"
                          + (f", and reports {', '.join(f'{p:#x}' for p in reported)}" if reported else "")
                          + "): what hpcckpt saved would be a buffer the application never sees, and a restore would "
                          "write into an orphan. Protect the array that holds the data (for a sharded tensor: its "
                          "local shard with global_shape and offset)")


def view_through_dlpack(name: str, array, what: str | None = None):
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
        return writable(name, view, f"the {what}'s memory is read-only and")
    return view


def writable(name: str, array: np.ndarray, what: str) -> np.ndarray:
    if not array.flags.writeable:
        raise ConfigError(f"protect({name!r}): {what} cannot be restored in place; protect a writable array")
    return array


def is_cupy(array) -> bool:
    return type(array).__module__.startswith("cupy") and hasattr(array, "data") and hasattr(array, "shape")


def is_torch_tensor(array) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)
