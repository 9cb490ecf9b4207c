"""Opening weights for reading region by region: `open_weight_slices` picks the reader for the form at a path (see
`weights_slices.py` for what each form reads up front). Its own module so that the readers (`weights_slices.py`,
`dcp_slices.py`) import nothing of each other but the base they share."""

from __future__ import annotations

from pathlib import Path

from perdure.checkpoints.dcp_slices import DCPSlices
from perdure.checkpoints.resolve import resolve_path
from perdure.checkpoints.weights_read import read_checkpoint_weights, read_weights, weight_files
from perdure.checkpoints.weights_slices import SafetensorsSlices, TensorSlices, WeightSlices
from perdure.errors import CheckpointError
from perdure.runners.compile import strip_compile_prefix


def open_weight_slices(path: Path, ema: bool = False) -> WeightSlices:
    """The weights at `path` (any form `read_weights` reads), opened for reading region by region: see the module
    docstring for what each form reads up front. `ema`: a checkpoint's EMA weights."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"pretrained path {path} does not exist")
    files = weight_files(path, ema)
    if files is not None and files[0].suffix == ".safetensors":
        return SafetensorsSlices(path, files, named=files == [path])
    if files is not None:
        return TensorSlices(path, read_weights(path, ema, mmap=True))
    info = resolve_path(path)
    if info.manifest.get("backend") == "dcp":
        return DCPSlices(path, info.path, info.manifest.get("files"), ema)
    return TensorSlices(path, strip_compile_prefix(read_checkpoint_weights(info, ema, mmap=True)))  # read whole
