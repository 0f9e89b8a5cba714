"""`hpcckpt train`: the job as a whole — set-up, the step loop, evaluation and reporting."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpcckpt.ckpt.engine import Checkpointer
from hpcckpt.ckpt.policy import IntervalPolicy
from hpcckpt.cluster.backend import select_backend
from hpcckpt.cluster.collectives import allgather_compact, fold_at_root
from hpcckpt.cluster.placement import discover_topology, local_dir_of
from hpcckpt.errors import ConfigError
from hpcckpt.faults import FaultInjector, current_attempt
from hpcckpt.runlog import RunLog, read_heartbeat
from hpcckpt.train.stopping import StopRequests
from hpcckpt.train.trainer import Trainer


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    val_loss: float | None
    val_accuracy: float | None
    seconds: float
    weights_digest: str
    halted: str | None = None  # why the run stopped early on request (signal, allocation end)


def run_training(config, comm, restart: str = "auto", faults=(), init_from: str | None = None,
                 init_optimizer: bool = False) -> TrainSummary:
    """(all ranks) Train for run.steps steps, resuming from a checkpoint per `restart`; a new
    run (no checkpoint of its own) starts from `init_from`'s weights (and optimizer state with
    `init_optimizer`) when given."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    topology = discover_topology(comm, config.cluster.simulated_nodes)
    log = RunLog(config.run.dir, rank, world_size)
    # From here on a stop signal only sets a flag: a job told to stop while it loads its
    # checkpoint still stops cleanly, after its first step.
    stopper = StopRequests(comm, config.run.end_time, config.run.halt_seconds).install()
    try:
        node = topology.node_of_rank[rank]
        local_rank = topology.local_index(rank)
        backend = select_backend(config.run.device, local_rank)
        trainer = Trainer(config, comm, backend, log)
        n_params = sum(int(a.size) for _, a in trainer.model.parameters())
        log.info(
            f"hpcckpt train: {world_size} ranks on {topology.node_count} node(s), device {backend.name}, "
            f"model {config.model.kind} ({n_params:,} parameters), data {config.data.source} "
            f"({trainer.dataset.train.size} train / {trainer.dataset.val.size} val), "
            f"optimizer {config.optimizer.kind}, global batch {config.data.batch_size}",
            console=True,
        )
        log.info(f"this rank runs on node {node} (local rank {local_rank})")
        checkpointer = None
        injector = FaultInjector(faults, rank, node, local_dir_of(
            config.storage.local_dir, str(config.run.dir), topology, rank), comm=comm)
        policy = IntervalPolicy.from_config(config.checkpoint)
        if init_from and not policy.enabled:
            raise ConfigError(f"--init-from {init_from}: checkpoints are off (checkpoint.every_steps = 0); the "
                              "loaded state would not be protected: set checkpoint.every_steps")
        if policy.enabled:
            checkpointer = Checkpointer(comm, config, topology=topology, log=log, faults=injector)
        try:
            if checkpointer is not None:
                for name, array in trainer.protected_arrays():
                    checkpointer.protect(name, array)
                checkpointer.register_state("trainer", trainer.training_state, trainer.load_training_state)
                checkpointer.register_state("policy", policy.state, policy.load_state)
                trainer.step_hooks = (CaptureAfterUpdate(checkpointer, trainer),)
                reached_before = read_heartbeat(config.run.dir) if rank == 0 else None
                restored = checkpointer.restart(restart)
                if restored is None and init_from:
                    select = (lambda name: name.startswith(("model/", "optim/"))) if init_optimizer \
                        else (lambda name: name.startswith("model/"))
                    source_step = checkpointer.init_from(init_from, select)
                    log.info(f"new run {checkpointer.run.run_id} starting at step 0 from the model weights"
                             f"{' and optimizer state' if init_optimizer else ''} of version {source_step} in "
                             f"{init_from}", console=True)
                elif restored is None:
                    log.info("starting from scratch (no checkpoint to resume from)", console=True)
                else:
                    if init_from:
                        log.info(f"--init-from {init_from} is not used: this run resumes from its own version "
                                 f"{restored}", console=True)
                    # The saved policy state predates its own checkpoint; count the interval from it.
                    policy.last_checkpoint = restored
                _report_restart(log, checkpointer, restored, reached_before)
                if policy.adaptive and policy.interval:
                    log.info(f"checkpoint interval {policy.interval} steps, kept from the checkpoint's profile: "
                             f"{policy.reason}", console=True)
            summary = _step_loop(config, trainer, log, checkpointer, injector, policy, stopper)
        finally:
            if checkpointer is not None:
                checkpointer.close()
        return summary
    finally:
        stopper.close()
        log.close()


