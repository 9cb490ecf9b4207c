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

Each rank reads on its own, one tensor's rows at a time. The tensors an adapter computes (`state_dict_adapter()`:
fused, permuted) are computed whole from the tensors they need, on every rank, as on stack=parallel
(`pretrained_shards.py`).

A hooked module (`checkpoints/state_pieces.py`: a state-dict post-hook or a `state_dict` of its own, which may rename,
fuse or split its tensors) is one piece, and its hooks never run on the partitions (their shape is empty): its own
parameters are gathered whole (`gathered_whole`, a collective), one hooked module at a time, for its hooks to give its
names and shapes (`plan_pretrained(..., gathered=gathered_whole)`) and again at the load. Should its hooks only pass
its tensors through (a rename), each rank reads its partitions as above. Should they make tensors (a `wqkv` saved split
into `wq` / `wk` / `wv`), its state dict is made from the gathered parameters, read whole into, loaded back through its
load hooks, and DeepSpeed cuts each rank's partitions from the result (`GatheredParameters(modifier_rank=0)`): each
rank holds one hooked module whole at a time, never the model.
"""

from __future__ import annotations

import math
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from perdure.checkpoints.state_pieces import StatePiece, made_by_hooks, own_tensors, state_pieces
from perdure.checkpoints.weights_slices import Region
from perdure.errors import PerdureError
from perdure.runners.compile import uncompiled
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
    if "deepspeed" not in sys.modules:  # none without DeepSpeed loaded; importing it to ask would cost ~30 MB of RSS
        return False
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    return is_zero_param(tensor)


def whole_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor: a partitioned parameter's `ds_shape` (its own `shape` is empty)."""
    return tuple(tensor.ds_shape) if is_partitioned(tensor) else tuple(tensor.shape)


def gathered_whole(module: nn.Module) -> AbstractContextManager[Any]:
    """`module`'s partitioned parameters gathered whole on every rank, to be read (a collective: DeepSpeed's
    `GatheredParameters`; nothing is written back): what a hooked module's state-dict hooks run on."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()))


def hooks_run_whole(piece: StatePiece) -> AbstractContextManager[Any]:
    """Where `piece`'s hooks run and its state loads back when it is a hooked module built partitioned (ZeRO-3
    `init_module`; the start-up state-dict round trip): its parameters gathered whole, each rank's partitions cut again
    from rank 0's values when it ends (`GatheredParameters(modifier_rank=0)`, a collective: every rank calls it and
    loads the same values). Any other piece: nothing to do."""
    parameters = list(piece.module.parameters()) if piece.hooked else []
    if not any(is_partitioned(parameter) for parameter in parameters):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=0)


@torch.no_grad()
def load_partitions(module: nn.Module, plan: PretrainedPlan) -> None:
    """Copy into each partitioned parameter of `module` this rank's chunk of its tensor in the weights, and each buffer
    (and any whole parameter) whole; a hooked module through its hooks, one at a time; see the module docstring.
    `plan`: from `plan_pretrained(..., full_shape=whole_shape, gathered=gathered_whole)`, names and shapes already
    checked. A collective where a module is hooked (every rank calls it). Call it before the engine is built."""
    target = uncompiled(module)
    owned = own_tensors(target)
    loaded: set[int] = set()
    for piece in state_pieces(target):
        if piece.hooked:
            _load_hooked(piece, plan, owned, loaded)
            continue
        for key, value in piece.state(keep_vars=True).items():
            _load_entry(key, value, plan, loaded)


def _load_entry(key: str, value: Any, plan: PretrainedPlan, loaded: set[int]) -> None:
    """One of the model's own tensors: this rank's chunk of a partitioned parameter, any other tensor whole."""
    if not isinstance(value, torch.Tensor) or id(value) in loaded:  # a tied parameter: loaded once
        return
    loaded.add(id(value))
    if is_partitioned(value):
        _load_partition(key, value, plan)
    else:
        value.copy_(plan.read(key, None))


def _load_hooked(piece: StatePiece, plan: PretrainedPlan, owned: set[int], loaded: set[int]) -> None:
    """A hooked module: its state dict made from its parameters gathered whole (a collective). Only the module's own
    tensors under other names: each rank reads its partitions of them. Tensors its hooks made: the state dict read
    whole, loaded back through its load hooks while gathered, and each rank's partitions cut from the result by
    DeepSpeed when the gather ends (every rank loads the same values; rank 0's are the ones kept)."""
    import deepspeed

    with gathered_whole(piece.module):
        state = piece.state(keep_vars=True)
        made = made_by_hooks(piece, state, owned)
        if made:
            del state  # made again below, where what is loaded into the gathered parameters is kept
    if not made:
        for key, value in state.items():
            _load_entry(key, value, plan, loaded)
        return
    with deepspeed.zero.GatheredParameters(list(piece.module.parameters()), modifier_rank=0):
        state = piece.state()
        plan.read_into([(key, None, value) for key, value in state.items() if isinstance(value, torch.Tensor)])
        piece.load(state)
        del state


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
