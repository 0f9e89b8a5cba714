"""Transfers, small collectives and the one way ranks agree on an outcome, waiting without
spinning.

MPICH's blocking waits spin; on shared cores the persist thread would steal time from
training. These helpers post non-blocking operations and poll them with a short sleep.

Agreement (in the style of torch DCP's _DistWrapper): `agree(comm, label, fn)` runs fn on
every rank and either returns its result everywhere or raises the same error on every rank,
carrying the failures by rank; `on_root(comm, label, fn)` runs fn on one rank and hands its
result, or its error, to all. A rank that only saw another rank fail reports a typed
PeerFailure, and the rank with its own error is the one named. Sizes per call: one
allreduce of an int on the happy path; O(ranks) small messages gathered when something failed.
`agree_per_rank` is the same agreement for stages that degrade rank by rank: storage failures
come back as data, by rank, and only other failures raise.

The job's collectives and what each rank sends and receives (W ranks, T tensors per shard, G
the erasure group size, V versions stored), for the rule "O(1) or O(group) per rank, or
O(W) at one root, never O(W^2) in total". The tools: fold_at_root (gather at rank 0, fold,
broadcast a small answer), decide_at_root (gather, decide, broadcast the shared part and
scatter one answer per rank), allgather_compact (the distinct values and runs of ranks),
point-to-point exchanges with the O(G) peers that need a rank's data.
  every agreement (agree, agree_per_rank, raise_if_any_failed): 1 allreduce of an int; when
    some rank failed, the reports gathered at rank 0 and the failing ones broadcast
  per checkpoint (save/pipeline.py, save/flush.py):
    snapshot, every stage, commit: one agreement each
    shard records: point to point to the O(G) ranks whose node-local record lists them;
      gathered at L4's coordinator (O(W x T) at the root), which writes the record listing
      every shard and broadcasts the version id and total size (O(1))
    L2 store: one shard to the partner, in chunks (exchange_streamed); L3 store: within the
      group, O(G), in rounds of chunks
    L4 at its own pace: 1 allreduce (is a copy running anywhere)
    end-of-run drain: committed steps folded at rank 0 (O(V) back); each shard record gathered
      at rank 0 (O(W x T) at the root)
    making room (save/room.py): steps, counts and pinned steps folded at rank 0 (O(V) back);
      L4 listing: on_root
  per restart (restore/flow.py, restore/plan.py):
    discovery: each rank's holdings (O(V)) gathered at rank 0, which decides; the candidates
      broadcast (O(V) each, plus the ranks whose node-local pieces are gone), each rank's own
      sources scattered (O(V)). A restart onto another rank count or placement (repartition)
      also broadcasts what each node-local directory holds, one object per node: O(W) per
      rank [W^2, only then]
    the commit record: bcast of one node-local record (O(G x T)); the table gathered at rank 0
      (O(G x T) per rank) and each rank's part scattered back (O(G x T)); a repartition
      broadcasts the whole table (O(W x T) per rank) [W^2 x T, only then]
    who still needs a shard: 1 allreduce, and the needy ranks folded at rank 0 when some are
    where each shard came from: allgather_compact (the levels, and runs of ranks)
    L2 delivery: point to point, holder and needy rank; L3: within the group, O(G)
    ledger, claim, L4 directory work: on_root, one bcast of a small result
    one rank per node-local directory: decide_at_root, one answer per rank
  at start (run/job_storage.py, cluster/placement.py): host names and node-local directories
    gathered at rank 0 and handed back as rules (node of each rank, a {node} template: O(1)
    for the usual placements); the placement log: each rank is told its partner's and
    group's hosts (O(G))
  at the end (train/loop.py): the weights digest by allgather_compact (one distinct value
    where the ranks agree), bytes stored folded at rank 0
  keyed tables (route_rows): one all-to-all of counts (O(W) per rank) and of the rows, each
    row sent once to the rank its id hashes to: per training step of the embedding model
    (train/embedding.py: ids out, rows back; gradients out), and per version of a table's
    chain at a restart (restore/tables.py)
  only under fault injection (faults.py): an allgather of each rank's host and pid, once
"""

from __future__ import annotations

import errno
import pickle
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from hpcckpt.cluster.mpi_gate import gated_call
from hpcckpt.errors import CheckpointError, HpcckptError, PeerFailed, StorageError
from hpcckpt.format.compact import pack_ints, unpack_ints

