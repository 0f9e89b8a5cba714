"""Orphaned MPI shared-memory segments (cluster/shm_orphans.py): only files no process has
open or mapped are taken, and a rank killed under MPICH really leaves one behind."""

import os
import subprocess
import sys
import time

import pytest
from conftest import assert_ok, mpi_env, mpiexec_prefix

from hpcckpt.cluster.shm_orphans import SHM_DIR, find_orphans, remove_orphans

HOLDER = """
import mmap, os, sys, time
opened = os.open(sys.argv[1], os.O_RDWR)
mapping_fd = os.open(sys.argv[2], os.O_RDWR)
mapping = mmap.mmap(mapping_fd, 4096)
os.close(mapping_fd)  # kept only as a mapping, as MPICH's ranks keep their segment
print("ready", flush=True)
time.sleep(60)
"""


def test_only_segments_nobody_holds_are_orphans(tmp_path):
    for name in ("mpich_shm_open", "mpich_shm_mapped", "mpich_shm_orphan", "other_file"):
        (tmp_path / name).write_bytes(bytes(8192))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "mpich_shm_open"),
                               str(tmp_path / "mpich_shm_mapped")], stdout=subprocess.PIPE, text=True)
    link = tmp_path.parent / (tmp_path.name + "-link")  # /dev/shm is a link to /run/shm on some systems
    link.symlink_to(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "ready"
        found = find_orphans(tmp_path)
        assert [p.name for p in found.paths] == ["mpich_shm_orphan"] and found.nbytes == 8192
        assert [p.name for p in find_orphans(link).paths] == ["mpich_shm_orphan"]
        assert [p.name for p in remove_orphans(tmp_path).paths] == ["mpich_shm_orphan"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_mapped", "mpich_shm_open", "other_file"]
    finally:
        holder.kill()
        holder.wait()
    assert [p.name for p in find_orphans(tmp_path).paths] == ["mpich_shm_mapped", "mpich_shm_open"]


def test_newer_than_leaves_older_segments(tmp_path):
    old = tmp_path / "mpich_shm_old"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "mpich_shm_new").write_bytes(b"y")
    assert [p.name for p in find_orphans(tmp_path, newer_than=time.time() - 60).paths] == ["mpich_shm_new"]


KILLED_RANK = """
import os, signal, time
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.Get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(30)
"""


def test_a_killed_mpich_rank_leaves_a_segment_that_clean_shm_deletes(tmp_path):
    from mpi4py import MPI

    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("MPICH's segments only; this MPI is " + MPI.Get_library_version().splitlines()[0])
    started = time.time() - 1
    killed = subprocess.run([*mpiexec_prefix(), "-n", "2", sys.executable, "-c", KILLED_RANK],
                            env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert killed.returncode != 0
    leaked = find_orphans(newer_than=started).paths
    assert leaked, "no segment left in /dev/shm by the killed job"
    cleaned = subprocess.run([sys.executable, "-m", "hpcckpt", "clean-shm", "--newer-than", str(started)],
                             env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert_ok(cleaned)
    assert "deleted" in cleaned.stdout and all(str(p) in cleaned.stdout for p in leaked)
    assert not any(p.exists() for p in leaked)
    assert SHM_DIR.is_dir()
