"""Going on inside the job when ranks die: the application's main entered again on the
survivors, with no relaunch (no launcher, MPI start, imports or run claim to pay again).

    def main(comm):
        ckpt = Checkpointer(comm, config)
        ...protect what comm's ranks hold...
        start = ckpt.restart() or 0              # after a failure: the newest version the
        ...the loop...                           # survivors can get, onto their rank count
        return ckpt.close()

    sys.exit(run_main(lambda: run_surviving(main)))

A rank's death reaches the survivors as an MPI error in whatever call touched it (main's
collectives on `comm` or the library's, its threads' included). Each survivor then abandons
the checkpointers main made (their communicators revoked, so nobody stays blocked in one;
their threads stopped; the version in flight dropped: its commit records never completed, so
no restore trusts it), the survivors shrink `comm` to themselves (cluster/fault_tolerance.py)
and main runs again on that communicator: its Checkpointer is built from it (topology,
partners, erasure groups, pipeline) and restart() loads the newest version every survivor can
get, as a relaunch onto fewer ranks would: the survivors' own shards, the lost ranks' from
their node's other ranks, their partners' copies or an erasure rebuild, or L4. Where
everything protected is replicated and main calls commit_step each step, restart() reads
nothing: the survivors go on from the finished step they hold in memory (each abandoned
checkpointer's held step is handed to the next one of its run, restore/from_memory.py).

Where the MPI cannot survive a dead rank (the mpich wheel; Open MPI without fault tolerance
on), or the error is not a process failure, it propagates as before and the job script's
relaunch is the second tier; a recovery step that overruns `timeout` ends the rank with the
relaunch exit code rather than hang.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, TypeVar

from hpcckpt.cluster.collectives import quiet_bcast
from hpcckpt.cluster.fault_tolerance import (RecoveryWatchdog, failure_reported, in_job_recovery_unavailable,
                                             is_process_failure, note_spares_at_start, revoke, shrink)
from hpcckpt.cluster.mpi_gate import fault_tolerant_agree
from hpcckpt.errors import ConfigError, HpcckptError
from hpcckpt.run.in_job_state import (FILLING, count_recovery, forget_held, held_runs, hold, open_checkpointers,
                                      recoveries_in_job, record as record_for_the_run, take_unrecorded)
from hpcckpt.run.spares import SparePool

T = TypeVar("T")

_application_comms: list = []  # what the application derived from its communicator


def revoke_on_failure(*comms) -> None:
    """(in main) Communicators main derived from the one it was given (a Cartesian grid, a
    split): revoked with it when ranks die, so that no survivor stays blocked in one waiting
    for a survivor that has gone on to recover. Forgotten after each recovery."""
    _application_comms.extend(comms)


_surviving = 0  # how many run_surviving calls are running main in this process


def close_waits_for_the_verdict(in_flight: BaseException | None) -> bool:
    """Whether a Checkpointer's close() with `in_flight` propagating should leave itself open:
    under run_surviving with in-job recovery on, the error may be a dead rank, and then the
    recovery must find the checkpointer open (its communicators to revoke, its lease holder,
    its nodes for the survivors) and abandon it; run_surviving closes it if it was not."""
    return in_flight is not None and _surviving > 0 and in_job_recovery_unavailable() is None


def close_left_open() -> None:
    """(run_surviving, handling an error that is not a process failure) Close what
    close_waits_for_the_verdict left open, as the error's own close would have."""
    global _surviving
    _surviving -= 1
    try:
        for ckpt in open_checkpointers():
            ckpt.close()
    finally:
        _surviving += 1


def speaks_for_the_job(world_rank: int) -> bool:
    """Whether this rank records how the job ended (exit_record.py): rank 0 of the world, or
    after ranks died in the job rank 0 of the working survivors (the world's may be among the
    dead; an idle spare never speaks)."""
    if _survivors is None:
        return world_rank == 0
    return _working is not None and _working.Get_rank() == 0