T = TypeVar("T")

POLL_S = 0.0005
POLLS_PER_FAILURE_CHECK = 100  # every 50 ms of waiting


def wait_all(requests) -> None:
    """Every request complete; a rank's death reported meanwhile raises it as a process
    failure where the job can survive one (cluster/fault_tolerance.py)."""
    from mpi4py import MPI

    from hpcckpt.cluster.fault_tolerance import raise_if_a_rank_died

    requests = [r for r in requests if r is not None]
    polls = 0
    while requests and not test_all(requests):
        time.sleep(POLL_S)
        polls += 1
        if polls % POLLS_PER_FAILURE_CHECK == 0:
            raise_if_a_rank_died()


def test_all(requests: list) -> bool:
    """Testall, but a request that failed raises its own error: ERR_IN_STATUS alone does not
    say that a rank died (ERR_PROC_FAILED) or that another survivor revoked the communicator
    (ERR_REVOKED), and the failure detector may not know yet."""
    from mpi4py import MPI

    statuses = [MPI.Status() for _ in requests]
    try:
        return gated_call(MPI.Request.Testall, requests, statuses)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        failed = [status.Get_error() for status in statuses if status.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
        if failed:
            raise MPI.Exception(failed[0]) from exc
        raise


def exchange(comm, sends: list[tuple[int, np.ndarray]], receives: list[tuple[int, np.ndarray]], tag: int) -> None:
    """Post every receive and send (rank, contiguous uint8 buffer), then wait for all."""
    wait_all(post_exchange(comm, sends, receives, tag))


def post_exchange(comm, sends: list[tuple[int, np.ndarray]], receives: list[tuple[int, np.ndarray]],
                  tag: int) -> list:
    """Post every receive and send; the requests, for wait_all once the caller has done
    what it overlaps with them."""
    from mpi4py import MPI

    requests = [gated_call(comm.Irecv, [buffer, MPI.BYTE], source=source, tag=tag) for source, buffer in receives]
    return requests + [gated_call(comm.Isend, [buffer, MPI.BYTE], dest=dest, tag=tag) for dest, buffer in sends]


def exchange_streamed(comm, sends: list[tuple[int, np.ndarray]], receives: list[tuple[int, int, Callable]], tag: int,
                      chunk_bytes: int, chunk_buffer: Callable[[int], np.ndarray]) -> BaseException | None:
    """An exchange of transfers too large to hold whole at the receiver: each send
    (rank, contiguous uint8 bytes) goes as chunks of `chunk_bytes` (views, posted at once:
    no copy); each receive (rank, nbytes, sink) comes in through two chunk buffers
    (`chunk_buffer(0)`, `chunk_buffer(1)`, each at least `chunk_bytes`), alternately, each
    chunk handed to sink(bytes, offset) before its buffer takes the one after next. MPI keeps
    one sender's messages of one tag in order. A sink that fails stops being called but the
    chunks are still taken (the sender must finish); its first error is returned."""
    from mpi4py import MPI

    requests = [gated_call(comm.Isend, [buffer[start:start + chunk_bytes], MPI.BYTE], dest=dest, tag=tag)
                for dest, buffer in sends for start in range(0, buffer.size, chunk_bytes)]
    failure = None
    for source, nbytes, sink in receives:
        starts = list(range(0, nbytes, chunk_bytes))
        pending = {}

        def post(index: int) -> None:
            if index < len(starts):
                view = chunk_buffer(index % 2)[:min(chunk_bytes, nbytes - starts[index])]
                pending[index] = (gated_call(comm.Irecv, [view, MPI.BYTE], source=source, tag=tag), view)
        post(0)
        post(1)
        for index, start in enumerate(starts):
            request, view = pending.pop(index)
            wait_all([request])
            if failure is None:
                try:
                    sink(view, start)
                except Exception as exc:  # noqa: BLE001 (kept and returned: the sender goes on)
                    failure = exc
            post(index + 2)
    wait_all(requests)
    return failure


def quiet_any(comm, flag: bool) -> bool:
    """True on every rank if `flag` is true on any: one sleeping allreduce round, where
    quiet_allgather needs two (sizes, then payloads). Each round on busy cores waits for
    every rank's thread to be scheduled, so the happy path of an agreement is one round."""
    from mpi4py import MPI

    mine = np.array([1 if flag else 0], dtype=np.int32)
    anyone = np.empty(1, dtype=np.int32)
    wait_all([gated_call(comm.Iallreduce, mine, anyone, op=MPI.MAX)])
    return bool(anyone[0])


@dataclass(frozen=True)
class PeerFailure:
    """This rank's part of a collective step failed only because another rank's did (that
    rank's own error says why)."""

    message: str


class StorageFailure(str):
    """A rank's own failure that was its storage's (full, read-only, I/O error, gone), as the
    levels degrade for; any other failure (memory, a codec, a file in the way) stops the
    checkpoint instead."""


# What a file system says when it cannot hold or reach a level's files; not ENOMEM, not
# EEXIST (a file in the way is a conflict, never overwritten).
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM,
                            errno.ENOENT, errno.ENOTDIR, errno.ESTALE, errno.ENODEV, errno.ENXIO})


