"""`hpcckpt train`: the job as a whole — set-up, the step loop, evaluation and reporting."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hpcckpt.cluster.backend import select_backend
from hpcckpt.ckpt.engine import Checkpointer
from hpcckpt.cluster.placement import discover_topology, local_dir_of
from hpcckpt.faults import FaultInjector
from hpcckpt.runlog import RunLog
from hpcckpt.train.trainer import Trainer


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    val_loss: float | None
    val_accuracy: float | None
    seconds: float
    weights_digest: str


def run_training(config, comm, restart: str = "auto", faults=()) -> TrainSummary:
    """(all ranks) Train for run.steps steps, resuming from a checkpoint per `restart`."""
    rank, world_size = comm.Get_rank(), comm.Get_size()
    topology = discover_topology(comm, config.cluster.simulated_nodes)
    log = RunLog(config.run.dir, rank, world_size)
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
            config.storage.local_dir, str(config.run.dir), topology, rank))
        if config.checkpoint.every_steps:
            checkpointer = Checkpointer(comm, config, topology=topology, log=log, faults=injector)
            for name, array in trainer.protected_arrays():
                checkpointer.protect(name, array)
            checkpointer.register_state("trainer", trainer.training_state, trainer.load_training_state)
            restored = checkpointer.restart(restart)
            if restored is None:
                log.info("starting from scratch (no checkpoint to resume from)", console=True)
        try:
            summary = _step_loop(config, trainer, log, checkpointer, injector)
        finally:
            if checkpointer is not None:
                checkpointer.close()
        return summary
    finally:
        log.close()


def _step_loop(config, trainer: Trainer, log: RunLog, checkpointer, injector) -> TrainSummary:
    total_steps = config.run.steps
    log_every = config.run.log_every
    eval_every = config.eval.every_steps
    started = time.perf_counter()
    window_time, window_samples, window_steps = 0.0, 0, 0
    last_eval: dict = {}
    while trainer.step < total_steps:
        next_step = trainer.step + 1
        report = next_step % log_every == 0 or next_step == total_steps
        result = trainer.train_step(reduce_loss=report)
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
        if checkpointer is not None and _checkpoint_due(config, result.step):
            metrics = last_eval if last_eval.get("step") == result.step else {}
            checkpointer.checkpoint(result.step, metrics, final=result.step == total_steps)
        log.progress(result.step, total_steps, f"loss {result.loss:.4f}" if result.loss is not None else "")
    if checkpointer is not None:
        checkpointer.wait()
    seconds = time.perf_counter() - started
    digest = trainer.weights_digest()
    # One small collective proves the data-parallel invariant: every rank holds the same weights.
    digests = trainer.comm.allgather(digest)
    identical = len(set(digests)) == 1
    if not identical:
        log.warning(f"weights differ across ranks after step {trainer.step}: {digests}")
    summary = TrainSummary(trainer.step, last_eval.get("val_loss"), last_eval.get("val_accuracy"), seconds, digest)
    accuracy = f"{100 * summary.val_accuracy:.2f} %" if summary.val_accuracy is not None else "n/a"
    log.info(f"done: {summary.steps} steps in {seconds:.1f} s, final val_accuracy {accuracy}, "
             f"weights {digest[:16]} ({'identical on all ranks' if identical else 'DIFFER across ranks'})",
             console=True)
    log.metrics({"step": trainer.step, "final": True, "weights_digest": digest,
                 "weights_identical_on_ranks": identical, "train_seconds": seconds,
                 "val_accuracy": summary.val_accuracy, "val_loss": summary.val_loss})
    return summary


def _checkpoint_due(config, step: int) -> bool:
    every = config.checkpoint.every_steps
    return bool(every) and (step % every == 0 or step == config.run.steps)
