"""Reading weights slice by slice: each rank of a sharded model reads only the regions of the tensors it holds.

`open_weight_slices(path)` (the read path, `read.py`) opens any form `read_weights` reads and reads no tensor data:
it gives every tensor's name, shape and dtype, and `read(name, region)` then reads one region of one tensor.

    safetensors files (perdure's      the headers only, checked by `check_safetensors_header` (bounded, offsets that
      `model.safetensors`, a Hugging    tile the file) before anything else; a region is read with the safetensors
      Face file, a `save_pretrained`    library's `safe_open(...).get_slice(name)[region]`, the file opened for that
      directory, sharded or not)        one read, so the pages it mapped are unmapped after: a rank's resident memory
                                        grows by the regions it reads, one at a time
    torch.save files (`model.pth`,    mapped, not read (`torch.load(mmap=True, weights_only=True)` through the
      `pytorch_model.bin`, a file       allow-listed loader): a pickle cannot be read in part, but its tensor data is
      checkpoint's `state.pth`)         only touched where a region is copied. The pages a rank touched belong to the
                                        file's page cache and count in its resident memory until the load ends (the
                                        mapping is dropped then): its regions, never the whole file
    a DCP checkpoint (`--ckpt.       its `.metadata` only (the allow-listed unpickler); a region is read with DCP's
      backend dcp`: a checkpoint,       own resharding, only the stored chunks that overlap it (`dcp_slices.py`); many
      checkpoints or run dir, a         regions at once with `read_into`, one pass over the shard files
      `latest` / `best` pointer)
    a DeepSpeed checkpoint            read whole (`read_weights`), then sliced: each rank holds the full weights while
                                        they load

Names are plain (`torch.compile`'s `_orig_mod.` removed), as `read_weights` gives them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from perdure.checkpoints.hf_read import check_safetensors_header, is_hf_source, open_safetensors
from perdure.runners.compile import plain_name

# safetensors' dtype names (those `check_safetensors_header` admits) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip

Region = tuple[slice, ...]


class WeightSlices:
    """The tensors at a path as names, shapes and dtypes (`shapes`, `dtypes`), read one region at a time (`read`).
    `path`: what was opened; `hf`: whether the names are in the Hugging Face layout (`is_hf_source`), so a runner's
    `state_dict_adapter()` maps them first. `bytes_read`: what has been read so far: the regions' own sizes, or, for
    a form that reads in larger units (`DCPSlices`: whole stored chunks), what its reader took from the files."""

    def __init__(self, path: Path, shapes: Mapping[str, torch.Size], dtypes: Mapping[str, torch.dtype]) -> None:
        self.path = path
        self.shapes = dict(shapes)
        self.dtypes = dict(dtypes)
        self.hf = is_hf_source(path)
        self.bytes_read = 0

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """Tensor `name`, or its `region` (one slice per dimension, steps of 1): a tensor to copy from (it may be a
        view of a mapped file). KeyError for a name `shapes` does not hold."""
        tensor = self.read_region(name, region)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_region(self, name: str, region: Region | None) -> torch.Tensor:
        """`read`, uncounted: each form's own."""
        raise NotImplementedError

    def read_into(self, requests: Sequence[tuple[str, Region | None, torch.Tensor]]) -> None:
        """Copy each (name, region, target) request's tensor or region into its target (shaped as the region); a
        form that reads many regions better together than one by one (`DCPSlices`) does."""
        for name, region, target in requests:
            target.copy_(self.read(name, region))

    def total_bytes(self) -> int:
        """The size of all the weights (as stored: their shapes and dtypes)."""
        return sum(shape.numel() * self.dtypes[name].itemsize for name, shape in self.shapes.items())

    def describe_read(self, bytes_read: int) -> str:
        """What a rank that read `bytes_read` (`read_into`'s count) read, for the log."""
        return f"read {bytes_read:,} of the {self.total_bytes():,} bytes of the weights (the regions of its shards)"


class SafetensorsSlices(WeightSlices):
    """The tensors of safetensors files, read region by region through the safetensors library."""

    def __init__(self, path: Path, files: list[Path], named: bool) -> None:
        shapes: dict[str, torch.Size] = {}
        dtypes: dict[str, torch.dtype] = {}
        self.files: dict[str, tuple[Path, str]] = {}  # plain name -> (file, the name in the file)
        for file in files:
            _, header = check_safetensors_header(file, named=named)
            for name, entry in header.items():
                plain = plain_name(name)
                shapes[plain] = torch.Size(entry["shape"])
                dtypes[plain] = SAFETENSORS_DTYPES[entry["dtype"]]
                self.files[plain] = (file, name)
        super().__init__(path, shapes, dtypes)

    def read_region(self, name: str, region: Region | None) -> torch.Tensor:
        file, stored = self.files[name]
        # Opened for this one read: closing it unmaps the pages the read touched.
        with open_safetensors(file) as opened:
            if region is None or _whole(region, self.shapes[name]):
                return opened.get_tensor(stored)
            return opened.get_slice(stored)[region]


class TensorSlices(WeightSlices):
    """Tensors already at hand (mapped from a torch.save file, or read whole), sliced as views."""

    def __init__(self, path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(path, {k: v.shape for k, v in tensors.items()}, {k: v.dtype for k, v in tensors.items()})
        self.tensors = dict(tensors)

    def read_region(self, name: str, region: Region | None) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor if region is None else tensor[region]


def region_of(shape: torch.Size, offset: tuple[int, ...], local_shape: tuple[int, ...]) -> Region:
    """The region of a tensor of `shape` that a shard at `offset` of `local_shape` covers."""
    return tuple(slice(start, start + size) for start, size in zip(offset, local_shape, strict=True))


def _whole(region: Region, shape: torch.Size) -> bool:
    return all(part.start in (0, None) and part.stop in (size, None) for part, size in zip(region, shape, strict=True))
