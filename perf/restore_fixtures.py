"""What bench_rebuild.py and bench_restart.py share: the synthetic state they save and check,
and making the run directory cold before a timed restart (the machine description, the
launch and the baselines are in harness/).

Imported by those scripts only (they run as `python perf/<script>.py`, so this directory is
on sys.path); mpi4py is imported inside functions, as the scripts require.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from harness import quiet_barrier  # noqa: F401  (the scripts import it from here too)

MiB = 1 << 20


def proc_io() -> dict:
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            values[key.strip()] = int(value)
    return values


def state_shapes(size_mib: float, tensors: int, layout: str = "tall", min_rows: int = 1) -> list[tuple[int, int]]:
    """Equal 2-D float32 tensors, about square: "tall" (rows >= columns) is cut along axis 0 by
    hpcckpt's layout (its largest dimension, lowest on ties); "wide" transposes the shape so
    it is cut along axis 1 (pieces are stored axis-major: a transposing copy on both sides)."""
    elements = int(size_mib * MiB) // tensors // 4
    columns = 1 << max(0, (elements.bit_length() - 1) // 2)  # the power of two <= sqrt(elements)
    rows = elements // columns
    if rows < min_rows:
        raise SystemExit(f"--size-mib {size_mib} is too small for {tensors} tensors")
    if layout == "wide":
        rows, columns = max(1, columns // 2), rows * 2 if columns > 1 else rows  # columns > rows: cut along axis 1
    return [(rows, columns)] * tensors


def fill(arrays: list[np.ndarray]) -> None:
    """Deterministic, position-dependent contents (cheap: no RNG), the same on every rank."""
    for i, a in enumerate(arrays):
        bits = a.reshape(-1).view(np.uint32)
        np.multiply(np.arange(bits.size, dtype=np.uint32), np.uint32(2654435761), out=bits)
        bits += np.uint32(i * 7919 + 1)


def digests(arrays) -> list[str]:
    import xxhash

    return [xxhash.xxh3_64_hexdigest(memoryview(a.reshape(-1).view(np.uint8))) for a in arrays]


def evict(comm, method: str, run_dir) -> None:
    """(all ranks) Push every file of the run directory out of the page cache: fsync then
    posix_fadvise(DONTNEED) per file (no root needed, other jobs' cache left alone), or
    `sync; echo 3 > /proc/sys/vm/drop_caches` (root only)."""
    quiet_barrier(comm)
    if comm.Get_rank() == 0 and method != "none":
        if method == "drop_caches":
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        else:
            for root, _, files in os.walk(run_dir):
                for name in files:
                    try:
                        fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    except OSError:
                        continue
                    try:
                        os.fsync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
    quiet_barrier(comm)


def cold_method_works(method: str, probe_dir: Path) -> tuple[bool, str]:
    """Write and fsync 64 MiB, evict it, read it back: did the block layer read it? Returns
    (works, why) for the report."""
    if method == "none":
        return False, "cold runs disabled (--cold-method none)"
    path = Path(probe_dir) / "probe.bin"
    try:
        with open(path, "wb") as f:
            f.write(os.urandom(MiB) * 64)
            f.flush()
            os.fsync(f.fileno())
        if method == "drop_caches":
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        else:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        before = proc_io()["read_bytes"]
        with open(path, "rb") as f:
            while f.read(8 * MiB):
                pass
        read = proc_io()["read_bytes"] - before
    except OSError as exc:
        return False, f"{method} failed ({exc}): warm page cache only"
    finally:
        path.unlink(missing_ok=True)
    if read < 48 * MiB:
        return False, f"{method} did not evict (read {read / MiB:.0f} of 64 MiB from disk): warm page cache only"
    return True, f"cold page cache ({method} before each restart; probe read {read / MiB:.0f} of 64 MiB from disk)"
