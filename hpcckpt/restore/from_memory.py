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
from collections import Counter
from dataclasses import dataclass

import numpy as np

from hpcckpt.ckpt.replicas import differing, digest
from hpcckpt.cluster.backend import array_module
from hpcckpt.cluster.collectives import exchange, quiet_allgather, quiet_bcast
from hpcckpt.format.rank_state import split_state
from hpcckpt.levels.naming import LEVEL_LABELS


MEMORY = "memory"  # where each rank's state came from, in the restart record
SOURCE_LABELS = {MEMORY: "memory", **LEVEL_LABELS}  # where a restored shard came from, in the log


def counted_by_source(sources, unit: str = "") -> str:
    """How many shards came from each source, nearest first: "3 rank(s) from memory, 1 rank(s)
    from L2 partner" (`unit` "rank(s)")."""
    counts = Counter(sources)
    each = f" {unit}" if unit else ""
    return ", ".join(f"{counts[source]}{each} from {label}" for source, label in SOURCE_LABELS.items()
                     if counts[source])


@dataclass(frozen=True)
class FromMemory:
    step: int
    state: dict  # the registered state and the engine's, as frozen at due(step) on rank 0
    seconds: float
    rank_states: dict  # {this survivor's rank then: its own per-rank state then}
    world_size: int  # the job's ranks then
    handed_to: int = 0  # spares in dead ranks' places that a survivor gave the step to


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


def go_on_from_memory(comm, held, registry, log, strike=None) -> FromMemory | None:
    """(all ranks of the survivors' communicator) The arrays protected now filled with the
    finished step the survivors hold, and that step's state; or None (said in the log), the
    arrays untouched, where the restart must read a version instead. `held` is FILLING on a
    spare in a dead rank's place: a survivor that holds the step sends it the arrays.
    `strike(step)`: fault injection as the hand-over to spares begins (faults.py)."""
    from hpcckpt.run.in_job_state import FILLING

    started = time.perf_counter()
    filling = held is FILLING
    everyone = quiet_allgather(comm, (FILLING_PLACE, None) if filling else offer(held, registry, comm.Get_size()))
    refusing = [(r, why) for r, (_, why) in enumerate(everyone) if why is not None]
    needy = [r for r, (step, _) in enumerate(everyone) if step == FILLING_PLACE]
    holders = [r for r in range(len(everyone)) if r not in needy]
    if not refusing and needy and registry.per_rank_states:
        refusing = [(needy[0], f"a spare took the place of a rank that died, and per-rank state "
                               f"{sorted(registry.per_rank_states)[0]!r} died with it")]
    if not refusing and not holders:
        refusing = [(0, "no survivor holds a finished step")]
    if refusing:
        first, why = refusing[0]
        others = f" (and {len(refusing) - 1} more rank(s))" if len(refusing) > 1 else ""
        log.info(f"the survivors read a version: rank {first}{others} cannot go on from memory: {why}",
                 console=True)
        return None
    steps = sorted({everyone[r][0] for r in holders})
    if len(steps) > 1:
        log.warning(f"the survivors hold different steps ({', '.join(map(str, steps))}): due() was called out of step "
                    "on some rank; reading a version instead")
        return None
    names = list(registry.arrays)
    digests = None if filling else np.array([digest(held.arrays[name]) for name in names], dtype=np.uint64)
    differ = differing(comm, digests, len(names)) if names else []
    if differ:
        listed = ", ".join(repr(names[i]) for i in differ[:4])
        log.warning(f"the survivors' copies of step {steps[0]} differ ({listed}{' ...' if len(differ) > 4 else ''}): "
                    "the arrays were changed outside commit_step .. due(); reading a version instead")
        return None
    if not filling:
        for name in names:
            array, target = held.arrays[name], registry.arrays[name].array
            if array is not target:
                target[...] = array
    if needy:
        if strike is not None:
            strike(steps[0])
        _hand_to_spares(comm, registry, holders, needy)
    root = holders[0]
    state = quiet_bcast(comm, held.state if comm.Get_rank() == root else None, root=root)
    seconds = time.perf_counter() - started
    if filling:
        return FromMemory(steps[0], state, seconds, {}, comm.Get_size(), len(needy))
    _, own = split_state(held.state, registry.per_rank_states)
    return FromMemory(steps[0], state, seconds, {held.rank: own}, held.world_size, len(needy))


FILLING_PLACE = -2  # what a spare in a dead rank's place offers: no step of its own


def _hand_to_spares(comm, registry, holders: list[int], needy: list[int]) -> None:
    """(all ranks) Each spare in a dead rank's place gets every protected array from a
    survivor (spares spread over the survivors: O(state) sent per survivor, not per spare),
    all arrays posted at once (MPI keeps one sender's messages of one tag in order), received
    straight into the arrays where their memory allows."""
    rank = comm.Get_rank()
    source_of = {spare: holders[i % len(holders)] for i, spare in enumerate(needy)}
    targets = [protected.array for protected in registry.arrays.values()]
    sends = [(spare, _host_bytes(target)) for spare, source in source_of.items() if source == rank
             for target in targets]
    landings = [(target, _landing(target)) for target in targets] if rank in source_of else []
    receives = [(source_of[rank], landing) for _, landing in landings]
    exchange(comm, sends, receives, HAND_OVER_TAG)
    for target, landing in landings:
        if not _lands_in_place(target):
            values = landing.view(target.dtype).reshape(target.shape)
            xp = array_module(target)
            target[...] = values if xp is np else xp.asarray(values)


def _lands_in_place(target) -> bool:
    return isinstance(target, np.ndarray) and target.flags.c_contiguous and target.flags.writeable


def _landing(target) -> np.ndarray:
    """Where a spare receives `target`'s bytes: its own memory where it is one contiguous
    NumPy buffer, else a buffer copied in afterwards (a GPU array, a strided view)."""
    if _lands_in_place(target):
        return target.reshape(-1).view(np.uint8)
    return np.empty(target.nbytes, dtype=np.uint8)


HAND_OVER_TAG = 32200


def _host_bytes(array) -> np.ndarray:
    xp = array_module(array)
    host = array if xp is np else xp.asnumpy(array)
    return np.ascontiguousarray(host).reshape(-1).view(np.uint8)
