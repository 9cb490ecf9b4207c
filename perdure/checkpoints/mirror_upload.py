"""The uploader of a run's checkpoints to its mirror (`ckpt.mirror`), on a background thread of the training process
(rank 0): a save never waits for it. A slow or failing store is warned about and retried with backoff; a checkpoint
that could not be uploaded is recorded like a failed save. After each upload `ckpt.keep_latest_k` is applied to the
mirror. The store and its commit rule: `mirror.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure.checkpoints.mirror import MirrorStore, store_errors, upload_checkpoint
from perdure.checkpoints.mirror_restore import prune_mirror
from perdure.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger("perdure")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 15.0


@dataclass(frozen=True)
class MirrorFailure:
    """A checkpoint the mirror did not get (or not yet): recorded like a failed save."""

    name: str
    error: str


@dataclass
class _Upload:
    name: str
    forced: bool
    protected: frozenset[str]
    attempts: int = 0


class MirrorUploader:
    """Uploads this run's committed checkpoints to its `MirrorStore` on one background thread, oldest first.

    `committed` is called in the training process once a checkpoint has committed locally; it returns at once. A plain
    checkpoint still waiting when a newer one commits is skipped (the newer one supersedes it); final and preemption
    ones always go. After each upload `ckpt.keep_latest_k` is applied to the mirror (`mirror_restore.prune_mirror`).
    """

    def __init__(
        self, store: MirrorStore, local_root: Path, *, every: int = 1, keep_latest_k: int = 0, drain_s: float = 600.0
    ) -> None:
        self.store = store
        self.local_root = Path(local_root)
        self.every = every
        self.keep_latest_k = keep_latest_k
        self.drain_s = drain_s
        self.uploaded: list[str] = []
        self._count = 0
        self._handed: set[str] = set()
        self._queue: list[_Upload] = []
        self._failures: list[MirrorFailure] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None  # set by `close`: give up retrying after it

    def committed(self, name: str, reason: str, protected: Iterable[str | None] = ()) -> None:
        """Checkpoint `name` committed locally (`reason` from its manifest); `protected`: names retention must keep.
        Thread-safe; a name handed over before is ignored."""
        forced = reason in ("final", "preemption")
        upload = _Upload(name, forced, frozenset(p for p in protected if p))
        with self._cond:
            if name in self._handed:
                return
            self._handed.add(name)
            self._count += 1
            if not forced and self._count % self.every != 0:
                return
            skipped = [job.name for job in self._queue[1:] if not job.forced]
            if skipped:
                logger.info("mirror: %s superseded by %s before its upload began", ", ".join(skipped), name)
            self._queue = [job for i, job in enumerate(self._queue) if i == 0 or job.forced] + [upload]
            self._deadline = None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="perdure-mirror", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> set[str]:
        """Names queued or being uploaded: local retention must not remove them yet."""
        with self._cond:
            return {job.name for job in self._queue}

    def take_failures(self) -> list[MirrorFailure]:
        with self._cond:
            failures, self._failures = self._failures, []
        return failures

    def close(self) -> None:
        """Wait for the uploads in flight, retrying for at most `drain_s` seconds; what is left is recorded failed."""
        with self._cond:
            if self._thread is None:
                return
            if self._queue:
                logger.info("mirror: waiting for %d upload(s) to %s", len(self._queue), self.store)
            self._deadline = time.monotonic() + self.drain_s
            self._cond.notify_all()
            thread = self._thread
        thread.join()
        with self._cond:
            self._thread = None
            if self._queue:  # the thread died of an error no store raises (logged by threading's excepthook)
                self._failures.extend(
                    MirrorFailure(job.name, "not uploaded: the uploader stopped") for job in self._queue
                )
                self._queue.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self._deadline is None:
                    self._cond.wait()
                if not self._queue:
                    return
                upload = self._queue[0]
            try:
                started = time.perf_counter()
                upload_checkpoint(self.store, self.local_root, upload.name)
            except _mirror_errors() as error:
                if not self._retry(upload, error):
                    return
                continue
            logger.info("mirror: uploaded %s to %s in %.2fs", upload.name, self.store, time.perf_counter() - started)
            self.uploaded.append(upload.name)
            with self._cond:
                self._queue.pop(0)
                protected = upload.protected | {job.name for job in self._queue} | {upload.name}
            self._prune(protected)

    def _retry(self, upload: _Upload, error: BaseException) -> bool:
        """After a failed upload: wait and retry, drop it, or stop (past the close deadline). False: the thread ends."""
        upload.attempts += 1
        message = f"{type(error).__name__}: {error}"
        gone = not (self.local_root / upload.name).is_dir()  # pruned locally meanwhile: a newer one supersedes it
        if gone or isinstance(error, CheckpointCorruptError):
            logger.warning("mirror: %s is not uploaded: %s", upload.name, "no longer on local disk" if gone else error)
            with self._cond:
                self._queue.remove(upload)
                if not gone:
                    self._failures.append(MirrorFailure(upload.name, message))
            return True
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (upload.attempts - 1))
        with self._cond:
            if upload.attempts == 1:
                self._failures.append(MirrorFailure(upload.name, f"upload failed, retrying: {message}"))
            if self._deadline is not None and time.monotonic() + delay > self._deadline:
                left = [job.name for job in self._queue]
                logger.error("mirror: giving up on %s after %d attempts: %s", ", ".join(left), upload.attempts, message)
                self._failures.extend(MirrorFailure(name, f"not uploaded: {message}") for name in left)
                self._queue.clear()
                return False
            logger.warning(
                "mirror: uploading %s to %s failed (%s, attempt %d); retrying in %.1fs, training goes on",
                upload.name, self.store, message, upload.attempts, delay,
            )  # fmt: skip
            self._cond.wait(delay)
        return True

    def _prune(self, protected: frozenset[str] | set[str]) -> None:
        if self.keep_latest_k <= 0:
            return
        try:
            prune_mirror(self.store, self.keep_latest_k, protected=set(protected))
        except _mirror_errors() as error:
            logger.warning("mirror: ckpt.keep_latest_k could not prune %s (%s); nothing committed was lost", self.store,
                           error)  # fmt: skip


def mirror_for_run(ckpt: Mapping[str, Any], run_path: Path, run_root: Path | None) -> MirrorUploader | None:
    """The uploader of a run (`ckpt.mirror`, `ckpt.mirror_every`, `ckpt.keep_latest_k`), or None without a mirror.

    The run's checkpoints live at `<ckpt.mirror>/<the run's path in its workspace>/checkpoints/` in the mirror."""
    url = ckpt.get("mirror")
    if not url or not ckpt.get("enabled", True):  # ckpt.enabled=false writes nothing, downloads included
        return None
    relative = run_path.relative_to(run_root) if run_root is not None else Path(run_path.name)
    store = MirrorStore(f"{str(url).rstrip('/')}/{relative.as_posix()}/checkpoints")
    return MirrorUploader(
        store,
        run_path / "checkpoints",
        every=int(ckpt.get("mirror_every") or 1),
        keep_latest_k=int(ckpt.get("keep_latest_k") or 0),
        drain_s=float(ckpt.get("mirror_drain_s", 600.0)),
    )


def _mirror_errors() -> tuple[type[BaseException], ...]:
    """What one upload or prune may fail with and the mirror survives (it retries, or warns)."""
    return (CheckpointError, *store_errors())
