"""Arrays of other frameworks, protected as they are: a NumPy or CuPy view of their memory.

protect() keeps an array and restores it in place, so what it keeps must share memory with
what the application computes on and must be writable. NumPy and CuPy arrays are kept as
they are. Anything else that speaks DLPack (a PyTorch tensor on the CPU or a CUDA GPU) or
the buffer protocol (bytearray, array.array, a writable memoryview) is seen through a view:
np.from_dlpack / cupy.from_dlpack / memoryview, no copy, so a restart writes into the
framework's own storage. A PyTorch parameter that requires grad is viewed through detach(),
which shares its storage. What cannot be written in place (a read-only buffer, an immutable
JAX array, a dtype NumPy lacks such as bfloat16) is refused with what to do instead.
"""

from __future__ import annotations

import numpy as np

from hpcckpt.errors import ConfigError

_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory)
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def protectable_array(name: str, array):
    """A NumPy or CuPy array sharing `array`'s memory, writable in place; ConfigError naming
    the problem otherwise."""
    if isinstance(array, np.ndarray):
        return _writable(name, array, "a read-only NumPy array")
    if _is_cupy(array):
        return array
    kind = type(array).__module__.split(".")[0]
    if kind in ("jax", "jaxlib"):
        raise ConfigError(f"protect({name!r}): a JAX array is immutable and cannot be restored in place; protect a "
                          "NumPy copy (np.array(x)) and build the jax.Array from it after restart()")
    if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
        return _from_dlpack(name, array)
    try:
        view = memoryview(array)
    except TypeError:
        raise ConfigError(f"protect({name!r}): expected a NumPy or CuPy array, or an array that speaks DLPack or "
                          f"the buffer protocol (a PyTorch tensor, a bytearray), got {type(array).__name__}") from None
    if view.readonly:
        raise ConfigError(f"protect({name!r}): the {type(array).__name__} is read-only and cannot be restored in "
                          "place; protect a writable array (a NumPy copy, a bytearray)")
    return np.asarray(view)


def _from_dlpack(name: str, array):
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
                raise ConfigError(f"protect({name!r}): the {type(array).__name__} is on a GPU, and its memory is "
                                  "reached through CuPy, which is not installed: pip install cupy-cuda12x (or "
                                  "cupy-cuda13x, to match the CUDA of the node)") from None
            view = cupy.from_dlpack(array)
        else:
            raise ConfigError(f"protect({name!r}): the {type(array).__name__} lives on DLPack device type "
                              f"{device_type}, neither the host nor a CUDA GPU; move it to one of them")
    except (BufferError, TypeError, RuntimeError) as exc:
        hint = " (e.g. bfloat16: protect tensor.view(torch.int16), which shares its bytes)" \
            if "dtype" in str(exc).lower() else ""
        raise ConfigError(f"protect({name!r}): the {type(array).__name__} cannot be viewed as an array in place: "
                          f"{exc}{hint}") from None
    if isinstance(view, np.ndarray):
        return _writable(name, view, f"the {type(array).__name__}'s memory is read-only and")
    return view


def _writable(name: str, array: np.ndarray, what: str) -> np.ndarray:
    if not array.flags.writeable:
        raise ConfigError(f"protect({name!r}): {what} cannot be restored in place; protect a writable array")
    return array


def _is_cupy(array) -> bool:
    return type(array).__module__.startswith("cupy") and hasattr(array, "data") and hasattr(array, "shape")
