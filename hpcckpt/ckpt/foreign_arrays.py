"""Arrays of other frameworks, protected as they are: what protect() keeps of the object it is
handed (ckpt/array_views.py's views), and how it follows objects the application rebinds.

NumPy and CuPy arrays are kept as they are. Anything else that speaks DLPack (a PyTorch tensor)
or the buffer protocol (bytearray, array.array, a writable memoryview) is seen through a view,
no copy. A PyTorch DTensor is protected as what it is, this rank's local shard at its place in
the global tensor (ckpt/dtensors.py); a Heat DNDarray likewise, its local tensor at the offset
its split gives (ckpt/dndarrays.py).

Protection by reference: code that rebinds a name (W = W * s, a framework's out-of-place
operators) leaves an array protected by value behind, saved stale forever. protect() given a
getter (lambda: W), or a framework's array whose local memory the framework may swap itself (a
DNDarray's resplit_), follows the application's object: followed() says how to reach it, and
the registry reads it again at each capture and restore, where it is another object than the
one seen last (seen_as).

What cannot be written in place (a read-only buffer, an immutable JAX array, a dtype NumPy
lacks such as bfloat16, a DTensor holding partial sums) is refused with what to do instead.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hpcckpt.ckpt.array_views import (
    Protectable,
    check_exported_memory,
    is_cupy,
    is_torch_tensor,
    protectable_tensor,
    view_through_dlpack,
    writable,
)
from hpcckpt.ckpt.dndarrays import is_dndarray, protectable_dndarray
from hpcckpt.ckpt.dtensors import is_dtensor, protectable_dtensor
from hpcckpt.errors import ConfigError


def followed(obj) -> Callable[[], object] | None:
    """How to reach the application's current object at each capture and restore: a getter
    as it is, a framework's array that swaps its own local memory (a DNDarray) as itself;
    None for an array protected by value."""
    if is_dndarray(obj):
        return lambda: obj
    if callable(obj) and not hasattr(obj, "shape") and not hasattr(obj, "__dlpack__"):
        return obj
    return None


def seen_as(obj) -> tuple:
    """What tells, cheaply, that the object is the one a view was made from: the object, and
    a DNDarray's local tensor and split (which resplit_() and balance_() replace)."""
    if is_dndarray(obj):
        return (id(obj), id(obj.larray), obj.split, tuple(obj.gshape))
    return (id(obj),)


def protectable_array(name: str, array):
    """A NumPy or CuPy array sharing `array`'s memory, writable in place; ConfigError naming
    the problem otherwise."""
    return protectable(name, array).array


def protectable(name: str, array) -> Protectable:
    """What to keep of `array` (see the module's docstring); ConfigError naming the problem."""
    if isinstance(array, np.ndarray):
        return Protectable(writable(name, array, "a read-only NumPy array"))
    if is_cupy(array):
        return Protectable(array)
    kind = type(array).__module__.split(".")[0]
    if kind in ("jax", "jaxlib"):
        raise ConfigError(f"protect({name!r}): a JAX array is immutable and cannot be restored in place; protect a "
                          "NumPy copy (np.array(x)) and build the jax.Array from it after restart()")
    if is_dndarray(array):
        return protectable_dndarray(name, array)
    if is_torch_tensor(array):
        if is_dtensor(array):
            return protectable_dtensor(name, array)
        return protectable_tensor(name, array)
    if hasattr(array, "to_local") or hasattr(array, "full_tensor"):
        raise ConfigError(f"protect({name!r}): the {type(array).__name__} wraps a shard of a distributed tensor, and "
                          "what it exports is not this rank's memory; protect its local shard (to_local()) with "
                          "global_shape and this rank's offset")
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
        view = view_through_dlpack(name, array)
        check_exported_memory(name, array, view)
        return Protectable(view)
    try:
        view = memoryview(array)
    except TypeError:
        raise ConfigError(f"protect({name!r}): expected a NumPy or CuPy array, an array that speaks DLPack or the "
                          "buffer protocol (a PyTorch tensor, a bytearray), a Heat DNDarray, or a getter returning "
                          f"one of them (lambda: W), got {type(array).__name__}") from None
    if view.readonly:
        raise ConfigError(f"protect({name!r}): the {type(array).__name__} is read-only and cannot be restored in "
                          "place; protect a writable array (a NumPy copy, a bytearray)")
    return Protectable(np.asarray(view))