class CaptureAfterUpdate:
    """Extraction during backprop: right after a parameter's weight update (its optimizer
    state updated with it), its shard is copied into the open snapshot, overlapping the
    backward pass and allreduce of the layers below (DeepFreeze's "Opt"). With snapshots
    opened by begin_checkpoint(copy_in_background=True) the copy is only queued, and the
    next update of that parameter waits until it is taken (CheckFreq)."""

    def __init__(self, checkpointer, trainer: Trainer):
        self.checkpointer = checkpointer
        state_names = [n for n, _ in trainer.optimizer.state_arrays()]
        self.protected_names = {
            param: [f"model/{param}"] + [f"optim/{n}" for n in state_names if n.startswith(param + "/")]
            for param in trainer.parameters
        }

    def before_update(self, param: str) -> None:
        for name in self.protected_names[param]:
            self.checkpointer.before_update(name)

    def after_update(self, param: str) -> None:
        for name in self.protected_names[param]:
            self.checkpointer.capture(name)


def _report_restart(log: RunLog, checkpointer, restored: int | None, reached_before) -> None:
    """Where each rank's shard came from (each old rank's, when the version was written by
    another rank count) and how much work the failure cost, for the run's summary
    (metrics.jsonl) and `hpcckpt report`."""
    record = {"event": "restart", "attempt": current_attempt(), "step": restored or 0,
              "sources": list(checkpointer.restored_sources), "ranks": checkpointer.world_size}
    if reached_before is not None:
        reached, _ = reached_before
        record["reached_before"] = reached
        record["lost_steps"] = max(0, reached - (restored or 0))
        if record["lost_steps"] and restored is not None:
            log.info(f"the previous run had reached step {reached}: {record['lost_steps']} step(s) are done again",
                     console=True)
    log.metrics(record)


def _agreed_max(comm, values) -> list[float]:
    """The interval policy must decide the same everywhere: feed it the slowest rank's costs."""
    import numpy as np
    from mpi4py import MPI

    local = np.asarray(values, dtype=np.float64)
    agreed = np.empty_like(local)
    comm.Allreduce(local, agreed, op=MPI.MAX)
    return agreed.tolist()


