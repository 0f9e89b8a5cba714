"""The trainer's part of a rewind after a divergence (the rest is the library's,
schedule/divergence.py): when the replay comes back to where the trouble started, the batches that
led to it are skipped (resilience.skip_batches_on_rewind)."""

from __future__ import annotations

from hpcckpt.schedule.divergence import Rewound


class SkippedBatches:
    def __init__(self, log):
        self.log = log
        self._pending: Rewound | None = None

    def after(self, rewound: Rewound) -> None:
        """A rewind happened: skip its batches once the replay reaches them."""
        self._pending = rewound

    def before_step(self, trainer) -> None:
        pending = self._pending
        if pending is not None and trainer.step >= pending.skip_from:
            trainer.skip_batches(pending.skip_count)
            self.log.info(f"skipped {pending.skip_count} batch(es) that led to the divergence at step "
                          f"{pending.diverged_at}", console=True)
            self._pending = None
