"""The ranks of one job, found from outside it: for scripts that kill a rank as a crash does
(perf/kill_in_job.py, perf/bench_goodput.py, tests/fault_campaign.py). Each job is started
with a tag in its environment, which every rank inherits."""

from __future__ import annotations

from pathlib import Path

# The rank as the launcher tells it: MPICH's Hydra, Open MPI's prterun.
RANK_VARIABLES = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK")


def tagged_ranks(variable: str, tag: str, name_contains: str | None = None) -> dict[int, int]:
    """rank -> pid of the live processes whose environment has `variable`=`tag` and a rank;
    `name_contains`: only those whose process name (/proc/PID/status) holds it, where the
    launcher's own helpers carry the same environment."""
    wanted = f"{variable}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            status = (entry / "status").read_text() if name_contains is not None else ""
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if wanted not in environ:
            continue
        values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        rank = next((values[key] for key in RANK_VARIABLES if key in values), None)
        if rank is None or (name_contains is not None and name_contains not in status.split("\n", 1)[0]):
            continue
        found[int(rank)] = int(entry.name)
    return found
