"""Reading DCP checkpoints that may come from someone else without ever running their code (see safe_unpickle.py).

- DCP's `.metadata` is a plain pickle of DCP's own dataclasses. `read_dcp_metadata` unpickles it with
  `RestrictedUnpickler`, whose `find_class` knows exactly those classes, `torch.Size`, dtypes and layouts, and
  then checks the structure: every storage entry names a shard file of this checkpoint, within its size. The
  unpickler also never changes what it did not build: pickle's BUILD sets attributes on whatever object it is given,
  a class included (`Metadata.__getstate__ = ...` in one `.metadata` would break every later save of the process),
  so BUILD is only allowed on an instance of a metadata class that this load created.
- `RestrictedFileSystemReader` is the `FileSystemReader` every DCP load uses: its metadata comes from
  `read_dcp_metadata`, and it only reads with `RestrictedLoadPlanner`, whose non-tensor entries go through
  `load_torch_bytes` (torch's default planner would `torch.load(weights_only=False)` them).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from perdure.checkpoints.safe_unpickle import BlockedGlobalError, _refusal, load_torch_bytes
from perdure.errors import CheckpointError
from perdure.private_api import (
    dcp_mem_format_encoding,
    dcp_set_element,
    dcp_storage_info_class,
    serialization_get_layout,
)
from perdure.safe_io import UnsafeFileError, read_regular, safe_name

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30
SHARD_NAME = re.compile(r"^__\d+_\d+\.distcp$")
DcpStorageInfo = dcp_storage_info_class()  # what DCP's metadata maps each index to (a private class of DCP)

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
_ALLOWED[(_DCP_METADATA, "_MEM_FORMAT_ENCODING")] = dcp_mem_format_encoding()
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = DcpStorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = serialization_get_layout()  # a lookup of torch's layouts
# StorageMeta.checkpoint_id is the path it was saved to; constructing a path object runs nothing.
for _module in ("pathlib", "pathlib._local"):
    for _name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        _ALLOWED[(_module, _name)] = getattr(__import__("pathlib"), _name)


# The classes whose instances pickle fills in with BUILD (their `__dict__`, or TensorProperties' `__setstate__`).
_BUILDABLE = frozenset(
    (Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
     TensorProperties, DcpStorageInfo)
)  # fmt: skip


class BlockedChangeError(pickle.UnpicklingError):
    """A pickle asked to change an object the unpickler did not create (a class, a function, a shared value)."""


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata: DCP's metadata dataclasses, `torch.Size`, dtypes and layouts, and nothing else; changes
    only objects it created itself.

    Python's own unpickler (the pure-Python one: the C one's opcodes cannot be overridden) with `find_class`
    restricted and the opcodes that change an existing object checked first: BUILD only on an instance of a DCP
    metadata class that NEWOBJ / REDUCE / INST / OBJ of this load created, never on a class, a function, a dtype or an
    enum member; APPEND / SETITEM / ADDITEMS only on a plain list / dict / set (which only pickle's own opcodes make).
    """

    # The pure-Python unpickler's working stacks (set by `load`), which typeshed's `_Unpickler` does not list.
    stack: list[Any]
    metastack: list[list[Any]]

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._created: dict[int, Any] = {}  # id -> object (kept alive, so that an id is never reused)

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise BlockedGlobalError(f"{module}.{name}")

    def load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in _BUILDABLE or self._created.get(id(target)) is not target:
            raise BlockedChangeError(f"sets attributes of {_described(target)} (pickle's BUILD)")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # typeshed lists no `load_*` opcode methods


def _recording_creation(load: Any) -> Any:
    def create(self: RestrictedUnpickler) -> None:
        load(self)
        made = self.stack[-1]
        if type(made) in _BUILDABLE:
            self._created[id(made)] = made

    return create


def _checking_container(load: Any, opcode: bytes, expected: type) -> Any:
    marked = opcode in (pickle.APPENDS, pickle.SETITEMS, pickle.ADDITEMS)  # the target sits below the mark
    depth = 3 if opcode == pickle.SETITEM else 2

    def fill(self: RestrictedUnpickler) -> None:
        target = self.metastack[-1][-1] if marked else self.stack[-depth]
        if type(target) is not expected:
            raise BlockedChangeError(f"adds items to {_described(target)} (pickle's {opcode!r})")
        load(self)

    return fill


_PLAIN = pickle._Unpickler.dispatch
# typeshed types `dispatch` as taking any `Unpickler`; these entries are only ever called with a RestrictedUnpickler.
RestrictedUnpickler.dispatch = {
    **_PLAIN,
    pickle.BUILD[0]: RestrictedUnpickler.load_build,  # type: ignore[dict-item]
    **{op[0]: _recording_creation(_PLAIN[op[0]]) for op in (pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.REDUCE,
                                                            pickle.INST, pickle.OBJ)},
    **{op[0]: _checking_container(_PLAIN[op[0]], op, kind) for op, kind in ((pickle.APPEND, list),
       (pickle.APPENDS, list), (pickle.SETITEM, dict), (pickle.SETITEMS, dict), (pickle.ADDITEMS, set))},
}  # fmt: skip


def _described(target: Any) -> str:
    if isinstance(target, type):
        return f"the class {target.__module__}.{target.__qualname__}"
    return f"a {type(target).__module__}.{type(target).__qualname__} it did not create"


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
    except BlockedChangeError as error:
        raise CheckpointError(
            f"refused to load {path}: its pickle {error}. Unpickling it would change a class or object the whole "
            "process uses (every later checkpoint it writes or reads), so perdure never does; DCP never writes such "
            "a pickle: the file was made by hand."
        ) from None
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
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str) or type(info) is not DcpStorageInfo:
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
            dcp_set_element(self.original_state_dict, self.mappings[fqn], obj)
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
        assert metadata.storage_meta is not None  # `read_dcp_metadata` gives one to metadata that had none
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, RestrictedLoadPlanner):
            raise CheckpointError(
                "internal: a DCP load without RestrictedLoadPlanner would unpickle non-tensor entries unrestricted"
            )
        return super().read_data(plan, planner)
