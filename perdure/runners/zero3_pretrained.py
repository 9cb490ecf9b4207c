"""`--pretrained` into a model built partitioned under ZeRO-3 (`deepspeed.zero.Init`, the DeepSpeed runner's
`init_module()`), one tensor at a time: each rank reads only the part of each parameter its partition holds.

The weights are opened from their metadata (`open_weight_slices`: a safetensors header, a mapped torch.save file), and
names and shapes are checked on the whole model before any tensor data is read (`plan_pretrained`, the check of every
`--pretrained` load, given each partitioned parameter's whole shape: its `ds_shape`). Then, before the engine is
built (it takes its flat partitions and, in bf16 / fp16, its fp32 master copy from the parameters' partitions):

    a partitioned parameter   its partition `ds_tensor` is rank r's contiguous chunk of the flattened parameter,
                              padded to a multiple of the ranks: elements [r * n, (r + 1) * n) for a partition of n
                              elements (DeepSpeed's `_partition_param`), the padding past the end left as it is.
                              Each rank reads the rows of the tensor's first dimension that its chunk spans (a region
                              of whole rows: at most two rows beyond its elements) and copies its elements in
    a buffer (whole on every  read whole and copied in
      rank under ZeRO-3)

No collective is involved: each rank reads on its own, one tensor's rows at a time. The tensors an adapter computes
(`state_dict_adapter()`: fused, permuted) are computed whole from the tensors they need, on every rank, as on
stack=parallel (`pretrained_shards.py`). A state-dict hook that makes new tensors (a fused `wqkv` saved split) cannot
be loaded into partitions: refused, naming the key.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from perdure.checkpoints.weights_slices import Region
from perdure.errors import PerdureError
from perdure.runners.compile import strip_compile_prefix, uncompiled
from perdure.runners.pretrained_shards import PretrainedPlan

if TYPE_CHECKING:

    class ZeroPartition(torch.Tensor):
        """A ZeRO-3 parameter's partition on this rank (flat, padded to a multiple of the ranks)."""

        final_location: Any  # where DeepSpeed keeps it: an OffloadDeviceEnum, or None

    class ZeroParameter(nn.Parameter):
        """A parameter ZeRO-3 partitioned, with the attributes DeepSpeed gives it (for a type checker: deepspeed
        ships no types)."""

        ds_shape: torch.Size  # the whole tensor's shape (its own is empty)
        ds_numel: int  # the whole tensor's elements
        ds_tensor: ZeroPartition  # this rank's partition
        ds_secondary_tensor: torch.Tensor | None  # a secondary partition (zero_hpz_partition_size)
        ds_process_group: Any  # the ranks the parameter is partitioned over


def is_partitioned(tensor: torch.Tensor) -> TypeGuard[ZeroParameter]:
    """Whether `tensor` is a ZeRO-3 parameter (built under `deepspeed.zero.Init`, or partitioned by the engine)."""
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    return is_zero_param(tensor)


def whole_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor: a partitioned parameter's `ds_shape` (its own `shape` is empty)."""
    return tuple(tensor.ds_shape) if is_partitioned(tensor) else tuple(tensor.shape)


@torch.no_grad()
def load_partitions(module: nn.Module, plan: PretrainedPlan) -> None:
    """Copy into each partitioned parameter of `module` this rank's chunk of its tensor in the weights, and each buffer
    (and any whole parameter) whole; see the module docstring. `plan`: from `plan_pretrained(..., full_shape=
    whole_shape)`, names and shapes already checked. Call it before the engine is built."""
    target = uncompiled(module)
    owned = {id(tensor) for tensor in (*target.parameters(), *target.buffers())}
    loaded: set[int] = set()
    for key, value in strip_compile_prefix(target.state_dict(keep_vars=True)).items():
        if not isinstance(value, torch.Tensor) or id(value) in loaded:  # a tied parameter: loaded once
            continue
        if id(value) not in owned:
            raise PerdureError(
                f"--pretrained into {type(target).__name__} built partitioned (ZeRO-3 init_module): its state dict's "
                f"{key!r} is made by a state-dict hook, not one of its parameters or buffers, and cannot be loaded "
                "into partitions. Build the model whole (outside self.init_module()) to load these weights, or "
                "remove the hook"
            )
        loaded.add(id(value))
        if is_partitioned(value):
            _load_partition(key, value, plan)
        else:
            value.copy_(plan.read(key, None))


def _load_partition(key: str, parameter: ZeroParameter, plan: PretrainedPlan) -> None:
    """Rank r's chunk [r * n, r * n + n) of the flattened tensor `key` into `parameter.ds_tensor` (n elements)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    partition = parameter.ds_tensor
    if parameter.ds_secondary_tensor is not None or partition.final_location == OffloadDeviceEnum.nvme:
        nvme = partition.final_location == OffloadDeviceEnum.nvme
        where = "NVMe (offload_param.device nvme)" if nvme else "a secondary partition (zero_hpz_partition_size)"
        raise PerdureError(
            f"--pretrained into {key}: its ZeRO-3 partition is kept in {where}, which perdure cannot load into in "
            "place; remove that setting from deepspeed.config, or build the model whole (outside "
            "self.init_module())"
        )
    start = dist.get_rank(parameter.ds_process_group) * partition.numel()
    stop = min(start + partition.numel(), parameter.ds_numel)
    if start >= stop:  # only padding on this rank
        return
    region, skip = _rows(tuple(parameter.ds_shape), start, stop)
    flat = plan.read(key, region).reshape(-1)
    partition[: stop - start].copy_(flat[skip : skip + stop - start])


def _rows(shape: tuple[int, ...], start: int, stop: int) -> tuple[Region | None, int]:
    """The region of whole rows (first dimension) of a tensor of `shape` that holds its flattened elements
    [start, stop), and where `start` falls in that region flattened. A 0-d tensor: the whole (None)."""
    if not shape:
        return None, start
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row)
    return (slice(first, last), *(slice(0, size) for size in shape[1:])), start - first * row
