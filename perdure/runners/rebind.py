"""Moving the user's optimizer and scheduler onto the parameters of a sharded model.

The program is the same on every stack: the user builds the optimizer in `__init__` over the whole model's parameters.
Sharding replaces those parameters (FSDP2 and tensor parallelism put new DTensor parameters into the same modules, a
pipeline stage is a copy holding some of them), so an optimizer kept as it is would step tensors no longer in the
model: the model would silently not train. The optimizer is therefore rebuilt: the same class, the same groups with the
same options, each group holding the new parameters of the ones it held before (those this rank holds), and the
scheduler is pointed at it.

Each parameter is found again through the module tree, never by a name lookup alone: before sharding, `parameter_slots`
records the module holding it and its attribute there; wrappers (torch's `checkpoint_wrapper`, `torch.compile`) keep
that module inside them, and sharding replaces the parameter in it, so the module gives the new parameter whatever the
wrappers renamed. Only a stage built as a copy of the model (the modules are new objects) is matched by name, with the
wrappers' segments (`_checkpoint_wrapped_module`, `_orig_mod`) taken out of both sides. Whatever still cannot be found
is caught by the coverage check (`perdure.runners.param_coverage`) before the first step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from perdure.errors import PerdureError
from perdure.private_api import chained_schedulers, mark_lr_scheduler_step, own_parameters

# Module names that wrappers put between a module and its children; a parameter's identity does not include them.
WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


@dataclass(frozen=True)
class ParameterSlot:
    """Where one optimizer parameter lives in the whole model: `module.<attribute>`, named `name` (wrapper segments
    taken out)."""

    module: nn.Module
    attribute: str
    name: str


def unwrapped_name(name: str) -> str:
    """A parameter's name without the segments wrappers add (`layers.0._checkpoint_wrapped_module.fc.weight` ->
    `layers.0.fc.weight`)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def parameter_slots(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[ParameterSlot]]:
    """For each parameter group of `optimizer`, where in `model` its parameters live. Refuses an optimizer that holds
    a tensor the model does not have, or that already has state (it stepped before the model was sharded)."""
    slots: dict[int, ParameterSlot] = {}
    for module_name, module in model.named_modules():
        for attribute, parameter in own_parameters(module).items():
            if parameter is not None and id(parameter) not in slots:
                name = unwrapped_name(f"{module_name}.{attribute}" if module_name else attribute)
                slots[id(parameter)] = ParameterSlot(module, attribute, name)
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in slots]
        if unknown:
            raise PerdureError(
                f"{type(optimizer).__name__}'s parameter group {index} holds {len(unknown)} tensor(s) that are not "
                f"parameters of the model (shapes {unknown[:3]}): the parallel stack rebuilds the optimizer over the "
                "sharded model, so build it over self.model.parameters() (or groups of them)"
            )
        groups.append([slots[id(p)] for p in group["params"]])
    if optimizer.state:
        raise PerdureError(
            f"{type(optimizer).__name__} already holds state for {len(optimizer.state)} parameter(s): it was stepped "
            "before the runner sharded the model; do not step it in __init__ (the runner owns the steps)"
        )
    return groups


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, slots: list[list[ParameterSlot]], parts: Sequence[nn.Module]
) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s class over the parameters `parts` (this rank's sharded stages) hold: group
    `i` holds the new parameters of `slots[i]` that are here (possibly none), with group `i`'s options (learning
    rate, weight decay, `initial_lr` of a scheduler, ...)."""
    modules = {id(module) for part in parts for module in part.modules()}
    by_name = {unwrapped_name(name): p for part in parts for name, p in part.named_parameters()}
    groups = []
    for options, group in zip(optimizer.param_groups, slots):
        rebuilt = {key: value for key, value in options.items() if key != "params"}
        found = (_new_parameter(slot, modules, by_name) for slot in group)
        rebuilt["params"] = list({id(p): p for p in found if p is not None}.values())
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


def _new_parameter(slot: ParameterSlot, modules: set[int], by_name: dict[str, nn.Parameter]) -> nn.Parameter | None:
    """The parameter now in `slot`: the module's own when the module is still in the sharded tree, else (a stage
    copied from the model) the one of the same name, else None (another rank's stage holds it)."""
    if id(slot.module) in modules:
        return own_parameters(slot.module).get(slot.attribute)
    return by_name.get(slot.name)


def rebind_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point `scheduler` (and the schedulers it chains, e.g. SequentialLR's) from `old` to `new`. The learning rates
    it set live in the groups' options, which the new optimizer copied."""
    pending = [scheduler]
    while pending:
        current = pending.pop()
        if current.optimizer is old:
            current.optimizer = new
        pending.extend(chained_schedulers(current))
    _count_steps(new)


def _count_steps(optimizer: torch.optim.Optimizer) -> None:
    """What an LRScheduler does to the optimizer it is built with (it checks that `optimizer.step()` runs before its
    own `step()`, and warns otherwise): mark the new optimizer's steps the same way."""
    optimizer.step = mark_lr_scheduler_step(optimizer, optimizer.step)  # type: ignore[method-assign]
