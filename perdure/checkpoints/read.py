"""The one read path: resolving, verifying and reading a checkpoint or a file of weights, whatever wrote it.

The commit protocol (`commit.py`) is the one way in; this module is the one way out. A read first locates what a path
holds (`locate_weights`):

    model.pth, any torch.save file of tensors    format `pt`: allow-listed `torch.load(weights_only=True)`
    X.safetensors                                format `safetensors`: perdure's `model.safetensors` export or a
                                                 Hugging Face file, its header checked first (`hf_read.py`)
    a Hugging Face directory                     `save_pretrained`'s layout (perdure's `hf/` export too): the shards
                                                 of `model.safetensors.index.json`, `model.safetensors` (format
                                                 `safetensors`) or `pytorch_model.bin` (format `pt`)
    a checkpoint / checkpoints / run dir,        perdure's own, resolved and verified (manifest and checksums,
      a `latest` / `best` pointer                  `resolve.resolve_path`): the format of the backend that wrote it
                                                   (`file`, `dcp`, `deepspeed`: the manifest's `backend`)

then hands it to the reader its format registered (`WeightsFormat`). The entries:

    read_weights(path)           the model (or EMA) weights, whole: `--pretrained`, `perdure ckpt export`
                                 (`read_located`: the same for a location found already)
    open_weight_slices(path)     the same, opened to be read region by region (`weights_slices.py`): a sharded model
    checkpoint_format(backend)   the reader of a checkpoint's training state: `CheckpointManager.load` restores
                                 through the `manager` of the backend that wrote it, whichever one the run saves with

How a format plugs in: its module builds a `WeightsFormat` (its name, `read`, optionally `open_slices`, and for a
checkpoint backend its CheckpointManager class as `manager`, named as the manager's `backend`) and calls
`register_format` when it is imported; `formats.py` imports every such module, and `perdure/__init__` imports
`formats.py`, so all formats are registered before anything is read. The weight-file formats (`pt`, `safetensors`)
are registered at the end of this module; the checkpoint backends by their own modules (file.py, dcp.py,
deepspeed_engine.py). This module imports none of the backends: they import it, and so does `base.py`, which must not
know its backends.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from perdure.checkpoints.commit import POINTERS
from perdure.checkpoints.hf_read import hf_dir_files, is_hf_dir, read_safetensors
from perdure.checkpoints.resolve import CheckpointInfo, resolve_path
from perdure.checkpoints.safe_unpickle import load_torch_file
from perdure.checkpoints.weights_slices import SafetensorsSlices, TensorSlices, WeightSlices
from perdure.errors import CheckpointError
from perdure.runners.compile import strip_compile_prefix
from perdure.safe_io import UnsafeFileError, safe_name


@dataclass(frozen=True)
class WeightsLocation:
    """What `locate_weights` found at `path` (as the user gave it): the name of its format, and either the `files`
    that hold the weights (a weight-file format) or the resolved, verified `checkpoint` (a checkpoint backend's)."""

    path: Path
    format: str
    files: tuple[Path, ...] = ()
    checkpoint: CheckpointInfo | None = None
    named: bool = False  # the user named the one file: a symlink to it is followed (one found in a directory never is)

    @property
    def info(self) -> CheckpointInfo:
        """The checkpoint of a checkpoint backend's location."""
        if self.checkpoint is None:
            raise CheckpointError(f"{self.path} holds weights in the {self.format} format, not a perdure checkpoint")
        return self.checkpoint


class StateReader(Protocol):
    """What restores the training state of a checkpoint: a backend's `CheckpointManager` (see its `read`)."""

    def read(self, path: Path, states: Mapping[str, Any], local_states: Mapping[str, Any]) -> bool: ...


@dataclass(frozen=True)
class WeightsFormat:
    """One format perdure reads, as the module that implements it registers it (`register_format`).

    `read(location, ema, mmap)`: the model weights (`ema`: the EMA weights) at `location`, with the names the format
    stores (`read_weights` removes compile prefixes); `mmap`: a torch.save file's tensors mapped from the file, not
    read. `open_slices(location, ema)`: the weights opened to be read region by region; None: read whole (`mmap`) and
    sliced as views. `manager`: a checkpoint backend's CheckpointManager class, built with a manager's constructor
    arguments, whose `read` restores the training state of the backend's checkpoints; None for a weight-file format.
    """

    name: str
    read: Callable[[WeightsLocation, bool, bool], dict[str, torch.Tensor]]
    open_slices: Callable[[WeightsLocation, bool], WeightSlices] | None = None
    manager: Callable[..., StateReader] | None = None


_FORMATS: dict[str, WeightsFormat] = {}


def register_format(weights_format: WeightsFormat) -> None:
    """Make a format readable; called by its module when it is imported (a second registration replaces the first)."""
    _FORMATS[weights_format.name] = weights_format


def registered_format(name: str) -> WeightsFormat:
    """The registered format `name`; CheckpointError when none is (its module was never imported)."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise CheckpointError(f"no reader of the {safe_name(name)} format is registered") from None


def checkpoint_format(backend: object) -> WeightsFormat | None:
    """The format of the checkpoints backend `backend` wrote (a manifest's `backend` field), with its `manager`; None
    when no registered checkpoint backend has that name."""
    found = _FORMATS.get(backend) if isinstance(backend, str) else None
    return found if found is not None and found.manager is not None else None


def checkpoint_backends() -> list[str]:
    """The names of the checkpoint backends whose checkpoints can be read (registered with a `manager`)."""
    return sorted(name for name, found in _FORMATS.items() if found.manager is not None)


def locate_weights(path: Path, ema: bool = False) -> WeightsLocation:
    """What the weights at `path` are (see the module docstring): a checkpoint is resolved and verified first.
    CheckpointError when `path` does not exist, holds nothing perdure reads, or is a file asked for `ema` weights."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"pretrained path {path} does not exist")
    files = weight_files(path, ema)
    if files is not None:
        name = "safetensors" if files[0].suffix == ".safetensors" else "pt"
        return WeightsLocation(path, name, tuple(files), named=files == [path])
    info = resolve_path(path)
    # A manifest that names no backend this perdure knows is read as the file backend's (its state.pth).
    backend = checkpoint_format(info.manifest.get("backend"))
    return WeightsLocation(path, backend.name if backend is not None else "file", checkpoint=info)


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


def read_weights(path: Path, ema: bool = False, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The weights at `path` (any form in the module docstring), with plain names (`torch.compile`'s `_orig_mod.`
    removed, see `perdure.runners.compile`). `ema`: a checkpoint's EMA weights instead of the model's. `mmap`: the
    tensors of a torch.save file (`model.pth`, `pytorch_model.bin`, a file checkpoint's state) are mapped from the
    file, not read: a reader that copies a slice of one reads only the pages of that slice (`weights_slices.py`)."""
    return read_located(locate_weights(path, ema), ema, mmap=mmap)


def read_located(location: WeightsLocation, ema: bool = False, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """`read_weights` of what `locate_weights` found already (a caller that also describes the location): the
    checkpoint is not resolved nor verified again."""
    return strip_compile_prefix(registered_format(location.format).read(location, ema, mmap))


def open_weight_slices(path: Path, ema: bool = False) -> WeightSlices:
    """The weights at `path` (any form `read_weights` reads), opened for reading region by region: see
    `weights_slices.py` for what each form reads up front. `ema`: a checkpoint's EMA weights."""
    location = locate_weights(path, ema)
    weights_format = registered_format(location.format)
    if weights_format.open_slices is not None:
        return weights_format.open_slices(location, ema)
    return TensorSlices(location.path, strip_compile_prefix(weights_format.read(location, ema, True)))


def load_weights_file(path: Path, *, named: bool = False, mmap: bool = False) -> object:
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


def _tensors(weights: object, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(f"{path} holds no state dict of tensors; give a model export such as model.pth")
    return weights


def _read_torch_file(location: WeightsLocation, ema: bool, mmap: bool) -> dict[str, torch.Tensor]:
    file = location.files[0]
    return _tensors(load_weights_file(file, named=location.named, mmap=mmap), file)


def _read_safetensors_files(location: WeightsLocation, ema: bool, mmap: bool) -> dict[str, torch.Tensor]:
    return {
        name: tensor for file in location.files for name, tensor in read_safetensors(file, named=location.named).items()
    }


def _open_safetensors_slices(location: WeightsLocation, ema: bool) -> WeightSlices:
    return SafetensorsSlices(location.path, list(location.files), named=location.named)


register_format(WeightsFormat("pt", read=_read_torch_file))
register_format(WeightsFormat("safetensors", read=_read_safetensors_files, open_slices=_open_safetensors_slices))
