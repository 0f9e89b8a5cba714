"""What several ranks hold alike: checked to be alike before it is saved once, and handed to
every holder at a restore.

A replicated array is stored once, sliced across the ranks, and restored onto every rank
from those slices: if the ranks' copies differed (a shard declared replicated, a rank that
drifted), the version would mix them and a restore would give every rank the same wrong
array, silently. So the first checkpoint of each process checks it: each rank hashes its
copy of every replicated array (xxh3_64), one allreduce of the digests and their
complements gives each array's largest and smallest digest, and an array whose two differ
is refused on every rank, naming it and which ranks hold which copy (gathered only then).
Registered state that is not per rank is stored once in the commit record and given to
every rank at a restore: it is checked the same way, by the digest of its encoding.
Blocks held whole by several ranks (a DTensor replicated over some mesh dimensions and
sharded over others) are checked the same way within each group of holders.

Such a block is stored by one rank of its group (BlockCopies.owner); after a restore the
owner's block goes to the others of its group with one broadcast per array on a
communicator of the group (split once per mesh arrangement, the same split on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from hpcckpt.cluster.collectives import quiet_any, wait_all
from hpcckpt.cluster.mpi_gate import gated_call
from hpcckpt.errors import ConfigError


@dataclass(frozen=True)
class BlockCopies:
    """This rank holds a block that the other ranks of `group` hold too; `owner` stores it;
    `target` is the whole local block, written at a restore. `arrangement` names how the
    ranks fall into groups (the same for every array of one mesh and placements, and on
    every rank), so the groups are split once for all of them."""

    group: int
    owner: bool
    target: object
    arrangement: tuple


def digest(array) -> int:
    """xxh3_64 of an array's bytes in C order (a CuPy array's, once copied to the host)."""
    if not isinstance(array, np.ndarray):
        array = array.get()
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def check_alike(comm, arrays: list[tuple[str, object]], what: str = "replicated") -> None:
    """(all ranks; the same names in the same order everywhere) Refuse, on every rank, the
    arrays whose copies differ between the ranks of `comm`: one allreduce when they agree."""
    problems = _differing_copies(comm, [(name, digest(array)) for name, array in arrays])
    if problems:
        raise ConfigError(
            f"protected as {what} but not the same on every rank that holds it: {problems}; a replicated array is "
            "stored once and restored onto every rank, so these would come back wrong. If each rank holds its own "
            "part of a larger array, protect it as a block (global_shape and offset; a DTensor itself rather than "
            "its to_local()), or with replicated=False if it belongs to its rank alone; if the ranks should agree, "
            "make them (broadcast the initial values) before the first checkpoint", collective=True)


def check_state_alike(comm, digests: list[tuple[str, int]]) -> None:
    """(all ranks; the same names in the same order everywhere) Refuse, on every rank, the
    registered states (name, digest of its encoding) that differ between the ranks of
    `comm`: a state not registered per rank is stored once and given to every rank."""
    problems = _differing_copies(comm, digests)
    if problems:
        raise ConfigError(
            f"registered state not the same on every rank: {problems}; state registered without per_rank=True is "
            "stored once and given back to every rank, so these would come back as one rank's. If it belongs to "
            "each rank (an RNG stream, a rank's data position), register it with register_state(name, get, set, "
            "per_rank=True); if the ranks should agree, make them before the first checkpoint", collective=True)


def _differing_copies(comm, digests: list[tuple[str, int]]) -> str:
    """(all ranks) '' when every named digest is the same on every rank; else which differ
    and which ranks hold which copy (gathered only then)."""
    if not digests:
        return ""
    mine = np.array([d for _, d in digests], dtype=np.uint64)
    differ = differing(comm, mine)
    if not differ:
        return ""
    everyone = comm.allgather([int(mine[i]) for i in differ])
    problems = []
    for position, index in enumerate(differ):
        holders: dict[int, list[int]] = {}
        for rank, held in enumerate(everyone):
            holders.setdefault(held[position], []).append(rank)
        groups = sorted(holders.values(), key=lambda ranks: (-len(ranks), ranks))
        problems.append(f"{digests[index][0]!r} (" + " vs ".join(f"ranks {_ranks(g)}" for g in groups) + ")")
    return ", ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")


def differing(comm, digests: np.ndarray | None, count: int = 0) -> list[int]:
    """(all ranks, a uint64 digest per array in the same order everywhere) The indices of the
    arrays whose digests are not the same on every rank of `comm`: one allreduce of the digests
    and their complements gives each one's largest and smallest. `digests` None: this rank
    holds none of the `count` arrays and takes no part in the comparison (zeros in both halves
    change no maximum)."""
    from mpi4py import MPI

    extremes = np.concatenate([digests, ~digests]) if digests is not None else np.zeros(2 * count, dtype=np.uint64)
    wait_all([gated_call(comm.Iallreduce, MPI.IN_PLACE, extremes, op=MPI.MAX)])
    half = len(extremes) // 2
    return np.flatnonzero(extremes[:half] != ~extremes[half:]).tolist()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


class CopyGroups:
    """The communicators of the groups of ranks that hold the same blocks, split from the
    checkpointer's communicator on first use, one per arrangement (every array of one mesh
    and placements shares it); freed with close()."""

    def __init__(self, comm):
        self.comm = comm
        self._split: dict[tuple, tuple[object, int]] = {}  # arrangement -> (communicator, owner's rank in it)

    def _of(self, copies: BlockCopies):
        from mpi4py import MPI

        arrangement = copies.arrangement
        if arrangement not in self._split:
            sub = self.comm.Split(copies.group, self.comm.Get_rank())
            owner = np.array([sub.Get_rank() if copies.owner else -1], dtype=np.int64)
            wait_all([sub.Iallreduce(MPI.IN_PLACE, owner, op=MPI.MAX)])
            self._split[arrangement] = (sub, int(owner[0]))
        return self._split[arrangement]

    def communicators(self) -> list:
        return [sub for sub, _ in self._split.values()]

    def check_alike(self, held: list[tuple[str, BlockCopies]]) -> None:
        """(all ranks) Every group's copies of each block the same, refused naming it otherwise."""
        by_arrangement: dict[tuple, list] = {}
        for name, copies in held:
            by_arrangement.setdefault(copies.arrangement, []).append((name, copies))
        failures = []
        for arrays in by_arrangement.values():
            sub, _ = self._of(arrays[0][1])
            try:
                check_alike(sub, [(name, copies.target) for name, copies in arrays], "a block several ranks hold")
            except ConfigError as exc:
                failures.append(str(exc))
        if quiet_any(self.comm, bool(failures)):
            raise ConfigError(failures[0] if failures else "a block several ranks hold differs between them on "
                              "another rank (its message names it)", collective=True)

    def share(self, held: list[tuple[str, BlockCopies]]) -> None:
        """(all ranks) After a restore: each block from the rank that stored it to the others
        of its group."""
        for _, copies in held:
            sub, owner = self._of(copies)
            target = copies.target
            host = target if isinstance(target, np.ndarray) and target.flags.c_contiguous else \
                np.ascontiguousarray(target if isinstance(target, np.ndarray) else target.get())
            wait_all([sub.Ibcast(host.view(np.uint8).reshape(-1), root=owner)])
            if host is not target:
                if isinstance(target, np.ndarray):
                    target[...] = host
                else:
                    target.set(host) if target.flags.c_contiguous else target.__setitem__(Ellipsis, host)

    def close(self) -> None:
        for sub, _ in self._split.values():
            sub.Free()
        self._split.clear()
