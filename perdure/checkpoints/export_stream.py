"""Writing a weights export tensor by tensor: `model.pth` and `model.safetensors` from a stream of whole tensors, so the
writer holds one tensor at a time (plus what the file has taken), never the whole model (issue 38).

Every name, dtype and shape is known before any tensor is (a sharded model's metadata), so each file's head is written
first and each tensor's bytes follow as it arrives:

    safetensors   the header (JSON: every tensor's dtype, shape and byte range), then the data in the order
                  `safetensors.torch.save_file` lays it out (dtype by dtype, largest first, then by name): the file is
                  byte for byte the one `save_file` writes for the same dict, but for the `__metadata__` entries,
                  which `save_file` writes in a random order and this writer sorted
    pth           torch.save's zip: the pickle of the dict (each tensor a reference to a storage record, as
                  `torch.save` pickles it), then one record per tensor, written through torch's own zip writer as each
                  tensor arrives. With the tensors in the dict's order, byte for byte `torch.save` of the dict

The tensors come in `stream_order`: the safetensors layout when that format is written, else the dict's order; the
pth's storage records are numbered in that order, so they lie in the file in numeric order as `torch.save`'s do.

The pth side uses torch's private zip writer and the pickle layout of `Tensor._reduce_ex_internal` (through
perdure/private_api.py: `open_zipfile_writer`, `tensor_pickle_reduction`, `storage_pickle_reference`);
tests/test_export_stream.py compares the bytes with `torch.save`'s, so a torch release that changes them fails there.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from perdure.atomic import atomic_write
from perdure.errors import CheckpointError
from perdure.private_api import (
    open_zipfile_writer,
    storage_alignment,
    storage_pickle_reference,
    tensor_pickle_reduction,
)

# safetensors' names of the dtypes, in the order `save_file` lays their tensors out (measured with safetensors 0.8:
# its dtype enumeration, largest first); tests/test_export_stream.py checks the bytes against save_file's
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}
FORMATS = ("pth", "safetensors")


@dataclass(frozen=True)
class Planned:
    """One tensor of an export as the file will hold it: name, dtype (after any cast) and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def stream_order(planned: Sequence[Planned], formats: Sequence[str]) -> list[Planned]:
    """The order the tensors must arrive in: safetensors' layout when that format is written, else the dict's."""
    if "safetensors" not in formats:
        return list(planned)
    for entry in planned:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"weight {entry.name!r} is {entry.dtype}, which safetensors does not hold")
    return sorted(planned, key=lambda entry: (_RANK[entry.dtype], entry.name))


def safetensors_header(ordered: Sequence[Planned], metadata: dict[str, str]) -> bytes:
    """The head of a safetensors file holding `ordered` in that order: 8 bytes of little-endian length, then the JSON
    header padded with spaces to a multiple of 8 bytes (as `save_file` writes it)."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for entry in ordered:
        end = offset + entry.nbytes
        header[entry.name] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, end]}  # fmt: skip
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class _Storage:
    """Stands for a tensor's storage in the pickle: `persistent_id` turns it into torch.save's storage reference."""

    def __init__(self, dtype: torch.dtype, numel: int, key: str) -> None:
        self.dtype, self.numel, self.key = dtype, numel, key


class _Tensor:
    """Pickles as torch.save pickles a contiguous CPU tensor of `entry`'s dtype and shape whose storage is `key`."""

    def __init__(self, entry: Planned, key: str) -> None:
        self.entry, self.key = entry, key

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        shape = self.entry.shape
        stride: list[int] = []
        step = 1
        for size in reversed(shape):
            stride.append(step)
            step *= size
        numel = step
        storage = _Storage(self.entry.dtype, numel, self.key)
        args: tuple[Any, ...] = (storage, 0, tuple(shape), tuple(reversed(stride)), False, collections.OrderedDict())
        return tensor_pickle_reduction(self.entry.dtype, args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _Storage):
            return None
        return storage_pickle_reference(obj.dtype, obj.numel, obj.key)