def exit_if_survived_failures(code: int) -> None:
    """If this process went on after ranks died, end it now with `code`, without MPI_Finalize,
    which hangs on the survivors of a failure (a known fault of Open MPI's ULFM; seen here in
    most runs); a survivor that exits without it still ends the job cleanly. run_main calls it;
    an application with a main of its own calls it last."""
    if recoveries_in_job():
        sys.stdout.flush()
        sys.stderr.flush()
        # Not before every survivor is through: one that leaves while a message it sent is
        # still on its way counts as one more failure to the ranks still receiving it.
        try:
            _survivors.Barrier()
        except Exception as exc:  # a failure at the very end: the exit code says the rest
            print(f"hpcckpt: the survivors' last barrier failed: {exc}", file=sys.stderr, flush=True)
        # The barrier's own last messages may still be in flight when it returns here.
        time.sleep(LINGER_S)
        os._exit(code)


LINGER_S = 0.5
_survivors = None  # the communicator of the last recovery's survivors, idle spares included
_working = None  # of those, the ranks that run main (None on an idle spare)
_pool = None  # the job's spare ranks (run/spares.py), where it holds any


def caused_by_process_failure(exc: BaseException, comms=()) -> bool:
    """`exc` or an error it was raised from or while handling is an MPI error that says a
    rank died, or MPI's failure detector knows of a death the survivors have not recovered
    from, or another survivor revoked one of `comms` after one: then whatever failed (the
    library's agreed error about a transfer, say) failed because of it."""
    from mpi4py import MPI

    from hpcckpt.errors import CheckpointError

    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        chain.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    if any(is_process_failure(error) for error in chain):
        return True
    # An error about communication (an MPI error of another class, an agreed checkpoint
    # error) may be a death the failure detector has not confirmed yet, or one that only
    # other survivors saw (ULFM does not report a failure to every rank alike): wait for
    # either verdict.
    if any(isinstance(error, (MPI.Exception, CheckpointError)) for error in chain):
        deadline = time.monotonic() + DETECTION_S
        while time.monotonic() < deadline:
            if failure_reported(*comms):
                return True
            time.sleep(0.05)
    return failure_reported(*comms)


# How long an error about communication waits for MPI to report a dead process (the runtime
# reports one at once); a rank that hangs is the failure detector's (cluster/launcher.py), and
# an error it causes meanwhile ends the job for the relaunch tier.
DETECTION_S = 7.0