def is_storage_failure(exc: BaseException) -> bool:
    """Whether an error, or every rank's own failure in an agreed one, was the storage's."""
    if isinstance(exc, CheckpointError):
        failures = [f for f in exc.failures_by_rank.values() if not isinstance(f, PeerFailure)]
        return bool(failures) and all(isinstance(f, StorageFailure) for f in failures)
    if isinstance(exc, FileExistsError):
        return False
    return isinstance(exc, StorageError) or (isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS)


def describe_failure(exc: BaseException) -> str | PeerFailure:
    """What a rank reports for its own failure in an agreement: one that only says another
    rank failed is a PeerFailure, so that rank's own error is the one told; one of its
    storage a StorageFailure."""
    if isinstance(exc, PeerFailed):
        return PeerFailure(str(exc))
    # MemoryError, an MPI or CuPy error: agreed, never a hang.
    text = str(exc) if isinstance(exc, HpcckptError) else f"{type(exc).__name__}: {exc}"
    return StorageFailure(text) if is_storage_failure(exc) else text


def raise_if_any_failed(comm, label: str, failure: str | PeerFailure | None, *, step: int | None = None,
                        error_type: type = CheckpointError) -> None:
    """(all ranks of comm) Turn a failure on any rank into the same exception on every rank.
    One allreduce round when no rank failed; the failures are gathered only when one did."""
    if not quiet_any(comm, failure is not None):
        return
    failures = _failures_by_rank(comm, failure)
    _raise_agreed(comm, label, failures, step, error_type)


def _failures_by_rank(comm, failure: str | PeerFailure | None) -> dict:
    """{rank: its report} of the ranks that failed, on every rank: gathered at rank 0, and
    only the failures handed back (O(failing ranks) each)."""
    return fold_at_root(comm, failure, lambda reports: {r: f for r, f in enumerate(reports) if f is not None})


def _raise_agreed(comm, label: str, failures: dict, step: int | None, error_type: type) -> None:
    """The same exception on every rank for the gathered `failures` (rank -> its report)."""
    # Ranks that only saw a peer fail are named when no rank has its own error to tell.
    own = {rank: f for rank, f in failures.items() if not isinstance(f, PeerFailure)}
    failures = own or {rank: f.message for rank, f in failures.items()}
    first_error = next(iter(failures.values()))
    size = comm.Get_size()
    where = f" of step {step}" if step is not None else ""
    who = f"rank(s) {sorted(failures)}" if len(failures) < size else f"all {size} ranks"
    if step is not None or len(failures) < size:
        message = f"{label}{where} failed on {who}: {first_error}"
    else:
        message = first_error  # every rank says the same thing: say it once
    if issubclass(error_type, CheckpointError):
        exc = error_type(message, failures, collective=True)
    else:
        exc = error_type(message, collective=True)
    exc.agreed_on = comm  # agree() on the same communicator passes it through as it is
    raise exc


def _run_here(comm, fn: Callable[[], T]) -> tuple[T | None, str | PeerFailure | None]:
    """fn's result here, or this rank's report of its failure for an agreement on `comm`; an
    error every rank of `comm` already agreed on inside fn is raised as it is."""
    try:
        return fn(), None
    except HpcckptError as exc:
        if getattr(exc, "agreed_on", None) is comm:
            raise
        return None, describe_failure(exc)
    except Exception as exc:
        return None, describe_failure(exc)