def _step_loop(config, trainer: Trainer, log: RunLog, checkpointer, injector, policy,
               stopper: StopRequests) -> TrainSummary:
    total_steps = config.run.steps
    log_every = config.run.log_every
    eval_every = config.eval.every_steps
    started = time.perf_counter()
    window_time, window_samples, window_steps = 0.0, 0, 0
    last_eval: dict = {}
    previous_durable = 0.0
    warned_short_interval = False
    blocking_times: list[float] = []
    halted = None
    steps_this_run = 0
    copies_behind = None  # the report of a snapshot whose copies may still be running
    while trainer.step < total_steps:
        next_step = trainer.step + 1
        report = next_step % log_every == 0 or next_step == total_steps
        checkpoint_due = checkpointer is not None and policy.due(next_step, total_steps)
        blocked = 0.0
        if checkpoint_due:
            opened = time.perf_counter()
            previous = checkpointer.begin_checkpoint(next_step, copy_in_background=True)
            blocked = time.perf_counter() - opened
            if previous is not None and previous.durable_s:
                previous_durable = max(previous.durable_s.values())
                log.metrics({"step": previous.step, "checkpoint_durable_s": previous.durable_s})
        stopper.post()
        persisting = checkpointer is not None and checkpointer.persisting
        result = trainer.train_step(reduce_loss=report)
        steps_this_run += 1
        if copies_behind is not None:
            # The previous snapshot's copies ran behind this step; what they made it wait counts.
            blocking_times[-1] += copies_behind.copy_wait_s
            log.metrics({"step": copies_behind.step, "checkpoint_copy_wait_s": copies_behind.copy_wait_s,
                         "checkpoint_background_copy_s": copies_behind.background_copy_s})
            copies_behind = None
        log.heartbeat(result.step)
        if checkpointer is not None and steps_this_run == config.checkpoint.confirm_after_steps:
            checkpointer.confirm_restart()
        if not checkpoint_due:
            policy.observe_step(result.seconds, persisting)
        window_time += result.seconds
        window_samples += result.samples
        window_steps += 1
        if report:
            epoch = trainer.batches.epoch
            rate = window_samples / window_time if window_time else 0.0
            ms_per_step = 1000.0 * window_time / window_steps
            log.info(
                f"step {result.step:6d}  epoch {epoch:3d}  loss {result.loss:.4f}  "
                f"{rate:9.0f} samples/s  {ms_per_step:7.2f} ms/step",
                console=True,
            )
            log.metrics({"step": result.step, "epoch": epoch, "loss": result.loss,
                         "samples_per_s": rate, "ms_per_step": ms_per_step})
            window_time, window_samples, window_steps = 0.0, 0, 0
        if (eval_every and result.step % eval_every == 0) or result.step == total_steps:
            last_eval = {"step": result.step, **trainer.evaluate()}
            log.info(
                f"step {result.step:6d}  val_loss {last_eval['val_loss']:.4f}  "
                f"val_accuracy {100 * last_eval['val_accuracy']:.2f} %",
                console=True,
            )
            log.metrics(last_eval)
        injector.strike(result.step)
        halted = stopper.agreed()
        if halted and checkpointer is not None and not checkpoint_due:
            # The final checkpoint of a stopped run: everything is captured at end_checkpoint.
            checkpoint_due = True
            opened = time.perf_counter()
            checkpointer.begin_checkpoint(result.step, copy_in_background=True)
            blocked = time.perf_counter() - opened
        if checkpoint_due:
            metrics = last_eval if last_eval.get("step") == result.step else {}
            closing = checkpointer.end_checkpoint(metrics, final=result.step == total_steps or bool(halted))
            blocked += closing.snapshot_s + closing.captured_early_s
            blocking_times.append(blocked)
            copies_behind = closing
            log.metrics({"step": result.step, "checkpoint_blocking_s": blocked,
                         "checkpoint_captured_during_step_s": closing.captured_early_s})
            if policy.adaptive and policy.interval == 0:
                # The profiling checkpoint: wait once for it to be durable, so the first interval
                # already accounts for how long a persist takes.
                checkpointer.wait()
                previous_durable = max(closing.durable_s.values()) if closing.durable_s else 0.0
            if policy.adaptive:
                step_time, busy_step_time, blocking, durable = _agreed_max(
                    trainer.comm, [policy.step_time, policy.busy_step_time, blocked, previous_durable])
                policy.step_time, policy.busy_step_time = step_time, busy_step_time
                change = policy.observe_checkpoint(result.step, blocking, durable or None)
                if change:
                    log.info(change, console=True)
            else:
                policy.observe_checkpoint(result.step, blocked, None)
                waited = blocked - closing.snapshot_s - closing.captured_early_s
                if waited > 0.5 * blocked > 0.01 and not warned_short_interval:
                    # At most one checkpoint is in flight: a fixed interval shorter than a persist
                    # turns the persist's duration into blocking time.
                    log.warning(f"checkpoint.every_steps = {config.checkpoint.every_steps} is shorter than a "
                                f"persist takes: step {result.step} waited {waited:.3f} s for the previous one; "
                                "use a larger interval or every_steps = \"auto\"")
                    warned_short_interval = True
        log.progress(result.step, total_steps, f"loss {result.loss:.4f}" if result.loss is not None else "")
        if halted:
            break
    if checkpointer is not None:
        last = checkpointer.wait()
        if last is not None and last.durable_s:
            log.metrics({"step": last.step, "checkpoint_durable_s": last.durable_s})
        # Node-local storage may go with the allocation: L4 gets what its retention keeps.
        checkpointer.drain()
    seconds = time.perf_counter() - started
    _summarise_checkpoints(trainer.comm, log, checkpointer, blocking_times, seconds)
    if halted:
        _report_halt(log, checkpointer, trainer.step, halted)
    digest = trainer.weights_digest()
    # One small collective proves the data-parallel invariant: every rank holds the same weights.
    digests = allgather_compact(trainer.comm, digest)  # one distinct value, sent once, where they agree
    identical = len(set(digests)) == 1
    if not identical:
        log.warning(f"weights differ across ranks after step {trainer.step}: {digests}")
    summary = TrainSummary(trainer.step, last_eval.get("val_loss"), last_eval.get("val_accuracy"), seconds, digest,
                           halted)
    accuracy = f"{100 * summary.val_accuracy:.2f} %" if summary.val_accuracy is not None else "n/a"
    log.info(f"done: {summary.steps} steps in {seconds:.1f} s, final val_accuracy {accuracy}, "
             f"weights {digest[:16]} ({'identical on all ranks' if identical else 'DIFFER across ranks'})",
             console=True)
    log.metrics({"step": trainer.step, "final": not halted, "halted": halted, "weights_digest": digest,
                 "weights_identical_on_ranks": identical, "train_seconds": seconds,
                 "val_accuracy": summary.val_accuracy, "val_loss": summary.val_loss})
    return summary