def run_surviving(main: Callable[[object], T], comm=None, *, timeout: float = 60.0,
                  max_recoveries: int | None = None, spares: int = 0, shrink: bool = True) -> T | None:
    """(all ranks) main(comm), entered again on the survivors' communicator each time ranks
    die, at most `max_recoveries` times (None: as long as ranks are left). Returns what the
    last main returned. `spares`: the last that many ranks of `comm` do not run main but wait
    to take dead ranks' places (run/spares.py), so that main goes on at its size; an idle
    spare released at the end returns None. `shrink` false: a death that leaves main fewer
    ranks than it started with (no spare left for its place) ends the job for a relaunch
    (OutOfSpares) instead of going on smaller."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    unavailable = in_job_recovery_unavailable()
    global _pool, _survivors, _working
    if spares:
        if unavailable is not None:
            raise ConfigError(f"resilience.spares = {spares}: spare ranks take dead ranks' places in the job, "
                              f"which needs in-job recovery: {unavailable}; set resilience.spares = 0 here")
        _pool = SparePool(comm, spares)
        note_spares_at_start(spares)
        comm = _pool.work
    places = len(_pool.place) - spares if _pool is not None else comm.Get_size()
    global _surviving
    while True:
        if _pool is not None and _pool.is_spare:
            if not _pool.wait_idle():
                return None  # the workers are done
            count_recovery()
            comm = _survivors = _join_recovery_as_spare(_pool, timeout)
            if not _pool.is_spare:
                comm = _working = _pool.work
                _relaunch_if_shrunk(comm, places, shrink)
            continue
        _surviving += 1
        leaving = True  # main returns or its error ends the job: the idle spares are released
        try:
            return main(comm)
        except BaseException as exc:
            if unavailable is not None:
                raise
            confirmed = caused_by_process_failure(exc, _job_communicators(comm, open_checkpointers()))
            if not confirmed:
                print(f"hpcckpt: rank {comm.Get_rank()}: {type(exc).__name__} is not a process failure MPI "
                      f"confirmed; the job ends: {exc}", file=sys.stderr, flush=True)
                close_left_open()
                raise
            # Counted alike on every live rank, spares that took a place included.
            if max_recoveries is not None and recoveries_in_job() >= max_recoveries:
                # Ranks are dead: a close would wait on them. Left to the relaunch, as without ULFM.
                for ckpt in open_checkpointers():
                    ckpt.abandon()
                print(f"hpcckpt: rank {comm.Get_rank()}: ranks died after {recoveries_in_job()} recovery(ies) in the "
                      f"job, max_recoveries = {max_recoveries}: the job ends for a relaunch", file=sys.stderr,
                      flush=True)
                raise
            leaving = False
            count_recovery()
            comm = _working = recover(comm, timeout, exc)
            _survivors = _pool.whole if _pool is not None else comm
            _relaunch_if_shrunk(comm, places, shrink)
        finally:
            _surviving -= 1
            if leaving:
                _release_spares()


class OutOfSpares(HpcckptError):
    """Ranks died that no spare was left to replace, and the job may not shrink: every
    survivor ends for the relaunch tier, which starts the job at its size again."""

    collective = True  # every survivor raises it after the same agreed recovery


def _relaunch_if_shrunk(working, places: int, shrink: bool) -> None:
    """(every rank of `working` after a recovery) OutOfSpares where main would go on with
    fewer than its `places` ranks and `shrink` is off; said once, by `working`'s rank 0 (the
    job's rank 0 may be among the dead)."""
    if shrink or working.Get_size() >= places:
        return
    said = (f"ranks died that no spare was left to replace: {working.Get_size()} of the job's {places} working "
            f"ranks are left and it may not shrink (resilience.out_of_spares = \"relaunch\"); it ends for a "
            f"relaunch at its size from its newest version")
    from mpi4py import MPI

    from hpcckpt.runlog import append_metrics

    unrecorded = take_unrecorded()  # no next Checkpointer in this job will write them
    if working.Get_rank() == 0:
        for run_dir in held_runs():
            append_metrics(run_dir, unrecorded)
        if MPI.COMM_WORLD.Get_rank() != 0:  # run_main has the job's rank 0 say it
            print(f"hpcckpt: error: {said}", file=sys.stderr, flush=True)
    raise OutOfSpares(said)


def _release_spares() -> None:
    """(a worker leaving run_surviving) The idle spares told that the job is over, whichever
    way it ended, so that none waits for a recovery that will not come."""
    if _pool is None or _pool.is_spare:
        return
    try:
        _pool.release()
    except Exception as exc:  # the job ends either way; said, and the exit code says the rest
        print(f"hpcckpt: releasing the idle spares failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _join_recovery_as_spare(pool, timeout: float):
    """(an idle spare, once the workers' recovery revoked where it waits) Its part in the
    shrink and the refill; the run directories the workers offered are marked FILLING where it
    takes a place. Returns the spares' and workers' communicator."""
    # Woken by the revoke, at the start of the workers' recovery: they shrink only once their
    # checkpointers are abandoned, which has a watchdog of its own.
    survivors = shrink(pool.whole, timeout=2 * timeout)
    with RecoveryWatchdog("taking the dead ranks' places", timeout, pool.whole.Get_rank()):
        refilled = pool.refill(survivors)
        _offer_runs_to_spares(pool, refilled, [])
    if not pool.is_spare:  # its next Checkpointer writes the run's records, maybe as their rank 0
        _record_and_say(refilled.places_before, set(refilled.lost_places), pool.work, survivors, refilled,
                        "none: an idle spare, woken by the workers' recovery")
    return pool.whole


def _refill_record(refilled, survivors, pool) -> dict:
    return {"event": "spares", "lost_places": list(refilled.lost_places),
            "filled": {str(place): spare for place, spare in refilled.filled.items()},
            "given_up": list(refilled.given_up), "spares_lost": refilled.spares_lost,
            "spares_left": pool.idle_spares, "shrink_s": round(survivors.seconds, 6)}


def _described(exc: BaseException | None) -> str | None:
    """The error a rank met first, and where: what tells a death that surfaced in a checkpoint's
    transfers from one in the application's own collectives."""
    if exc is None:
        return None
    import traceback

    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename.endswith(".py")]
    where = f" in {frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _job_communicators(comm, checkpointers) -> list:
    """`comm`, what main derived from it (revoke_on_failure) and what `checkpointers` derived:
    what a process failure revokes, and where another survivor's revoke shows."""
    return [comm, *_application_comms, *[derived for ckpt in checkpointers for derived in ckpt.job.communicators()]]