def agree(comm, label: str, fn: Callable[[], T], *, step: int | None = None,
          error_type: type = CheckpointError) -> T:
    """(all ranks of comm) Run fn here; its result, or the same error on every rank. An error
    that every rank of this same communicator already agreed on inside fn passes through as
    it is (one agreed on a smaller one, an erasure group's, is agreed again here)."""
    result, failure = _run_here(comm, fn)
    raise_if_any_failed(comm, label, failure, step=step, error_type=error_type)
    return result


def agree_per_rank(comm, label: str, fn: Callable[[], T], *, step: int | None = None) -> tuple[T | None, dict]:
    """(all ranks of comm) Like agree, for a stage whose storage may fail on some ranks while
    the others' work stands (a node-local level: each rank writes its own node's files):
    returns (fn's result here, or None where it failed; {rank: StorageFailure} of the ranks
    whose own storage failed, the same on every rank). Any other failure, or a rank that
    only saw a peer fail (a collective transfer that never happened), raises on every rank as
    agree does. One allreduce round when no rank failed, as agree."""
    result, failure = _run_here(comm, fn)
    if not quiet_any(comm, failure is not None):
        return result, {}
    failures = _failures_by_rank(comm, failure)
    if not all(isinstance(f, StorageFailure) for f in failures.values()):
        _raise_agreed(comm, label, failures, step, CheckpointError)
    return result, failures


def agree_before_exchange(comm, failure: BaseException | None, label: str) -> None:
    """(all ranks of comm) A rank that failed while preparing a point-to-point exchange
    (allocating its buffers, reading its shard, encoding) would never post its sends and
    receives, and the others would wait for them for ever. So every rank says whether it is
    ready first: if any is not, every rank raises instead of exchanging, the failed one its
    own error, the others PeerFailed. One allreduce round. `comm` may be a part of the job
    (an erasure group): the caller's agreement over the whole job then names the rank."""
    if not quiet_any(comm, failure is not None):
        return
    if failure is not None:
        raise failure
    raise PeerFailed(f"{label}: another rank failed before the exchange (its error says why)")


def on_root(comm, label: str, fn: Callable[[], T], root: int = 0) -> T:
    """(all ranks of comm) Run fn on `root` only and hand its result, or its error, to every
    rank: an HpcckptError as it is, an OSError as a StorageError saying `label` failed (the
    others would otherwise wait for ever). One sleeping broadcast (two rounds)."""
    result = None
    if comm.Get_rank() == root:
        try:
            result = fn()
        except HpcckptError as exc:
            result = exc
        except OSError as exc:
            result = StorageError(f"{label} failed: {exc.strerror or exc}; fix the directory and restart")
    result = quiet_bcast(comm, result, root=root)
    if isinstance(result, HpcckptError):
        result.collective = True
        raise result
    return result


def quiet_allgather(comm, value):
    """allgather of picklable values that sleeps while it waits, in both of its rounds.

    A blocking allgather spins until the slowest rank arrives; a sleeping barrier in front of
    it is not enough, since each rank notices the barrier's end at its own next poll and the
    first ones then spin for the others (milliseconds, on cores shared with training).
    """
    from mpi4py import MPI

    payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    wait_all([gated_call(comm.Iallgather, np.array([payload.size], dtype=np.int64), sizes)])
    offsets = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=offsets[1:])
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait_all([gated_call(comm.Iallgatherv, payload, [gathered, sizes, offsets, MPI.BYTE])])
    return [pickle.loads(gathered[o:o + n]) for o, n in zip(offsets.tolist(), sizes.tolist())]


def quiet_gather(comm, value, root: int = 0):
    """gather of picklable values to `root` that sleeps while it waits: the list there, None
    elsewhere. O(1) sent per rank, the sum at the root."""
    from mpi4py import MPI

    payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    is_root = comm.Get_rank() == root
    sizes = np.empty(comm.Get_size() if is_root else 0, dtype=np.int64)
    wait_all([gated_call(comm.Igather, np.array([payload.size], dtype=np.int64), sizes if is_root else None,
                         root=root)])
    if not is_root:
        wait_all([gated_call(comm.Igatherv, payload, None, root=root)])
        return None
    offsets = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=offsets[1:])
    gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait_all([gated_call(comm.Igatherv, payload, [gathered, sizes, offsets, MPI.BYTE], root=root)])
    return [pickle.loads(gathered[o:o + n]) for o, n in zip(offsets.tolist(), sizes.tolist())]


