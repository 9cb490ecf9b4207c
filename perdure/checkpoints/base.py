"""The CheckpointManager contract every backend (file, DCP, DeepSpeed engine) implements, and its policy."""

from __future__ import annotations

import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from perdure.checkpoints.commit import (
    FileRecord,
    commit_checkpoint,
    make_staging_dir,
    read_pointer,
    write_file,
    write_pointer,
)
from perdure.checkpoints.resolve import CheckpointInfo, committed_checkpoints, resolve_latest

logger = logging.getLogger("perdure")

PRUNE_PREFIX = ".prune-"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointPolicy:
    """When to write and what to keep; read from the `ckpt.*` config section."""

    enabled: bool = True
    interval: int | None = None
    interval_steps: int | None = None
    keep_latest_k: int = 0
    save_best: bool = True
    export_dtype: str | None = None

    @classmethod
    def from_config(cls, ckpt: Mapping[str, Any]) -> CheckpointPolicy:
        return cls(
            enabled=bool(ckpt.get("enabled", True)),
            interval=ckpt.get("interval"),
            interval_steps=ckpt.get("interval_steps"),
            keep_latest_k=int(ckpt.get("keep_latest_k") or 0),
            save_best=bool(ckpt.get("save_best", True)),
            export_dtype=ckpt.get("export_dtype"),
        )


class CheckpointManager(ABC):
    """Owns one run's `checkpoints/` directory: resolve what to resume from, save, load, prune.

    The runner hands over *what* to save as two mappings of objects with `state_dict` / `load_state_dict`:
    `states` (replicated: identical on every rank; the mapping order is the restore order) and `local_states`
    (rank-local: RNG, data position). A backend decides only the bytes inside a checkpoint directory (`write`,
    `read`); the commit protocol (staging, fsync, manifest last, rename, pointers) and retention live here and in
    `commit.py`, so every backend commits the same way. A `collective` backend is entered by every rank for save and
    load; a non-collective one is called by every rank too, and writes rank-local files on each rank.
    """

    backend: ClassVar[str]
    collective: ClassVar[bool] = False

    def __init__(
        self,
        root: Path,
        policy: CheckpointPolicy,
        *,
        rank: int = 0,
        world_size: int = 1,
        identity: Mapping[str, Any] | None = None,
    ) -> None:
        self.root = Path(root)
        self.policy = policy
        self.rank = rank
        self.world_size = world_size
        self.identity = dict(identity or {})
        self.resumed_from: str | None = None
        self.last_saved: str | None = None

    # ---- what the runner calls -------------------------------------------------------------------------------

    def resolve(self) -> CheckpointInfo | None:
        """The newest checkpoint of this run that verifies, quarantining bad ones (only when writes are allowed)."""
        if not self.root.is_dir():
            return None
        return resolve_latest(self.root, repair=self.policy.enabled and self.rank == 0)

    def save(
        self,
        name: str,
        states: Mapping[str, Stateful],
        local_states: Mapping[str, Stateful],
        *,
        meta: Mapping[str, Any],
        is_best: bool = False,
        texts: Mapping[str, str] | None = None,
    ) -> Path | None:
        """Write, commit and publish checkpoint `name`; prune afterwards. Returns its directory, or None if disabled.

        `meta` goes into the manifest (step, epoch, ids, ...); `texts` are small human-readable files (config.yaml).
        A name that is already committed is not written again: a position is never saved twice.
        """
        if not self.policy.enabled:
            return None
        final = self.root / name
        if final.exists():
            return final
        replicated = {key: state.state_dict() for key, state in states.items()}
        local = {key: state.state_dict() for key, state in local_states.items()}
        staging = make_staging_dir(self.root, name)
        try:
            files = self.write(staging, replicated, local)
            for relative, text in (texts or {}).items():
                files[relative] = _write_text_file(staging / relative, text)
            manifest_meta = {**self.identity, **meta, "backend": self.backend, "world_size": self.world_size}
            commit_checkpoint(staging, final, files, manifest_meta)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        write_pointer(self.root, "latest", name)
        if is_best:
            write_pointer(self.root, "best", name)
        self.last_saved = name
        self.prune()
        return final

    def load(self, info: CheckpointInfo, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> None:
        """Restore every object from a verified checkpoint, in the mappings' order."""
        self.read(info.path, states, local_states)
        if info.path.parent.resolve() == self.root.resolve():
            self.resumed_from = info.name

    def prune(self) -> list[Path]:
        """Apply `keep_latest_k` by scanning the directory, so retention survives restarts.

        Never removes the `latest` or `best` target, the checkpoint this attempt resumed from, or the one just saved.
        A directory is first renamed aside, then deleted, so a kill mid-delete never leaves a half checkpoint under a
        committed name.
        """
        if not self.policy.enabled or self.rank != 0:
            return []
        for leftover in self.root.glob(PRUNE_PREFIX + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        keep = self.policy.keep_latest_k
        if keep <= 0:
            return []
        protected = {read_pointer(self.root, "latest"), read_pointer(self.root, "best")}
        protected |= {self.resumed_from, self.last_saved}
        removed = []
        for path in committed_checkpoints(self.root)[keep:]:
            if path.name in protected:
                continue
            aside = self.root / f"{PRUNE_PREFIX}{path.name}"
            os.rename(path, aside)
            shutil.rmtree(aside)
            removed.append(path)
        return removed

    def close(self) -> None:
        """Wait for every save in flight. Synchronous managers have nothing to wait for."""
        return None

    # ---- what a backend implements ---------------------------------------------------------------------------

    @abstractmethod
    def write(self, staging: Path, replicated: dict[str, Any], local: dict[str, Any]) -> dict[str, FileRecord]:
        """Write this rank's share of a checkpoint into `staging`; return every file written with its record.

        Called on every rank inside `save`. Must fsync what it writes (use `commit.write_file`) and must not touch
        pointers, manifests or anything outside `staging`.
        """

    @abstractmethod
    def read(self, path: Path, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> None:
        """Load a verified checkpoint directory into the given objects, in order. Must not write anything."""


def _write_text_file(path: Path, text: str) -> FileRecord:
    data = text.encode()
    return write_file(path, lambda f: f.write(data))
