"""How the parallel stack shards one model (or one pipeline stage), in TorchTitan's order:

    model parallelism (tensor / context / expert: the model's own `parallelize(mesh)`)
      -> activation checkpointing (per block) -> compile (per block) -> FSDP2 (per block, then the root)

Each step is one function. None of them renames a parameter: activation checkpointing wraps a block's `forward` in
place (no `_checkpoint_wrapped_module.`), compile uses `nn.Module.compile` (no `_orig_mod.`), and FSDP2 keeps names,
so checkpoints and exports hold the names of the user's model on every stack.

"Blocks" are the repeated units of a model (transformer layers): the children of its `layers` or `blocks` container
(`nn.ModuleDict` or `nn.ModuleList`). A model without one is sharded as a whole (one FSDP unit) and cannot use
activation checkpointing or per-block compile; `ParallelRunner.model_blocks` is the override point.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from perdure.distributed.topology import FSDP_CONTEXT_MESH, MESH_NAMES, MESH_ORDER, MODEL_AXES, Topology
from perdure.errors import ConfigError, PerdureError
from perdure.private_api import child_modules

BLOCK_CONTAINERS = ("layers", "blocks")
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the model's `layers` / `blocks` container (ModuleDict or ModuleList), else none."""
    for name in BLOCK_CONTAINERS:
        container = child_modules(model).get(name)
        if isinstance(container, (nn.ModuleDict, nn.ModuleList)):
            return [block for block in container.children()]
    return []


def apply_model_parallel(model: nn.Module, mesh: Any, topology: Topology) -> None:
    """Tensor, context and expert parallelism are the model's business: call `model.parallelize(mesh)` when any of
    those axes is > 1. A model without that method is refused: training it unsplit would silently be a no-op."""
    if not topology.model_parallel:
        return
    axes = ", ".join(f"{axis}={topology.size(axis)}" for axis in MODEL_AXES if topology.size(axis) > 1)
    parallelize = getattr(type(model), "parallelize", None)
    if not callable(parallelize):
        raise ConfigError(
            "parallel.axes",
            axes,
            f"{type(model).__name__} has no parallelize(mesh) method, so it cannot be split along {axes}; give it "
            "one (e.g. a tensor-parallel plan with torch.distributed.tensor.parallel.parallelize_module on "
            "mesh['tp']), or set those axes to 1",
        )
    cast(Any, model).parallelize(mesh)  # the method of its class, found above


@contextlib.contextmanager
def mesh_misuse_hints(where: str) -> Iterator[None]:
    """Torch's errors from a model's own plan that used perdure's mesh the wrong way, re-raised with the fix: a mesh
    dimension by another name (perdure names them as TorchTitan does), or a function that expects TorchTitan's
    ParallelDims (or another object of its own) instead of a DeviceMesh."""
    names = ", ".join(f"{MESH_NAMES[axis]} ({axis})" for axis in MESH_ORDER)
    try:
        yield
    except KeyError as error:
        if "mesh_dim_names" not in str(error):
            raise
        raise PerdureError(
            f"{where} asked the device mesh for a dimension it does not have ({error}). perdure's mesh names its "
            f"dimensions as TorchTitan does: {names}, plus {FSDP_CONTEXT_MESH} when cp > 1; the data axes are always "
            "there, the others only when > 1 (e.g. mesh['tp'], not mesh['tensor'])"
        ) from error
    except AttributeError as error:
        if "DeviceMesh" not in str(error):
            raise
        raise PerdureError(
            f"{where} treated the torch DeviceMesh it was given as another object ({error}). perdure passes a "
            f"DeviceMesh with the dimensions {names}; for a parallelize function that takes TorchTitan's "
            "ParallelDims or a config of its own, override ParallelRunner.parallelize_model(model, mesh) and call it "
            "from there with what it needs (mesh['tp'], ...)"
        ) from error


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block's activations in the backward instead of keeping them (non-reentrant checkpoint; the
    random state is restored for the recomputation, so dropout masks are the same and the maths does not change)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        forward = block.forward
        block.forward = functools.wraps(forward)(functools.partial(checkpoint, forward, use_reentrant=False))


def apply_compile(blocks: list[nn.Module], backend: str, mode: str | None) -> None:
    """`torch.compile` each block in place (`nn.Module.compile`: parameter names do not change)."""
    for block in blocks:
        block.compile(backend=backend, mode=mode)


def mixed_precision_policy(precision: str) -> Any:
    """FSDP2's policy for `precision`: parameters (and so the compute) in bf16 / fp16, gradients reduced in fp32;
    fp32 keeps everything in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in PARAM_DTYPES:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[precision], reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh: Any,
    *,
    mp_policy: Any,
    offload: bool,
    reshard_after_forward: bool,
) -> None:
    """`fully_shard` every block, then the root (which takes the parameters no block holds). `mesh` is the data mesh
    (1-D: FSDP; 2-D replicate x shard: HSDP). The root is not resharded after the forward: its backward comes next."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=False, **options)
