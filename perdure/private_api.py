"""The one place perdure uses private torch and DeepSpeed APIs (names with a leading underscore, modules under `_`).

Each is a small named function here, with a comment saying what it relies on; every one is tested with torch 2.13 and
DeepSpeed 0.19.8 (what the suite runs). A release that moves or changes one breaks here, under a name that says what
perdure needed, instead of somewhere in the runner. tests/test_private_api.py fails when any other module of perdure
touches a private torch or DeepSpeed attribute.

A leaf module: it imports nothing of perdure. It imports `torch` (and `torch.utils._python_dispatch`, which
`import torch` loads anyway); torch's other private modules and DeepSpeed are imported inside the function that needs
them, so that importing this module loads neither dynamo, DCP nor DeepSpeed.
"""

from __future__ import annotations

import functools
import io
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import IO, TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

# The base of a dispatch mode (`meta_init.NamedDraws`); torch.utils._python_dispatch, torch 2.13.
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch._dynamo.eval_frame import OptimizedModule as OptimizedModule  # the type of a torch.compile wrapper
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "DCP_EXECUTOR_MODULE",
    "TorchDispatchMode",
    "chained_schedulers",
    "child_modules",
    "compiled_original",
    "compute_local_shape_and_global_offset",
    "dcp_checkpoint_process",
    "dcp_executor_holds_process",
    "dcp_forget_checkpoint_process",
    "dcp_mem_format_encoding",
    "dcp_set_element",
    "dcp_storage_info_class",
    "disable_deepspeed_op",
    "flatten_dense_tensors",
    "flatten_mesh_dims",
    "foreach_lerp_",
    "has_state_dict_hooks",
    "is_compiled_in_place",
    "is_compiled_wrapper",
    "load_own_state",
    "mark_lr_scheduler_step",
    "non_finite_check_and_unscale_",
    "open_zipfile_writer",
    "own_buffers",
    "own_parameters",
    "push_all_rebuilt_params",
    "run_state_dict_pre_hooks",
    "save_own_state",
    "saves_own_state_as_module_does",
    "serialization_get_layout",
    "set_load_universal_checkpoint",
    "share_storage_fd",
    "storage_alignment",
    "storage_from_shared_fd",
    "storage_pickle_reference",
    "streaming_load",
    "tensor_pickle_reduction",
    "tensorboard_file_writer",
    "tree_map",
    "unflatten_dense_tensors",
]

