"""Reading checkpoint files that may come from someone else without ever running their code.

A checkpoint's manifest is no defence (whoever hands over a checkpoint writes its checksums too), so every pickle
perdure reads goes through an allow-list:

- `torch.save` files (`state.pth`, `replicated.pth`, `rank*.pth`, DCP's non-tensor entries) are read with
  `torch.load(weights_only=True)`: tensors and plain data only. `load_torch_file` / `load_torch_bytes` turn a
  refusal into a `CheckpointError` that names the file and the global it wanted, never torch's advice to retry
  with `weights_only=False`.
- DCP's `.metadata` is a plain pickle of DCP's own dataclasses. `read_dcp_metadata` unpickles it with
  `RestrictedUnpickler`, whose `find_class` knows exactly those classes, `torch.Size`, dtypes and layouts, and
  then checks the structure: every storage entry names a shard file of this checkpoint, within its size.
- `RestrictedFileSystemReader` is the `FileSystemReader` every DCP load uses: its metadata comes from
  `read_dcp_metadata`, and it only reads with `RestrictedLoadPlanner`, whose non-tensor entries go through
  `load_torch_bytes` (torch's default planner would `torch.load(weights_only=False)` them).
- DeepSpeed engine files (`*_model_states.pt`, `*_optim_states.pt`, universal `zero/*/*.pt`) are `torch.save` files
  that also hold four DeepSpeed classes (`DEEPSPEED_GLOBALS`). `load_deepspeed_file` reads them with
  `weights_only=True` and exactly those classes allowed.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from perdure.errors import CheckpointError
from perdure.safe_io import UnsafeFileError, open_regular, read_regular, safe_name

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30
SHARD_NAME = re.compile(r"^__\d+_\d+\.distcp$")

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP_METADATA, cls.__name__): cls
    for cls in (
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
    )
}
_ALLOWED[(_DCP_METADATA, "_MEM_FORMAT_ENCODING")] = torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a lookup of torch's layouts
# StorageMeta.checkpoint_id is the path it was saved to; constructing a path object runs nothing.
for _module in ("pathlib", "pathlib._local"):
    for _name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        _ALLOWED[(_module, _name)] = getattr(__import__("pathlib"), _name)


class BlockedGlobalError(pickle.UnpicklingError):
    """A pickle asked for a global outside the allow-list. `name` is `module.qualname`."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"global {name} is not allowed")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: DCP's metadata dataclasses, `torch.Size`, dtypes and layouts, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise BlockedGlobalError(f"{module}.{name}")


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


