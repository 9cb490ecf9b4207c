"""Models built on the meta device: materialised on this rank's device and initialised the same on every topology.

A model larger than one device is built the way TorchTitan builds it: under `torch.device("meta")` (shapes, no
storage), then sharded, then each rank allocates only its shards (`to_empty`) and initialises them. The initialisation
is the model's own: its `init_weights()` (TorchTitan's convention; called with `buffer_device=` when it takes one) or,
without one, every submodule's `reset_parameters()`. Buffers are initialised by the same methods (TorchTitan's
`init_weights` recomputes the RoPE table), so a module that owns a tensor built on meta and that neither method reaches
is refused before anything is allocated.

The same weights on every topology: each random draw into a parameter or buffer (`uniform_`, `normal_`, ... : what
`nn.init` calls) takes its numbers from a generator of its own, seeded by the run's seed, the tensor's name in the
whole model and how many draws that tensor had before. A sharded tensor (a DTensor: FSDP2, tensor parallelism) is
drawn whole and this rank keeps its shard, so a 1-rank run, a 4-rank FSDP2 x TP run and a pipeline stage draw the
same numbers for the same parameter. A rank holds at most one whole parameter beyond its shards at a time. Other
operations (`fill_`, `zero_`, arithmetic on the shards) run on the shards as DTensor runs them.

On a GPU the draws come from the device's generator, so a GPU run starts from other values than a CPU run of the same
seed; on one kind of device every topology starts the same.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from perdure.errors import ConfigError, PerdureError
from perdure.private_api import TorchDispatchMode, own_buffers, own_parameters
from perdure.runners.rebind import unwrapped_name

aten = torch.ops.aten
# The in-place random fills `nn.init` (and model code) draw with: the tensor is their first argument.
RANDOM_FILLS = frozenset(
    {
        aten.uniform_.default,
        aten.normal_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
        aten.bernoulli_.float,
        aten.exponential_.default,
        aten.geometric_.default,
        aten.log_normal_.default,
        aten.cauchy_.default,
    }
)


def is_meta_model(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device (built under `torch.device("meta")`)."""
    return any(tensor.is_meta for tensor in _tensors(model))


def check_initialisable(model: nn.Module) -> None:
    """Refuse, before anything is allocated, a meta model that nothing initialises: without `init_weights()`, every
    module that owns a tensor built on meta must have `reset_parameters()`. ConfigError naming the first modules.
    A model with parameters both on meta and on a device is refused too: allocating it would overwrite the ones that
    have values."""
    real = [unwrapped_name(name) for name, parameter in model.named_parameters() if not parameter.is_meta]
    if real:
        raise ConfigError(
            "model",
            f"{type(model).__name__} built partly on the meta device",
            f"{', '.join(real[:3])}{', ...' if len(real) > 3 else ''} ({len(real)} parameters) are on a device, the "
            "others on meta; the runner allocates and initialises the whole model, which would overwrite them. Build "
            "every parameter on meta (load given values with --pretrained), or none",
        )
    if callable(_method(model, "init_weights")):
        return
    bare = []
    for name, module in model.named_modules():
        owned = [*own_parameters(module).items(), *own_buffers(module).items()]
        meta = [attribute for attribute, tensor in owned if tensor is not None and tensor.is_meta]
        if meta and not callable(_method(module, "reset_parameters")):
            where = unwrapped_name(name) or "the model"
            bare.append(f"{where} ({type(module).__name__}: {', '.join(meta)})")
    if bare:
        more = f", ... ({len(bare)} in all)" if len(bare) > 3 else ""
        raise ConfigError(
            "model",
            f"{type(model).__name__} built on the meta device",
            f"nothing initialises {', '.join(bare[:3])}{more}: the model has no init_weights() and these modules no "
            "reset_parameters(). Give the model an init_weights() that initialises every parameter and buffer "
            "(TorchTitan's convention; it may take buffer_device=), or give those modules a reset_parameters(), or "
            "build the model on a real device",
        )