def quiet_bcast(comm, value, root: int = 0):
    """bcast of a picklable value from `root` that sleeps while it waits (two rounds: size,
    then payload): `value` there, the root's everywhere else."""
    from mpi4py import MPI

    is_root = comm.Get_rank() == root
    # A writable copy: MPI's bcast takes one buffer for both sides.
    payload = np.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=np.uint8) \
        if is_root else None
    size = np.array([payload.size if is_root else 0], dtype=np.int64)
    wait_all([gated_call(comm.Ibcast, size, root=root)])
    if not is_root:
        payload = np.empty(int(size[0]), dtype=np.uint8)
    wait_all([gated_call(comm.Ibcast, [payload, MPI.BYTE], root=root)])
    return value if is_root else pickle.loads(payload)


def fold_at_root(comm, value, fold: Callable[[list], T], root: int = 0) -> T:
    """What `fold` makes of every rank's `value`, on every rank: gathered at `root` (O(ranks)
    there), folded, and the result broadcast. For answers smaller than the inputs (a union,
    an intersection, the ranks that failed), where an allgather would send every value to
    every rank (O(ranks^2) in all). A fold that fails raises on every rank."""
    return decide_at_root(comm, "combining the ranks' answers", value, lambda values: (fold(values), None),
                          root=root, scatter=False)[0]


def quiet_scatter(comm, values: list | None, root: int = 0):
    """scatter of picklable values from `root` (one per rank, in rank order; None elsewhere)
    that sleeps while it waits: this rank's value. O(1) received per rank."""
    from mpi4py import MPI

    is_root = comm.Get_rank() == root
    size = np.empty(1, dtype=np.int64)
    if is_root:
        payloads = [pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for v in values]
        sizes = np.array([len(p) for p in payloads], dtype=np.int64)
        offsets = np.zeros_like(sizes)
        np.cumsum(sizes[:-1], out=offsets[1:])
        packed = np.frombuffer(bytearray(b"".join(payloads)), dtype=np.uint8)
        wait_all([gated_call(comm.Iscatter, sizes, size, root=root)])
    else:
        wait_all([gated_call(comm.Iscatter, None, size, root=root)])
    received = np.empty(int(size[0]), dtype=np.uint8)
    wait_all([gated_call(comm.Iscatterv, [packed, sizes, offsets, MPI.BYTE] if is_root else None, [received, MPI.BYTE],
                             root=root)])
    return pickle.loads(received)


def decide_at_root(comm, label: str, value, decide: Callable[[list], tuple], root: int = 0,
                   scatter: bool = True):
    """(all ranks) Every rank's `value` gathered at `root`, where `decide(values)` returns
    (shared, [an answer per rank]); every rank gets (shared, its own answer), or the same
    error raised. For a decision over every rank's state that the others need only a part
    of: O(ranks) at the root, the shared part and one answer per rank elsewhere. Without
    `scatter` the answers are not sent (None)."""
    gathered = quiet_gather(comm, value, root=root)
    error, cause, shared, answers = None, None, None, None
    if gathered is not None:
        try:
            shared, answers = decide(gathered)
        except HpcckptError as exc:
            error = exc
        except OSError as exc:
            error, cause = StorageError(f"{label} failed: {exc.strerror or exc}; fix the directory and restart"), exc
        except Exception as exc:  # a bug: said on every rank, rather than leaving them waiting
            error, cause = CheckpointError(f"{label} failed on rank {root}: {type(exc).__name__}: {exc}"), exc
    error, shared = quiet_bcast(comm, (error, shared), root=root)
    if error is not None:
        error.collective = True
        if cause is not None:
            raise error from cause  # the root keeps the traceback
        raise error
    return shared, quiet_scatter(comm, answers, root=root) if scatter else None


