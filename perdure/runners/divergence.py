"""Optimizer steps skipped for non-finite gradients, and when so many in a row mean the run has diverged.

`skip_nonfinite_grad` skips a step whose gradients are not finite without counting it: a loss-scale search (fp16)
or a bad batch costs a few. But once the parameters themselves are not finite (an update with a huge learning rate),
every later step is skipped too and the budget is never reached: the run would spin, writing a warning per window,
until its allocation ends. `resilience.max_consecutive_skips` steps in a row end it instead, saying so.
"""

from __future__ import annotations

import logging

from perdure.errors import PerdureError

logger = logging.getLogger("perdure")


class TrainingDivergedError(PerdureError):
    """Too many optimizer steps in a row had non-finite gradients: nothing further would be trained."""


class SkippedSteps:
    """Counts the skipped steps in a row (every rank alike: a skip is a joint decision) and stops the run at `limit`."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.in_a_row = 0

    def skipped(self, step: int, total: int) -> None:
        """A step was skipped at `step` (`total` skipped in all). Raises `TrainingDivergedError` at the limit."""
        self.in_a_row += 1
        logger.warning("non-finite gradients at step %d: optimizer step skipped (%d skipped so far)", step, total)
        if self.limit is not None and self.in_a_row >= self.limit:
            raise TrainingDivergedError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients (at step {step}, {total} skipped "
                "in all): the run has diverged, or its parameters are no longer finite, and no later step would "
                "count. Lower optim.lr or set max_grad_norm, and rerun from a checkpoint taken before it diverged "
                "(--checkpoint <run dir>/checkpoints/ckpt-...); resilience.max_consecutive_skips sets this limit "
                "(None: never stop)"
            )

    def stepped(self) -> None:
        self.in_a_row = 0
