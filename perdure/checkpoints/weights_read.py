"""The one entry that reads model weights from a path, whatever wrote them: `read_weights(path)`.

    model.pth, any torch.save file of tensors    allow-listed `torch.load(weights_only=True)` (`safe_unpickle`)
    a checkpoint / checkpoints / run dir,        perdure's own: file, DCP and DeepSpeed backends, `latest` / `best`
      a `latest` / `best` pointer
    X.safetensors                                perdure's `model.safetensors` export or a Hugging Face file
    a Hugging Face directory                     `save_pretrained`'s layout (perdure's `hf/` export too):
                                                 `model.safetensors`, a sharded `model.safetensors.index.json`, or
                                                 `pytorch_model.bin` (allow-listed loader only)

Safetensors files are read through the `safetensors` library (no pickle), after perdure has checked the header itself
(`check_safetensors_header`): a bounded length, a JSON object of known dtypes whose offsets tile the file exactly, so
a hostile header is refused before anything is allocated. Shard names of an index are plain names in its directory;
a shard that is a symlink is refused.

`is_hf_source(path)`: whether the weights are in the Hugging Face layout (a directory as above, or a safetensors
file perdure did not write), so a runner with a `state_dict_adapter()` maps them with `from_hf` first.
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.commit import MANIFEST_NAME, POINTERS
from perdure.checkpoints.file import REPLICATED_FILE
from perdure.checkpoints.resolve import CheckpointInfo, resolve_path
from perdure.checkpoints.safe_unpickle import load_torch_file
from perdure.errors import CheckpointError, WeightsMisfitError
from perdure.runners.compile import strip_compile_prefix
from perdure.safe_io import UnsafeFileError, check_real_path, loads_json, open_regular, read_regular, safe_name

SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"
CONFIG_NAME = "config.json"
MAX_HEADER_BYTES = 100 << 20  # a header lists names, shapes and offsets: far below this even for large shards
MAX_INDEX_BYTES = 64 << 20
MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 1024
MAX_SHARDS = 100_000
MISMATCHES_SHOWN = 5  # the first few missing / unexpected / mis-shaped keys named in a refusal
# safetensors' dtype names -> bytes per value (the dtypes torch can hold)
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
PERDURE_KEYS = ("run", "source")  # `__metadata__` keys only perdure's own model.safetensors carries


def read_weights(path: Path, ema: bool = False, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The weights at `path` (any form in the module docstring), with plain names (`torch.compile`'s `_orig_mod.`
    removed, see `perdure.runners.compile`). `ema`: a checkpoint's EMA weights instead of the model's. `mmap`: the
    tensors of a torch.save file (`model.pth`, `pytorch_model.bin`, a file checkpoint's state) are mapped from the
    file, not read: a reader that copies a slice of one reads only the pages of that slice (`weights_slices.py`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"pretrained path {path} does not exist")
    return strip_compile_prefix(_read(path, ema, mmap))


def weight_files(path: Path, ema: bool = False) -> list[Path] | None:
    """The files that hold the weights when `path` is a file of weights or a `save_pretrained`-style directory (its
    `hf_dir_files`); None for a checkpoint, checkpoints or run directory or a pointer (read through `resolve_path`).
    CheckpointError for `ema` of a file: it holds one set of weights."""
    hf_dir = is_hf_dir(path)
    if not ((path.is_file() and path.name not in POINTERS) or hf_dir):
        return None
    if ema:
        raise CheckpointError(f"{path} holds one set of weights; EMA weights are read from a checkpoint")
    return hf_dir_files(path) if hf_dir else [path]


def _read(path: Path, ema: bool, mmap: bool) -> dict[str, torch.Tensor]:
    files = weight_files(path, ema)
    if files is not None:
        named = files == [path]  # the user named this file: a symlink to it is followed
        if files[0].suffix != ".safetensors":
            return _tensors(_load(files[0], named=named, mmap=mmap), files[0])
        return {name: tensor for file in files for name, tensor in read_safetensors(file, named=named).items()}
    return read_checkpoint_weights(resolve_path(path), ema, mmap=mmap)


def read_checkpoint_weights(info: CheckpointInfo, ema: bool = False, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The model (`ema`: EMA) weights of the resolved, verified checkpoint `info` (`resolve_path`), of any
    backend, with the names it stores (`read_weights` removes compile prefixes)."""
    if info.manifest.get("backend") == "dcp":
        from perdure.checkpoints.dcp import read_dcp_weights

        return read_dcp_weights(info.path, ema=ema)
    if info.manifest.get("backend") == "deepspeed":
        from perdure.checkpoints.deepspeed_engine import read_deepspeed_weights

        return read_deepspeed_weights(info.path, ema=ema)
    state = _load(info.path / REPLICATED_FILE, mmap=mmap)
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


