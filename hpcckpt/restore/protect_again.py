"""After a version was loaded over another job's shards (another rank count or placement):
write it again under this job's geometry (behind the resumed run's first steps where MPI
allows threads: ckpt/resuming.py), so a second node loss right after a shrink is survived
once it is written, and clear the old job's node-local files."""

from __future__ import annotations

from typing import Callable

from hpcckpt.errors import CheckpointError


def protect_again(result, write: Callable[[tuple], None], clear_old_geometry: Callable[[Callable], None],
                  ledger, rank: int, log, where: str) -> None:
    """(all ranks) Write the restored version (`result`, restore/context.py's RestoreResult) to the levels
    it names, with the state and metrics it was saved with (`write(level names)`). L4 first,
    where it lacks the version: its files cannot collide with the old job's, so the version
    is durable there before the old job's node-local copies of it give way to the new ones
    (same names, never overwritten). Then the old job's older node-local versions go, if its
    rank count or placement was another (`clear_old_geometry(which steps)`). A failure here is
    a warning: the version is loaded, and the next checkpoint protects the run. `where`: this
    job's ranks and nodes, for the log."""
    step = result.step
    global_first = result.protect_globally
    node_local = tuple(name for name in result.protect_again if name not in global_first)
    # Written before the first step (`ledger` given), a crash while writing the version
    # loaded and verified is the storage's or a node's, not the version's, and must not get
    # it marked failed (run/ledger.py); the first steps are watched again afterwards. Behind
    # the steps no ledger is given: a crash then may be the steps', and counts as theirs.
    if ledger is not None and rank == 0:
        ledger.confirm()
    try:
        if global_first:
            write(global_first)
        clear_old_geometry(lambda s: s >= step)
        if node_local:
            write(node_local)
    except CheckpointError as exc:
        if log:
            log.warning(f"version {step} is restored but could not be written again under this job's levels: "
                        f"{exc}; the next checkpoint protects the run")
    else:
        if log:
            log.info(f"version {step} protected again on {', '.join(result.protect_again)} for {where}",
                     console=rank == 0)
        if result.geometry_changed:
            clear_old_geometry(lambda s: s < step)
    finally:
        if ledger is not None and rank == 0:
            ledger.begin(step)
