"""A module's state dict made piece by piece, so that what its state-dict hooks make is held one hooked module at a
time, never for the whole model (issue 38).

Model code fuses, splits and renames tensors in state-dict hooks; a hook that splits a sharded fused `wqkv` into whole
`wq` / `wk` / `wv` (examples/llama.py) gathers it first. `module.state_dict()` runs every module's hooks in one call, so
each rank would hold every hooked module's whole tensors at once. `state_pieces` cuts the state dict where torch's own
recursion allows it:

    a hooked module       one that changes its subtree's entries: a state-dict post-hook (`_state_dict_hooks`), or a
                          class of its own `state_dict` / `_save_to_state_dict`. Its whole subtree is one piece, made
                          by its own `state_dict(prefix=...)` (its hooks and its descendants' run as in the model's)
    any other module      a piece of its own parameters, buffers and extra state (`_save_to_state_dict`, after its
                          state-dict pre-hooks: FSDP2's), then its children's pieces

The pieces, made in order and joined, are `module.state_dict()` (same keys, values and order: no ancestor of a piece
has a post-hook that could change them). A piece of a module's own tensors holds references to them (DTensors stay
sharded); a hooked piece is made when it is needed and dropped after it. Names are plain (`strip_compile_prefix`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from perdure.errors import CheckpointError
from perdure.private_api import (
    child_modules,
    has_state_dict_hooks,
    run_state_dict_pre_hooks,
    save_own_state,
    saves_own_state_as_module_does,
)
from perdure.runners.compile import plain_name, uncompiled


@dataclass
class StatePiece:
    """One piece of a module's state dict: `module`'s whole subtree (`hooked`) or its own tensors, under `prefix`
    (its name in the model, with any `_orig_mod.` as `state_dict` writes it, and a trailing dot)."""

    module: nn.Module
    prefix: str
    hooked: bool
    names: dict[str, str] = field(default_factory=dict)  # plain name -> the key `module.load_state_dict` takes

    def state(self, keep_vars: bool = False) -> dict[str, Any]:
        """This piece's entries, plain names (a hooked piece runs its hooks: a collective where they gather)."""
        raw = self._raw_state(keep_vars)
        self.names = {plain_name(key): key[len(self.prefix) :] for key in raw}
        return {plain_name(key): value for key, value in raw.items()}

    def _raw_state(self, keep_vars: bool) -> dict[str, Any]:
        if self.hooked:
            return dict(self.module.state_dict(prefix=self.prefix, keep_vars=keep_vars))
        run_state_dict_pre_hooks(self.module, self.prefix, keep_vars)
        destination: dict[str, Any] = OrderedDict()
        save_own_state(self.module, destination, self.prefix, keep_vars)
        return dict(destination)

    def load(self, state: dict[str, Any]) -> None:
        """Load this hooked piece's entries (plain names, as `state` gave them) back through the module's load hooks,
        strictly: every entry of the piece, nothing else. The piece's state must have been made (`state`) before."""
        unknown = sorted(set(state) - set(self.names))
        if unknown:
            where = self.prefix.rstrip(".") or "the model"
            raise CheckpointError(f"{', '.join(unknown[:5])}: not entries of {where}'s state dict, cannot load them")
        self.module.load_state_dict({self.names[key]: value for key, value in state.items()}, strict=True)


def is_hooked(module: nn.Module) -> bool:
    """Whether `module` may change its subtree's state-dict entries (see the module docstring)."""
    kind = type(module)
    return (
        has_state_dict_hooks(module)
        or kind.state_dict is not nn.Module.state_dict
        or not saves_own_state_as_module_does(kind)
    )


def state_pieces(module: nn.Module) -> list[StatePiece]:
    """`module`'s state dict as pieces, in `state_dict()`'s order (a compiled module: the one it holds)."""
    return list(_pieces(uncompiled(module), ""))


def _pieces(module: nn.Module, prefix: str) -> Iterator[StatePiece]:
    if is_hooked(module):
        yield StatePiece(module, prefix, hooked=True)
        return
    yield StatePiece(module, prefix, hooked=False)
    for name, child in child_modules(module).items():
        if child is not None:
            yield from _pieces(child, f"{prefix}{name}.")


def own_tensors(module: nn.Module) -> set[int]:
    """The ids of `module`'s parameters and buffers (what a piece holds by reference, not made by a hook)."""
    target = uncompiled(module)
    return {id(tensor) for tensor in (*target.parameters(), *target.buffers())}


def made_by_hooks(piece: StatePiece, state: dict[str, Any], owned: set[int]) -> bool:
    """Whether `state` (the piece's, made with keep_vars=True) holds a tensor that is none of the model's own (`owned`,
    from `own_tensors`): one a hook made, which is held whole only while its piece is in use."""
    return piece.hooked and any(isinstance(value, torch.Tensor) and id(value) not in owned for value in state.values())