# ---- the training step -----------------------------------------------------------------------------------------------


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    # GradScaler's fused kernel torch._amp_foreach_non_finite_check_and_unscale_ (one device's tensors); torch 2.13.
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def foreach_lerp_(tensors: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    # The fused in-place lerp torch._foreach_lerp_ (what torch.optim's foreach paths use); torch 2.13.
    torch._foreach_lerp_(tensors, ends, weight)


def flatten_dense_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    # torch._utils._flatten_dense_tensors: one flat tensor of the tensors' elements, as DDP buckets them; torch 2.13.
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # torch._utils._unflatten_dense_tensors: views of `flat` shaped as `tensors`; torch 2.13.
    return tuple(torch._utils._unflatten_dense_tensors(flat, tensors))


def push_all_rebuilt_params(reducer: Any) -> None:
    # DDP's Reducer._push_all_rebuilt_params: marks every parameter seen, in index order (the bucket layout);
    # torch 2.13.
    reducer._push_all_rebuilt_params()


def mark_lr_scheduler_step(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> Callable[..., Any]:
    """`step` wrapped as an LRScheduler wraps the step of the optimizer it is built with."""

    # LRScheduler's protocol: the wrapper sets optimizer._opt_called and carries _wrapped_by_lr_sched; torch 2.13.
    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return counted


def chained_schedulers(scheduler: Any) -> list[Any]:
    # The schedulers a SequentialLR / ChainedScheduler holds (its _schedulers; none for another); torch 2.13.
    return list(vars(scheduler).get("_schedulers", []))


# ---- torch.compile ---------------------------------------------------------------------------------------------------


def is_compiled_wrapper(module: nn.Module) -> TypeGuard[OptimizedModule]:
    # Whether `module` is torch.compile's wrapper torch._dynamo.eval_frame.OptimizedModule, without importing dynamo
    # (nothing can be compiled before it is imported); torch 2.13.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def compiled_original(module: OptimizedModule) -> nn.Module:
    # The module a torch.compile wrapper holds (OptimizedModule._orig_mod); torch 2.13.
    return module._orig_mod


def is_compiled_in_place(module: nn.Module) -> bool:
    # Whether `nn.Module.compile` compiled `module` in place (its _compiled_call_impl is set); torch 2.13.
    return module._compiled_call_impl is not None


# ---- a module's own members ------------------------------------------------------------------------------------------


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    # nn.Module._parameters: `module`'s own parameters by attribute name (None: registered as None), the dict itself,
    # so that a write re-registers one; torch 2.13.
    return module._parameters


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    # nn.Module._buffers: `module`'s own buffers by attribute name, the dict itself (a write replaces one); torch 2.13.
    return module._buffers


def child_modules(module: nn.Module) -> dict[str, nn.Module | None]:
    # nn.Module._modules: `module`'s direct children by attribute name, None ones included; torch 2.13.
    return module._modules


def has_state_dict_hooks(module: nn.Module) -> bool:
    # Whether `module` has state-dict post hooks registered (nn.Module._state_dict_hooks); torch 2.13.
    return bool(module._state_dict_hooks)


def saves_own_state_as_module_does(kind: type[nn.Module]) -> bool:
    # Whether a module class keeps nn.Module's own _save_to_state_dict (no override that changes its entries);
    # torch 2.13.
    return kind._save_to_state_dict is nn.Module._save_to_state_dict


def run_state_dict_pre_hooks(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    # The state-dict pre hooks `module.state_dict()` runs first (nn.Module._state_dict_pre_hooks); torch 2.13.
    for hook in module._state_dict_pre_hooks.values():
        hook(module, prefix, keep_vars)


def save_own_state(module: nn.Module, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
    # `module`'s own parameters and buffers (not its children's) into `destination`: nn.Module._save_to_state_dict;
    # torch 2.13.
    module._save_to_state_dict(destination, prefix, keep_vars)


def load_own_state(
    module: nn.Module, state: dict[str, Any], prefix: str, missing: list[str], unexpected: list[str], errors: list[str]
) -> None:
    # `module`'s own entries (not its children's) from `state`, strictly, with the module's version as metadata:
    # nn.Module._load_from_state_dict and _version; torch 2.13.
    metadata = {"version": module._version}
    module._load_from_state_dict(state, prefix, metadata, True, missing, unexpected, errors)


# ---- shared memory, pickling and torch.save's format -----------------------------------------------------------------


def storage_from_shared_fd(fd: int, nbytes: int) -> torch.UntypedStorage:
    # A CPU storage mapping a duplicate of the shared-memory descriptor `fd`: torch.UntypedStorage._new_shared_fd_cpu
    # (not in torch's stubs); torch 2.13.
    return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]


def share_storage_fd(storage: torch.UntypedStorage) -> tuple[int, int]:
    # The descriptor a shared CPU storage keeps and its size, nothing copied: UntypedStorage._share_fd_cpu_; torch 2.13.
    descriptor, nbytes = storage._share_fd_cpu_()
    return int(descriptor), int(nbytes)


def streaming_load(stream: io.BufferedIOBase, *, weights_only: bool) -> Any:
    # torch.distributed._serialization._streaming_load: torch.load of a byte stream written by _streaming_save, with
    # its allow-list when weights_only (what torchft's HTTP transport sends); torch 2.13.
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(stream, weights_only=weights_only)


def tree_map(function: Callable[[Any], Any], tree: Any) -> Any:
    # torch.utils._pytree.tree_map over nested lists, tuples and dicts; torch 2.13.
    from torch.utils._pytree import tree_map as pytree_map

    return pytree_map(function, tree)


def tensor_pickle_reduction(dtype: torch.dtype, args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    # What Tensor._reduce_ex_internal returns for a CPU tensor as torch.save pickles it: torch._utils._rebuild_tensor_v3
    # (with the dtype) for the dtypes torch.storage._new_dtypes() lists, else _rebuild_tensor_v2; torch 2.13.
    if dtype in torch.storage._new_dtypes():
        return (torch._utils._rebuild_tensor_v3, (*args, dtype))
    return (torch._utils._rebuild_tensor_v2, args)


def storage_pickle_reference(dtype: torch.dtype, numel: int, key: str) -> tuple[Any, ...]:
    # torch.save's persistent id of a CPU storage of `numel` elements of `dtype` kept in record `key`: an UntypedStorage
    # of bytes for torch.storage._new_dtypes(), else the typed storage class its _pickle_storage_type() names;
    # torch 2.13.
    if dtype in torch.storage._new_dtypes():
        return ("storage", torch.UntypedStorage, key, "cpu", numel * dtype.itemsize)
    typed = torch.empty(0, dtype=dtype)._typed_storage()
    return ("storage", getattr(torch, typed._pickle_storage_type()), key, "cpu", numel)


def open_zipfile_writer(file: IO[bytes]) -> AbstractContextManager[Any]:
    # torch.save's zip writer over a file object (torch.serialization._open_zipfile_writer; write_record); torch 2.13.
    return torch.serialization._open_zipfile_writer(file)


def storage_alignment() -> int:
    # The storage alignment torch.save writes as `.storage_alignment` (torch.serialization._get_storage_alignment);
    # torch 2.13.
    return torch.serialization._get_storage_alignment()


def serialization_get_layout() -> Callable[[str], Any]:
    # torch.serialization._get_layout, the lookup of torch's layouts a pickled TensorProperties names; torch 2.13.
    return torch.serialization._get_layout


def tensorboard_file_writer(writer: Any) -> Any:
    # The event-file writer of a torch.utils.tensorboard SummaryWriter (_get_file_writer), to add a raw Summary;
    # torch 2.13.
    return writer._get_file_writer()


# ---- distributed checkpoint (DCP) and DTensor ------------------------------------------------------------------------


def dcp_storage_info_class() -> type[_StorageInfo]:
    # DCP's _StorageInfo (torch.distributed.checkpoint.filesystem), what its metadata maps each index to; torch 2.13.
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


def dcp_mem_format_encoding() -> type:
    # DCP's _MEM_FORMAT_ENCODING enum (torch.distributed.checkpoint.metadata), pickled in TensorProperties; torch 2.13.
    from torch.distributed.checkpoint import metadata

    return metadata._MEM_FORMAT_ENCODING


def dcp_set_element(state_dict: dict[str, Any], path: Any, value: Any) -> None:
    # DCP's torch.distributed.checkpoint._traverse.set_element: puts `value` at an object path of a state dict;
    # torch 2.13.
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


DCP_EXECUTOR_MODULE = "torch.distributed.checkpoint._async_process_executor"


def dcp_executor_holds_process() -> bool:
    # Whether DCP's process executor is imported and keeps its checkpoint process in _CHECKPOINT_PROCESS; torch 2.13.
    module = sys.modules.get(DCP_EXECUTOR_MODULE)
    return module is not None and hasattr(module, "_CHECKPOINT_PROCESS")


def dcp_checkpoint_process() -> Any | None:
    # The process DCP's process executor started (its _CHECKPOINT_PROCESS holder's _save_process), None while it is
    # being started or when there is none; torch 2.13.
    module = sys.modules.get(DCP_EXECUTOR_MODULE)
    holder = None if module is None else module._CHECKPOINT_PROCESS
    return None if holder is None else holder._save_process


def dcp_forget_checkpoint_process() -> None:
    # Makes DCP's process executor start a new process at the next save (_CHECKPOINT_PROCESS = None); torch 2.13.
    module = sys.modules[DCP_EXECUTOR_MODULE]
    module._CHECKPOINT_PROCESS = None  # type: ignore[attr-defined]  # torch's private executor state (no stub)


def compute_local_shape_and_global_offset(
    global_shape: torch.Size | tuple[int, ...], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # The shape and global offset of this rank's shard of a DTensor, as DCP computes them
    # (torch.distributed.tensor._utils.compute_local_shape_and_global_offset); torch 2.13.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    shape, offset = compute(global_shape, mesh, placements)
    return tuple(shape), tuple(offset)


def dtensor_local(tensor: DTensor) -> torch.Tensor:
    # The shard a DTensor holds on this rank (DTensor._local_tensor), the tensor `to_local()` returns a view of, without
    # to_local()'s autograd Function: for gradients, read on the step's path once per parameter, where that Function
    # cost ~8 us each (issue 37); torch 2.13.
    return tensor._local_tensor


def flatten_mesh_dims(mesh: DeviceMesh, names: tuple[str, ...], name: str) -> None:
    # Flattens dimensions `names` of a DeviceMesh into one named `name` (DeviceMesh._flatten); torch 2.13.
    mesh[names]._flatten(name)


# ---- DeepSpeed -------------------------------------------------------------------------------------------------------


def disable_deepspeed_op(name: str) -> None:
    # Marks a DeepSpeed op incompatible in deepspeed.ops.__compatible_ops__, read when its comm backend initialises;
    # DeepSpeed 0.19.8.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[name] = False


def set_load_universal_checkpoint(engine: Any, universal: bool) -> None:
    # A DeepSpeed engine's config switch load_universal_checkpoint (engine._config), read by load_checkpoint only;
    # DeepSpeed 0.19.8.
    engine._config.load_universal_checkpoint = universal
