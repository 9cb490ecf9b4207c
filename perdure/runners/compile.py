"""`torch.compile` for every stack, and plain parameter names wherever weights are stored or loaded.

perdure compiles a module in place (`nn.Module.compile`): its `__call__` runs the compiled graph, while the module,
its parameters and its `state_dict()` names stay what they were. `torch.compile(module)`, which users often write by
hand, instead returns an `OptimizedModule` holding the module as `_orig_mod`, whose `state_dict()` names every tensor
`_orig_mod.<name>`. That prefix never reaches a checkpoint, an export or an EMA: the runner takes state from the
module inside the wrapper (`uncompiled`, `plain_state_dict`), and weights that carry the prefix anywhere in their
names (another tool's files, a hand-compiled submodule) are stripped when they are read or exported
(`strip_compile_prefix`). A checkpoint of a compiled model therefore loads into an uncompiled one and the other way
round; the wrapper shares its parameters with the module it wraps, so loading into either updates both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
from torch import nn

from perdure.private_api import compiled_original, is_compiled_in_place, is_compiled_wrapper

if TYPE_CHECKING:
    from perdure.private_api import OptimizedModule

COMPILE_PREFIX = "_orig_mod."
V = TypeVar("V")


def compile_model(module: nn.Module, config: Any) -> nn.Module:
    """Compile `module` in place with `compile.backend` and `compile.mode` when `compile.enabled` (a module the user
    already compiled is left as it is); returns `module`. Compilation itself happens at the first call."""
    if config.compile.enabled and not is_compiled(module) and not is_compiled_in_place(module):
        module.compile(backend=config.compile.backend, mode=config.compile.mode)
    return module


def is_compiled(module: nn.Module) -> TypeGuard[OptimizedModule]:
    """Whether `module` is a `torch.compile` wrapper (`OptimizedModule`). Without importing dynamo: nothing can be
    compiled before it is imported."""
    return is_compiled_wrapper(module)


def uncompiled(module: nn.Module) -> nn.Module:
    """The module a `torch.compile` wrapper (or several) holds; `module` itself when it is not compiled."""
    while is_compiled(module):
        module = compiled_original(module)
    return module


def plain_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with plain names, also for a module (or submodules) the user compiled by hand."""
    return strip_compile_prefix(uncompiled(module).state_dict())


def strip_compile_prefix(state_dict: Mapping[str, V]) -> dict[str, V]:
    """The same entries with every `_orig_mod.` removed from their names (at the start or after a submodule's name,
    where a compiled submodule puts it). A state dict without it comes back equal."""
    if not any(COMPILE_PREFIX in key for key in state_dict):
        return dict(state_dict)
    return {plain_name(key): value for key, value in state_dict.items()}


def plain_name(key: str) -> str:
    """A state-dict name without `_orig_mod.` (`_orig_mod.net.0.weight` -> `net.0.weight`)."""
    while key.startswith(COMPILE_PREFIX):
        key = key[len(COMPILE_PREFIX) :]
    return key.replace("." + COMPILE_PREFIX, ".")