def materialise(parts: Sequence[nn.Module], device: torch.device) -> None:
    """Allocate each part's parameters and buffers on `device`, uninitialised (`to_empty`: FSDP2 points its sharded
    parameters at the new storage). The parameter objects stay the same (swapped, not replaced: an optimizer built in
    the user's `__init__` holds them). Buffers that were not on meta keep their values."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for part in parts:
            _materialise(part, device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def _materialise(part: nn.Module, device: torch.device) -> None:
    kept = [
        (module, name, tensor)
        for module in part.modules()
        for name, tensor in own_buffers(module).items()
        if tensor is not None and not tensor.is_meta and not isinstance(tensor, DTensor)
    ]
    part.to_empty(device=device)
    for module, name, tensor in kept:
        own_buffers(module)[name] = tensor.to(device)


@torch.no_grad()
def initialise(parts: Sequence[nn.Module], seed: int, device: torch.device) -> None:
    """Initialise materialised parts (the whole model, or this rank's pipeline stages, under the whole model's
    names) with their own `init_weights()` or each submodule's `reset_parameters()`, every random draw seeded by
    (`seed`, the tensor's name, its draw count): the same values whatever the topology."""
    for part in parts:
        with NamedDraws(part, seed):
            init_weights = _method(part, "init_weights")
            if callable(init_weights):
                takes_device = "buffer_device" in inspect.signature(init_weights).parameters
                init_weights(buffer_device=device) if takes_device else init_weights()
                continue
            for module in part.modules():
                reset = _method(module, "reset_parameters")
                if callable(reset):
                    reset()


class NamedDraws(TorchDispatchMode):
    """Within it, an in-place random fill of a parameter or buffer of `model` draws the whole tensor from a generator
    seeded by (seed, the tensor's name, its draw count) and keeps this rank's shard of it. A fill of a DTensor that is
    not the model's is refused (its numbers would depend on the sharding); one of a plain tensor runs as usual."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.names: dict[int, str] = {}
        self.storages: dict[tuple[int, int, tuple[int, ...]], str] = {}
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            name = unwrapped_name(name)
            self.names[id(tensor)] = name
            key = _storage_key(tensor)
            if key is not None:
                self.storages[key] = name
        self.draws: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in RANDOM_FILLS:
            return func(*args, **kwargs)
        target = args[0]
        name = self._name(target)
        if name is None:
            if isinstance(target, DTensor):
                raise PerdureError(
                    f"initialising the meta-built model drew random values into a sharded tensor of shape "
                    f"{tuple(target.shape)} that is not one of its parameters or buffers: draw in place into the "
                    "parameters themselves (nn.init.*), which perdure initialises the same on every topology"
                )
            return func(*args, **kwargs)
        count = self.draws.get(name, 0)
        self.draws[name] = count + 1
        local = target.to_local() if isinstance(target, DTensor) else target
        generator = torch.Generator(device=local.device)
        generator.manual_seed(_draw_seed(self.seed, name, count))
        whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(whole, *args[1:], **{**kwargs, "generator": generator})
        if isinstance(target, DTensor):
            whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local.copy_(whole)
        return target

    def _name(self, tensor: torch.Tensor) -> str | None:
        name = self.names.get(id(tensor))
        if name is None:  # `weight.data.normal_()`: another tensor object over the same storage
            key = _storage_key(tensor)
            name = self.storages.get(key) if key is not None else None
        return name


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.is_meta or local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), int(local.storage_offset()), tuple(tensor.shape))


def _draw_seed(seed: int, name: str, count: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{count}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def _method(module: nn.Module, name: str) -> Any:
    """`module.<name>` when its class defines it (a submodule or parameter of that name is not a method)."""
    return getattr(module, name) if inspect.isroutine(inspect.getattr_static(type(module), name, None)) else None


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]