def _tensors(weights: object, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path} holds no state dict of tensors; give a model export such as model.pth")
    return weights


def is_hf_dir(path: Path) -> bool:
    """A `save_pretrained`-style directory: it holds `model.safetensors`, a safetensors index or `pytorch_model.bin`,
    and is no perdure checkpoint (a manifest) or run directory (`checkpoints/`), whose `model.safetensors` is an
    export beside the checkpoints that `--pretrained RUN` reads."""
    if not path.is_dir() or (path / MANIFEST_NAME).exists() or (path / "checkpoints").exists():
        return False
    return any(os.path.lexists(path / name) for name in (SAFETENSORS_NAME, INDEX_NAME, BIN_NAME))


def is_hf_source(path: Path) -> bool:
    """Whether the weights at `path` are in the Hugging Face layout: a `save_pretrained`-style directory, a file
    beside a `config.json`, or a safetensors file whose metadata is not perdure's (perdure's own `model.safetensors`
    keeps the model's names and says which run or file it came from)."""
    path = Path(path)
    if is_hf_dir(path):
        return True
    if not path.is_file():
        return False
    if (path.parent / CONFIG_NAME).is_file():
        return True
    if path.suffix != ".safetensors":
        return False
    metadata, _ = check_safetensors_header(path, named=True)
    return not any(key in metadata for key in PERDURE_KEYS)


