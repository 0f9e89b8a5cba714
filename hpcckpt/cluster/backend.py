"""Array backend: CuPy when a GPU is present and allowed, else NumPy; one code path."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from hpcckpt.errors import ConfigError


@dataclass(frozen=True)
class Backend:
    xp: ModuleType
    name: str  # "cpu" or "gpu"

    @property
    def is_gpu(self) -> bool:
        return self.name == "gpu"

    def to_host(self, array) -> np.ndarray:
        if self.is_gpu:
            return self.xp.asnumpy(array)
        return np.asarray(array)

    def from_host(self, array: np.ndarray):
        return self.xp.asarray(array)

    def synchronize(self) -> None:
        if self.is_gpu:
            self.xp.cuda.Device().synchronize()


def gpu_available() -> bool:
    try:
        import cupy
    except Exception:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def select_backend(device: str = "auto", local_rank: int = 0) -> Backend:
    """Pick NumPy or CuPy for `device` in {"auto", "gpu", "cpu"}.

    On a node with several GPUs, ranks take devices round-robin by node-local rank.
    """
    if device == "cpu":
        return Backend(np, "cpu")
    if device not in ("auto", "gpu"):
        raise ConfigError(f"run.device = {device!r}: allowed are 'auto', 'gpu', 'cpu'")
    if gpu_available():
        import cupy

        cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount()).use()
        return Backend(cupy, "gpu")
    if device == "gpu":
        raise ConfigError("run.device = 'gpu' but no usable GPU/CuPy was found; use 'auto' or 'cpu'")
    return Backend(np, "cpu")


def array_module(array) -> ModuleType:
    """NumPy or CuPy, whichever owns `array`."""
    if type(array).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def pinned_empty(shape, dtype) -> np.ndarray:
    """A NumPy array in page-locked host memory: device-to-host copies into it run
    asynchronously at full PCIe speed (into pageable memory they are staged and synchronous),
    and a non-CUDA-aware MPI can send from it."""
    import cupy

    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = cupy.cuda.alloc_pinned_memory(max(1, count * dtype.itemsize))
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)
