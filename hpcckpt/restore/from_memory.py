"""Going on after ranks died in the job from the state the survivors hold in memory: no
version read, nothing done again but the step in flight.

Where everything protected is replicated (data-parallel weights and optimizer state), every
survivor holds the whole state, and ckpt/step_commits.py says of which finished step. The
survivors tell each other what they hold (one allgather): the step, or why they hold none (the
application does not call commit_step, a rank was caught between commit_step and due(), an
array that is not replicated or a keyed table, arrays protected now that differ from those
held). One reason on one rank, or survivors holding different steps (a commit's outcome
reaches every survivor alike, so only an application that calls due() out of step gets there),
and the restart reads a version as before. Otherwise each rank hashes the arrays it held
(xxh3_64) and one allreduce compares them: copies that differ (arrays changed outside
commit_step .. due()) send the restart to a version, said in the log, before anything is
copied. Then each survivor copies what it held into the arrays protected now (the same
objects, where the application kept them: no copy), and the registered state goes from rank
0 to all, as a version holds it, but for per-rank state, which each survivor takes from what
it held itself (ckpt/registered_state.py: onto fewer ranks through its reshard). Never wrong
in silence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hpcckpt.ckpt.replicas import differing, digest
from hpcckpt.format.rank_state import split_state


MEMORY = "memory"  # where each rank's state came from, in the restart record


@dataclass(frozen=True)
class FromMemory:
    step: int
    state: dict  # the registered state and the engine's, as frozen at due(step) on rank 0
    seconds: float
    rank_states: dict  # {this survivor's rank then: its own per-rank state then}
    world_size: int  # the job's ranks then


def offer(held, registry, world_size: int) -> tuple[int, str | None]:
    """What this rank can go on from onto `world_size` ranks: (its finished step, None), or
    (-1, why it cannot)."""
    if held is None:
        return -1, ("it holds no finished step (the application does not call commit_step each step, or this rank "
                    "was between commit_step and due() when the rank died)")
    if registry.tables:
        return -1, "keyed tables are protected (each rank holds only the rows whose id hashes to it)"
    if set(held.arrays) != set(registry.arrays):
        return -1, "the arrays protected now are not those it held"
    unshared = sorted(name for name, registered in registry.states.items()
                      if registered.per_rank and registered.reshard is None)
    if unshared and held.world_size != world_size:
        return -1, (f"state {unshared[0]!r} is per rank and has no reshard for {held.world_size} -> {world_size} "
                    "ranks")
    for name, protected in registry.arrays.items():
        array = held.arrays[name]
        if protected.per_rank or protected.block is not None or protected.copies is not None:
            return -1, f"array {name!r} is not replicated (each rank holds its own part)"
        if tuple(array.shape) != tuple(protected.array.shape) or array.dtype != protected.array.dtype:
            return -1, (f"array {name!r} is protected now as {protected.array.dtype}{list(protected.array.shape)}, "
                        f"held as {array.dtype}{list(array.shape)}")
    return held.step, None


def go_on_from_memory(comm, held, registry, log) -> FromMemory | None:
    """(all ranks of the survivors' communicator) The arrays protected now filled with the
    finished step the survivors hold, and that step's state; or None (said in the log), the
    arrays untouched, where the restart must read a version instead."""
    started = time.perf_counter()
    rank = comm.Get_rank()
    everyone = comm.allgather(offer(held, registry, comm.Get_size()))
    refusing = [(r, why) for r, (_, why) in enumerate(everyone) if why is not None]
    if refusing:
        first, why = refusing[0]
        others = f" (and {len(refusing) - 1} more rank(s))" if len(refusing) > 1 else ""
        log.info(f"the survivors read a version: rank {first}{others} cannot go on from memory: {why}",
                 console=True)
        return None
    steps = sorted({step for step, _ in everyone})
    if len(steps) > 1:
        log.warning(f"the survivors hold different steps ({', '.join(map(str, steps))}): due() was called out of step "
                    "on some rank; reading a version instead")
        return None
    kept = [(name, held.arrays[name]) for name in registry.arrays]
    differ = differing(comm, np.array([digest(array) for _, array in kept], dtype=np.uint64)) if kept else []
    if differ:
        names = ", ".join(repr(kept[i][0]) for i in differ[:4])
        log.warning(f"the survivors' copies of step {steps[0]} differ ({names}{' ...' if len(differ) > 4 else ''}): "
                    "the arrays were changed outside commit_step .. due(); reading a version instead")
        return None
    for name, array in kept:
        target = registry.arrays[name].array
        if array is not target:
            target[...] = array
    state = comm.bcast(held.state if rank == 0 else None, root=0)
    _, own = split_state(held.state, registry.per_rank_states)
    return FromMemory(steps[0], state, time.perf_counter() - started, {held.rank: own}, held.world_size)
