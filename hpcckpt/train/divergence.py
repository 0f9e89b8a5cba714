"""A run that diverges rolls itself back.

The check (DivergenceCheck, pure): a step diverged when its allreduced gradients or its loss
are not finite, or, with `resilience.divergence_factor` F > 0, when its loss is above F times
the median loss of the last LOSS_HISTORY healthy steps (once MIN_HISTORY are known). The loss
and the gradients are the allreduced ones, the same on every rank, so every rank decides alike
with no collective of its own. The history travels with each version (registered state), so a
restarted or rewound run judges its steps against the same past as an uninterrupted one.

What follows (Rewinds): the step is never checkpointed; the run rewinds in process to the
newest version before it (Checkpointer.rewind, which goes further back when the run diverges
again from the version it was just rewound to) and, when the replay comes back to where the
trouble started, skips the `resilience.skip_batches_on_rewind` batches that led to it. More
than `max_rewinds` rewinds within `rewind_window_steps` steps stop the run (exit 2), naming
the steps.
"""

from __future__ import annotations

import math
import statistics

from hpcckpt.errors import DivergenceError

LOSS_HISTORY = 20  # healthy steps whose median loss a spike is measured against
MIN_HISTORY = 5  # healthy steps known before a spike can be called one


class DivergenceCheck:
    def __init__(self, factor: float):
        self.factor = factor
        self.losses: list[float] = []

    def verdict(self, step: int, loss: float, gradients_finite: bool) -> str | None:
        """Why step `step` diverged, or None for a healthy step (its loss joins the history)."""
        if not gradients_finite:
            return f"non-finite gradients at step {step}"
        if not math.isfinite(loss):
            return f"non-finite loss ({loss}) at step {step}"
        if self.factor > 0 and len(self.losses) >= MIN_HISTORY:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                return (f"loss spike at step {step}: {loss:.4g}, above {self.factor:g} x the median {median:.4g} "
                        f"of the last {len(self.losses)} steps")
        self.losses = (self.losses + [float(loss)])[-LOSS_HISTORY:]
        return None

    def state(self) -> dict:
        return {"losses": list(self.losses)}

    def load_state(self, state: dict) -> None:
        self.losses = [float(x) for x in state.get("losses", ())][-LOSS_HISTORY:]


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

    def diverged(self, step: int, checkpointer, reason: str | None = None) -> int:
        """(all ranks) Step `step` diverged (`reason` says how): rewind, or stop when that is
        not allowed or too many rewinds came too close. Returns the step the run goes on from."""
        reason = reason or f"non-finite gradients at step {step}"
        self.diverged_at.append(step)
        if not self.enabled:
            raise DivergenceError(f"step {step}: the run diverged ({reason}); set resilience.rewind_on_divergence = "
                                  "true to rewind to the newest version before it and skip the batches that led "
                                  "to it")
        recent = [s for s in self.diverged_at if s > step - self.window]
        if len(recent) > self.max_rewinds:
            raise DivergenceError(f"the run diverged {len(recent)} times within {self.window} steps (at steps "
                                  f"{recent}), more than resilience.max_rewinds = {self.max_rewinds}: stopping; "
                                  f"look at the data and learning rate around those steps (the last: {reason})")
        if checkpointer is None:
            raise DivergenceError(f"step {step}: the run diverged ({reason}) and checkpoints are off "
                                  "(checkpoint.every_steps = 0): nothing to rewind to")
        back = checkpointer.rewind(step, reason)
        skip = max(1, self.skip)
        self._skip_from = max(back, step - skip)
        self._skip_count = step - self._skip_from
        self.log.metrics({"event": "diverged", "step": step, "rewound_to": back, "skipping": self._skip_count,
                          "reason": reason})
        return back
