"""`--pretrained` into a sharded model, shard by shard: each rank reads only the regions of the tensors it holds.

Two steps, around the sharding (`ParallelRunner.distribute_model`):

    plan_pretrained      before the model is split and sharded (on meta or not), on names and shapes only: the
                         weights' names mapped into the model's layout (`state_dict_adapter().from_hf` for Hugging
                         Face weights), tied copies `save_pretrained` left out filled in, and the same key and shape
                         check as a whole-model load (`check_weights_fit`), before any tensor data is read
    load_shards          once each rank holds its shards (materialised and initialised, for a meta model): for every
                         entry of each part's state dict, a DTensor's local region (its placements over its device
                         mesh: `compute_local_shape_and_global_offset`, as DCP computes it) is read from the weights
                         and copied into the shard in place; the state dict then loads back through the model's hooks

What a rank reads beyond its shards:
- an entry a state-dict hook makes whole (examples/llama.py splits its fused `wqkv` into whole `wq`, `wk`, `wv`):
  read whole, and loaded back through the hook, as the model asks; one hooked module at a time
  (`checkpoints/state_pieces.py`: its state dict made, read into and loaded back before the next is made), so a rank
  never holds every hooked module's whole tensors at once;
- the adapter: `from_hf` is first called with tensors on the meta device to learn which tensors it passes through
  under another name (one to one: those are read by region). The tensors it computes (fuses, splits, permutes) are
  computed from the whole tensors it needs, on every rank, then sliced; should one of them need a tensor it also
  passes through, it is given every tensor whole.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from perdure.checkpoints.hf_adapter import StateDictAdapter
from perdure.checkpoints.state_pieces import made_by_hooks, own_tensors, state_pieces
from perdure.checkpoints.weights_fit import check_weights_fit
from perdure.checkpoints.weights_slices import Region, WeightSlices, region_of
from perdure.errors import PerdureError
from perdure.private_api import compute_local_shape_and_global_offset


class PretrainedPlan:
    """Where each entry of the model's state dict comes from: `sources` (model name -> name in the weights, read by
    region) or `computed` (model name -> a whole tensor the adapter made). `bytes_read`: what this rank has read."""

    def __init__(self, slices: WeightSlices, sources: dict[str, str], computed: dict[str, torch.Tensor]) -> None:
        self.slices = slices
        self.sources = sources
        self.computed = computed
        self.bytes_read = sum(tensor.numel() * tensor.element_size() for tensor in computed.values())

    def read(self, key: str, region: Region | None) -> torch.Tensor:
        """The model's entry `key`, or its `region`."""
        if key in self.computed:
            whole = self.computed[key]
            return whole if region is None else whole[region]
        before = self.slices.bytes_read
        tensor = self.slices.read(self.sources[key], region)
        self.bytes_read += self.slices.bytes_read - before
        return tensor

    def read_into(self, requests: list[tuple[str, Region | None, torch.Tensor]]) -> None:
        """Copy each (model key, region, target) request into its target: the computed entries from the adapter's
        tensors, the others read together (`WeightSlices.read_into`: one pass over a DCP checkpoint's files)."""
        sourced = []
        for key, region, target in requests:
            if key in self.computed:
                target.copy_(self.read(key, region))
            else:
                sourced.append((self.sources[key], region, target))
        before = self.slices.bytes_read
        self.slices.read_into(sourced)
        self.bytes_read += self.slices.bytes_read - before


