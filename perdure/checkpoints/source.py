"""The one rule that decides what a starting run restores from."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from perdure.checkpoints.resolve import CheckpointInfo, resolve_path
from perdure.errors import ResumeError

logger = logging.getLogger("perdure")

SourceKind = Literal["resume", "checkpoint", "pretrained", "fresh"]


@dataclass(frozen=True)
class RestoreSource:
    """What to load before training: this run's own checkpoint, an explicit one, pretrained weights, or nothing."""

    kind: SourceKind
    info: CheckpointInfo | None = None
    path: Path | None = None

    def describe(self) -> str:
        if self.kind == "resume":
            assert self.info is not None  # a resume or checkpoint source always carries its checkpoint
            return f"resuming from {self.info.path} (step {self.info.global_step})"
        if self.kind == "checkpoint":
            assert self.info is not None
            return f"starting from checkpoint {self.info.path} (step {self.info.global_step})"
        if self.kind == "pretrained":
            return f"starting from pretrained weights {self.path}"
        return "starting fresh at step 0"


def _names(path: Path, checkpoint: CheckpointInfo, run_dir: Path) -> bool:
    """Whether a user-given path means `checkpoint`: the checkpoint itself, or its run / checkpoints dir / `latest`."""
    path = path.resolve()
    run_dir = run_dir.resolve()
    return path in (checkpoint.path.resolve(), run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "latest")


def choose_restore_source(
    own: CheckpointInfo | None,
    *,
    run_dir: Path,
    resume: str | bool,
    checkpoint: str | None,
    pretrained: str | None,
    quarantined: list[str] | None = None,
) -> RestoreSource:
    """A run with a committed checkpoint continues from it; otherwise checkpoint > pretrained > fresh.

    `resume="auto"` (default) and `resume=True` both continue a run that has checkpoints; `True` also says so when
    there is nothing to resume. `resume=False` refuses to start over a run that has checkpoints, since starting over
    would mix two histories in one directory.
    """
    if own is not None:
        if resume is False:
            raise ResumeError(
                f"run {run_dir} already has checkpoints (latest: {own.name}) and resume=false refuses to start over "
                f"it. Drop --resume false to continue that run, or set --workspace.id NEW_ID to start a separate run."
            )
        for key, value in (("checkpoint", checkpoint), ("pretrained", pretrained)):
            if value and not _names(Path(value), own, run_dir):
                logger.warning(
                    "ignoring %s=%s: run %s already has checkpoints and continues from %s. To branch a new run from "
                    "%s instead, give it another identity: --workspace.id NEW_ID (or --workspace.lineage NAME).",
                    key,
                    value,
                    run_dir,
                    own.name,
                    value,
                )
        return RestoreSource("resume", info=own)
    # Quarantined staging leftovers ("tmp-...") were never checkpoints; committed ones that failed are.
    committed = [name for name in quarantined or [] if not name.startswith("tmp-")]
    if committed:
        if resume is True:
            raise ResumeError(
                f"every checkpoint of run {run_dir} failed verification ({', '.join(committed)} moved to "
                f"checkpoints/quarantine/ with the reasons): --resume refuses to start over. Inspect them with "
                f"`perdure ckpt ls {run_dir}`, or run without --resume to train this run again from step 0."
            )
        logger.warning(
            "CHECKPOINT PROBLEM: no checkpoint of run %s verifies (%s quarantined): starting over from step 0",
            run_dir,
            ", ".join(committed),
        )
    if resume is True:
        logger.info("--resume: nothing to resume in %s, starting a new run", run_dir)
    if checkpoint:
        return RestoreSource("checkpoint", info=resolve_path(Path(checkpoint)))
    if pretrained:
        return RestoreSource("pretrained", path=Path(pretrained))
    return RestoreSource("fresh")
