"""Checkpoints as the viewer shows them: each committed one with its manifest and whether it verifies, the
quarantined ones with the reason they were set aside.

Verification is perdure's own (`verify_checkpoint`, `read_manifest`): a checkpoint exists only if its manifest
verifies. Before calling it, the directory is walked without following links: a symlink or a non-regular file inside a
checkpoint fails it here, so verification never reads outside the run. Results are cached until a file in the
directory changes (size, mtime or inode), so a page refresh does not re-hash gigabytes.
"""

from __future__ import annotations

import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure.checkpoints.commit import QUARANTINE_DIR, STAGING_PREFIX, read_manifest, read_pointer
from perdure.checkpoints.commit import verify_checkpoint as perdure_verify
from perdure.checkpoints.resolve import committed_checkpoints
from perdure.errors import CheckpointCorruptError
from perdure.web.files import KIB, Refused, StatCache, inside, read_text

CHECKPOINTS_DIR = "checkpoints"
REASON_LIMIT = 64 * KIB
# Manifest keys shown as they are (the file list is summarised as a count and a total size).
_SKIP_KEYS = ("files", "format", "hash")


@dataclass(frozen=True)
class Verification:
    """The outcome of checking one checkpoint directory. `deep`: checksums were compared, not only sizes."""

    verified: bool
    problem: str | None
    deep: bool
    manifest: dict[str, Any] | None


