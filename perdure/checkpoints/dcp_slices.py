"""A DCP checkpoint's model (or EMA) weights, read region by region: each rank reads only the chunks it needs.

`DCPSlices` is the `WeightSlices` (`weights_slices.py`) of a perdure checkpoint written with `--ckpt.backend dcp`:

    names, shapes, dtypes   from DCP's `.metadata` alone, unpickled through the allow-list (`read_dcp_metadata`,
                            `safe_dcp.py`): the entries under `model.` (or `ema.shadow.`), as `read_dcp_weights`
                            names them; non-tensor entries left out. No tensor data is read to open it.
    a region                DCP's own resharding: `create_read_items_for_chunk_list` matches the region against the
                            chunks the writing ranks stored (their offsets and sizes in the metadata), and the
                            allow-listed `RestrictedFileSystemReader` reads only the chunks that overlap it, each
                            through `torch.load(weights_only=True)`, narrowed into the destination in place

A stored chunk is one `torch.save` record: a chunk that overlaps a region is read whole. A checkpoint written by as
many ranks with the same sharding as the reading model gives each rank exactly its chunks; one written by a single
process stores each tensor as one chunk, which every rank then reads whole (and keeps only its region of).

`read_into` reads many regions in one pass over the shard files (each file opened once); `bytes_read` counts the
bytes the reader actually took from the shard files (`_CountingView`), not what the plan says.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from perdure.checkpoints.safe_dcp import RestrictedFileSystemReader, RestrictedLoadPlanner, read_dcp_metadata
from perdure.checkpoints.weights_slices import Region, WeightSlices
from perdure.errors import CheckpointError
from perdure.runners.compile import plain_name


class DCPSlices(WeightSlices):
    """The model (`ema`: EMA) weights of DCP checkpoint `checkpoint` (a resolved checkpoint directory; `path` is
    what the user gave), opened from its metadata. `files`: the verified manifest's file list, bounding what the
    metadata may point at."""

    def __init__(self, path: Path, checkpoint: Path, files: dict[str, Any] | None, ema: bool = False) -> None:
        prefix = "ema.shadow." if ema else "model."
        self.checkpoint = Path(checkpoint)
        self.files = files
        self.metadata = read_dcp_metadata(self.checkpoint, files)
        self.entries: dict[str, tuple[str, TensorStorageMetadata]] = {}  # plain name -> (DCP key, its metadata)
        for key, item in self.metadata.state_dict_metadata.items():
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
                self.entries[plain_name(key[len(prefix) :])] = (key, item)
        if not self.entries:
            what = "EMA weights (it was trained with ema.enabled=false)" if ema else "model weights"
            raise CheckpointError(f"DCP checkpoint {self.checkpoint} holds no {what}")
        shapes = {name: item.size for name, (_, item) in self.entries.items()}
        dtypes = {name: item.properties.dtype for name, (_, item) in self.entries.items()}
        super().__init__(path, shapes, dtypes)

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """`WeightSlices.read`, counted by what the reader took from the files (`read_into`)."""
        sizes = [stop - start for start, stop in _bounds(region, self.shapes[name])]
        target = torch.empty(sizes, dtype=self.dtypes[name])
        self.read_into([(name, region, target)])
        return target

    def read_into(self, requests: Sequence[tuple[str, Region | None, torch.Tensor]]) -> None:
        """Read each (name, region, target) into its target in one pass: the chunks overlapping the regions, each
        file opened once; `bytes_read` grows by what the reader took from the shard files."""
        items: list[ReadItem] = []
        targets: list[torch.Tensor] = []
        for name, region, target in requests:
            key, item = self.entries[name]
            starts = [start for start, _ in _bounds(region, item.size)]
            chunk = ChunkStorageMetadata(offsets=torch.Size(starts), sizes=torch.Size(target.shape))
            # One destination per request (two model keys may read the same tensor: tied weights), by its number.
            index = str(len(targets))
            for read in create_read_items_for_chunk_list(key, item, [chunk]):
                items.append(dataclasses.replace(read, dest_index=MetadataIndex(index, read.dest_index.offset)))
            targets.append(target)
        reader = _CountingReader(self.checkpoint, self.files)
        reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        try:
            reader.read_data(LoadPlan(items), _RegionPlanner(self.checkpoint, targets)).wait()
        except CheckpointError:
            raise
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError) as error:
            raise CheckpointError(
                f"cannot read weights from DCP checkpoint {self.checkpoint}: {type(error).__name__}: {error}"
            ) from error
        self.bytes_read += reader.bytes_read

    def describe_read(self, bytes_read: int) -> str:
        return (
            f"read {bytes_read:,} bytes of its DCP shard files (each stored chunk that overlaps a shard of it, "
            f"whole) for the {self.total_bytes():,} bytes of the weights"
        )


def _bounds(region: Region | None, shape: torch.Size) -> list[tuple[int, int]]:
    """(start, stop) of `region` (None: the whole tensor) in each dimension of a tensor of `shape`."""
    if region is None:
        return [(0, size) for size in shape]
    return [part.indices(size)[:2] for part, size in zip(region, shape, strict=True)]


class _RegionPlanner(RestrictedLoadPlanner):
    """Resolves read item destinations numbered by `DCPSlices.read_into` to their target tensors."""

    def __init__(self, checkpoint: Path, targets: list[torch.Tensor]) -> None:
        super().__init__(checkpoint)
        self.targets = targets

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[int(index.fqn)]


class _CountingReader(RestrictedFileSystemReader):
    """The restricted reader, counting the bytes read from each stored item's slice of its shard file."""

    def __init__(self, path: Path, files: dict[str, Any] | None) -> None:
        super().__init__(path, files)
        self.bytes_read = 0

    # FileSystemReader's one place where a stored item's bytes are taken from its shard file (torch 2.13, pinned)
    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        return _CountingView(super()._slice_file(file, sinfo), self)


class _CountingView(io.IOBase):
    """A file view that adds the bytes each read returns to `counter.bytes_read`."""

    def __init__(self, view: Any, counter: _CountingReader) -> None:
        super().__init__()
        self.view = view
        self.counter = counter

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        return self.view.seek(offset, whence)

    def tell(self) -> int:
        return self.view.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = self.view.readinto(buffer)
        self.counter.bytes_read += count or 0
        return count

    def read(self, size: int = -1) -> bytes:
        data = self.view.read(size)
        self.counter.bytes_read += len(data)
        return data
