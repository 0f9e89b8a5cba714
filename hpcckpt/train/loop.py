"""`hpcckpt train`: the job as a whole — set-up, the step loop, evaluation and reporting."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.ckpt.engine import Checkpointer
from hpcckpt.schedule.policy import checkpoints_enabled
from hpcckpt.schedule.stopping import HALT_FILE_NAME, StopRequests
from hpcckpt.cluster.backend import select_backend
from hpcckpt.cluster.collectives import allgather_compact
from hpcckpt.cluster.placement import discover_topology, local_dir_of
from hpcckpt.errors import ConfigError
from hpcckpt.faults import FaultInjector
from hpcckpt.runlog import RunLog
from hpcckpt.schedule.divergence import DivergenceCheck
from hpcckpt.errors import DivergenceError
from hpcckpt.train.divergence import SkippedBatches
from hpcckpt.train.embedding import TABLE_NAME
from hpcckpt.train.trainer import Trainer


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    val_loss: float | None
    val_accuracy: float | None
    seconds: float
    weights_digest: str
    halted: str | None = None  # why the run stopped early on request (signal, allocation end, halt file)


def run_training(config, comm, restart: str = "auto", faults=(), init_from: str | None = None,
                 init_optimizer: bool = False) -> TrainSummary:
    """(all ranks) Train for run.steps steps, resuming from a checkpoint per `restart`; a new
    run (no checkpoint of its own) starts from `init_from`'s weights (and optimizer state with
    `init_optimizer`) when given. When to checkpoint and when to stop are the library's
    (Checkpointer.planned/due/stopping, as for any application)."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    topology = discover_topology(comm, config.cluster.simulated_nodes, config.cluster.failure_domains,
                                  config.cluster.simulated_domains)
    log = RunLog(config.run.dir, rank, world_size)
    checkpointer = stops = None
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
        injector = FaultInjector(faults, rank, node, local_dir_of(
            config.storage.local_dir, str(config.run.dir), topology, rank), comm=comm,
            memory_dir=local_dir_of(config.storage.memory_dir, str(config.run.dir), topology, rank)
            if config.storage.memory_dir else None)
        if not checkpoints_enabled(config.checkpoint):
            if init_from:
                raise ConfigError(f"--init-from {init_from}: checkpoints are off (checkpoint.every_steps = 0); the "
                                  "loaded state would not be protected: set checkpoint.every_steps")
            # No checkpoints, but a stop request still ends the run after an agreed step.
            stops = StopRequests(comm, config.run.end_time, config.run.halt_seconds,
                                 Path(config.run.dir) / HALT_FILE_NAME).install(log)
            stops.post()  # a stop asked for during set-up is agreed after the first step
        else:
            checkpointer = Checkpointer(comm, config, topology=topology, log=log, faults=injector)
            _protect(checkpointer, trainer)
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
            elif init_from:
                log.info(f"--init-from {init_from} is not used: this run resumes from its own version {restored}",
                         console=True)
            if restored is not None:
                _record_restored(trainer, log, restored)
        summary = _step_loop(config, trainer, log, checkpointer, injector, stops)
        if checkpointer is not None:
            # Node-local storage may go with the allocation: close() leaves the newest versions
            # on L4 (those its retention keeps), and says what checkpoints cost the run.
            checkpointer.close()
        return _report_end(trainer, log, summary, checkpointer is None)
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if stops is not None:
            stops.close()
        log.close()


def _protect(checkpointer: Checkpointer, trainer: Trainer) -> None:
    for name, array in trainer.protected_arrays():
        checkpointer.protect(name, array)
    checkpointer.register_state("trainer", trainer.training_state, trainer.load_training_state)
    if trainer.embedding is not None:
        checkpointer.protect_table(TABLE_NAME, trainer.embedding.table)
    trainer.step_hooks = (CaptureAfterUpdate(checkpointer, trainer),)
    if checkpointer.survives_rank_loss and trainer.embedding is None:
        # Every parameter and optimizer array is replicated: after a rank's death the
        # survivors go on from the step they hold, with no version read.
        trainer.commit_step = checkpointer.commit_step


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


def _record_restored(trainer: Trainer, log: RunLog, step: int, rewound: bool = False) -> None:
    """What was loaded, bit for bit (rank 0): a run's history can be checked against the
    versions' exports."""
    if trainer.rank == 0:
        log.metrics({"event": "restored_weights", "step": step, "weights_digest": trainer.weights_digest(),
                     **({"rewound": True} if rewound else {})})