def _summarise_checkpoints(comm, log: RunLog, checkpointer, blocking_times: list[float], seconds: float) -> None:
    """(all ranks) One line per run: how many checkpoints, what they cost training, and how
    many bytes each level took (summed over ranks)."""
    import numpy as np

    if checkpointer is None:
        return
    per_level = fold_at_root(comm, checkpointer.bytes_stored, lambda stored: {
        level: sum(s.get(level, 0) for s in stored) for level in checkpointer.levels_enabled})
    blocking = np.asarray(blocking_times or [0.0])
    overhead = 100.0 * blocking.sum() / seconds if seconds else 0.0
    labels = {"local": "L1", "partner": "L2", "erasure": "L3", "pfs": "L4"}
    written = ", ".join(f"{labels[level]} {_megabytes(n)}" for level, n in per_level.items())
    log.info(f"checkpoints: {len(blocking_times)} taken, blocking median {1000 * np.median(blocking):.1f} ms, "
             f"max {1000 * blocking.max():.1f} ms, estimated overhead {overhead:.2f} % of the run's time; "
             f"written {written}", console=True)
    flush = checkpointer.pipeline.flush
    if flush is not None and flush.stats.describe():
        log.info(flush.stats.describe(), console=True)
    log.metrics({"event": "checkpoint_summary", "checkpoints": len(blocking_times),
                 "blocking_median_s": float(np.median(blocking)), "blocking_max_s": float(blocking.max()),
                 "overhead_pct": overhead, "bytes_per_level": per_level,
                 **({"l4_async": {"offered": flush.stats.offered, "skipped": flush.stats.skipped,
                                  "copied": [step for step, _ in flush.stats.copied],
                                  "lag_s": [lag for _, lag in flush.stats.copied]}} if flush is not None else {})})


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _report_halt(log: RunLog, checkpointer, step: int, reason: str) -> None:
    if checkpointer is None:
        where = "checkpoints are off (checkpoint.every_steps = 0), so this run cannot be resumed"
    elif "pfs" in checkpointer.levels_enabled:
        where = f"its final checkpoint is durable on the PFS ({checkpointer.pfs_dir})"
    else:
        where = ("its final checkpoint is on node-local storage only (the pfs level is off), "
                 "so it survives only on these nodes")
    log.info(f"stopped cleanly after step {step}: {reason}; {where}; run the same command again to continue",
             console=True)
    log.metrics({"event": "halted", "step": step, "reason": reason})
