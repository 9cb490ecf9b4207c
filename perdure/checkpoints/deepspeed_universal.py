"""A DeepSpeed checkpoint of one world size, loaded on another: DeepSpeed's universal checkpoint, kept beside it.

ZeRO partitions the optimizer state (and under ZeRO-3 the weights) by data-parallel rank, so a checkpoint written by
N ranks cannot be loaded on M directly. On restore, perdure converts it with DeepSpeed's own converter
(`deepspeed.checkpoint.ds_to_universal`: one file per parameter and optimizer state, whatever the world size) and loads
that with the engine's `load_universal_checkpoint` switched on for that one load.

The conversion is derived data: it is written outside the run while the runner is built (only `train()` writes into a
run) and committed through the one protocol (`commit.py`) when training starts, as

    checkpoints/universal/<checkpoint name>/      engine/ (the universal tag directory) + manifest.json

whose manifest names the checkpoint it came from (`derived_from`: name and creation time). The original is never
touched; the next restore of the same checkpoint on another world size loads the derived one after verifying it.
Retention removes a derived checkpoint with its original. Every file of the original is checked
(`deepspeed_files.check_engine_files`: no symlink anywhere, the allow-list, parameter names that are plain path
components) before DeepSpeed's converter reads it, and every file of a derived checkpoint before the engine loads it;
both run with every `torch.load` restricted (`deepspeed_loads_restricted`). A derived checkpoint that is refused
is converted again from its original, and moved to quarantine (with the reason) when training starts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

from perdure.checkpoints.commit import (
    CHECKPOINT_PATTERN,
    STAGING_PREFIX,
    commit_checkpoint,
    hash_file,
    make_staging_dir,
    quarantine,
    read_manifest,
    verify_checkpoint,
)
from perdure.checkpoints.deepspeed_files import check_engine_files
from perdure.checkpoints.retire import leftovers, remove_leftover, retire
from perdure.checkpoints.safe_unpickle import deepspeed_loads_restricted, deepspeed_refusal
from perdure.distributed.collectives import broadcast_object
from perdure.errors import CheckpointCorruptError, CheckpointError
from perdure.safe_io import check_real_path, ensure_dir, is_symlink, regular_files_under

logger = logging.getLogger("perdure")

UNIVERSAL_DIR = "universal"
BACKEND = "deepspeed-universal"


def derived_path(checkpoint: Path) -> Path:
    """Where the universal form of `checkpoint` is kept: `checkpoints/universal/<its name>`."""
    return checkpoint.parent / UNIVERSAL_DIR / checkpoint.name


class UniversalSource:
    """The universal form of one checkpoint for a restore: found (a derived checkpoint that verifies) or converted now
    by rank 0 into a temporary directory, which `commit` later turns into the derived checkpoint."""

    def __init__(self, checkpoint: Path, tag: str, rank: int) -> None:
        self.checkpoint, self.tag, self.rank = checkpoint, tag, rank
        self.temporary: Path | None = None  # rank 0: a conversion not yet committed
        self.refused: str | None = None  # rank 0: why the derived checkpoint kept in the run was refused

    def locate(self, world_size: int) -> Path:
        """The directory holding the universal tag (collective: rank 0 decides, converting if needed)."""
        outcome: tuple[str, Any] = ("", None)
        if self.rank == 0:
            try:
                source = self._existing()
                if source is None:
                    check_engine_files(self.checkpoint / self.tag)
                    source = self.temporary = self._convert(world_size)
                check_engine_files(source / self.tag)
                outcome = ("ok", str(source))
            except CheckpointError as error:
                outcome = ("error", str(error))
        status, value = broadcast_object(outcome)
        if status != "ok":
            raise CheckpointError(value)
        return Path(value)

    def _origin(self) -> dict[str, Any]:
        manifest = read_manifest(self.checkpoint)
        return {"name": manifest["name"], "created": manifest["created"]}

    def _existing(self) -> Path | None:
        derived = derived_path(self.checkpoint)
        if not os.path.lexists(derived):
            return None
        try:
            check_real_path(derived, self.checkpoint.parent)  # `universal/` and the checkpoint: no symlink
            manifest = verify_checkpoint(derived)
            check_engine_files(derived / self.tag)
        except CheckpointCorruptError as error:
            logger.warning("universal checkpoint %s does not verify (%s): converting %s again", derived, error.reason,
                           self.checkpoint.name)  # fmt: skip
            return None
        except (CheckpointError, OSError) as error:
            self.refused = str(error)
            logger.warning(
                "CHECKPOINT PROBLEM: refused the universal form %s of %s (%s); converting %s again (the refused one "
                "is moved to quarantine when training starts)", derived, self.checkpoint.name, error,
                self.checkpoint.name,
            )  # fmt: skip
            return None
        if manifest.get("derived_from") != self._origin() or manifest.get("backend") != BACKEND:
            logger.warning("%s was not derived from this %s: converting it again", derived, self.checkpoint.name)
            return None
        logger.info("loading %s, the universal form of %s", derived, self.checkpoint.name)
        return derived

    def _convert(self, world_size: int) -> Path:
        from perdure.distributed.deepspeed_env import import_deepspeed

        import_deepspeed()
        from deepspeed.checkpoint.ds_to_universal import main as to_universal

        written = read_manifest(self.checkpoint).get("world_size")
        temporary = Path(tempfile.mkdtemp(prefix=f"perdure-universal-{self.checkpoint.name}-"))
        arguments = argparse.Namespace(
            input_folder=str(self.checkpoint / self.tag),
            output_folder=str(temporary / self.tag),
            num_extract_workers=1,  # in this process: no process pool inside a rank
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # perdure's checkpoints carry no Megatron-style universal info of their own
        )
        logger.warning(
            "%s was written by %s ranks, this run has %d: converting it to DeepSpeed's universal checkpoint format",
            self.checkpoint.name,
            written,
            world_size,
        )
        output = io.StringIO()
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):  # its progress bars
                with deepspeed_loads_restricted():
                    to_universal(arguments)
            regular_files_under(temporary)  # what the engine will load: its own regular files, no symlink
        except pickle.UnpicklingError as error:
            shutil.rmtree(temporary, ignore_errors=True)
            raise deepspeed_refusal(self.checkpoint / self.tag, error) from None
        except Exception as error:
            shutil.rmtree(temporary, ignore_errors=True)
            raise CheckpointError(
                f"cannot convert {self.checkpoint} (written by {written} ranks) for {world_size} ranks: "
                f"{type(error).__name__}: {error}. Resume it on the number of ranks that wrote it "
                f"(torchrun --nproc_per_node {written} <your program> <its arguments>), or convert it with DeepSpeed "
                f"to see why: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                f"{self.checkpoint / self.tag} --output_folder <directory>/{self.tag} --inject_missing_state"
            ) from error
        logger.debug("%s", output.getvalue())
        (temporary / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer file: never trusted
        return temporary

    def commit(self) -> Path | None:
        """Rank 0, when training starts: copy a fresh conversion into the run as a derived checkpoint (only beside a
        checkpoint of this run: one from another run, given with --checkpoint, is converted for this restore only)."""
        if self.temporary is None:
            return None
        temporary, self.temporary = self.temporary, None
        target = derived_path(self.checkpoint)
        try:
            if self.refused is not None:  # kept, with the reason, for whoever wants to see what was handed over
                moved = quarantine(target, f"refused universal form of {self.checkpoint.name}: {self.refused}")
                logger.warning("CHECKPOINT PROBLEM: moved the refused %s to %s", target, moved)
                self.refused = None
            elif target.exists():  # a stale or broken one: the fresh conversion replaces it
                retire(target)
            root = ensure_dir(target.parent)
            staging = make_staging_dir(root, target.name)
            shutil.copytree(temporary / self.tag, staging / self.tag)
            files = {
                path.relative_to(staging).as_posix(): hash_file(path) for path in sorted(staging.rglob("*"))
                if path.is_file()
            }  # fmt: skip
            meta = {"backend": BACKEND, "derived_from": self._origin(), "world_size": None}
            commit_checkpoint(staging, target, files, meta)
        except (OSError, CheckpointError) as error:
            logger.warning("could not keep the universal form of %s in %s: %s", self.checkpoint.name, target, error)
            return None
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        logger.info("kept the universal form of %s as %s", self.checkpoint.name, target)
        return target

    def discard(self) -> None:
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)
            self.temporary = None


def prune_derived(checkpoints: Path) -> None:
    """Rank 0 holding the run lock: remove derived universal checkpoints whose original is gone (retention removed
    it), and what an interrupted commit or removal left in `checkpoints/universal/`."""
    root = checkpoints / UNIVERSAL_DIR
    if not root.is_dir() or is_symlink(root):
        return
    for leftover in leftovers(root)[0]:
        with contextlib.suppress(OSError):
            remove_leftover(leftover)
    for entry in root.iterdir():
        if not entry.is_dir() or is_symlink(entry):
            continue
        with contextlib.suppress(OSError):
            if entry.name.startswith(STAGING_PREFIX):
                shutil.rmtree(entry)
            elif CHECKPOINT_PATTERN.match(entry.name) and not (checkpoints / entry.name).exists():
                retire(entry)
