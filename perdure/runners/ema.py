"""Exponential moving average of a model's parameters and floating-point buffers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from perdure.private_api import foreach_lerp_
from perdure.runners.compile import plain_state_dict


def average_into(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], decay: float) -> None:
    """For each (shadow, value): `shadow = decay * shadow + (1 - decay) * value` in one fused lerp over the
    floating-point shadows; any other shadow (an integer buffer) takes the value."""
    averaged, targets = [], []
    for shadow, value in pairs:
        if shadow.is_floating_point():
            averaged.append(shadow)
            targets.append(value.to(shadow.dtype))
        else:
            shadow.copy_(value)
    if averaged:
        foreach_lerp_(averaged, targets, 1.0 - decay)


class ExponentialMovingAverage:
    """Keeps `shadow = decay * shadow + (1 - decay) * current` for every floating-point tensor of a module.

    Integer buffers (e.g. BatchNorm's `num_batches_tracked`) are copied, not averaged. The shadow lives on the
    model's device and is saved and restored with the checkpoint. Its names are the plain ones, also for a model
    compiled with `torch.compile` (`perdure.runners.compile.plain_state_dict`).
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {
            name: tensor.detach().clone() for name, tensor in plain_state_dict(model).items()
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        current = plain_state_dict(model)
        average_into(((shadow, current[name].detach()) for name, shadow in self.shadow.items()), self.decay)

    def to(self, device: torch.device) -> ExponentialMovingAverage:
        """Move the shadows to `device` (the model's), where `update` averages them."""
        self.shadow = {name: tensor.to(device) for name, tensor in self.shadow.items()}
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, tensor in state["shadow"].items():
            self.shadow[name].copy_(tensor)

    def weights(self) -> dict[str, torch.Tensor]:
        """The averaged weights as a state dict for the model."""
        return dict(self.shadow)
