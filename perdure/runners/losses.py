"""The train losses between two log lines: device tensors in the loop, plain numbers in a checkpoint.

The loop appends each step's loss as the tensor it is (no `.item()`, so no device sync per step). A checkpoint carries
the ones not yet logged as plain floats (`RunnerState.pending_losses`), whatever device they were on, and a resumed run
puts them back in front of its own; the log line then averages both exactly as the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def losses_as_floats(losses: Sequence[torch.Tensor | float]) -> list[float]:
    """The losses as Python floats, in order: one device sync for all the tensors among them (at save time)."""
    tensors = [loss.detach().reshape(()) for loss in losses if isinstance(loss, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(values) if isinstance(loss, torch.Tensor) else float(loss) for loss in losses]


def mean_loss(losses: Sequence[torch.Tensor | float]) -> float:
    """The mean of the losses since the last log line (at log time; one device sync).

    Floats carried over a resume come first; they are turned back into a tensor of the dtype and device of the
    run's own losses, so the mean is the same reduction over the same values as in a run that never stopped.
    """
    carried = [loss for loss in losses if not isinstance(loss, torch.Tensor)]
    tensors = [loss for loss in losses if isinstance(loss, torch.Tensor)]
    if not carried:
        return torch.stack(tensors).mean().item()
    if not tensors:  # not reached by the loop, which logs right after a step; float32, the usual loss dtype
        return torch.tensor(carried).mean().item()
    like = tensors[0]
    own = torch.stack(tensors).reshape(-1)
    values = torch.cat([torch.tensor(carried, dtype=like.dtype, device=like.device), own])
    return values.mean().item()