def check_safetensors_header(path: Path, *, named: bool = False) -> tuple[dict[str, str], dict[str, Any]]:
    """(metadata, {name: entry}) of the safetensors file `path`, checked before any library reads it: the length in
    its first 8 bytes (little-endian) bounded and inside the file, a JSON object of {name: {dtype, shape,
    data_offsets}} (and `__metadata__` of strings), known dtypes, and offsets that tile the data exactly, each span
    the size its shape and dtype give. CheckpointError naming the file and the problem otherwise. `named`: the user
    gave this file (a symlink to it is followed); a file found in a directory never is."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a safetensors file perdure can read: {why}")

    fd = open_regular(path, follow_symlinks=named)
    try:
        size = os.fstat(fd).st_size
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise bad(f"it is {size} bytes long, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise bad(
                f"its header claims {length:,} bytes, more than "
                + ("the file holds" if length <= MAX_HEADER_BYTES else f"the {MAX_HEADER_BYTES:,} perdure reads")
            )
        data = os.pread(fd, length, 8)
    finally:
        os.close(fd)
    try:
        header = loads_json(data)
    except (ValueError, RecursionError) as error:
        raise bad(f"its header is not JSON ({safe_name(str(error), limit=120)})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a JSON {type(header).__name__}, not an object of tensors")
    if len(header) > MAX_TENSORS + 1:
        raise bad(f"its header lists {len(header):,} entries, more than {MAX_TENSORS:,}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad("its __metadata__ is not an object of strings")
    spans = []
    for name, entry in header.items():
        shown = safe_name(name)
        if len(name) > MAX_NAME_CHARS:
            raise bad(f"tensor name {shown}... is longer than {MAX_NAME_CHARS} characters")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {shown} is not an object of dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise bad(f"tensor {shown} has dtype {safe_name(dtype)}, not one of {', '.join(DTYPE_SIZES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 64:
            raise bad(f"tensor {shown} has shape {safe_name(shape)}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
            raise bad(f"tensor {shown} has data_offsets {safe_name(offsets)}, not [begin, end]")
        numel = 1
        for n in shape:
            numel *= n
        if offsets[1] - offsets[0] != numel * DTYPE_SIZES[dtype]:
            raise bad(
                f"tensor {shown} spans bytes {offsets[0]}..{offsets[1]}, but its shape {shape} of {dtype} needs "
                f"{numel * DTYPE_SIZES[dtype]:,}"
            )
        spans.append((offsets[0], offsets[1], shown))
    end = 0
    for begin, stop, shown in sorted(spans):
        if begin != end:
            raise bad(f"tensor {shown} starts at byte {begin} of the data, not at {end} where the previous one ends")
        end = stop
    if end != size - 8 - length:
        raise bad(f"its tensors end at byte {end:,} of the data, but the file holds {size - 8 - length:,} data bytes")
    return metadata, header


def read_safetensors(path: Path, *, named: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, its header checked first (`check_safetensors_header`)."""
    check_safetensors_header(path, named=named)
    with open_safetensors(path) as file:
        return {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118  (safe_open has no __iter__)


def open_safetensors(path: Path) -> Any:
    """`safetensors.safe_open(path)` on the CPU, for a `with` block (the file is mapped while it is open); its header
    is to be checked first (`check_safetensors_header`). A missing safetensors package is a CheckpointError."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(
            f"reading {path.name} needs the safetensors package: pip install safetensors (or perdure[hf])"
        ) from None
    return safe_open(str(path), framework="pt", device="cpu")


def hf_dir_files(directory: Path) -> list[Path]:
    """The weight files of a `save_pretrained`-style directory: the shards of its index, else `model.safetensors`,
    else `pytorch_model.bin`; none of them a symlink."""
    index = directory / INDEX_NAME
    if os.path.lexists(index):
        return index_shards(index)
    single = directory / SAFETENSORS_NAME
    if os.path.lexists(single):
        return [check_real_path(single, directory)]
    return [check_real_path(directory / BIN_NAME, directory)]


def index_shards(index: Path) -> list[Path]:
    """The shard files `model.safetensors.index.json` names, each a plain file name in its directory (no `/`, no
    `..`, no symlink), each once. The index itself: a regular file, bounded in size."""
    try:
        data = read_regular(index, MAX_INDEX_BYTES)
    except UnsafeFileError as error:
        raise CheckpointError(f"{index} cannot be read safely: {error}") from None
    try:
        parsed = loads_json(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{index} is not JSON ({safe_name(str(error), limit=120)})") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} holds no weight_map of tensor names to shard files; it is no safetensors index")
    names = sorted(set(weight_map.values()))
    if len(names) > MAX_SHARDS:
        raise CheckpointError(f"{index} names {len(names):,} shard files, more than {MAX_SHARDS:,}")
    shards = []
    for name in names:
        if not name or "/" in name or "\\" in name or name in (".", "..") or "\x00" in name:
            raise CheckpointError(
                f"{index} names the shard {safe_name(name)}, which is not a plain file name in {index.parent}; "
                "perdure reads shards beside their index only"
            )
        shard = index.parent / name
        if not os.path.lexists(shard):
            raise CheckpointError(f"{index} names the shard {safe_name(name)}, which is missing from {index.parent}")
        shards.append(check_real_path(shard, index.parent))
    return shards


def _load(path: Path, *, named: bool = False, mmap: bool = False) -> object:
    """`torch.load(weights_only=True)`; `named`: the user gave this file (a symlink to it is fine); `mmap`: tensors
    mapped from the file, not read (`load_torch_file`)."""
    try:
        return load_torch_file(path, follow_symlinks=named, mmap=mmap)
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


def in_model_layout(weights: dict[str, torch.Tensor], path: Path, adapter: Any) -> dict[str, torch.Tensor]:
    """`weights` read from `path`, mapped by `adapter.from_hf` (`Runner.state_dict_adapter()`) when they are in the
    Hugging Face layout (`is_hf_source`) and the runner has an adapter; as they are otherwise."""
    if adapter is None or not is_hf_source(Path(path)):
        return weights
    return adapter.from_hf(weights)


def with_tied(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` plus the entries of tied parameters they leave out, as `save_pretrained` leaves out `lm_head.weight`
    when it is the input embedding: a name of `expected` (the model's state dict) missing from `weights` whose
    tensor is the same storage as a present name's gets that name's tensor. Others stay missing (and are refused)."""
    present = {
        (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape): name
        for name, tensor in expected.items()
        if name in weights and tensor.device.type != "meta" and tensor.numel()
    }
    filled = dict(weights)
    for name, tensor in expected.items():
        if name in weights or tensor.device.type == "meta" or not tensor.numel():
            continue
        twin = present.get((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape))
        if twin is not None:
            filled[name] = weights[twin]
    return filled


def check_weights_fit(
    model_name: str,
    expected: Mapping[str, tuple[int, ...] | None],
    given: Mapping[str, tuple[int, ...] | None],
    source: Path,
    *,
    unexpected_too: bool = True,
) -> None:
    """Refuse weights whose names and shapes (`given`, None for an entry that is no tensor) do not fit the model's
    (`expected`) with a WeightsMisfitError naming the missing, unexpected and mis-shaped keys (the first few of each,
    and how many). Shapes only: it runs on a file's metadata before any tensor is read. `unexpected_too`: False when
    `expected` is part of the model (a pipeline stage), whose other parts hold the keys it lacks."""
    missing = [key for key in expected if key not in given]
    unexpected = [key for key in given if key not in expected] if unexpected_too else []
    shapes = [
        f"{key} {given[key]} (model: {expected[key]})"
        for key in expected
        if key in given and given[key] is not None and given[key] != expected[key]
    ]
    problems = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes)):
        if items:
            shown = ", ".join(items[:MISMATCHES_SHOWN]) + (", ..." if len(items) > MISMATCHES_SHOWN else "")
            problems.append(f"{len(items)} {what}: {shown}")
    if problems:
        raise WeightsMisfitError(
            f"the weights in {source} do not fit {model_name}: {'; '.join(problems)}. Give weights of the "
            "same architecture (a checkpoint or model.pth of this model)"
        )
