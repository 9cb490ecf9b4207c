"""Model-only weights: the `model.pth` export, and reading weights back for `--pretrained`."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.commit import POINTERS, fsync_dir, write_file
from perdure.checkpoints.file import REPLICATED_FILE
from perdure.checkpoints.resolve import resolve_path
from perdure.checkpoints.safe_unpickle import load_torch_file
from perdure.errors import CheckpointError, ConfigError, PerdureError
from perdure.runners.compile import strip_compile_prefix
from perdure.safe_io import UnsafeFileError

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_weights(state_dict: dict[str, torch.Tensor], path: Path, dtype: str | None = None) -> Path:
    """Atomically write a state dict, casting floating-point tensors to `dtype` (fp32 | bf16 | fp16) when given."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError("ckpt.export_dtype", dtype, f"use one of {', '.join(EXPORT_DTYPES)} or leave it unset")
    target = EXPORT_DTYPES.get(dtype) if dtype else None
    weights = {
        name: (tensor.detach().to("cpu", target) if target and tensor.is_floating_point() else tensor.detach().cpu())
        for name, tensor in strip_compile_prefix(state_dict).items()
    }
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    write_file(temporary, lambda f: torch.save(weights, f))
    os.replace(temporary, path)
    fsync_dir(path.parent)
    return path


def cast_weights(weights: dict[str, Any], dtype: str | None) -> dict[str, torch.Tensor]:
    target = EXPORT_DTYPES[dtype] if dtype else None
    out = {}
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"weight {name!r} is a {type(tensor).__name__}, not a tensor; safetensors holds tensors"
            )
        tensor = tensor.detach().cpu()
        out[name] = tensor.to(target) if target is not None and tensor.is_floating_point() else tensor
    return out


def save_safetensors(weights: dict[str, Any], path: Path, dtype: str | None, metadata: dict[str, str]) -> Path:
    """Atomically write `weights` as safetensors: cast, contiguous, shared storage cloned, fsynced."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise PerdureError(
            f"writing {path.name} needs the safetensors package: pip install safetensors (or export to .pth)"
        ) from None
    tensors, seen = {}, set()
    for name, tensor in cast_weights(weights, dtype).items():
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        tensor = tensor.clone() if storage is not None and storage in seen else tensor.contiguous()
        seen.add(storage)
        tensors[name] = tensor
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def read_weights(path: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """Weights from an exported file (`model.pth`) or from a checkpoint / checkpoints / run directory or pointer,
    with plain names (`torch.compile`'s `_orig_mod.` removed, see `perdure.runners.compile`)."""
    return strip_compile_prefix(_read_weights(path, ema))


def _read_weights(path: Path, ema: bool) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"pretrained path {path} does not exist")
    if path.is_file() and path.name not in POINTERS:
        weights = _load(path, named=True)
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise CheckpointError(f"{path} holds no state dict of tensors; give a model export such as model.pth")
        return weights
    info = resolve_path(path)
    if info.manifest.get("backend") == "dcp":
        from perdure.checkpoints.dcp import read_dcp_weights

        return read_dcp_weights(info.path, ema=ema)
    if info.manifest.get("backend") == "deepspeed":
        from perdure.checkpoints.deepspeed_engine import read_deepspeed_weights

        return read_deepspeed_weights(info.path, ema=ema)
    state = _load(info.path / REPLICATED_FILE)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{info.path / REPLICATED_FILE} holds no model state; it is not a perdure checkpoint")
    if ema:
        if "ema" not in state:
            raise CheckpointError(
                f"checkpoint {info.path} holds no EMA weights (it was trained with ema.enabled=false)"
            )
        weights = state["ema"].get("shadow") if isinstance(state["ema"], dict) else None
    else:
        weights = state["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        what = "EMA weights" if ema else "model weights"
        raise CheckpointError(f"{info.path / REPLICATED_FILE} holds no state dict of tensors as its {what}")
    return weights


def _load(path: Path, *, named: bool = False) -> object:
    """`torch.load(weights_only=True)`; `named`: the user gave this file (a symlink to it is fine)."""
    try:
        return load_torch_file(path, follow_symlinks=named)
    except (CheckpointError, UnsafeFileError):
        raise
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} is not a torch.save file of tensors that perdure can load safely (it reads weights with "
            "weights_only=True); give a model export (model.pth) or a checkpoint / run directory"
        ) from error
    except Exception as error:
        raise CheckpointError(
            f"cannot read weights from {path} ({type(error).__name__}: {str(error).splitlines()[0]}); give a model "
            "export (model.pth) or a checkpoint / run directory"
        ) from error
