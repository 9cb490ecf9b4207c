"""Checkpoints mirrored to object storage (`ckpt.mirror`): the store, and the uploader that runs beside training.

The local commit protocol (`commit.py`) makes a checkpoint exist on this machine; the mirror makes it outlive the
machine. An object store has no rename, so the mirror has a commit rule of its own: a checkpoint's files are uploaded
first and its `manifest.json` object last, and a checkpoint is in the mirror only when its manifest object exists; a
reader verifies every file against it (`mirror_restore.py`). The pointers (`latest`, `best`) move after the manifest.

The upload runs on a background thread of the training process (rank 0): a save never waits for it. A slow or failing
store is warned about and retried with backoff; a checkpoint that could not be uploaded is recorded like a failed save.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from perdure.checkpoints.commit import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    FileRecord,
    hash_file,
    parse_manifest,
    read_pointer,
    write_file,
)
from perdure.config_checks import register_section_check
from perdure.errors import CheckpointCorruptError, CheckpointError, ConfigError
from perdure.safe_io import read_regular, safe_name

logger = logging.getLogger("perdure")

CHUNK = 8 << 20
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 15.0
# fsspec options per protocol: a request that cannot connect fails within seconds (the uploader retries it).
_STORE_OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}},
    "file": {"auto_mkdir": True},  # a mounted filesystem as the mirror: its directories are made as objects are written
}


def _client_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = ()
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += (BotoCoreError, ClientError)
    except ImportError:  # no S3 client installed: its errors cannot happen
        pass
    try:
        from aiohttp import ClientError as HTTPClientError

        errors += (HTTPClientError,)
    except ImportError:
        pass
    return errors


# What a store raises when it is unreachable, refuses or fails a request: fsspec maps most of it to OSError; botocore's
# and aiohttp's connection errors (s3fs, http stores) come as they are, once the client's own retries are spent.
STORE_ERRORS: tuple[type[BaseException], ...] = (OSError, *_client_errors())


def check_mirror_url(key: str, url: Any) -> None:
    """ConfigError unless `url` is None or a URL whose fsspec filesystem is installed (`s3://` needs `perdure[s3]`)."""
    if url is None:
        return
    if not isinstance(url, str) or "://" not in url or url.split("://", 1)[1].strip("/") == "":
        raise ConfigError(key, url, "use an object-store URL with a bucket, e.g. s3://bucket/prefix, or None")
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(key, url, f"fsspec knows no storage {protocol!r}; use s3://bucket/prefix") from None
    except ImportError as error:
        extra = " (pip install 'perdure[s3]')" if protocol in ("s3", "s3a") else ""
        raise ConfigError(key, url, f"the client of {protocol}:// is not installed{extra}: {error}") from None


register_section_check("ckpt.mirror", lambda config, get: check_mirror_url("ckpt.mirror", get("ckpt.mirror")))


def is_safe_key(key: str) -> bool:
    """A relative posix key without `..`, empty or absolute parts, or backslashes: it cannot leave its prefix."""
    parts = PurePosixPath(key).parts
    return bool(key) and key == "/".join(parts) and not key.startswith("/") and ".." not in parts and "\\" not in key


class MirrorStore:
    """The objects under one prefix of an fsspec URL (a run's `checkpoints/` in the mirror); every key is checked."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        protocol = self.url.split("://", 1)[0]
        options = {"skip_instance_cache": True, **_STORE_OPTIONS.get(protocol, {})}
        self.fs, self.base = fsspec.core.url_to_fs(self.url, **options)
        self.base = self.base.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def path(self, key: str) -> str:
        if not is_safe_key(key):
            raise CheckpointError(f"mirror key {safe_name(key)} would leave {self.url}: refused")
        return f"{self.base}/{key}"

    def names(self, key: str = "") -> list[str]:
        """The names of the entries right under `key` (the prefix itself when empty); [] when there are none."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.path(key) if key else self.base, detail=False)
        except FileNotFoundError:
            return []
        return sorted({PurePosixPath(str(entry).rstrip("/")).name for entry in entries})

    def size(self, key: str) -> int | None:
        """The size of object `key`; None when it does not exist."""
        self.fs.invalidate_cache()
        try:
            info = self.fs.info(self.path(key))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def read(self, key: str, limit: int) -> bytes | None:
        """Object `key` (at most `limit` bytes, CheckpointCorruptError beyond); None when it does not exist."""
        size = self.size(key)
        if size is None:
            return None
        if size > limit:
            raise CheckpointCorruptError(f"{self.url}/{key}", f"is {size:,} bytes, more than the {limit:,} allowed")
        try:
            data = self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise CheckpointCorruptError(f"{self.url}/{key}", f"is more than the {limit:,} bytes allowed")
        return data

    def read_pointer(self, pointer: str) -> str | None:
        data = self.read(pointer, MAX_POINTER_BYTES)
        return None if data is None else data.decode("utf-8", errors="replace").strip()

    def write_bytes(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data)

    def upload(self, key: str, local: Path, expected: FileRecord) -> None:
        """Upload the local file to object `key` with the store's own upload (multipart for large files), after
        checking that it is the file the local manifest describes (CheckpointCorruptError otherwise: a local copy that
        rotted is never mirrored)."""
        record = hash_file(local)
        if record != expected:
            raise CheckpointCorruptError(local.parent, f"{local.name}: checksum mismatch in the local copy")
        self.fs.put_file(str(local), self.path(key))

    def download(self, key: str, dest: Path, size: int) -> FileRecord:
        """Write object `key` to the new local file `dest` (fsynced), reading at most `size` + 1 bytes of it."""

        def copy(target: BinaryIO) -> None:
            with self.fs.open(self.path(key), "rb") as source:
                left = size + 1  # one byte more than the manifest says shows an object that grew
                while left > 0 and (chunk := source.read(min(CHUNK, left))):
                    target.write(chunk)
                    left -= len(chunk)

        return write_file(dest, copy)

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(key))

    def remove_tree(self, key: str) -> None:
        self.fs.invalidate_cache()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(key), recursive=True)


def upload_checkpoint(store: MirrorStore, local_root: Path, name: str) -> dict[str, Any]:
    """Upload committed checkpoint `local_root/name`: its files, then its manifest, then `latest` (and `best` when the
    local `best` names it). Returns the manifest. Raises what the store raises, or CheckpointCorruptError."""
    local = local_root / name
    manifest_bytes = read_regular(local / MANIFEST_NAME, MAX_MANIFEST_BYTES)
    manifest = parse_manifest(manifest_bytes, local)
    if manifest["name"] != name:
        raise CheckpointCorruptError(local, f"{MANIFEST_NAME} names {safe_name(manifest['name'])}")
    # A manifest left by an earlier upload of this name must not vouch for the files being replaced under it.
    store.remove(f"{name}/{MANIFEST_NAME}")
    for rel, entry in sorted(manifest["files"].items()):
        store.upload(f"{name}/{rel}", local / rel, FileRecord(entry["size"], entry["digest"]))
    store.write_bytes(f"{name}/{MANIFEST_NAME}", manifest_bytes)
    store.write_bytes("latest", f"{name}\n".encode())
    if read_pointer(local_root, "best") == name:
        store.write_bytes("best", f"{name}\n".encode())
    return manifest


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
            except (CheckpointError, *STORE_ERRORS) as error:
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
        from perdure.checkpoints.mirror_restore import prune_mirror

        if self.keep_latest_k <= 0:
            return
        try:
            prune_mirror(self.store, self.keep_latest_k, protected=set(protected))
        except (CheckpointError, *STORE_ERRORS) as error:
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
