"""A run that diverges rolls itself back: a step whose allreduced gradients are not finite
(every rank sees the same values, so every rank decides alike with no collective of its own)
is never checkpointed; the run rewinds in process to the newest version before it
(Checkpointer.rewind) and, when it comes back to where the trouble started, skips the
`resilience.skip_batches_on_rewind` batches that led to it. More than `max_rewinds` rewinds
within `rewind_window_steps` steps stop the run (exit 2), naming the steps.
"""

from __future__ import annotations

from hpcckpt.errors import DivergenceError


class Rewinds:
    def __init__(self, resilience, log):
        self.enabled = resilience.rewind_on_divergence
        self.skip = resilience.skip_batches_on_rewind
        self.max_rewinds = resilience.max_rewinds
        self.window = resilience.rewind_window_steps
        self.log = log
        self.diverged_at: list[int] = []
        self._skip_from: int | None = None  # the step after which the skipped batches begin
        self._skip_count = 0

    def before_step(self, trainer) -> None:
        """Skip the batches that led to the last divergence, once the replay reaches them."""
        if self._skip_from is not None and trainer.step >= self._skip_from:
            trainer.skip_batches(self._skip_count)
            self.log.info(f"skipped {self._skip_count} batch(es) that led to the divergence at step "
                          f"{self.diverged_at[-1]}", console=True)
            self._skip_from, self._skip_count = None, 0

    def diverged(self, step: int, checkpointer) -> int:
        """(all ranks) Step `step` went non-finite: rewind, or stop when that is not allowed
        or too many rewinds came too close. Returns the step the run goes on from."""
        self.diverged_at.append(step)
        if not self.enabled:
            raise DivergenceError(f"step {step}: the gradients are not finite (NaN or inf): the run diverged; set "
                                  "resilience.rewind_on_divergence = true to rewind to the newest version before "
                                  "it and skip the batches that led to it")
        recent = [s for s in self.diverged_at if s > step - self.window]
        if len(recent) > self.max_rewinds:
            raise DivergenceError(f"the run diverged {len(recent)} times within {self.window} steps (at steps "
                                  f"{recent}), more than resilience.max_rewinds = {self.max_rewinds}: stopping; "
                                  "look at the data and learning rate around those steps")
        if checkpointer is None:
            raise DivergenceError(f"step {step}: the gradients are not finite and checkpoints are off "
                                  "(checkpoint.every_steps = 0): nothing to rewind to")
        back = checkpointer.rewind(step, f"non-finite gradients at step {step}")
        skip = max(1, self.skip)
        self._skip_from = max(back, step - skip)
        self._skip_count = step - self._skip_from
        self.log.metrics({"event": "diverged", "step": step, "rewound_to": back, "skipping": self._skip_count})
        return back
