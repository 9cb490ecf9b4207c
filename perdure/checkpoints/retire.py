"""Deleting a committed checkpoint (retention, `perdure ckpt prune`): only checkpoints, and only perdure's leftovers.

A checkpoint is deleted in three steps, so that a kill at any instant never leaves half a checkpoint under a
committed name: a marker `.prune-<name>.perdure` is created beside it, the directory is renamed to `.prune-<name>`,
then removed, then the marker. A `.prune-*` directory counts as perdure's leftover (removed by the next prune) only
while its marker exists: a user's own `.prune-notes/` folder, or a symlink under such a name, is never touched.
Symlinks are never followed: a `ckpt-*` symlink is not a checkpoint, and `shutil.rmtree` removes links, not targets.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from perdure.checkpoints.commit import fsync_dir
from perdure.safe_io import create_new, is_symlink

PRUNE_PREFIX = ".prune-"
MARKER_SUFFIX = ".perdure"


def retire(path: Path) -> None:
    """Delete the committed checkpoint directory `path` (a real directory, not a symlink: OSError otherwise)."""
    root = path.parent
    if is_symlink(path) or not path.is_dir():
        raise NotADirectoryError(f"{path} is not a checkpoint directory (a symlink or a file); left alone")
    aside = root / f"{PRUNE_PREFIX}{path.name}"
    if os.path.lexists(aside):
        if not is_leftover(aside):
            raise FileExistsError(f"{aside} exists and is not perdure's; move it away to prune {path.name}")
        remove_leftover(aside)
    marker = _marker(aside)
    try:
        os.close(create_new(marker))
    except FileExistsError:
        pass  # an earlier prune of this name stopped before the rename: the marker is ours
    fsync_dir(root)
    os.rename(path, aside)  # a kill mid-delete leaves a marked .prune-* dir, never half a checkpoint
    fsync_dir(root)
    remove_leftover(aside)


def is_leftover(entry: Path) -> bool:
    """Whether `entry` is what an interrupted `retire` left: a real `.prune-*` directory with its marker beside it."""
    marker = _marker(entry)
    return (
        entry.name.startswith(PRUNE_PREFIX)
        and entry.is_dir()
        and not is_symlink(entry)
        and marker.is_file()
        and not is_symlink(marker)
    )


def leftovers(root: Path) -> tuple[list[Path], list[Path]]:
    """(perdure's leftovers, other `.prune-*` entries) in `root`."""
    ours: list[Path] = []
    others: list[Path] = []
    for entry in sorted(Path(root).glob(PRUNE_PREFIX + "*")):
        if entry.name.endswith(MARKER_SUFFIX):
            continue
        (ours if is_leftover(entry) else others).append(entry)
    return ours, others


def remove_leftover(entry: Path) -> None:
    """Remove a marked `.prune-*` directory, then its marker."""
    shutil.rmtree(entry)
    _marker(entry).unlink(missing_ok=True)
    fsync_dir(entry.parent)


def _marker(entry: Path) -> Path:
    return entry.with_name(entry.name + MARKER_SUFFIX)