def plan_pretrained(
    model: nn.Module | list[nn.Module],
    slices: WeightSlices,
    adapter: StateDictAdapter | None,
    whole: bool = True,
    full_shape: Callable[[torch.Tensor], tuple[int, ...]] | None = None,
    gathered: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
) -> PretrainedPlan:
    """Map the weights' names into `model`'s (the whole model, or this rank's parts when `whole` is False) and check
    names and shapes, reading no tensor data (except what an adapter computes, after the check). CheckpointError
    naming the missing, unexpected and mis-shaped keys, as a whole-model load does. `full_shape`: a tensor's whole
    shape where its `shape` is not (a ZeRO-3 partitioned parameter's `ds_shape`); default its `shape` (a DTensor's is
    whole). `gathered(module)`: a context in which a hooked module's own tensors are whole for its hooks to run on
    (ZeRO-3: its partitions gathered, `zero3_pretrained.gathered_whole`); default none needed."""
    parts = model if isinstance(model, list) else [model]
    expected: dict[str, Any] = {}
    owned = set().union(*(own_tensors(part) for part in parts))
    for part in parts:  # the Parameters themselves: tied names hold the same object
        for piece in state_pieces(part):  # what hooks make: its dtype and shape only, one hooked module at a time
            with gathered(piece.module) if gathered is not None and piece.hooked else nullcontext():
                for key, value in piece.state(keep_vars=True).items():
                    hooked = isinstance(value, torch.Tensor) and id(value) not in owned
                    expected[key] = torch.empty(value.shape, dtype=value.dtype, device="meta") if hooked else value
    sources, made = _model_layout(slices, adapter)
    given = {key: tuple(slices.shapes[name]) for key, name in sources.items()}
    given.update({key: tuple(tensor.shape) for key, tensor in made.items()})
    for key, tensor in expected.items():  # `save_pretrained` leaves out a tied copy (`lm_head.weight`)
        if key not in given:
            twin = next((name for name, other in expected.items() if other is tensor and name in given), None)
            if twin is not None and twin in sources:
                sources[key], given[key] = sources[twin], given[twin]
            elif twin is not None:
                made[key], given[key] = made[twin], given[twin]
    shape_of = full_shape or _shape
    shapes = {key: shape_of(value) if isinstance(value, torch.Tensor) else None for key, value in expected.items()}
    name = type(parts[0]).__name__ if whole else f"this rank's part of {type(parts[0]).__name__}"
    check_weights_fit(name, shapes, given, slices.path, unexpected_too=whole)
    return PretrainedPlan(slices, sources, _computed(slices, adapter, sources, made))


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _model_layout(
    slices: WeightSlices, adapter: StateDictAdapter | None
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(model name -> name in the weights for the tensors passed through, model name -> the adapter's output on the
    meta device for the tensors it computes)."""
    if adapter is None or not slices.hf:
        return {name: name for name in slices.shapes}, {}
    meta = {name: torch.empty(shape, dtype=slices.dtypes[name], device="meta") for name, shape in slices.shapes.items()}
    by_id = {id(tensor): name for name, tensor in meta.items()}
    mapped = adapter.from_hf(meta)
    sources = {key: by_id[id(value)] for key, value in mapped.items() if id(value) in by_id}
    return sources, {key: value for key, value in mapped.items() if key not in sources}


def _computed(
    slices: WeightSlices, adapter: StateDictAdapter | None, sources: dict[str, str], made: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The tensors the adapter computes, from the whole tensors it does not pass through (all of them whole, should
    it need one it passes through: a result left on meta shows it)."""
    if not made or adapter is None:
        return {}
    passed = set(sources.values())
    inputs = {
        name: torch.empty(shape, dtype=slices.dtypes[name], device="meta") if name in passed else slices.read(name)
        for name, shape in slices.shapes.items()
    }
    mapped = adapter.from_hf(inputs)
    if any(mapped[key].is_meta for key in made if key in mapped):
        mapped = adapter.from_hf({name: slices.read(name) for name in slices.shapes})
    return {key: mapped[key] if key in mapped else mapped[_tied_source(key, made)] for key in made}


def _tied_source(key: str, made: dict[str, torch.Tensor]) -> str:
    """The computed key a tied copy `key` was filled from (`plan_pretrained`)."""
    return next(name for name, tensor in made.items() if tensor is made[key] and name != key)


@torch.no_grad()
def load_shards(parts: list[nn.Module], plan: PretrainedPlan) -> None:
    """Copy each rank's regions of the weights into its shards of `parts` (sharded, materialised): the model's own
    tensors in place, all in one read; then, one hooked module at a time, what its state-dict hooks make (a fused
    weight split whole) read and loaded back through its hooks (`StatePiece.load`; a collective where a hook gathers
    or distributes: every rank calls it)."""
    owned = set().union(*(own_tensors(part) for part in parts))
    made = []
    requests: list[tuple[str, Region | None, torch.Tensor]] = []
    for part in parts:
        for piece in state_pieces(part):
            state = piece.state(keep_vars=True)
            if made_by_hooks(piece, state, owned):
                made.append(piece)  # made again below, read into and loaded back: one at a time
            else:
                requests.extend(_requests(state))
            del state
    plan.read_into(requests)
    for piece in made:
        state = piece.state()
        plan.read_into(_requests(state))
        piece.load(state)
        del state


def _requests(state: dict[str, Any]) -> list[tuple[str, Region | None, torch.Tensor]]:
    """(key, region, target) for each tensor of `state`: a DTensor's local shard and the region its placements say it
    holds, a plain tensor whole."""
    requests = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        region = None
        target = value
        if isinstance(value, DTensor):
            target = value.to_local()
            local_shape, offset = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )
            if tuple(local_shape) != tuple(target.shape):
                raise PerdureError(
                    f"{key}: this rank's shard is {tuple(target.shape)}, but its placements "
                    f"{value.placements} over the device mesh give {tuple(local_shape)}; a model whose shards "
                    "are not the regions their placements say cannot load --pretrained weights shard by shard"
                )
            region = region_of(value.shape, tuple(offset), tuple(local_shape))
        if target.numel():
            requests.append((key, region, target))
    return requests


def describe_reads(plan: PretrainedPlan, path: Path) -> str:
    """One line for the log: how much of the weights rank 0 (this rank) read."""
    return f"--pretrained {path}: rank 0 {plan.slices.describe_read(plan.bytes_read)}"
