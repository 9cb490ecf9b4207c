"""The files of a DeepSpeed checkpoint, checked before DeepSpeed's own code reads them.

DeepSpeed's engine (for a universal checkpoint), its universal converter and its zero-to-fp32 routine open the files
of a tag directory by name, walk its folders, `torch.load` with `weights_only=False`, and (the converter) turn
parameter names into paths to write. So before any of them runs, `check_engine_files`:

- walks the tag directory entry by entry without following anything (`safe_io.regular_files_under`): a symlink
  anywhere, to a file or to a folder, or anything but regular files and folders refuses the checkpoint (`rglob`
  does not descend into a symlinked folder, so what lay behind one was never looked at);
- reads every `*.pt` through the allow-list (`load_deepspeed_file`, the pickle only: tensor data is mapped);
- checks every parameter name the converter makes a path of (`PARAM_NAME_FIELDS`) like a path: one plain component,
  so that `os.path.join(output, name)` stays inside the conversion's own directory.

DeepSpeed's code then runs under `deepspeed_loads_restricted` (safe_unpickle.py), so that its loads are the
allow-listed ones too, whatever it asks for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from perdure.checkpoints.safe_unpickle import load_deepspeed_file
from perdure.errors import CheckpointCorruptError, CheckpointError
from perdure.safe_io import UnsafeFileError, is_symlink, regular_files_under, safe_name

TAG = "engine"  # the engine's tag directory inside every checkpoint perdure's DeepSpeed backend writes

# Where DeepSpeed's files name parameters (model states: top level; optimizer states: under optimizer_state_dict).
PARAM_NAME_FIELDS = ("module", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
                     "buffer_names", "param_slice_mappings")  # fmt: skip
MAX_NAME_BYTES = 255  # one path component


def check_tag_dir(tag_dir: Path) -> None:
    """The engine's tag directory is a real directory of the checkpoint, not a symlink to files elsewhere."""
    if is_symlink(tag_dir) or not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} is not a directory of the checkpoint (a symlink, a file or missing)")


def refuse_hostile_checkpoint(checkpoint: Path, tag: str) -> None:
    """Called by `resolve.find_latest` on a DeepSpeed checkpoint whose manifest verified, before the run chooses it:
    its tag directory checked as `check_engine_files` does. A `CheckpointCorruptError` makes the resolution
    quarantine it and fall back to an older checkpoint, as for a file or DCP checkpoint that fails to verify (a
    manifest recomputed by whoever planted a symlink or a payload verifies). Reads only; loads no tensor data."""
    try:
        check_engine_files(checkpoint / tag)
    except CheckpointError as error:
        raise CheckpointCorruptError(checkpoint, f"refused DeepSpeed files: {str(error).rstrip('.')}") from None


def check_engine_files(tag_dir: Path) -> list[Path]:
    """Every file of a tag directory checked (see the module docstring) before code that opens them by name sees
    them; a `CheckpointError` names the file and what is wrong with it. Returns the `*.pt` files."""
    check_tag_dir(tag_dir)
    try:
        files = [path for path in regular_files_under(tag_dir) if path.suffix == ".pt"]
    except UnsafeFileError as error:
        raise CheckpointError(f"refused DeepSpeed checkpoint {tag_dir}: {error}") from None
    except OSError as error:
        raise CheckpointError(f"cannot read {tag_dir}: {error}") from None
    for path in files:
        try:
            content = load_deepspeed_file(path, mmap=True)
        except OSError as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None
        for name in parameter_names(content):
            check_parameter_name(path, name)
    return files


def parameter_names(content: Any) -> Iterator[Any]:
    """The parameter names a DeepSpeed model or optimizer states file holds (keys, and the names in lists)."""
    if not isinstance(content, Mapping):
        return
    places = [content, content.get("optimizer_state_dict")]
    for place in places:
        if not isinstance(place, Mapping):
            continue
        for field in PARAM_NAME_FIELDS:
            yield from _names_in(place.get(field))


def _names_in(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        yield from value.keys()
        if all(isinstance(item, str) for item in value.values()):  # shared_params: name -> name
            yield from value.values()
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, Mapping):  # param_shapes / param_slice_mappings: one mapping per group
                yield from item.keys()
            else:
                yield item


def check_parameter_name(path: Path, name: Any) -> None:
    """A parameter name that DeepSpeed's converter makes a folder of: one plain path component."""
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
    )
    if not plain:
        raise CheckpointError(
            f"refused DeepSpeed checkpoint file {path}: it names a parameter {safe_name(name)}, which is not one "
            "plain path component (DeepSpeed's universal conversion writes a folder of that name, which would lie "
            "outside its own directory). perdure never writes such a name: the file was made by hand"
        )