def _step_loop(config, trainer: Trainer, log: RunLog, checkpointer: Checkpointer | None, injector,
               stops: StopRequests | None) -> TrainSummary:
    total_steps = config.run.steps
    log_every = config.run.log_every
    eval_every = config.eval.every_steps
    started = time.perf_counter()
    window_time, window_samples, window_steps = 0.0, 0, 0
    last_eval: dict = {}
    halted = None
    skipped = SkippedBatches(log)
    # Without checkpoints nothing can be rewound: a divergence only stops the run.
    unprotected = DivergenceCheck(config.resilience.divergence_factor) if checkpointer is None else None
    while trainer.step < total_steps:
        skipped.before_step(trainer)
        next_step = trainer.step + 1
        report = next_step % log_every == 0 or next_step == total_steps
        if checkpointer is not None and checkpointer.planned(next_step, last=next_step == total_steps):
            # Opened before the step, so each parameter's shard is captured right after its update.
            checkpointer.begin_checkpoint(next_step, copy_in_background=True)
        result = trainer.train_step(injector.corruption(next_step))
        if checkpointer is None:
            diverged = unprotected.verdict(result.step, result.loss, result.finite)
            if diverged:
                raise DivergenceError(f"step {result.step}: the run diverged ({diverged}) and checkpoints are off "
                                      "(checkpoint.every_steps = 0): nothing to rewind to")
        else:
            rewound = checkpointer.observe(result.step, result.loss, result.finite)
            if rewound is not None:  # never checkpointed: rewound, the open snapshot dropped
                skipped.after(rewound)
                _record_restored(trainer, log, rewound.step, rewound=True)
                window_time, window_samples, window_steps = 0.0, 0, 0
                continue
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
        if checkpointer is not None:
            if checkpointer.due(result.step, last=result.step == total_steps, step_seconds=result.seconds):
                # The step's loss goes with the version: a restore checks the arrays of a version
                # whose loss was finite for NaN and inf (checkpoint.verify_finite).
                checkpointer.checkpoint(result.step, {"loss": result.loss,
                                                      **(last_eval if last_eval.get("step") == result.step else {})})
            halted = checkpointer.stopping
        else:
            log.heartbeat(result.step)  # (the checkpointer's due() writes it otherwise)
            halted = stops.step_over()
        log.progress(result.step, total_steps, f"loss {result.loss:.4f}")
        if halted:
            break
    return TrainSummary(trainer.step, last_eval.get("val_loss"), last_eval.get("val_accuracy"),
                        time.perf_counter() - started, "", halted)


def _report_end(trainer: Trainer, log: RunLog, summary: TrainSummary, checkpoints_off: bool) -> TrainSummary:
    """(all ranks) The run's last lines: a stop without checkpoints, the weights' digest
    (compared across ranks: one small collective proves the data-parallel invariant), the
    final metrics record."""
    if summary.halted and checkpoints_off:
        log.info(f"stopped cleanly after step {trainer.step}: {summary.halted}; checkpoints are off "
                 "(checkpoint.every_steps = 0), so this run cannot be resumed", console=True)
        log.metrics({"event": "halted", "step": trainer.step, "reason": summary.halted})
    digest = trainer.weights_digest()
    digests = allgather_compact(trainer.comm, digest)  # one distinct value, sent once, where they agree
    identical = len(set(digests)) == 1
    if not identical:
        log.warning(f"weights differ across ranks after step {trainer.step}: {digests}")
    summary = dataclasses.replace(summary, weights_digest=digest)
    seconds = summary.seconds
    accuracy = f"{100 * summary.val_accuracy:.2f} %" if summary.val_accuracy is not None else "n/a"
    table = {}
    if trainer.embedding is not None:  # every rank's rows, by id, in rank order: compared on as many ranks
        rows_and_hash = trainer.embedding.table.digest(trainer.comm)
        table = {"table_digest": rows_and_hash, "table_rows": int(rows_and_hash.split(":")[0])}
    log.info(f"done: {summary.steps} steps in {seconds:.1f} s, final val_accuracy {accuracy}, "
             f"weights {digest[:16]} ({'identical on all ranks' if identical else 'DIFFER across ranks'})"
             + (f", embedding table {table['table_digest']} ({table['table_rows']} rows)" if table else ""),
             console=True)
    log.metrics({"step": trainer.step, "final": not summary.halted, "halted": summary.halted, "weights_digest": digest,
                 "weights_identical_on_ranks": identical, "train_seconds": seconds,
                 "val_accuracy": summary.val_accuracy, "val_loss": summary.val_loss, **table})
    return summary
