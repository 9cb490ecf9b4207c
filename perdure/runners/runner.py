"""Runner: the class users subclass; it becomes the stack that `config.stack` names."""

from __future__ import annotations

import importlib
from typing import Any

from perdure.config_checks import find_stack, stack_names
from perdure.errors import StackNotAvailableError
from perdure.runners.base import BaseRunner, RunnerMeta


def stack_class(stack: str) -> type[BaseRunner]:
    """The runner class for `config.stack`, or a clear error for a stack this version does not have.

    Each stack registers its runner's module and class (`config_checks.register_stack`), imported only here, when a
    runner of that stack is built: the parallel stack's imports (FSDP, DTensor, DCP's state-dict helpers) cost half a
    second that a torch-stack process never pays."""
    found = find_stack(stack)
    if found is not None:
        module, name = found.runner.split(":")
        return getattr(importlib.import_module(module), name)
    names = ", ".join(stack_names())
    raise StackNotAvailableError(f"config key 'stack' = {stack!r}: unknown stack; use one of {names}")


class _RunnerDispatch(RunnerMeta):
    """`Runner(config)` or `MyRunner(config)` builds an instance of the user's class mixed with the chosen stack.

    The combined class is made once per (user class, stack) and cached, so `type(runner)` is stable. With
    `ft.enabled` the replica-group layer (`perdure.ft.runner.FaultTolerant`) sits between them.
    """

    _combined: dict[tuple[type, ...], type] = {}

    def __call__(cls, config: Any, *args: Any, **kwargs: Any) -> Any:
        config.check()
        stack = stack_class(config.get("stack", "torch"))
        layers: tuple[type, ...] = ()
        if config.lookup("ft.enabled", False):  # TorchFT: the replica-group layer goes in front of the stack
            from perdure.ft.runner import FaultTolerant

            layers = () if issubclass(cls, FaultTolerant) else (FaultTolerant,)
        if issubclass(cls, stack) and not layers:
            return super().__call__(config, *args, **kwargs)
        key = (cls, *layers, stack)
        if key not in cls._combined:
            cls._combined[key] = _RunnerDispatch(cls.__name__, key, {"__module__": cls.__module__})
        return cls._combined[key](config, *args, **kwargs)


class Runner(BaseRunner, metaclass=_RunnerDispatch):
    """Subclass this: assign `self.model`, `self.optimizer` (optional), `self.datasets[...]` in `__init__`.

    The stack (`torch`, `parallel`, `deepspeed` / `ds`) is picked from `config.stack` when the runner is built.
    """
