"""Spare ranks: started with the job, idle until ranks die, then in the dead ranks' places, so
the job goes on at its size (in the manner of Fenix's spare ranks: MPI_Comm_spawn after a
failure is not dependable in Open MPI 5, ranks started with the job are).

The job's ranks are split once: the first `workers` of COMM_WORLD run the application's main
on a communicator of their own (`work`), the last `spares` wait. Every one of them is a rank
of `whole`, a duplicate of COMM_WORLD that a recovery revokes and shrinks with the workers'
communicators; an idle spare waits on it (one receive from the workers' rank 0, tested every
IDLE_POLL_S: far below a percent of a core) and so learns of a recovery as the workers' other
communicators do, through the revoke. Between its tests it sleeps on a doorbell
(cluster/doorbell.py) that the workers ring as they revoke, so that it tests at once and joins
their shrink without making them wait out its polling interval. After the shrink every
survivor, worker or spare, calls `refill` with the same shrunk communicator and the same list
of the lost: each lost place (the worker's rank in `work`) goes to a live spare, in order, and
a new `work` is split off with each rank at its place; where places outnumber the spares the
rest are given up and the workers renumbered as a shrink does. A spare that dies is not
replaced: it is one of the lost.

At the end the workers' rank 0 releases every idle spare (`release`), which returns from
run_surviving with None.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from hpcckpt.cluster.collectives import POLL_S, test_all
from hpcckpt.cluster.doorbell import Doorbell
from hpcckpt.cluster.fault_tolerance import failures_handled, is_process_failure, note_idle_spares
from hpcckpt.cluster.mpi_gate import gated_call
from hpcckpt.errors import ConfigError

IDLE_POLL_S = 0.05
# Rung, a spare tests every POLL_S until the revoke has reached it (the workers ring right
# after revoking), for at most this long; a ring with no revoke behind it (a stray datagram)
# costs no more quick testing than that.
WOKEN_S = 2.0
RELEASE_TAG = 32101  # nothing else sends on `whole`


@dataclass(frozen=True)
class Refilled:
    """What one recovery did to the places: `lost_places` the workers' ranks (in the old
    `work`) that died, `filled` {place: the COMM_WORLD rank of the spare now in it}, `given_up` the
    places no spare was left for, `spares_lost` how many idle spares died, `origin` for each
    rank of the new `work` either ("worker", its old rank) or ("spare", its whole rank)."""

    places_before: int  # the workers' ranks before the recovery
    lost_places: tuple[int, ...]
    filled: dict
    given_up: tuple[int, ...]
    spares_lost: int
    origin: tuple[tuple[str, int], ...]


class SparePool:
    """(all ranks of `world`) Collective to construct."""

    def __init__(self, world, spares: int):
        from mpi4py import MPI

        size = world.Get_size()
        if spares < 0 or spares >= size:
            raise ConfigError(f"resilience.spares = {spares} but the job has {size} rank(s): give 0 to "
                              f"{size - 1} spares, so that at least one rank works (mpiexec -n counts the spares)")
        self.whole = world.Dup()
        self.whole.Set_errhandler(MPI.ERRORS_RETURN)
        workers = size - spares
        # The place of each rank of `whole` in `work`; None: an idle spare.
        self.place: list[int | None] = [rank if rank < workers else None for rank in range(size)]
        self.world_of = MPI.Group.Translate_ranks(self.whole.Get_group(), list(range(size)),
                                                  MPI.COMM_WORLD.Get_group())
        self.started_as_spares = frozenset(self.world_of[workers:])
        self.doorbell = Doorbell(self.whole, listening=self.is_spare, key=self.world_of[self.whole.Get_rank()])
        self._note_idle()
        self.work = self._split()

    def _note_idle(self) -> None:
        """The workers' failure detection leaves out every rank started as a spare that is not
        working, dead ones included: an idle spare's death is no reason to stop the work."""
        working = {self.world_of[rank] for rank, place in enumerate(self.place) if place is not None}
        note_idle_spares(self.started_as_spares - working)

    @property
    def is_spare(self) -> bool:
        return self.place[self.whole.Get_rank()] is None

    @property
    def idle_spares(self) -> int:
        return sum(1 for place in self.place if place is None)

    def communicators(self) -> list:
        """What a recovery revokes beside the workers' own: `whole`, where the spares wait."""
        return [self.whole]

    def wake_idle(self) -> None:
        """(a worker that has revoked `whole`) The idle spares told to test for the revoke now."""
        self.doorbell.ring(self.world_of[rank] for rank, place in enumerate(self.place) if place is None)

    def _split(self):
        me = self.whole.Get_rank()
        place = self.place[me]
        return self.whole.Split(0 if place is not None else 1, key=place if place is not None else me)

    def _leader(self) -> int:
        """The rank of `whole` in place 0, which releases the spares at the end."""
        return self.place.index(0)

    def wait_idle(self) -> bool:
        """(an idle spare) Until the workers release it at the end (False) or a recovery
        revokes `whole` or the workers' rank 0 dies (True: it joins the recovery)."""
        released = np.zeros(1, dtype=np.int32)
        request = gated_call(self.whole.Irecv, released, source=self._leader(), tag=RELEASE_TAG)
        self.doorbell.drain()  # rings of a recovery this spare has already joined
        woken_until = None
        while True:
            try:
                if test_all([request]):
                    return False
            except Exception as exc:
                if is_process_failure(exc):
                    return True
                raise
            if woken_until is not None and time.monotonic() < woken_until:
                time.sleep(POLL_S)
                continue
            if woken_until is not None:  # a stray ring, or the others' rings of this one
                self.doorbell.drain()
            woken_until = time.monotonic() + WOKEN_S if self.doorbell.wait(IDLE_POLL_S) else None

    def release(self) -> None:
        """(the workers' rank 0, at the end) Every idle spare returns from its wait. A spare
        that died idle is told to no one: it is past releasing, and the work is done."""
        if self.place[self.whole.Get_rank()] != 0:
            return
        done = np.ones(1, dtype=np.int32)
        for rank, place in enumerate(self.place):
            if place is None:
                request = gated_call(self.whole.Isend, done, dest=rank, tag=RELEASE_TAG)
                self.doorbell.ring([self.world_of[rank]])
                try:
                    while not test_all([request]):
                        time.sleep(IDLE_POLL_S / 10)
                except Exception as exc:
                    if not is_process_failure(exc):
                        raise
                    print(f"hpcckpt: spare rank {self.world_of[rank]} had died while idle", file=sys.stderr,
                          flush=True)

    def refill(self, survivors) -> Refilled:
        """(every survivor of `whole`, after its shrink: `survivors` from
        cluster/fault_tolerance.shrink) The lost places filled by live spares, the new `whole`
        and `work`."""
        old_place = self.place
        lost_places = sorted(old_place[r] for r in survivors.lost if old_place[r] is not None)
        spares_lost = sum(1 for r in survivors.lost if old_place[r] is None)
        live_spares = [r for r in survivors.kept if old_place[r] is None]
        filled = dict(zip(lost_places, live_spares))
        given_up = tuple(lost_places[len(filled):])
        filling = {spare: place for place, spare in filled.items()}
        # Each survivor's place before the workers are renumbered over the places given up.
        places = [old_place[old] if old_place[old] is not None else filling.get(old) for old in survivors.kept]
        ordered = sorted(place for place in places if place is not None)
        renumbered = {place: rank for rank, place in enumerate(ordered)}
        self.place = [renumbered[place] if place is not None else None for place in places]
        origin_of = {}
        for old, place in zip(survivors.kept, places):
            if place is not None:
                origin_of[renumbered[place]] = ("worker", old_place[old]) if old_place[old] is not None \
                    else ("spare", old)
        filled_by_world_rank = {place: self.world_of[spare] for place, spare in filled.items()}
        self.whole = survivors.comm
        self.world_of = [self.world_of[old] for old in survivors.kept]
        if not self.is_spare:  # no longer waits to be woken
            self.doorbell.close()
        self._note_idle()
        # The shrink counted the failures known with the idle spares of before: a spare that
        # worked and died since is left out now, and would hide the next death.
        failures_handled()
        self.work = self._split()
        return Refilled(sum(1 for place in old_place if place is not None), tuple(lost_places), filled_by_world_rank,
                        given_up, spares_lost, tuple(origin_of[rank] for rank in range(len(ordered))))

    def offering_rank(self, refilled: Refilled) -> int:
        """The rank of `whole` of the first place held by a rank that was working before this
        refill (it knows what the abandoned checkpointers offered); 0 where none is left."""
        for place, (kind, _) in enumerate(refilled.origin):
            if kind == "worker":
                return self.place.index(place)
        return 0

    def took_place_now(self, refilled: Refilled) -> bool:
        """This rank was an idle spare and took a place in this refill."""
        place = self.place[self.whole.Get_rank()]
        return place is not None and refilled.origin[place][0] == "spare"
