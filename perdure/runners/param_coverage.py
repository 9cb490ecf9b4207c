"""The check that the optimizer trains exactly the model: made once, before the first step, on every stack.

Every parameter of the model with `requires_grad` must be in exactly one parameter group of the optimizer, and every
tensor the optimizer holds must be a parameter of the model. Anything else trains a different model than the one that
is saved: a parameter left out never changes (a block silently frozen), one held twice is stepped twice, and a tensor
outside the model is stepped but never checkpointed (a resume would lose it).
"""

from __future__ import annotations

import torch
from torch import nn

from perdure.errors import ConfigError
from perdure.runners.rebind import unwrapped_name

SHOWN = 5  # names an error lists before "..."


def check_parameter_coverage(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Refuse, with a ConfigError naming the first few parameters and how many there are, an `optimizer` that does
    not hold every trainable parameter of `model` exactly once, or that holds a tensor `model` does not have."""
    names = {id(p): unwrapped_name(name) for name, p in model.named_parameters()}
    groups: dict[int, list[int]] = {}
    foreign: list[str] = []
    for index, group in enumerate(optimizer.param_groups):
        for parameter in group["params"]:
            groups.setdefault(id(parameter), []).append(index)
            if id(parameter) not in names:
                foreign.append(f"group {index}: {tuple(parameter.shape)}")
    untrained = [names[id(p)] for _, p in model.named_parameters() if p.requires_grad and id(p) not in groups]
    twice = [f"{names[key]} (groups {places})" for key, places in groups.items() if key in names and len(places) > 1]
    optimizer_name = type(optimizer).__name__
    if untrained:
        total = sum(1 for p in model.parameters() if p.requires_grad)
        raise ConfigError(
            "optimizer",
            f"{optimizer_name} without {len(untrained)} of the model's {total} trainable parameters",
            f"{_listed(untrained)} have requires_grad but no parameter group holds them, so they would never train. "
            "Build the optimizer over self.model.parameters() (or groups that together hold every trainable "
            "parameter), after any change to the model; to freeze a parameter, set requires_grad_(False) on it",
        )
    if twice:
        raise ConfigError(
            "optimizer",
            f"{optimizer_name} holding {len(twice)} parameter(s) more than once",
            f"{_listed(twice)} are in more than one parameter group (each group would step them); put each "
            "parameter in one group",
        )
    if foreign:
        raise ConfigError(
            "optimizer",
            f"{optimizer_name} holding {len(foreign)} tensor(s) that are not parameters of the model",
            f"{_listed(foreign)} (shapes) are stepped but are not in self.model, so no checkpoint saves them and a "
            "resume would lose them. Make them parameters of a submodule of self.model, or leave them out",
        )


def _listed(items: list[str]) -> str:
    more = f", ... ({len(items)} in all)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more