class CheckpointVerifier:
    """Verifies checkpoint directories under a workspace root, caching each result until the directory changes.

    `check(deep=False, background=True)` answers at once from sizes (or from a cached checksum result) and queues
    the checksum verification on one daemon thread, so a listing stays fast and the next one knows more.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self._cache = StatCache()
        self._queue: queue.Queue[tuple[Path, tuple[Any, ...]]] = queue.Queue()
        self._queued: set[tuple[Path, tuple[Any, ...]]] = set()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def check(self, path: Path, *, deep: bool, background: bool = False) -> Verification:
        """Verify `path`: with `deep`, every file's checksum; else the manifest and the files' sizes. A cached deep
        result also answers a shallow question; with `background`, a shallow answer queues the deep check."""
        try:
            resolved = inside(self.root, path)
        except Refused as refused:
            return Verification(False, refused.reason, deep, None)
        files, problem = _walk(resolved)
        if problem is not None:
            return Verification(False, problem, deep, _manifest_or_none(resolved))
        if not deep and (deep_hit := self._cache.peek((resolved, True), files)) is not None:
            return deep_hit
        result = self._cache.get((resolved, deep), files, lambda: _verify(resolved, deep))
        if not deep and background and result.verified:
            self._enqueue(resolved, files)
        return result

    def _enqueue(self, path: Path, files: tuple[Any, ...]) -> None:
        with self._lock:
            if (path, files) in self._queued:
                return
            self._queued.add((path, files))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="perdure-web-verify", daemon=True)
                self._worker.start()
        self._queue.put((path, files))

    def _work(self) -> None:
        while True:
            path, files = self._queue.get()
            try:
                self.check(path, deep=True)
            finally:
                with self._lock:
                    self._queued.discard((path, files))


def _verify(path: Path, deep: bool) -> Verification:
    try:
        manifest = perdure_verify(path, deep=deep)
    except CheckpointCorruptError as error:
        return Verification(False, error.reason, deep, _manifest_or_none(path))
    except OSError as error:
        return Verification(False, f"unreadable: {error.strerror}", deep, None)
    return Verification(True, None, deep, manifest)


def _manifest_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return read_manifest(path)
    except (CheckpointCorruptError, OSError):
        return None


def _walk(path: Path) -> tuple[tuple[Any, ...], str | None]:
    """(signature of every entry, problem): the problem names the first symlink or non-regular file found."""
    entries = []
    for directory, names, files in os.walk(path):
        for name in sorted(names + files):
            full = Path(directory) / name
            relative = full.relative_to(path).as_posix()
            try:
                info = os.lstat(full)
            except OSError:
                return (), f"{relative} vanished while being checked"
            if stat.S_ISLNK(info.st_mode):
                return (), f"{relative} is a symlink (a checkpoint holds regular files only)"
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                return (), f"{relative} is not a regular file"
            entries.append((relative, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(entries), None


def checkpoint_table(run_dir: Path, verifier: CheckpointVerifier) -> dict[str, Any]:
    """The checkpoints of a run: `{"latest", "best", "checkpoints": [...], "quarantined": [...], "in_flight": [...]}`.

    Each checkpoint, newest first: name, step, epoch, reason (why it was saved), created, files, size, verified,
    problem, `checked` ("sizes" until the background checksum verification is done, then "checksums"), the
    `latest` / `best` flags and the rest of its manifest. Quarantined entries carry the reason and time
    from their REASON.txt; `in_flight` lists staging directories (a save in progress, or an interrupted one).
    """
    root = run_dir / CHECKPOINTS_DIR
    try:
        root = inside(verifier.root, root)
    except Refused:
        return {"latest": None, "best": None, "checkpoints": [], "quarantined": [], "in_flight": []}
    latest, best = _pointer(root, "latest"), _pointer(root, "best")
    checkpoints = []
    for path in committed_checkpoints(root):
        result = verifier.check(path, deep=False, background=True)
        checkpoints.append(_describe(path.name, result, latest=latest, best=best))
    in_flight = sorted(entry.name for entry in _entries(root) if entry.name.startswith(STAGING_PREFIX))
    return {
        "latest": latest,
        "best": best,
        "checkpoints": checkpoints,
        "quarantined": quarantined(root, verifier.root),
        "in_flight": in_flight,
    }


def _pointer(root: Path, name: str) -> str | None:
    target = read_pointer(root, name)
    return target[:200] if target else None


def _describe(name: str, result: Verification, *, latest: str | None, best: str | None) -> dict[str, Any]:
    manifest = result.manifest or {}
    listed = manifest.get("files")
    files = listed if isinstance(listed, dict) else {}
    sizes = [entry.get("size") for entry in files.values() if isinstance(entry, dict)]
    return {
        "name": name,
        "step": manifest.get("global_step"),
        "epoch": manifest.get("epoch"),
        "reason": manifest.get("reason"),
        "created": manifest.get("created"),
        "files": len(files),
        "size": sum(size for size in sizes if isinstance(size, int)),
        "verified": result.verified,
        "checked": "checksums" if result.deep else "sizes",
        "problem": result.problem,
        "latest": name == latest,
        "best": name == best,
        "manifest": {key: value for key, value in manifest.items() if key not in _SKIP_KEYS},
    }


def _entries(root: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(root) as entries:
            return list(entries)
    except OSError:
        return []


def quarantined(checkpoints: Path, workspace_root: Path) -> list[dict[str, Any]]:
    """The entries of `<checkpoints>/quarantine/`, each with the `reason` and `quarantined` time its note gives."""
    qroot = checkpoints / QUARANTINE_DIR
    try:
        qroot = inside(workspace_root, qroot)
    except Refused:
        return []
    found = []
    for entry in sorted(_entries(qroot), key=lambda entry: entry.name):
        if entry.name.endswith(".REASON.txt"):
            continue
        note = Path(entry.path) / "REASON.txt" if entry.is_dir(follow_symlinks=False) else None
        if note is None:
            note = qroot / f"{entry.name}.REASON.txt"
        found.append({"name": entry.name, **_reason(note, workspace_root)})
    return found


def _reason(note: Path, workspace_root: Path) -> dict[str, str | None]:
    facts: dict[str, str | None] = {"reason": None, "quarantined": None}
    try:
        text = read_text(inside(workspace_root, note), REASON_LIMIT)
    except Refused:
        return facts
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key in facts and facts[key] is None:
            facts[key] = value.strip()
    return facts
