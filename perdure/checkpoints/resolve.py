"""Deciding which checkpoint to load: follow the pointer, verify, quarantine what is bad, fall back to older ones.

The rule (see ARCHITECTURE.md, "Checkpoint contract"): a checkpoint exists only if its manifest verifies. `latest` is
a hint; the newest committed directory that verifies wins, because a kill between the commit (rename) and the
pointer update leaves a good checkpoint newer than the pointer. Nothing is ever deleted: bad directories are moved to
`<checkpoints>/quarantine/` with the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure.checkpoints.commit import (
    CHECKPOINT_PATTERN,
    MANIFEST_NAME,
    POINTERS,
    STAGING_PREFIX,
    fsync_dir,
    quarantine,
    read_manifest,
    read_pointer,
    verify_checkpoint,
    write_pointer,
)
from perdure.errors import CheckpointCorruptError, CheckpointError
from perdure.safe_io import is_symlink, safe_name

logger = logging.getLogger("perdure")
Warn = Callable[[str], None]


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint that verified: where it is, its name, and its manifest."""

    path: Path
    name: str
    manifest: dict[str, Any]

    @property
    def global_step(self) -> int | None:
        """`global_step` recorded in the manifest (None if the backend did not record one)."""
        return self.manifest.get("global_step")

    @property
    def epoch(self) -> int | None:
        """`epoch` recorded in the manifest (None if the backend did not record one)."""
        return self.manifest.get("epoch")


