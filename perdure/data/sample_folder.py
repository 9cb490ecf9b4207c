"""SampleFolder: a dataset of one file per sample, read lazily, so each rank loads only its own share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from perdure.errors import PerdureError


class SampleFolder(Dataset):
    """Every file of `folder` matching `pattern` (sorted by name) is one sample, loaded only when it is read.

    Under the runner, rank `r` of `W` reads the positions `offset + r, offset + r + W, ...` of the epoch's order
    (see `ResumableSampler`), so it opens only the files of its own share — and since the order and the position
    are global, a resume on another number of ranks neither skips nor repeats a file. `load` turns a path into a
    sample (default: `torch.load(path, weights_only=True)`, e.g. a `(input, target)` tuple).
    """

    def __init__(
        self,
        folder: str | Path,
        pattern: str = "*.pt",
        load: Callable[[Path], Any] | None = None,
    ) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise PerdureError(f"sample folder {self.folder} does not exist or is not a directory")
        self.files: Sequence[Path] = sorted(self.folder.glob(pattern))
        if not self.files:
            raise PerdureError(f"sample folder {self.folder} holds no file matching {pattern!r}")
        self.load = load or _load_tensor_file

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Any:
        return self.load(self.files[index])


def _load_tensor_file(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def write_sample_folder(folder: str | Path, samples: Sequence[Any], digits: int = 8) -> Path:
    """Write one `.pt` file per sample (`sample-00000000.pt`, ...): a helper to build a SampleFolder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for index, sample in enumerate(samples):
        torch.save(sample, folder / f"sample-{index:0{digits}d}.pt")
    return folder
