"""Reading checkpoint files that may come from someone else without ever running their code.

A checkpoint's manifest is no defence (whoever hands over a checkpoint writes its checksums too), so every pickle
perdure reads goes through an allow-list:

- `torch.save` files (`state.pth`, `replicated.pth`, `rank*.pth`, DCP's non-tensor entries) are read with
  `torch.load(weights_only=True)`: tensors and plain data only. `load_torch_file` / `load_torch_bytes` turn a
  refusal into a `CheckpointError` that names the file and the global it wanted, never torch's advice to retry
  with `weights_only=False`.
- DCP's `.metadata` and its readers: `safe_dcp.py` (apart, so that a process that never reads DCP never imports it).
- DeepSpeed engine files (`*_model_states.pt`, `*_optim_states.pt`, universal `zero/*/*.pt`) are `torch.save` files
  that also hold four DeepSpeed classes (`DEEPSPEED_GLOBALS`). `load_deepspeed_file` reads them with
  `weights_only=True` and exactly those classes allowed.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from perdure.errors import CheckpointError
from perdure.safe_io import open_regular, safe_name


class BlockedGlobalError(pickle.UnpicklingError):
    """A pickle asked for a global outside the allow-list. `name` is `module.qualname`."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"global {name} is not allowed")


def _refusal(path: object, global_name: str) -> CheckpointError:
    return CheckpointError(
        f"refused to load {path}: it needs the global {global_name}, which is not plain data, tensors or DCP "
        "metadata. Unpickling it could run code, so perdure never does; a checkpoint from someone else that needs it "
        "cannot be loaded (ask its author for a checkpoint perdure wrote, or for a model export such as model.pth)."
    )


_TORCH_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _torch_refusal(path: object, error: pickle.UnpicklingError) -> CheckpointError:
    match = _TORCH_GLOBAL.search(str(error))
    if match is None:  # not a refused global: the bytes are no pickle torch can read (garbage, truncated, ...)
        detail = next((line.strip() for line in str(error).splitlines() if "Unsupported" in line), "")
        return CheckpointError(
            f"{path} is not a torch.save file of tensors and plain data that perdure can read"
            + (f" ({safe_name(detail, limit=120)})" if detail else "")
        )
    name = match.group(1)
    if "." not in name:  # torch strips the module of builtins from its message
        name = f"builtins.{name}"
    return _refusal(path, name)


def load_torch_bytes(data: IO[bytes], what: object) -> Any:
    """`torch.load(data, weights_only=True)`; a refused pickle is a `CheckpointError` naming `what` and the global
    (or saying it is no torch.save file at all)."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise _torch_refusal(what, error) from None


def load_torch_file(path: Path, *, follow_symlinks: bool = False, mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` of a regular file (never a FIFO; a symlink only with `follow_symlinks`,
    for a file the user named), refusals made clear. OSError (missing, unreadable, `UnsafeFileError`) passes through.
    `mmap`: the tensors are mapped from the file, not read (only the pages a reader touches are read; torch maps a
    file by name, after the check that it is a regular file)."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    if mmap:
        os.close(fd)
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as error:
            raise _torch_refusal(path, error) from None
    with os.fdopen(fd, "rb") as file:
        return load_torch_bytes(file, path)


# ---------------------------------------------------------------------- DeepSpeed

# The DeepSpeed classes found in the engine's checkpoint files (DeepSpeed 0.19.8; ZeRO 0-3; fp32, bf16, fp16; universal
# checkpoints): records whose unpickling sets attributes (or, for the enum, looks a member up) and runs nothing else.
# Named rather than imported here: DeepSpeed is an optional extra and slow to import.
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # the static loss scale of fp32 / bf16 ZeRO optimizers
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # fp16's dynamic loss scale
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # an int enum: the ZeRO stage
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # a dataclass of two ints: (numel, start)
)


@functools.cache
def deepspeed_globals() -> list[Any]:
    """The classes of `DEEPSPEED_GLOBALS` for `torch.serialization.safe_globals` (imports DeepSpeed).

    torch's unpickler sets attributes (BUILD) on any object whose type is allowed. An enum member is a value shared
    by the whole process (`ZeroStageEnum(2)` returns the one `ZeroStageEnum.gradients`), so the enum is allowed
    under its name as a function that looks a member up: the member's type is then not allowed, and a pickle cannot
    change it."""
    import importlib

    allowed: list[Any] = []
    for module, name in DEEPSPEED_GLOBALS:
        found = getattr(importlib.import_module(module), name)
        if isinstance(found, enum.EnumMeta):
            allowed.append((_enum_lookup(found), f"{module}.{name}"))
        else:
            allowed.append(found)
    return allowed


def _enum_lookup(enum_class: enum.EnumMeta) -> Any:
    def member(value: Any) -> Any:
        return enum_class(value)

    return member


@contextlib.contextmanager
def deepspeed_loads_restricted() -> Iterator[None]:
    """While DeepSpeed's own code runs (its engine's universal load, its universal converter, zero-to-fp32), every
    `torch.load` of the process is `weights_only=True` with `DEEPSPEED_GLOBALS` allowed, whatever the caller asked:
    DeepSpeed opens the files of a checkpoint by name with `weights_only=False`. torch reads
    `TORCH_FORCE_WEIGHTS_ONLY_LOAD` at every load; a refused pickle raises torch's UnpicklingError (a
    `CheckpointError` through `deepspeed_refusal`)."""
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # both set is an error of torch's
    try:
        with _deepspeed_globals_allowed():
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _deepspeed_globals_allowed() -> contextlib.AbstractContextManager[Any]:
    """torch's `safe_globals` of those of `DEEPSPEED_GLOBALS` not allowed yet: leaving a nested one (a file read
    through `load_deepspeed_file` inside `deepspeed_loads_restricted`) must not disallow the outer one's."""
    present = torch.serialization.get_safe_globals()
    return torch.serialization.safe_globals([item for item in deepspeed_globals() if item not in present])


def deepspeed_refusal(what: object, error: pickle.UnpicklingError) -> CheckpointError:
    """The `CheckpointError` of a pickle that `deepspeed_loads_restricted` refused in DeepSpeed's code."""
    return _torch_refusal(what, error)


def load_deepspeed_file(path: Path, *, mmap: bool = False) -> Any:
    """A DeepSpeed engine file, `torch.load(weights_only=True)` with `DEEPSPEED_GLOBALS` allowed and nothing else; a
    refusal is a `CheckpointError` naming the file and the global. `mmap` maps tensor data instead of reading it (a
    cheap check of the pickle alone). OSError (missing, a symlink, not a regular file) passes through."""
    os.close(open_regular(path))  # a regular file, not a symlink: torch.load below opens it by name (mmap needs that)
    with _deepspeed_globals_allowed():
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            raise _torch_refusal(path, error) from None
        except RuntimeError as error:  # not a zip archive torch can read (truncated, garbage)
            raise CheckpointError(f"{path} is not a torch.save file perdure can read ({error})") from None
