"""Loss parallelism under tensor parallelism (`parallel.loss_parallel`), and the hint for the error without it.

A tensor-parallel plan may leave the model's output (the logits) sharded over the vocabulary, as a DTensor
(`ColwiseParallel(use_local_output=False)` on the output layer, as TorchTitan's plan does with loss parallelism):
gathering logits of a large vocabulary costs memory and time. Torch's `loss_parallel()` context computes the
cross-entropy on the shards; the loss and its backward must both run inside it, so the runner enters it around the
whole forward and backward of a window (and around evaluation), only when the tensor axis is > 1 (on one tensor rank
the plan is not applied and the logits are a plain tensor).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

from perdure.errors import PerdureError


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """Torch's `loss_parallel()` when `enabled`; either way, torch's error for a loss that mixes a sharded output with
    a plain target re-raised with the fix."""
    from torch.distributed.tensor.parallel import loss_parallel

    try:
        with loss_parallel() if enabled else nullcontext():
            yield
    except RuntimeError as error:
        if "mixed torch.Tensor and DTensor" not in str(error):
            raise
        fix = (
            "the loss was computed outside loss parallelism: with tensor parallelism and a plan that leaves the "
            "logits sharded, set --parallel.loss_parallel true"
            if not enabled
            else "loss parallelism handles the cross-entropy only: compute the rest of the loss on plain tensors"
        )
        raise PerdureError(
            f"the loss mixes a DTensor (the model's output, sharded by its tensor-parallel plan) with a plain tensor: "
            f"{fix}, or let the plan's output layer return a local tensor (use_local_output=True, which gathers the "
            f"logits). Torch said: {error}"
        ) from error


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (what a loss under loss parallelism is) as a plain tensor, for logging."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