def recover(comm, timeout: float, noticed: BaseException | None = None):
    """(all survivors) Abandon this process's checkpointers, shrink `comm` to the survivors and
    return their communicator. `noticed`: the error through which this rank learnt of the
    failure, kept in the run's record."""
    from mpi4py import MPI

    from hpcckpt.run.lease import mark_holder_lost

    abandoned = open_checkpointers()
    forget_held()
    for ckpt in abandoned:
        hold(ckpt.config.run_dir, ckpt.commits.offered())
    # Every communicator revoked and the library's threads stopped before the shrink: Open
    # MPI's Shrink is not safe beside threads still working on communicators of the job.
    revoke(*_job_communicators(comm, abandoned), *(_pool.communicators() if _pool is not None else ()))
    if _pool is not None:  # they join the shrink below, which waits for them
        _pool.wake_idle()
    _application_comms.clear()
    holders, groups, comm_group = {}, {}, comm.Get_group()
    with RecoveryWatchdog("abandoning the checkpointers after a process failure", timeout, comm.Get_rank()):
        for ckpt in abandoned:
            # Survivors waiting in commit_step's agreement (which a revoke does not end) would
            # wait for this rank there while it waits for them in the shrink.
            if ckpt.job.schedule is not None and ckpt.job.schedule.comm is not None:
                ckpt.commits.join_recovery(partial(fault_tolerant_agree, ckpt.job.schedule.comm))
        for ckpt in abandoned:
            if ckpt.job.comm is not None:  # its ranks, for the lease's holder and the read ahead below
                groups[id(ckpt)] = ckpt.job.comm.Get_group()
                if ckpt.job.claim.holder is not None:
                    # The lease's holder is rank 0 of that checkpointer's communicator.
                    holder_rank = MPI.Group.Translate_ranks(groups[id(ckpt)], [0], comm_group)[0]
                    holders[holder_rank] = ckpt.job.claim.holder
            ckpt.abandon()
    if _pool is None:
        survivors = shrink(comm, timeout=timeout)
        lost, working, refilled = set(survivors.lost), survivors.comm, None
        if abandoned:
            from hpcckpt.cluster.fault_tolerance import inherit_topology
            from hpcckpt.cluster.topology import Topology

            old = abandoned[0].job.topology
            inherit_topology(Topology(tuple(old.node_of_rank[rank] for rank in survivors.kept), old.domain_of_node,
                                      old.domain_names))
    else:  # the spares wait on `whole`, which the revoke above reached: they shrink it with us
        survivors = shrink(_pool.whole, timeout=timeout)
        with RecoveryWatchdog("giving the dead ranks' places to spares", timeout, _pool.whole.Get_rank()):
            refilled = _pool.refill(survivors)
            lost_holders = [holders[rank] for rank in set(refilled.lost_places) & set(holders)]
            _offer_runs_to_spares(_pool, refilled, lost_holders)
        lost, working = set(refilled.lost_places), _pool.work
    for rank in lost & set(holders):
        mark_holder_lost(*holders[rank])
    _read_ahead_for_the_restore(abandoned, groups, comm_group, lost)
    for ckpt in abandoned:
        ckpt.abandoned()
    _record_and_say(comm.Get_size(), lost, working, survivors, refilled, _described(noticed))
    return working


