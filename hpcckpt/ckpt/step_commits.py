"""Which finished step the protected state in this process's memory is: what the survivors of
a rank's death go on from without reading a version (restore/from_memory.py).

The application's promise, made by calling commit_step(step) at all: it changes the protected
arrays in place only between commit_step(step) and due(step). commit_step is a fault-tolerant
agreement (ULFM's MPI_Comm_agree, whose outcome is the same on every survivor even when a rank
dies during it): after a death, either every survivor passed it for a step or none did. So a
survivor that called due(step) holds the arrays of that finished step; the registered state
(data position, RNG), which moves during a step, is frozen at due(). A rank caught between
commit_step and due() holds arrays it may have half changed, and says so; so does a step that
due() closed without a commit, or any restore or rewind since the last due().

The agreement's outcome is a bitwise AND, and each rank contributes a flag with bit 0 set:
COMMITTING where it finished its collectives, RECOVERING (bit 1 clear) where it entered the
recovery. Open MPI 5's MPIX_Comm_agree, while another thread of the process is inside MPI,
now and then returns 0 (or worse) with no rank dead and none recovering, not always on every
rank alike (perf/agree_beside_threads.py); the agreement is therefore run through
cluster/mpi_gate.py, which keeps the library's threads out of MPI meanwhile. Should an outcome
with bit 0 clear, no AND of what the ranks gave, come all the same, it is taken for a failure
(agreeing again would leave the ranks that got it waiting for those that went on) and said as
what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMITTING = 0b11  # this rank finished the step's collectives
RECOVERING = 0b01  # this rank entered the recovery: bit 1 cleared ends the others' round


@dataclass(frozen=True)
class HeldStep:
    """The state of a finished step, as this process holds it."""

    step: int
    arrays: dict  # name -> the application's array (not a copy)
    state: dict  # the registered state and the engine's, frozen at due(step)
    rank: int = 0  # this process's rank then, and the job's ranks (its per-rank state's owner)
    world_size: int = 1


class StepCommits:
    """One per Checkpointer: the steps committed and finished on this rank."""

    def __init__(self):
        self.in_use = False  # the application calls commit_step
        self.committing: int | None = None  # commit_step(step) passed, due(step) not yet called
        self.finished: HeldStep | None = None
        self.took_part = False  # this rank met the other survivors in the agreement of this round
        # What this checkpointer's restart took from the one a recovery abandoned (a HeldStep,
        # or in_job_state.FILLING on a spare in a dead rank's place), until the next commit
        # or a load: a death before then (in the hand-over to a spare, or among survivors that
        # finished the restart before the others) offers it again, since the arrays are
        # changed only after commit_step.
        self.restarting_from = None

    def commit(self, step: int, agree, on_unsound=None) -> None:
        """`agree(flag)`: the fault-tolerant agreement over the job's ranks, the AND of every
        live rank's flag; raises where a rank died. Agreed RECOVERING (a survivor met it from
        its recovery: join_recovery), the step is not committed anywhere and a process failure
        is raised here: this rank recovers too. An outcome no flag explains (bit 0 clear) is
        raised the same way, after `on_unsound(outcome)` is told."""
        self.in_use = True
        self.took_part = False
        self.restarting_from = None
        try:
            agreed = agree(COMMITTING)  # raising here, nobody changed anything: the step finished before is held
        except BaseException:
            self.took_part = True
            raise
        if agreed != COMMITTING:
            self.took_part = True
            if not agreed & 1 and on_unsound is not None:
                on_unsound(agreed)
            _raise_process_failure()
        self.committing = step  # until due(step) the arrays change

    def join_recovery(self, agree) -> None:
        """(a survivor entering the recovery) The agreement is immune to a revoke: survivors
        that finished the step before the death was reported to them wait in the next
        commit_step's agreement for every live rank, while this one would wait in the shrink
        for them. Meeting them there with RECOVERING ends their round (their commit fails,
        and they recover too); survivors that also recover meet each other. Once per round: a rank
        whose own commit failed took part already."""
        if not self.in_use or self.took_part:
            return
        self.took_part = True
        try:
            agree(RECOVERING)
        except Exception:  # a death in the round too: the round is over all the same
            pass

    def step_done(self, step: int, registry, frozen_state, rank: int = 0, world_size: int = 1) -> None:
        """due(step) was called: the arrays are those of `step` if it was committed;
        `frozen_state()` the registered and the engine's state now; `rank` of `world_size`
        this process's place in the job."""
        if not self.in_use:
            return
        committed, self.committing = self.committing, None
        if committed != step:
            self.finished = None  # arrays changed outside the promise, or the step numbers disagree
            return
        registry.refresh()  # arrays protected by reference: the objects the step finished on
        self.finished = HeldStep(step, {name: p.array for name, p in registry.arrays.items()}, frozen_state(), rank,
                                 world_size)

    def forget(self) -> None:
        """A restore or a rewind replaced the arrays: no step is held until the next due()."""
        self.committing = None
        self.finished = None
        self.restarting_from = None

    def held_arrays(self) -> dict:
        """The arrays of the finished step held, by name (the application's objects)."""
        return self.finished.arrays if self.finished is not None else {}

    def held(self) -> HeldStep | None:
        return self.finished if self.committing is None else None

    def offered(self):
        """What the next checkpointer of the run may go on from if this one is abandoned: what
        its restart went on from, until the next commit, else the step held."""
        return self.restarting_from if self.restarting_from is not None else self.held()


def _raise_process_failure():
    from mpi4py import MPI

    raise MPI.Exception(MPI.ERR_PROC_FAILED)
