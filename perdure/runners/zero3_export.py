"""The export of a ZeRO-3 model, tensor by tensor: its state dict (through its hooks, `module_state_dict`'s names) as
a `StreamSource` whose tensors are gathered from the ranks' partitions one at a time (issue 38).

    a parameter            its fp32 master copy, gathered whole (`deepspeed.utils.safe_get_full_fp32_param`, a
                           collective); a frozen parameter, which has no master copy, from the module's own partitions
                           (`GatheredParameters`), in its own dtype
    a buffer               as it is (whole on every rank under ZeRO-3)
    a hooked module        (`checkpoints/state_pieces.py`: a state-dict post-hook, or a `state_dict` of its own, that
                           may rename, fuse or split its tensors) its state dict made from its own parameters' master
                           copies gathered whole and swapped in (`as_module_state_dict`), through its hooks, one hooked
                           module at a time: once to learn the names and shapes, again when the stream reaches it. Its
                           hooks never run on the partitions themselves (their shape is empty)

Every rank builds the source and takes the same names in the same order (the gathers are collectives); the writing
rank holds one whole tensor at a time, or one hooked module's state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perdure.checkpoints.module_state import as_module_state_dict
from perdure.checkpoints.state_pieces import StatePiece, state_pieces
from perdure.errors import CheckpointError
from perdure.runners.compile import plain_name, uncompiled
from perdure.runners.export import StreamSource
from perdure.runners.zero3_pretrained import is_partitioned


def zero3_source(module: nn.Module) -> StreamSource:
    """The export of ZeRO-3's `module` (the engine's) as a `StreamSource`; see the module docstring."""
    target = uncompiled(module)
    parameters = {id(tensor): tensor for tensor in target.parameters()}
    buffers = {id(tensor) for tensor in target.buffers()}
    pieces = state_pieces(target)
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    entries: dict[str, torch.Tensor] = {}
    where: dict[str, StatePiece] = {}
    for piece in pieces:
        if piece.hooked:
            made = hooked_state(piece)
            for name, value in made.items():
                shapes[name], where[name] = (value.dtype, tuple(value.shape)), piece
            del made
            continue
        for name, value in piece.state(keep_vars=True).items():
            parameter = parameters.get(id(value))
            if parameter is not None:
                dtype = torch.float32 if parameter.requires_grad else parameter.dtype
                shapes[name] = (dtype, tuple(parameter.ds_shape if is_partitioned(parameter) else parameter.shape))
            elif isinstance(value, torch.Tensor) and id(value) in buffers:
                shapes[name] = (value.dtype, tuple(value.shape))
            else:
                raise CheckpointError(
                    f"{name!r} of {type(target).__name__}'s state dict is a {type(value).__name__}, none of its "
                    "parameters or buffers; an export holds tensors"
                )
            entries[name] = value
    held: dict[str, torch.Tensor] = {}
    current: list[StatePiece | None] = [None]

    def whole(name: str) -> torch.Tensor:
        if name in entries:
            value = entries[name]
            return whole_fp32(value) if id(value) in parameters else value.detach()
        if current[0] is not where[name] or name not in held:
            held.clear()  # the previous hooked module's entries go before the next one's are made
            current[0] = where[name]
            held.update(hooked_state(where[name]))
        return held.pop(name)

    return StreamSource(shapes, whole)


def whole_fp32(parameter: torch.Tensor) -> torch.Tensor:
    """`parameter` whole (a collective): its fp32 master copy, or a frozen one's own partitions gathered."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(parameter) if parameter.requires_grad else None
    if full is None:  # a frozen parameter has no master copy: its own partitions, gathered
        with deepspeed.zero.GatheredParameters([parameter]):
            full = parameter.detach().clone()
    return full


def hooked_state(piece: StatePiece) -> dict[str, Any]:
    """The state dict of `piece`'s (hooked) module from its parameters gathered whole (`whole_fp32`, a collective) and
    its buffers, through its hooks, under the plain names the whole model's state dict gives them."""
    weights = {name: whole_fp32(parameter) for name, parameter in piece.module.named_parameters()}
    state = as_module_state_dict(piece.module, weights)
    del weights
    prefix = plain_name(piece.prefix)
    return {prefix + key: value for key, value in state.items()}
