"""The machine a result was measured on, described once and recorded with every result: a
figure means little without the cores, memory, disk and software it ran on, and these
benchmarks run on shared machines whose load is part of the reading."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

GIB = 1 << 30


def mem_total() -> int:
    """MemTotal of /proc/meminfo in bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _block_device(device: str) -> dict:
    """Model and rotational flag of the disk behind a /dev/<name> (its partition's parent
    where it is a partition), as sysfs tells them."""
    name = os.path.basename(os.path.realpath(device))
    node = Path("/sys/class/block") / name
    if not node.exists():
        return {}
    found = {}
    for where in (node, node.resolve().parent):
        rotational = where / "queue" / "rotational"
        if rotational.exists() and "rotational" not in found:
            found["rotational"] = rotational.read_text().strip() == "1"
        model = where / "device" / "model"
        if model.exists() and "model" not in found:
            found["model"] = model.read_text().strip()
    return found


def disk(directory: str | os.PathLike) -> dict:
    """The file system `directory` is on: its device, type, size and free space."""
    path = os.path.realpath(directory)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                source, mount, fstype = line.split()[:3]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
                    best = (mount, source, fstype)
    except OSError:
        pass
    out = {"dir": str(directory), "mount": best[0] or None, "device": best[1], "fs": best[2]}
    try:
        usage = shutil.disk_usage(path)
        out.update(size_gib=round(usage.total / GIB, 1), free_gib=round(usage.free / GIB, 1))
    except OSError:
        pass
    if best[1].startswith("/dev/"):
        out.update(_block_device(best[1]))
    return out


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _static(mpiexec: str | None, directory: str) -> dict:
    label = None
    try:
        from hpcckpt.cluster.launcher import find_mpiexec, find_ulfm_prefix, mpiexec_flags

        if mpiexec == "ulfm":  # harness/launch.py's ULFM
            prefix = find_ulfm_prefix()
            mpiexec = str(prefix / "bin" / "mpiexec") if prefix is not None else None
        _, label = mpiexec_flags(find_mpiexec(mpiexec))
    except OSError:
        pass
    # Versions from the installed distributions, not imports: importing NumPy here would size
    # its thread pools before a benchmark pins them, and importing torch costs seconds.
    return {"host": platform.node(), "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "cpu_model": _cpu_model(), "mem_gib": round(mem_total() / GIB, 1), "disk": disk(directory),
            "kernel": platform.release(), "python": platform.python_version(), "numpy": _version("numpy"),
            "mpi4py": _version("mpi4py"), "mpiexec": label, "h5py": _version("h5py"), "torch": _version("torch")}


def machine(mpiexec: str | None = None, directory: str | os.PathLike | None = None, **extra) -> dict:
    """This machine: host, CPUs (count, usable by this process, model), memory, the disk under
    `directory` (default the temp dir, where the benchmarks' run directories go), kernel,
    Python, NumPy, mpi4py, h5py and torch versions, the MPI that `mpiexec` runs, plus `extra`;
    the date and the load average now. The fixed part is read once per process."""
    out = dict(_static(mpiexec, str(directory or tempfile.gettempdir())))
    out.update(extra)
    out["date"] = time.strftime("%Y-%m-%d %H:%M")
    out["loadavg_start"] = round(os.getloadavg()[0], 2)
    return out


def describe(m: dict) -> str:
    """One line for a benchmark's output."""
    d = m.get("disk") or {}
    where = f"{d.get('fs', '?')} on {d.get('device', '?')}" + (f" ({d['model']})" if d.get("model") else "")
    software = ", ".join(f"{name} {m[key]}" for key, name in (("python", "Python"), ("numpy", "NumPy"),
                                                                ("h5py", "h5py"), ("torch", "torch"))
                         if m.get(key))
    return (f"{m['host']}, {m['cpus']} CPUs ({m['cpu_model']}), {m['mem_gib']} GiB, disk {where} under "
            f"{d.get('dir')}, mpiexec {m.get('mpiexec') or '(none found)'}, {software}; load average "
            f"{m['loadavg_start']:.2f}, {m['date']}")


def print_machine(m: dict) -> None:
    print(f"machine: {describe(m)}", flush=True)
