"""Reading the Hugging Face formats: safetensors files (perdure's `model.safetensors` export or a Hugging Face file)
and `save_pretrained` directories (perdure's `hf/` export too): `model.safetensors`, a sharded
`model.safetensors.index.json`, or `pytorch_model.bin` (read by the allow-listed torch.save loader only).

Safetensors files are read through the `safetensors` library (no pickle), after perdure has checked the header itself
(`check_safetensors_header`): a bounded length, a JSON object of known dtypes whose offsets tile the file exactly, so
a hostile header is refused before anything is allocated. Shard names of an index are plain names in its directory;
a shard that is a symlink is refused.

`is_hf_source(path)`: whether the weights are in the Hugging Face layout (a directory as above, or a safetensors
file perdure did not write), so a runner with a `state_dict_adapter()` maps them with `from_hf` first.

The read entry (`read.py`) locates these files and reads them through the functions here.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.commit import MANIFEST_NAME
from perdure.errors import CheckpointError
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
# safetensors' dtype names -> bytes per value (the dtypes torch can hold)
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
PERDURE_KEYS = ("run", "source")  # `__metadata__` keys only perdure's own model.safetensors carries


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
