"""Checkpoints mirrored to object storage (`ckpt.mirror`): the store and the upload of one checkpoint (the uploader
that runs beside training: `mirror_upload.py`; reading, restoring and pruning: `mirror_restore.py`).

The local commit protocol (`commit.py`) makes a checkpoint exist on this machine; the mirror makes it outlive the
machine. An object store has no rename, so the mirror has a commit rule of its own: a checkpoint's files are uploaded
first and its `manifest.json` object last, and a checkpoint is in the mirror only when its manifest object exists; a
reader verifies every file against it (`mirror_restore.py`). The pointers (`latest`, `best`) move after the manifest.

The upload runs on a background thread of the training process (rank 0): a save never waits for it. A slow or failing
store is warned about and retried with backoff; a checkpoint that could not be uploaded is recorded like a failed save.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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
# fsspec options per protocol: a request that cannot connect fails within seconds (the uploader retries it).
_STORE_OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}},
    "file": {"auto_mkdir": True},  # a mounted filesystem as the mirror: its directories are made as objects are written
}


@functools.cache
def store_errors() -> tuple[type[BaseException], ...]:
    """What a store raises when it is unreachable, refuses or fails a request: fsspec maps most of it to OSError;
    botocore's and aiohttp's connection errors (s3fs, http stores) come as they are, once the client's own retries are
    spent. Looked up at the first failure, not at import: the clients take a third of a second to import, and a run
    without a mirror never needs them."""
    errors: tuple[type[BaseException], ...] = (OSError,)
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