def _manifest_step(path: Path) -> int | None:
    try:
        step = read_manifest(path).get("global_step")
    except CheckpointCorruptError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def committed_checkpoints(root: Path) -> list[Path]:
    """Directories in `root` named like committed checkpoints, newest first (by global step, then by name).

    Being listed does not mean a directory verifies; see `resolve_latest`.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    steps: dict[Path, int | None] = {}
    epochs: dict[Path, int] = {}
    for path in root.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if not match or not _is_real_dir(path):  # a symlink is no checkpoint perdure wrote: never followed
            continue
        if match["step"] is not None:
            steps[path] = int(match["step"])
        else:  # epoch-named: only the manifest knows the step
            steps[path], epochs[path] = _manifest_step(path), int(match["epoch"])
    # An epoch dir with an unreadable manifest takes the step of the newest readable older epoch, so that it still
    # sorts by its epoch number: it is then tried (and quarantined) before the older ones, not silently left behind.
    for path in [p for p, s in steps.items() if s is None]:
        older = [s for p, s in steps.items() if s is not None and epochs.get(p, -1) < epochs[path] and p in epochs]
        steps[path] = max(older, default=-1)
    return sorted(steps, key=lambda p: (steps[p], epochs.get(p, -1), p.name), reverse=True)


def _is_real_dir(path: Path) -> bool:
    """A directory, not a symlink to one."""
    return path.is_dir() and not is_symlink(path)


def _describe(info: CheckpointInfo) -> str:
    where = [f"{k} {v}" for k, v in (("step", info.global_step), ("epoch", info.epoch)) if v is not None]
    return f"{info.name} ({', '.join(where)})" if where else info.name


def _check_latest_pointer(root: Path, pointer: str | None, n_dirs: int, warn: Warn) -> str | None:
    """Warn about a missing / garbage / dangling `latest`; return the pointer if it names an existing dir."""
    path = root / "latest"
    if pointer is None:
        if n_dirs:
            warn(
                f"CHECKPOINT PROBLEM: pointer {path} is missing but {n_dirs} checkpoint dir(s) exist "
                "(a save was interrupted, or the file was removed); choosing the newest checkpoint that verifies."
            )
        return None
    if not CHECKPOINT_PATTERN.match(pointer):
        warn(
            f"CHECKPOINT PROBLEM: pointer {path} holds {safe_name(pointer)}, which is not a checkpoint name "
            "(expected ckpt-s<12 digits> or ckpt-e<6 digits>); ignoring it and choosing the newest checkpoint "
            "that verifies."
        )
        return None
    if not _is_real_dir(root / pointer):
        warn(
            f"CHECKPOINT PROBLEM: pointer {path} names {pointer}, which does not exist in {root}; "
            "choosing the newest checkpoint that verifies."
        )
        return None
    return pointer


def _repair_pointers(root: Path, pointer: str | None, chosen: CheckpointInfo | None, warn: Warn) -> None:
    """Make `latest` name the chosen checkpoint (or remove it when none verifies); drop a `best` naming nothing."""
    if chosen is not None and pointer != chosen.name:
        write_pointer(root, "latest", chosen.name)
        warn(f"CHECKPOINT REPAIR: {root / 'latest'} now names {chosen.name} (it held {safe_name(pointer)}).")
    elif chosen is None and (root / "latest").exists():
        os.unlink(root / "latest")
        fsync_dir(root)
        warn(f"CHECKPOINT REPAIR: removed {root / 'latest'} ({safe_name(pointer)}): no checkpoint in {root} verifies.")
    # `best` is only ever re-pointed by a save whose score improved: pointing it at another checkpoint here would
    # claim a score that checkpoint does not have. A `best` that names no existing directory is removed instead.
    best = read_pointer(root, "best")
    if best is not None and not (CHECKPOINT_PATTERN.match(best) and _is_real_dir(root / best)):
        os.unlink(root / "best")
        fsync_dir(root)
        warn(
            f"CHECKPOINT REPAIR: removed {root / 'best'}: it named {safe_name(best)}, which is not a committed "
            "checkpoint (quarantined or missing); the next save whose score improves sets it again."
        )


@dataclass
class Resolution:
    """What looking at a checkpoints dir found, before anything is repaired: the checkpoint to use (`chosen`), the
    newer committed ones that failed verification, leftover staging dirs, what `latest` held, and notes about it."""

    root: Path
    chosen: CheckpointInfo | None = None
    failures: list[tuple[Path, str]] = field(default_factory=list)
    staging: list[Path] = field(default_factory=list)
    pointer: str | None = None
    notes: list[str] = field(default_factory=list)  # pointer problems, reported before the failures
    lag_note: str | None = None  # `latest` names an older checkpoint than a newer, good one

    @property
    def needs_repair(self) -> bool:
        best = read_pointer(self.root, "best")
        bad_best = best is not None and not (CHECKPOINT_PATTERN.match(best) and (self.root / best).is_dir())
        latest_wrong = self.pointer != (self.chosen.name if self.chosen else None)
        return bool(self.failures or self.staging or bad_best or latest_wrong)


def find_latest(root: Path, *, deep: bool = True) -> Resolution:
    """Look at a run's checkpoints dir without changing anything: the newest checkpoint that verifies, and what is
    wrong around it. `report` says it, `repair` fixes it; `resolve_latest` does both."""
    root = Path(root)
    resolution = Resolution(root)
    if not root.is_dir():
        return resolution
    resolution.staging = sorted(p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX) and p.is_dir())
    candidates = committed_checkpoints(root)
    resolution.pointer = read_pointer(root, "latest")
    valid_pointer = _check_latest_pointer(root, resolution.pointer, len(candidates), resolution.notes.append)
    for path in candidates:
        try:
            manifest = verify_checkpoint(path, deep=deep)
            if deep and manifest.get("backend") == "deepspeed":  # DeepSpeed opens its files by name, unpickling them
                from perdure.checkpoints.deepspeed_files import TAG, refuse_hostile_checkpoint

                refuse_hostile_checkpoint(path, TAG)
        except CheckpointCorruptError as exc:
            resolution.failures.append((path, exc.reason))
            continue
        resolution.chosen = CheckpointInfo(path, path.name, manifest)
        break
    chosen = resolution.chosen
    if chosen is not None and valid_pointer is not None and valid_pointer != chosen.name and not resolution.failures:
        resolution.lag_note = (
            f"CHECKPOINT NOTE: {root / 'latest'} names {valid_pointer} but the newer {chosen.name} is fully "
            "committed (the pointer update was interrupted); using the newer one."
        )
    return resolution


def report(resolution: Resolution, warn: Warn, fates: dict[Path, str] | None = None, default_fate: str = "") -> None:
    """Warn about everything `find_latest` found: pointer problems, each failed checkpoint with what became of it
    (`fates[path]`, else `default_fate`), and a `latest` that lags behind."""
    for note in resolution.notes:
        warn(note)
    chosen = resolution.chosen
    instead = f"resuming from {_describe(chosen)} instead" if chosen else "no older checkpoint verifies"
    for path, reason in resolution.failures:
        fate = (fates or {}).get(path, default_fate)
        warn(f"CHECKPOINT PROBLEM: {path} failed verification: {reason}. It was {fate}; {instead}.")
    if resolution.lag_note:
        warn(resolution.lag_note)


def repair(resolution: Resolution, warn: Warn) -> dict[Path, str]:
    """The run's owner (rank 0, holding the run lock, before it saves): quarantine leftover staging dirs and the failed
    checkpoints `find_latest` found, point `latest` at the chosen checkpoint (remove it when none verifies) and drop a
    `best` that names nothing. Returns what became of each failed checkpoint, for `report`."""
    root = resolution.root
    for staging in resolution.staging:
        if not staging.is_dir():
            continue
        try:
            moved = quarantine(staging, f"interrupted save: staging dir {staging.name} was never committed")
        except OSError as exc:  # leftover debris must not stop a resume
            warn(f"CHECKPOINT PROBLEM: could not quarantine the interrupted save {staging}: {exc}")
            continue
        warn(
            f"CHECKPOINT PROBLEM: {staging} is an interrupted save (the process stopped before it was "
            f"committed); moved to {moved}. Nothing committed was lost."
        )
    fates: dict[Path, str] = {}
    for path, reason in resolution.failures:
        if not path.is_dir():
            continue
        try:
            fates[path] = f"moved to {quarantine(path, reason)} (nothing deleted)"
        except OSError as qexc:  # still skipped: a bad checkpoint is never loaded
            warn(f"CHECKPOINT PROBLEM: could not quarantine {path}: {qexc}")
            fates[path] = "skipped"
    try:
        _repair_pointers(root, resolution.pointer, resolution.chosen, warn)
    except OSError as exc:  # e.g. a directory named `latest`: report, but still resume from the good checkpoint
        warn(f"CHECKPOINT PROBLEM: could not repair the pointers in {root}: {exc}")
    return fates


def resolve_latest(
    root: Path, *, repair: bool = True, warn: Warn | None = None, deep: bool = True
) -> CheckpointInfo | None:
    """The newest checkpoint in a run's checkpoints dir `root` that verifies, or None if there is none.

    With `repair` (the run's owner, rank 0, before this process starts saving): leftover staging dirs are
    quarantined as interrupted saves, every bad checkpoint newer than the chosen one is quarantined with its reason,
    `latest` is rewritten to the chosen one (removed when none verifies) and a `best` that names no existing
    checkpoint is removed. Without `repair` nothing is moved or written; bad checkpoints are skipped. Every problem is
    reported through `warn` (default: the "perdure" logger at WARNING). Never raises for a corrupt checkpoint.
    """
    warn = warn or logger.warning
    resolution = find_latest(root, deep=deep)
    if repair:
        fates = _repair(resolution, warn)
        report(resolution, warn, fates)
    else:
        report(resolution, warn, default_fate="left in place")
    return resolution.chosen


_repair = repair  # `resolve_latest` has a parameter of that name


def resolve_path(path: Path, *, warn: Warn | None = None) -> CheckpointInfo:
    """Resolve a user-given path (`--checkpoint`, `from_checkpoint`) to a verified checkpoint.

    Accepts a checkpoint dir (verified; CheckpointCorruptError if bad, since the user named it), a checkpoints dir
    (holds ckpt-* dirs or `latest`) or a run dir (has `checkpoints/`); the last two resolve to their newest good
    checkpoint without modifying anything. Anything else raises CheckpointError saying what was looked for.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if path.is_file() and path.name in POINTERS:
        target = read_pointer(path.parent, path.name)
        if not target or not CHECKPOINT_PATTERN.match(target) or not (path.parent / target).is_dir():
            raise CheckpointError(f"pointer {path} holds {safe_name(target)}, which names no checkpoint next to it")
        path = path.parent / target
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint path {path} is a file; a checkpoint is a directory holding {MANIFEST_NAME} "
            "(for model weights only, use --pretrained)"
        )
    if (path / MANIFEST_NAME).exists() or CHECKPOINT_PATTERN.match(path.name):
        # A copy under another name (e.g. "best-model/") is fine; a ckpt-* name must match its manifest.
        manifest = verify_checkpoint(path, check_name=bool(CHECKPOINT_PATTERN.match(path.name)))
        return CheckpointInfo(path, manifest["name"], manifest)
    for root in (path, path / "checkpoints"):
        if root.is_dir() and ((root / "latest").exists() or committed_checkpoints(root)):
            info = resolve_latest(root, repair=False, warn=warn)
            if info is None:
                raise CheckpointError(f"{root} holds checkpoints but none verifies (see the warnings above)")
            return info
    raise CheckpointError(
        f"{path} is not a checkpoint: looked for {MANIFEST_NAME} (a checkpoint dir), ckpt-* dirs or a `latest` "
        "pointer (a checkpoints dir) and a checkpoints/ subdir (a run dir)"
    )


def best_checkpoint(root: Path, *, warn: Warn | None = None) -> CheckpointInfo | None:
    """The checkpoint `root/best` names, verified; None if there is no `best` or it does not verify."""
    root = Path(root)
    name = read_pointer(root, "best")
    if name is None:
        return None
    warn = warn or logger.warning
    if not CHECKPOINT_PATTERN.match(name):
        warn(f"CHECKPOINT PROBLEM: pointer {root / 'best'} holds {safe_name(name)}, not a checkpoint name; ignoring it")
        return None
    try:
        manifest = verify_checkpoint(root / name)
    except CheckpointCorruptError as exc:
        warn(f"CHECKPOINT PROBLEM: best checkpoint {root / name} failed verification: {exc.reason}; ignoring it.")
        return None
    return CheckpointInfo(root / name, name, manifest)
