"""A model's state dict the way the model itself writes and reads it, on every backend: through its own hooks.

Model code renames and fuses tensors in state-dict hooks (a fused `wqkv` saved as `wq` / `wk` / `wv`, as TorchTitan and
Hugging Face models do; torch's `checkpoint_wrapper` taking its `_checkpoint_wrapped_module.` back out). Checkpoints,
exports and restores therefore go through `module.state_dict()` and `module.load_state_dict()`, which run those hooks:

    module_state_dict        what a checkpoint holds: `state_dict()` with the plain names (no `_orig_mod.` of a
                             submodule compiled by hand); DTensors stay sharded, so DCP saves each rank's shards
    load_module_state_dict   loads such a state dict back through the model's load hooks, strictly
    full_module_state_dict   the same with every DTensor gathered whole (collective), kept on rank 0's CPU or every rank
    load_full_module_state_dict  full weights into a sharded module (each rank keeps its shards)
    as_module_state_dict     weights keyed by parameter name (DeepSpeed's zero-to-fp32 gathers them so) in the layout
                             `state_dict()` writes, hooks applied, without touching the model's own tensors

torch's `get_model_state_dict` / `set_model_state_dict` (DCP's helpers) walk the module tree by each key's name and fail
on a key a hook made up ("'Attention' object has no attribute 'wq'"); they are not used for the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from perdure.private_api import own_buffers, own_parameters
from perdure.runners.compile import plain_name, strip_compile_prefix, uncompiled


def module_state_dict(module: nn.Module) -> dict[str, Any]:
    """`module.state_dict()` (its hooks applied) with plain names. Tensors are the live ones (or what hooks made)."""
    return strip_compile_prefix(uncompiled(module).state_dict())


def load_module_state_dict(module: nn.Module, state: Mapping[str, Any]) -> None:
    """Load `state` (names as `module_state_dict` gives them) through the module's load hooks; every key must fit."""
    target = uncompiled(module)
    names = {plain_name(key): key for key in target.state_dict()}
    target.load_state_dict({names.get(key, key): value for key, value in state.items()}, strict=True)


def full_module_state_dict(module: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
    """`module_state_dict` with every DTensor gathered into a full tensor (a collective: every rank calls it), one
    tensor at a time; on the CPU. `rank0_only`: the other ranks gather but keep nothing (an empty dict)."""
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    full: dict[str, torch.Tensor] = {}
    for key, value in module_state_dict(module).items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            full[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    return full


def as_module_state_dict(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`weights` keyed by the names of `named_parameters()` / `named_buffers()`, in the layout `module.state_dict()`
    writes (keys renamed or fused by its hooks). The module's tensors are swapped for `weights` while its state dict
    is taken, then put back; a tensor `weights` lacks stays the module's own."""
    target = uncompiled(module)
    by_id: dict[int, torch.Tensor] = {}
    for name, owned in (*target.named_parameters(), *target.named_buffers()):
        if name in weights:
            by_id[id(owned)] = weights[name]
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for submodule in target.modules():
            parameters = own_parameters(submodule)
            held: tuple[dict[str, Any], ...] = (parameters, own_buffers(submodule))
            for slots in held:
                for attribute, tensor in slots.items():
                    if tensor is not None and id(tensor) in by_id:
                        swapped.append((slots, attribute, tensor))
                        new = by_id[id(tensor)]
                        slots[attribute] = nn.Parameter(new, requires_grad=False) if slots is parameters else new
        state = strip_compile_prefix(target.state_dict())
        return {
            key: value.detach().clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()
        }
    finally:
        for slots, attribute, tensor in swapped:
            slots[attribute] = tensor


def load_full_module_state_dict(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load full (unsharded) `weights`, names as `module_state_dict` gives them, into a module whose state may be
    sharded: each rank keeps its shard of every tensor the module holds as a DTensor (no communication)."""
    local: dict[str, Any] = {}
    for key, held in module_state_dict(module).items():
        value = weights[key]
        if isinstance(held, DTensor):
            value = distribute_tensor(value.to(held.device), held.device_mesh, held.placements, src_data_rank=None)
        local[key] = value
    load_module_state_dict(module, local)
