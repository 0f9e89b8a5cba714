"""A run that diverges rolls itself back: the library's part, for any application
(Checkpointer.observe), the trainer's among them.

The check (DivergenceCheck, pure): a step diverged when its loss (any value that must stay
finite: a residual, a change) is not finite, when the application says the step was not
finite (the trainer: its allreduced gradients), or, with `resilience.divergence_factor` F > 0,
when the loss is above F times the median of the last LOSS_HISTORY healthy steps (once
MIN_HISTORY are known). The application hands in values that are the same on every rank (an
allreduced loss), so every rank decides alike with no collective of its own. The history
travels with each version (the engine's own state), so a restarted or rewound run judges its
steps against the same past as an uninterrupted one.

What follows (DivergencePolicy): without `resilience.rewind_on_divergence`, the run stops (exit
2). With it, the step is never checkpointed and the run rewinds in process to the newest
version before it (Checkpointer.rewind, which goes further back when the run diverges again
from the version it was just rewound to); the application is told which of the steps that led
to the divergence to skip when the replay reaches them (`resilience.skip_batches_on_rewind`:
the trainer skips their batches). More than `max_rewinds` rewinds within `rewind_window_steps`
steps stop the run (exit 2), naming the steps.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from hpcckpt.errors import DivergenceError

LOSS_HISTORY = 20  # healthy steps whose median loss a spike is measured against
MIN_HISTORY = 5  # healthy steps known before a spike can be called one


class DivergenceCheck:
    def __init__(self, factor: float):
        self.factor = factor
        self.losses: list[float] = []

    def verdict(self, step: int, loss: float, gradients_finite: bool = True) -> str | None:
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


@dataclass(frozen=True)
class Rewound:
    """What Checkpointer.observe did after a step that diverged: the version restored, and the
    steps whose inputs to skip when the replay reaches them (after step `skip_from`, the next
    `skip_count`)."""

    step: int
    diverged_at: int
    reason: str
    skip_from: int
    skip_count: int


class DivergencePolicy:
    """Whether a divergence may be rewound, and what the replay skips."""

    def __init__(self, resilience):
        self.check = DivergenceCheck(resilience.divergence_factor)
        self.enabled = resilience.rewind_on_divergence
        self.skip = resilience.skip_batches_on_rewind
        self.max_rewinds = resilience.max_rewinds
        self.window = resilience.rewind_window_steps
        self.diverged_at: list[int] = []
        self.rewound_to: int | None = None  # the version the last rewind restored

    def admit(self, step: int, reason: str) -> None:
        """Step `step` diverged: raise DivergenceError unless a rewind is allowed now."""
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

    def rewound(self, step: int, back: int, reason: str) -> Rewound:
        """The replay from version `back` skips the steps that led to the divergence at
        `step` (at least that one, none it does not replay)."""
        skip_from = max(back, step - max(1, self.skip))
        return Rewound(back, step, reason, skip_from, step - skip_from)