def _read_ahead_for_the_restore(abandoned, groups: dict, comm_group, lost: set) -> None:
    """(a survivor) Each abandoned checkpointer's files that will deliver the `lost` ranks'
    shards (numbered in `comm_group`, translated to each checkpointer's own) read into the
    page cache behind the rest of the recovery."""
    from mpi4py import MPI

    if not lost:
        return
    for ckpt in abandoned:
        group = groups.get(id(ckpt))
        if group is None:
            continue
        theirs = MPI.Group.Translate_ranks(comm_group, sorted(lost), group)
        ckpt.job.read_ahead_for(frozenset(rank for rank in theirs if rank != MPI.UNDEFINED))


def _record_and_say(size: int, lost: set, working, survivors, refilled, noticed: str | None) -> None:
    """(every rank of `working`) The recovery's records for the run, and its line on the
    console from `working`'s rank 0."""
    record = {"event": "process_failure", "lost_ranks": sorted(lost), "ranks_left": working.Get_size(),
              "shrink_s": round(survivors.seconds, 6), "noticed": noticed}
    record_for_the_run(record)
    if refilled is not None:
        record_for_the_run(_refill_record(refilled, survivors, _pool))
    if working.Get_rank() == 0:
        print(f"hpcckpt: {_recovery_said(size, lost, working, refilled, record)} (shrunk in "
              f"{survivors.seconds:.3f} s)", file=sys.stderr, flush=True)


def _recovery_said(size: int, lost: set, working, refilled, record: dict) -> str:
    """What a recovery did, in the user's words."""
    if not lost and (refilled is None or not refilled.spares_lost):
        # an error of MPI's own that no death explains: the job goes on whole
        return (f"a process failure was reported ({record['noticed']}) but no rank of {size} is lost: going on in the "
                f"job on all of them")
    if refilled is None:
        return f"rank(s) {', '.join(map(str, sorted(lost)))} of {size} died: going on in the job on the " \
               f"{working.Get_size()} left"
    said = f"rank(s) {', '.join(map(str, sorted(lost)))} of {size} died" if lost else "no working rank died"
    if refilled.filled:
        said += f"; spare(s) took place(s) {', '.join(map(str, sorted(refilled.filled)))}"
    if refilled.given_up:
        said += f"; no spare left for place(s) {', '.join(map(str, refilled.given_up))}"
    if refilled.spares_lost:
        said += f"; {refilled.spares_lost} idle spare(s) died"
    return f"{said}: going on in the job on {working.Get_size()} rank(s), {_pool.idle_spares} spare(s) left"


def _offer_runs_to_spares(pool, refilled, lost_holders: list) -> None:
    """(every survivor, workers and spares, after a refill) The run directories whose
    abandoned checkpointers offered what they held, and the lease holders that died, go from a
    rank that was working before to every rank: a spare now in a place marks the runs FILLING,
    so every rank of the new `work` takes the same path at its restart (from memory, or a
    version), and claims a run's lease knowing its holder is dead (it may be on another host)."""
    from hpcckpt.run.lease import mark_holder_lost

    root = pool.offering_rank(refilled)
    mine = (held_runs(), lost_holders) if pool.whole.Get_rank() == root else None
    runs, holders = quiet_bcast(pool.whole, mine, root=root) or ((), ())
    if pool.took_place_now(refilled):
        for run_dir in runs:
            hold(run_dir, FILLING)
        for holder in holders:
            mark_holder_lost(*holder)