def load_torch_file(path: Path, *, follow_symlinks: bool = False) -> Any:
    """`torch.load(path, weights_only=True)` of a regular file (never a FIFO; a symlink only with `follow_symlinks`,
    for a file the user named), refusals made clear. OSError (missing, unreadable, `UnsafeFileError`) passes through."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
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


def deepspeed_globals() -> list[Any]:
    """The classes of `DEEPSPEED_GLOBALS` (imports DeepSpeed)."""
    import importlib

    return [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_GLOBALS]


def load_deepspeed_file(path: Path, *, mmap: bool = False) -> Any:
    """A DeepSpeed engine file, `torch.load(weights_only=True)` with `DEEPSPEED_GLOBALS` allowed and nothing else; a
    refusal is a `CheckpointError` naming the file and the global. `mmap` maps tensor data instead of reading it (a
    cheap check of the pickle alone). OSError (missing, a symlink, not a regular file) passes through."""
    os.close(open_regular(path))  # a regular file, not a symlink: torch.load below opens it by name (mmap needs that)
    with torch.serialization.safe_globals(deepspeed_globals()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            raise _torch_refusal(path, error) from None
        except RuntimeError as error:  # not a zip archive torch can read (truncated, garbage)
            raise CheckpointError(f"{path} is not a torch.save file perdure can read ({error})") from None


# ---------------------------------------------------------------------- DCP


def read_dcp_metadata(checkpoint: Path, files: dict[str, Any] | None = None) -> Metadata:
    """DCP's `.metadata` of `checkpoint`, unpickled through the allow-list and checked.

    `files` (the manifest's `files`) lists what the checkpoint holds; without it the directory is looked at. Raises
    `CheckpointError` naming the file and the offending global or field.
    """
    path = Path(checkpoint) / METADATA_FILE
    try:
        data = read_regular(path, MAX_METADATA_BYTES)
    except UnsafeFileError as error:
        raise CheckpointError(f"cannot read DCP metadata: {error}") from None
    except OSError as error:
        raise CheckpointError(f"cannot read DCP metadata {path}: {error}") from None
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    except BlockedGlobalError as error:
        raise _refusal(path, error.name) from None
    except Exception as error:  # a malformed pickle of allowed classes: any error of their constructors
        raise CheckpointError(f"DCP metadata {path} is malformed ({type(error).__name__}: {error})") from None
    try:
        _check_metadata(path, metadata, _shard_sizes(Path(checkpoint), files))
    except CheckpointError:
        raise
    except Exception as error:  # an attribute missing, a size that overflows, ...: malformed all the same
        raise CheckpointError(f"DCP metadata {path} is malformed ({type(error).__name__}: {error})") from None
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _shard_sizes(checkpoint: Path, files: dict[str, Any] | None) -> dict[str, int]:
    if files is not None:
        return {name: int(entry["size"]) for name, entry in files.items() if SHARD_NAME.match(name)}
    sizes = {}
    for entry in os.scandir(checkpoint):
        if SHARD_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
            sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
    return sizes


def _size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)


def _check_metadata(path: Path, metadata: Any, shards: dict[str, int]) -> None:
    """The structure DCP's reader relies on, with every size bounded by the shard files that hold the data."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"DCP metadata {path} is malformed: {what}")

    if type(metadata) is not Metadata:
        raise bad(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise bad("state_dict_metadata / storage_data are not dicts")
    budget = sum(shards.values())  # a tensor cannot hold more bytes than the shard files store
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {safe_name(key)} is not a string")
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata:
            raise bad(f"entry {safe_name(key)} is a {type(item).__name__}")
        props = item.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype) or not _size(item.size):
            raise bad(f"entry {safe_name(key)} has no valid dtype / size")
        if item.size.numel() * props.dtype.itemsize > budget:
            raise bad(f"entry {safe_name(key)} claims {tuple(item.size)} values, more than its shard files hold")
        chunks = item.chunks
        if not isinstance(chunks, list) or not all(
            type(c) is ChunkStorageMetadata and _size(c.offsets) and _size(c.sizes) for c in chunks
        ):
            raise bad(f"entry {safe_name(key)} has malformed chunks")
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str) or type(info) is not _StorageInfo:
            raise bad("a storage entry is not a MetadataIndex -> _StorageInfo pair")
        name = info.relative_path
        if not isinstance(name, str) or name not in shards:
            raise bad(f"entry {safe_name(index.fqn)} points to {safe_name(name)}, not a shard file of the checkpoint")
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length):
            raise bad(f"entry {safe_name(index.fqn)} has a bad offset / length")
        if offset + length > shards[name]:
            raise bad(f"entry {safe_name(index.fqn)} reads past the end of {name}")
        if info.transform_descriptors:  # compression and other stream transforms: perdure never writes them
            raise bad(f"entry {safe_name(index.fqn)} uses stream transforms {safe_name(info.transform_descriptors)}")
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not StorageMeta:
        raise bad("storage_meta is not a StorageMeta")


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor entry is read with `torch.load(weights_only=True)`."""

    def __init__(self, checkpoint: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_torch_bytes(value, f"entry {fqn!r} of DCP checkpoint {self.checkpoint}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class RestrictedFileSystemReader(FileSystemReader):
    """The DCP reader of every perdure load: metadata through `read_dcp_metadata`, data only with a
    `RestrictedLoadPlanner`. `files` is the verified manifest's file list."""

    def __init__(self, path: Path, files: dict[str, Any] | None = None) -> None:
        super().__init__(path)
        self.checkpoint = Path(path)
        self.files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Always the one global `.metadata` (perdure never writes DCP's per-rank metadata files, `rank=`).
        metadata = read_dcp_metadata(self.checkpoint, self.files)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, RestrictedLoadPlanner):
            raise CheckpointError(
                "internal: a DCP load without RestrictedLoadPlanner would unpickle non-tensor entries unrestricted"
            )
        return super().read_data(plan, planner)
