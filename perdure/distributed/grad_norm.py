"""The gradient norm of a model sharded over a device mesh and split into pipeline stages: one number on every rank.

Gradients are DTensors on different meshes (a tensor-parallel weight on shard x tensor, a norm's weight on shard
alone), which `torch.nn.utils.clip_grad_norm_` cannot stack; so the norm is taken per mesh (DTensor reduces it over
that mesh, counting replicated placements once), the norms are combined, then summed over the pipeline stages, which
hold disjoint parameters. Every rank ends with the same norm, bit for bit, so clipping and the non-finite check agree
everywhere.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _by_mesh(parameters: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters that have a gradient, grouped by their gradient's mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(parameter)
    return list(groups.values())


def clip_grad_norm(
    parameters: list[torch.Tensor], max_norm: float | None, pipeline_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The 2-norm of every gradient of the model, over all shards and stages (`pipeline_group`: the ranks holding
    the other stages of this rank's pipeline; None without a pipeline); with `max_norm`, the gradients are then
    scaled so that it is at most `max_norm`. Returns the norm before clipping, the same on every rank (non-finite when
    any gradient anywhere is)."""
    groups = _by_mesh(parameters)
    squares = []
    for group in groups:
        grads = cast("list[torch.Tensor]", [p.grad for p in group])  # `_by_mesh` keeps only those with a gradient
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().square())
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if pipeline_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pipeline_group)
    total = total.sqrt()
    if dist.get_world_size() > 1:
        # DTensor reduces a norm over a 2-D mesh in two steps whose summation order may differ between ranks by a
        # rounding; replicated shards must be clipped by the very same factor on every rank, so all take the largest.
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    if max_norm is not None and math.isfinite(max_norm):
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
