"""Default optimizer and scheduler, built from `optim.*` / `sched.*` when the user assigned none."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from perdure.errors import ConfigError


def build_optimizer(parameters: Iterable[torch.nn.Parameter], optim: Mapping[str, Any]) -> torch.optim.Optimizer:
    name = optim.get("name", "adamw")
    lr = optim.get("lr", 1e-3)
    weight_decay = optim.get("weight_decay", 0.0)
    if name in ("adamw", "adam"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(
            parameters,
            lr=lr,
            betas=tuple(optim.get("betas", (0.9, 0.999))),
            eps=optim.get("eps", 1e-8),
            weight_decay=weight_decay,
        )
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=optim.get("momentum", 0.0), weight_decay=weight_decay)
    raise ConfigError("optim.name", name, "use one of adamw, adam, sgd, or assign self.optimizer yourself")


def build_scheduler(
    optimizer: torch.optim.Optimizer, sched: Mapping[str, Any], total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """A per-optimizer-step LambdaLR: linear warmup, then constant, cosine or linear decay to `min_lr_ratio`."""
    name = sched.get("name", "none")
    if name in (None, "none"):
        return None
    warmup = int(sched.get("warmup_steps", 0) or 0)
    floor = float(sched.get("min_lr_ratio", 0.0) or 0.0)
    if name not in ("constant", "cosine", "linear"):
        raise ConfigError("sched.name", name, "use one of none, constant, cosine, linear")
    return _ConfiguredLambdaLR(optimizer, _Schedule(name, warmup, max(total_steps, 1), floor))


class _ConfiguredLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR whose curve always comes from the config: its checkpoint keeps the position, not the curve.

    Plain LambdaLR would restore the schedule's parameters (its total length) from the checkpoint, so a run
    extended with a larger budget would keep decaying towards the old one. Pin `sched.total_steps` to keep a curve
    fixed across extensions.
    """

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The learning rate of the next step follows this config's curve (identical to the saved one when the
        # budget did not change, so an exact resume stays exact).
        rates = [base * schedule(self.last_epoch) for base, schedule in zip(self.base_lrs, self.lr_lambdas)]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        self._last_lr = rates


class _Schedule:
    """Picklable learning-rate multiplier (a lambda would not survive a process-based save)."""

    def __init__(self, name: str, warmup: int, total: int, floor: float) -> None:
        self.name, self.warmup, self.total, self.floor = name, warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "constant":
            return 1.0
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        if self.name == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return self.floor + (1.0 - self.floor) * decay