def pth_pickle(planned: Sequence[Planned], keys: dict[str, str]) -> bytes:
    """torch.save's `data.pkl` for the dict `planned` describes; a tensor's storage: the record `data/<keys[name]>`."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(
        {entry.name: _Tensor(entry, keys[entry.name]) for entry in planned}
    )
    return buffer.getvalue()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    # numpy's stubs give ndarray `__buffer__` only from Python 3.12 (python_version is 3.10): it is a buffer.
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _fit(entry: Planned, tensor: Any) -> torch.Tensor:
    """`tensor` checked against its plan, contiguous, on the CPU, owning exactly its bytes."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(
            f"weight {entry.name!r} is a {type(tensor).__name__}, not a tensor; an export holds tensors"
        )
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise CheckpointError(
            f"weight {entry.name!r} arrived as {tensor.dtype} {tuple(tensor.shape)}, planned as "
            f"{entry.dtype} {entry.shape}"
        )
    tensor = tensor.detach().cpu().contiguous()
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != entry.nbytes:
        tensor = tensor.clone()
    return tensor


def write_streamed(
    paths: dict[str, Path], planned: Sequence[Planned], tensors: Iterator[torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write `planned` into `paths` (format -> file: `pth`, `safetensors`), each atomically (perdure/atomic.py),
    taking each tensor from `tensors` as the formats are written: `tensors` yields them in
    `stream_order(planned, formats)`. `metadata` goes into the safetensors header. On a failure the rest of `tensors`
    is still consumed (it may drive a collective the other ranks take part in), then the error is raised."""
    unknown = set(paths) - set(FORMATS)
    if unknown:
        raise CheckpointError(f"cannot stream an export as {sorted(unknown)}: formats are {', '.join(FORMATS)}")
    ordered = stream_order(planned, list(paths))
    keys = {entry.name: str(index) for index, entry in enumerate(ordered)}
    try:
        _open_all(list(paths.items()), {}, lambda files: _write_all(files, planned, ordered, keys, tensors, metadata))
    finally:
        for _ in tensors:  # the rest, so that every rank leaves the collectives together
            pass


def _open_all(
    pending: list[tuple[str, Path]], files: dict[str, BinaryIO], body: Callable[[dict[str, BinaryIO]], None]
) -> None:
    """`body(files)` with every file of `pending` open through its own `atomic_write` (each renamed into place when
    `body` returns, none when it raises)."""
    if not pending:
        body(files)
        return
    (name, path), rest = pending[0], pending[1:]
    atomic_write(path, lambda file: _open_all(rest, {**files, name: file}, body))


def _write_all(
    files: dict[str, BinaryIO],
    planned: Sequence[Planned],
    ordered: Sequence[Planned],
    keys: dict[str, str],
    tensors: Iterator[torch.Tensor],
    metadata: dict[str, str],
) -> None:
    if "safetensors" in files:
        files["safetensors"].write(safetensors_header(ordered, metadata))
    with contextlib.ExitStack() as stack:
        zip_writer = None
        if "pth" in files:  # torch.save's records before the storages (torch.serialization._save)
            zip_writer = stack.enter_context(open_zipfile_writer(files["pth"]))
            alignment = str(storage_alignment())
            records = (("data.pkl", pth_pickle(planned, keys)), (".format_version", "1"),
                       (".storage_alignment", alignment), ("byteorder", sys.byteorder))  # fmt: skip
            for name, record in records:
                zip_writer.write_record(name, record, len(record))
        for entry in ordered:
            tensor = next(tensors, None)
            if tensor is None:
                raise CheckpointError(f"the export ended before weight {entry.name!r}")
            tensor = _fit(entry, tensor)
            if zip_writer is not None:
                zip_writer.write_record(f"data/{keys[entry.name]}", tensor.untyped_storage(), entry.nbytes)
            if "safetensors" in files:
                files["safetensors"].write(_tensor_bytes(tensor))
            del tensor
