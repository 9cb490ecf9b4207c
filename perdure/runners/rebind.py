"""Moving the user's optimizer and scheduler onto the parameters of a sharded model.

The program is the same on every stack: the user builds the optimizer in `__init__` over the whole model's parameters.
Sharding replaces those parameters (FSDP2 and tensor parallelism make new DTensor parameters, a pipeline stage is a
copy holding some of them), so an optimizer kept as it is would step tensors no longer in the model: the model would
silently not train. The optimizer is therefore rebuilt: the same class, the same groups with the same options, each
group holding the new parameters of the names it held before (those this rank holds), and the scheduler is pointed at
it. The names come from the whole model, read before it is sharded (`group_names`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from perdure.errors import PerdureError


def group_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str]]:
    """For each parameter group of `optimizer`, the names in `model` of its parameters. Refuses an optimizer that
    holds a tensor the model does not have, or that already has state (it stepped before the model was sharded)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if unknown:
            raise PerdureError(
                f"{type(optimizer).__name__}'s parameter group {index} holds {len(unknown)} tensor(s) that are not "
                f"parameters of the model (shapes {unknown[:3]}): the parallel stack rebuilds the optimizer over the "
                "sharded model by parameter name, so build it over self.model.parameters() (or named groups of them)"
            )
        groups.append([names[id(p)] for p in group["params"]])
    if optimizer.state:
        raise PerdureError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s): it was stepped "
            "before the runner sharded the model; do not step it in __init__ (the runner owns the steps)"
        )
    return groups


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, names: list[list[str]], parameters: Mapping[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s class over `parameters` (name -> the sharded parameter this rank holds): group
    `i` holds the parameters named `names[i]` that are here (possibly none), with group `i`'s options (learning
    rate, weight decay, `initial_lr` of a scheduler, ...)."""
    groups = []
    for options, group in zip(optimizer.param_groups, names):
        rebuilt = {key: value for key, value in options.items() if key != "params"}
        rebuilt["params"] = [parameters[name] for name in group if name in parameters]
        groups.append(rebuilt)
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    try:
        return cls(groups, **defaults)
    except Exception as error:
        raise PerdureError(
            f"cannot rebuild {cls.__name__} over the sharded parameters as {cls.__name__}(param_groups, "
            f"**defaults): {type(error).__name__}: {error}. Give the parallel stack an optimizer whose constructor "
            "takes param groups and its defaults as keywords (every torch.optim optimizer does)"
        ) from error


def rebind_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point `scheduler` (and the schedulers it chains, e.g. SequentialLR's) from `old` to `new`. The learning rates
    it set live in the groups' options, which the new optimizer copied."""
    pending = [scheduler]
    while pending:
        current = pending.pop()
        if current.optimizer is old:
            current.optimizer = new
        pending.extend(vars(current).get("_schedulers", []))
    _count_steps(new)


def _count_steps(optimizer: torch.optim.Optimizer) -> None:
    """What an LRScheduler does to the optimizer it is built with (it checks that `optimizer.step()` runs before its
    own `step()`, and warns otherwise): mark the new optimizer's steps the same way."""
    step = optimizer.step

    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]