def allgather_compact(comm, value) -> list:
    """Every rank's value on every rank, as an allgather gives them, sent as the distinct
    values and which ranks hold each (runs of ranks: format/compact.py): O(distinct values)
    per rank where most ranks agree (the level each rank restored from), where an allgather
    sends every rank's value to every rank."""
    def distinct(values: list):
        table: dict = {}
        index = [table.setdefault(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL), len(table)) for v in values]
        return [pickle.loads(key) for key in table], pack_ints(index)
    table, packed = fold_at_root(comm, value, distinct)
    return [table[i] for i in unpack_ints(packed)]


def first_of_each(comm, key) -> bool:
    """(all ranks) Whether this rank is the lowest one with its `key` (e.g. one rank per
    node-local directory): decided at rank 0, one answer sent to each rank."""
    def decide(keys: list):
        seen: dict = {}
        return None, [seen.setdefault(k, r) == r for r, k in enumerate(keys)]
    return decide_at_root(comm, "choosing one rank per key", key, decide)[1]


def failing_ranks(comm, ok: bool) -> set[int]:
    """(all ranks) The ranks where `ok` is false: one allreduce when none is, else gathered
    at rank 0 and the (short) list broadcast."""
    if not quiet_any(comm, not ok):
        return set()
    return fold_at_root(comm, ok, lambda flags: {r for r, flag in enumerate(flags) if not flag})


def exchange_objects(comm, value, send_to, receive_from, tag: int) -> dict:
    """Send the picklable `value` to each rank of `send_to` and receive one from each rank of
    `receive_from` (the two sides must agree), sleeping while waiting: {source: value}. Two
    point-to-point rounds (sizes, then payloads); O(peers) per rank, nothing global."""
    from mpi4py import MPI

    payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    send_to, receive_from = list(send_to), list(receive_from)
    size = np.array([payload.size], dtype=np.int64)
    sizes = {source: np.empty(1, dtype=np.int64) for source in receive_from}
    wait_all([gated_call(comm.Irecv, sizes[source], source=source, tag=tag) for source in receive_from]
             + [gated_call(comm.Isend, size, dest=dest, tag=tag) for dest in send_to])
    buffers = {source: np.empty(int(sizes[source][0]), dtype=np.uint8) for source in receive_from}
    wait_all([gated_call(comm.Irecv, [buffers[source], MPI.BYTE], source=source, tag=tag + 1)
              for source in receive_from]
             + [gated_call(comm.Isend, [payload, MPI.BYTE], dest=dest, tag=tag + 1) for dest in send_to])
    return {source: pickle.loads(buffer) for source, buffer in buffers.items()}


def quiet_barrier(comm) -> None:
    """A barrier that sleeps while it waits: MPICH's blocking barrier spins, and on shared cores
    a spinning background thread steals time from training and from the ranks doing I/O."""
    wait_all([gated_call(comm.Ibarrier)])


def route_rows(comm, rows, destinations, sizes_known=None):
    """(all ranks) Send each row of `rows` (a NumPy array, rows along axis 0) to the rank
    `destinations` names; returns (the rows this rank received, in source-rank order and
    each source's order, and how many came from each rank). `sizes_known`: the counts this
    rank receives from each rank when the caller knows them (the answer to an earlier
    route_rows), sparing the all-to-all of counts. One MPI datatype of a whole row, so a
    count is rows, not bytes."""
    import numpy as np
    from mpi4py import MPI

    size = comm.Get_size()
    destinations = np.asarray(destinations, dtype=np.int64)
    order = np.argsort(destinations, kind="stable")
    rows = np.ascontiguousarray(rows[order])
    counts = np.bincount(destinations, minlength=size).astype(np.int32) if destinations.size else \
        np.zeros(size, np.int32)
    if sizes_known is None:
        incoming = np.empty(size, np.int32)
        comm.Alltoall(counts, incoming)
    else:
        incoming = np.asarray(sizes_known, np.int32)
    row_bytes = int(np.prod(rows.shape[1:], dtype=np.int64)) * rows.dtype.itemsize
    received = np.empty((int(incoming.sum()),) + rows.shape[1:], rows.dtype)
    if row_bytes:
        row_type = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        try:
            send_at = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
            receive_at = np.concatenate([[0], np.cumsum(incoming)[:-1]]).astype(np.int32)
            comm.Alltoallv([rows.reshape(-1).view(np.uint8), (counts, send_at), row_type],
                           [received.reshape(-1).view(np.uint8), (incoming, receive_at), row_type])
        finally:
            row_type.Free()
    return received, incoming

