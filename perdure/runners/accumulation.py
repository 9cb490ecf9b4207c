"""Forward and backward of one accumulation window, and how its micro-batch losses become one gradient.

`loss.normalize` says what `train_step` returns and how the window's gradient is normalised:

    mean     train_step returns a mean (over its micro-batch). The gradient is the mean of the micro-batch means,
             averaged over the data ranks (each micro-batch weighs the same, however many tokens it holds).
    tokens   train_step returns a sum (over the micro-batch's target tokens, padding excluded), and `loss_tokens(batch)`
             counts what it sums. The gradient is the sum over the whole window and every data rank divided by the
             total count, as Hugging Face Trainer's `num_items_in_batch` makes it: every target token weighs the same.

With `tokens`, the counts of the window's micro-batches are summed over all ranks (one all-reduce per window, before
its first forward), and each micro-batch's sum is multiplied by `world_size / total` before its backward: the data
parallel reduction (DDP, FSDP, DeepSpeed) averages gradients over the data ranks, and tensor-parallel peers, which read
the same batches, count the same tokens, so `world_size / total` is the same factor on every rank and exactly undoes
the average. The window's logged loss is this rank's token mean (its sums over its counts). Nothing is kept between
windows: a resumed run computes the same factors from the same batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from perdure.errors import ConfigError, PerdureError
from perdure.runners.fields import RunnerFields

NORMALIZATIONS = ("mean", "tokens")
KEY = "loss.normalize"


class AccumulationMixin(RunnerFields):
    """`forward_backward` and `loss_tokens` of BaseRunner."""

    def forward_backward(self, window: list[Any]) -> torch.Tensor:
        """Forward and backward of one accumulation window (its micro-batches, in order); returns the window's loss
        (detached) for logging: the mean of the micro-batch losses, or with `loss.normalize=tokens` the token mean.

        Called once per window with zeroed gradients, before `optimizer_step`. The default runs `train_step` per
        micro-batch inside `no_sync` and `autocast`, and `backward` on its loss scaled as `loss.normalize` says (the
        module docstring); a stack whose schedule drives forward and backward itself (pipeline parallelism)
        overrides it. Must leave the window's summed, scaled gradients in place and must not step the optimizer or
        change `self.state`.
        """
        tokens = self.config.loss.normalize == "tokens"
        counts = [self.loss_tokens(batch) for batch in window] if tokens else []
        scale = window_scale(counts, self.world_size) if tokens else None
        losses = []
        for index, batch in enumerate(window):
            with self.no_sync(last_micro_batch=index == len(window) - 1):
                with self.autocast(), self.stragglers.timing():  # this rank's own time (the slow-rank check)
                    output = self.train_step(batch)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if scale is not None:
                    self.backward(loss * scale.to(loss.dtype))
                else:
                    self.backward(loss if len(window) == 1 else loss / len(window))
            losses.append(loss.detach())
        if tokens:
            return (torch.stack(losses).double().sum() / _as_tensor(counts, losses[0].device).sum()).float()
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    def loss_tokens(self, batch: Any) -> torch.Tensor | int:
        """With `loss.normalize=tokens`: how many items `train_step`'s summed loss of this micro-batch runs over
        (target tokens, padding and ignored labels excluded), e.g. `(batch["labels"][:, 1:] != -100).sum()`.

        Called for every micro-batch of a window before the window's first forward. Must count exactly what
        `train_step` sums, may return a tensor on the device (no `.item()` needed), and must not change any state.
        """
        raise NotImplementedError


def window_scale(counts: list[torch.Tensor | int], world_size: int) -> torch.Tensor:
    """`world_size / total`, total being the window's counts summed over every rank (one all-reduce), as a float32
    tensor on the counts' device; a PerdureError when nobody counted a single token."""
    device = next((count.device for count in counts if isinstance(count, torch.Tensor)), None)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if _uses_nccl() else torch.device("cpu")
    total = _as_tensor(counts, device).sum().to(torch.float64)
    if world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    if not bool(total > 0):  # one sync per window: a window of padding only would divide by zero
        raise PerdureError(
            "loss.normalize=tokens: loss_tokens counted 0 tokens in this window on all ranks together (only padding?); "
            "check loss_tokens, or skip such batches in the dataset"
        )
    return (world_size / total).to(torch.float32)


def check_loss_normalization(runner_class: type[AccumulationMixin], config: Any) -> None:
    """Before anything is written: `loss.normalize=tokens` needs `loss_tokens` overridden, and no TorchFT replica
    groups (they average their gradients with equal weights, whatever tokens each group counted)."""
    if config.loss.normalize != "tokens":
        return
    if config.lookup("ft.enabled", False):
        fix = (
            "TorchFT replica groups average their gradients with equal weights, so each group's tokens would weigh "
            "by its own count, not the job's; use mean"
        )
        raise ConfigError(KEY, "tokens", fix)
    if runner_class.loss_tokens is not AccumulationMixin.loss_tokens:
        return
    raise ConfigError(
        KEY,
        "tokens",
        f"{runner_class.__name__} does not override loss_tokens(batch), the count of target tokens train_step's "
        "summed loss runs over (e.g. (batch['labels'][:, 1:] != -100).sum()); override it, or use mean with a "
        "train_step that returns a mean",
    )


def _as_tensor(counts: list[torch.Tensor | int], device: torch.device) -> torch.Tensor:
    return torch.stack([torch.as_tensor(count, device=device).reshape(()).to(torch.float64) for count in counts])


def _uses_nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"
