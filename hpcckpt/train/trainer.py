"""The SPMD data-parallel training loop (all ranks run it in lockstep).

Each step: the global batch is split across ranks, every rank runs forward and backward on
its part, gradients are summed with bucketed non-blocking allreduce (pre-scaled so the sum is
the global mean) and every rank applies the same update, so weights stay identical everywhere.
The trainer knows checkpoints only through the small library API (protect, register_state,
checkpoint, restart), the same one outside code uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hpcckpt.train.allreduce import GradientAllreduce
from hpcckpt.train.data import ResumableBatches, load_dataset, rank_slice
from hpcckpt.train.embedding import ShardedEmbedding
from hpcckpt.train.kernels import softmax_cross_entropy
from hpcckpt.train.models import build_model
from hpcckpt.train.optim import build_optimizer

EVAL_BATCH = 1024


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # global mean loss (summed in the gradients' dtype)
    seconds: float
    samples: int
    finite: bool = True  # the allreduced gradients and the loss were finite


class Trainer:
    def __init__(self, config, comm, backend, log, step_hooks=()):
        self.config = config
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.backend = backend
        self.xp = backend.xp
        self.log = log
        self.step_hooks = tuple(step_hooks)
        # Called with the step's number once every gradient is reduced and before the first
        # parameter changes (Checkpointer.commit_step): the survivors of a rank's death then
        # hold the same finished step. None: updates overlap the reductions still running.
        self.commit_step = None
        self.dataset = load_dataset(config.data, config.run.seed)
        init_rng = np.random.default_rng([config.run.seed, 0x1417])
        # The embedding model's rows live on the rank their id hashes to (train/embedding.py).
        self.embedding = ShardedEmbedding(comm, config.model.embedding_dim, config.model.dtype, config.run.seed) \
            if config.model.kind == "embedding" else None
        embedded = self.dataset.fields * config.model.embedding_dim if self.embedding is not None else 0
        self.model = build_model(config.model, self.dataset.input_shape, self.dataset.n_classes, self.xp, init_rng,
                                 embedded=embedded)
        self.parameters = dict(self.model.parameters())
        self.optimizer = build_optimizer(config.optimizer, self.model.parameters(), self.xp)
        self.batches = ResumableBatches(self.dataset.train.size, config.data.batch_size, config.run.seed)
        self.allreduce = GradientAllreduce(
            comm, self.model.parameters(), config.optimizer.bucket_kb * 1024, backend
        )
        # Reserved for random choices made during training (e.g. augmentation); saved and restored.
        self.rng = np.random.default_rng([config.run.seed, 0x7A1])
        self.step = 0

    # -- state the checkpoint engine saves -------------------------------------------------
    def protected_arrays(self) -> list[tuple[str, object]]:
        return [(f"model/{n}", a) for n, a in self.model.parameters()] + [
            (f"optim/{n}", a) for n, a in self.optimizer.state_arrays()
        ]

    def training_state(self) -> dict:
        return {
            "step": self.step,
            "data": self.batches.state(),
            "rng": self.rng.bit_generator.state,
            "optimizer": self.optimizer.scalar_state(),
        }

    def load_training_state(self, state: dict) -> None:
        self.step = int(state["step"])
        self.batches.load_state(state["data"])
        self.rng.bit_generator.state = state["rng"]
        self.optimizer.load_scalar_state(state["optimizer"])

    # -- one step --------------------------------------------------------------------------
    def train_step(self, corrupt=None) -> StepResult:
        """One step. The step's global mean loss rides in the gradient allreduce (every rank
        gets the same value, every step, with no message of its own), and the allreduce says
        whether the reduced gradients and the loss were finite (`finite`, alike on every rank). `corrupt`: an injected nan or spike fault for this rank's step (faults.py)."""
        started = time.perf_counter()
        global_batch = self.batches.next_global_batch()
        local = global_batch[rank_slice(len(global_batch), self.world_size, self.rank)]
        inputs, labels = self.dataset.train.rows(local)
        if corrupt is not None and corrupt.kind == "spike":
            inputs = inputs * np.asarray(corrupt.factor, dtype=inputs.dtype)  # a bad batch
        inputs = self._with_embeddings(self.dataset.train, local, inputs, train=True)
        x = self.backend.from_host(inputs)
        y = self.backend.from_host(labels)
        logits = self.model.forward(x, train=True)
        if len(local):
            local_loss, grad_logits = softmax_cross_entropy(logits, y)
        else:
            local_loss, grad_logits = 0.0, self.xp.zeros_like(logits)
        # Weight by this rank's share so the allreduce SUM is the exact global mean, even for
        # the smaller last batch of an epoch split unevenly across ranks.
        share = len(local) / len(global_batch)
        grad_logits *= share
        if corrupt is not None and corrupt.kind == "nan":
            grad_logits *= float("nan")
        self.allreduce.add_scalar(float(local_loss) * share)
        for name, grad in self.model.backward(grad_logits):
            self.allreduce.add(name, grad)
        if self.embedding is not None:  # its rows' gradients go to their owners while the buckets reduce
            dense = inputs.shape[1] - self.embedding.dim * self.dataset.fields
            self.embedding.backward(self.backend.to_host(self.model.input_grad[:, dense:]), self.config.optimizer.lr)
        reduced = self.allreduce.reduced()
        if self.commit_step is not None:
            reduced = list(reduced)
            self.commit_step(self.step + 1)
        for name, reduced_grad in reduced:
            for hook in self.step_hooks:
                hook.before_update(name)
            self.optimizer.update(name, self.parameters[name], reduced_grad)
            for hook in self.step_hooks:
                hook.after_update(name)
        self.step += 1
        loss = self.allreduce.scalar
        self.backend.synchronize()
        return StepResult(self.step, loss, time.perf_counter() - started, len(global_batch), self.allreduce.finite)

    def _with_embeddings(self, split, indices, inputs, train: bool):
        """The dense features, each sample's fields' embedding rows appended (embedding model)."""
        if self.embedding is None:
            return inputs
        rows = self.embedding.lookup(split.categorical(indices), train)
        dense = np.asarray(inputs, self.model.dtype).reshape(len(inputs), int(np.prod(self.dataset.input_shape)))
        return np.concatenate([dense, rows.astype(self.model.dtype, copy=False)], axis=1)

    def skip_batches(self, count: int) -> None:
        """Advance the data past `count` global batches without training on them."""
        for _ in range(count):
            self.batches.next_global_batch()

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """(all ranks) Validation split across ranks; sums combined with one allreduce."""
        val = self.dataset.val
        mine = np.arange(val.size)[rank_slice(val.size, self.world_size, self.rank)]
        totals = np.zeros(3)  # loss sum, correct, count
        # As many batches on every rank (the embedding lookups are collective), some empty.
        largest = -(-val.size // self.world_size)
        for start in range(0, max(largest, 1), EVAL_BATCH):
            indices = mine[start: start + EVAL_BATCH]
            if not len(indices) and self.embedding is None:
                continue
            inputs, labels = val.rows(indices)
            inputs = self._with_embeddings(val, indices, inputs, train=False)
            if not len(indices):
                continue
            logits = self.model.forward(self.backend.from_host(inputs), train=False)
            loss, _ = softmax_cross_entropy(logits, self.backend.from_host(labels))
            predicted = self.backend.to_host(logits.argmax(axis=1))
            totals += (loss * len(indices), float(np.sum(predicted == labels)), len(indices))
        from mpi4py import MPI

        summed = np.empty_like(totals)
        self.comm.Allreduce(totals, summed, op=MPI.SUM)
        return {"val_loss": summed[0] / summed[2], "val_accuracy": summed[1] / summed[2]}

    def weights_on_host(self) -> dict[str, np.ndarray]:
        return {n: self.backend.to_host(a) for n, a in self.model.parameters()}

    def weights_digest(self) -> str:
        """xxh3-128 over every parameter's bytes in order: equal digests mean bit-equal weights."""
        import xxhash

        digest = xxhash.xxh3_128()
        for name, array in self.weights_on_host().items():
            digest.update(name.encode())
            digest.update(np.ascontiguousarray(array).view(np.uint8))
        return digest.hexdigest()
