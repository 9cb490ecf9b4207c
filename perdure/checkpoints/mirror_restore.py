"""Reading a run's mirror (`mirror.py`): the checkpoints it holds, the newest that verifies brought back to local
disk, and `ckpt.keep_latest_k` applied to it.

Everything read from the mirror may come from someone else: a manifest is parsed and checked like a local one (bounded
size, safe file keys), every object is downloaded into a local staging directory with its size bounded by the manifest
and its checksum compared, and only then committed locally (manifest last, rename into place).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure.checkpoints.commit import (
    CHECKPOINT_PATTERN,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    fsync_dir,
    make_staging_dir,
    parse_manifest,
    write_file,
    write_pointer,
)
from perdure.checkpoints.mirror import MirrorStore, store_errors
from perdure.errors import CheckpointCorruptError, CheckpointError
from perdure.safe_io import ensure_dir, escape_terminal

logger = logging.getLogger("perdure")


@dataclass(frozen=True)
class Mirrored:
    """One checkpoint name in the mirror; `manifest` is None when it is no checkpoint there (`error` says why)."""

    name: str
    manifest: dict[str, Any] | None
    error: str | None

    @property
    def order(self) -> tuple[int, str]:
        match = CHECKPOINT_PATTERN.match(self.name)
        step = match["step"] if match else None
        if step is None and self.manifest is not None:
            step = self.manifest.get("global_step")
        return (int(step) if step is not None else -1, self.name)


def read_mirrored(store: MirrorStore, name: str) -> tuple[dict[str, Any], bytes]:
    """The checked manifest of checkpoint `name` in the mirror, and its bytes; CheckpointCorruptError otherwise."""
    where = f"{store}/{name}"
    data = store.read(f"{name}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    if data is None:
        raise CheckpointCorruptError(where, f"no {MANIFEST_NAME} object: an upload that did not finish")
    manifest = parse_manifest(data, where)
    if manifest["name"] != name:
        raise CheckpointCorruptError(where, f"{MANIFEST_NAME} names {escape_terminal(manifest['name'])!r}")
    if MANIFEST_NAME in manifest["files"]:
        raise CheckpointCorruptError(where, f"{MANIFEST_NAME} lists itself")
    return manifest, data


def mirrored_checkpoints(store: MirrorStore) -> list[Mirrored]:
    """Every checkpoint name under the store's prefix, newest first, with its manifest when it has a valid one."""
    found = []
    for name in store.names():
        if not CHECKPOINT_PATTERN.match(name):
            continue
        try:
            found.append(Mirrored(name, read_mirrored(store, name)[0], None))
        except CheckpointCorruptError as error:
            found.append(Mirrored(name, None, error.reason))
    return sorted(found, key=lambda item: item.order, reverse=True)


def verify_mirrored(store: MirrorStore, name: str, *, deep: bool = True) -> dict[str, Any]:
    """Check checkpoint `name` in the mirror against its manifest: every object's size, and with `deep` its checksum
    (each object is read once, into memory one chunk at a time). Returns the manifest; CheckpointCorruptError."""
    import xxhash

    manifest, _ = read_mirrored(store, name)
    where = f"{store}/{name}"
    for rel, entry in sorted(manifest["files"].items()):
        _check_size(store, name, rel, entry["size"])
        if deep:
            hasher, size = xxhash.xxh3_128(), 0
            with store.fs.open(store.path(f"{name}/{rel}"), "rb") as source:
                while size <= entry["size"] and (chunk := source.read(8 << 20)):
                    hasher.update(chunk)
                    size += len(chunk)
            if size != entry["size"] or hasher.hexdigest() != entry["digest"]:
                raise CheckpointCorruptError(where, f"{escape_terminal(rel)}: checksum mismatch")
    return manifest


def _check_size(store: MirrorStore, name: str, rel: str, expected: int) -> None:
    size = store.size(f"{name}/{rel}")
    if size is None:
        raise CheckpointCorruptError(f"{store}/{name}", f"{escape_terminal(rel)} missing")
    if size != expected:
        raise CheckpointCorruptError(
            f"{store}/{name}", f"{escape_terminal(rel)}: size {size} != {expected} in manifest"
        )


def download_checkpoint(store: MirrorStore, name: str, root: Path) -> Path:
    """Download checkpoint `name` into `root/name`, verifying each object while it is written, committing it like a
    local save (staging directory, manifest last, fsync, rename). CheckpointCorruptError when an object does not match
    the manifest (nothing is left behind); a store's error as it comes."""
    manifest, data = read_mirrored(store, name)
    final = Path(root) / name
    if final.exists():
        raise CheckpointError(f"{final} exists already (and did not verify): move it aside to fetch the mirror's copy")
    staging = make_staging_dir(root, name)
    try:
        for rel, entry in sorted(manifest["files"].items()):
            _check_size(store, name, rel, entry["size"])
            dest = staging / rel
            ensure_dir(dest.parent)
            record = store.download(f"{name}/{rel}", dest, entry["size"])
            if record.size != entry["size"] or record.digest != entry["digest"]:
                raise CheckpointCorruptError(f"{store}/{name}", f"{escape_terminal(rel)}: checksum mismatch")
        write_file(staging / MANIFEST_NAME, lambda file: file.write(data))
        for directory, _, _ in os.walk(staging, topdown=False):
            fsync_dir(Path(directory))
        # A whole directory, committed as commit.py commits a local save: not a small file, so not perdure/atomic.py.
        os.rename(staging, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def restore_newest(store: MirrorStore, root: Path, local: tuple[int, str] | None = None) -> str | None:
    """Bring the newest checkpoint of the mirror that verifies into `root` when it is newer than `local` (the (step,
    name) of the newest local checkpoint that verifies, None when there is none), and point `latest` at it; a partial
    upload or a corrupt object is skipped with a warning. Returns its name, or None.

    A store that cannot be read stops a launch that has no local checkpoint (CheckpointError): starting over at step 0
    could lose the run; with a local checkpoint it is a warning, and the run continues from that one."""
    try:
        candidates = mirrored_checkpoints(store)
        for item in candidates:
            if local is not None and item.order <= local:
                return None
            if item.manifest is None:
                logger.warning("MIRROR: %s/%s is no checkpoint (%s): skipped", store, item.name, item.error)
                continue
            if (Path(root) / item.name).exists():
                logger.warning("MIRROR: %s is on local disk but does not verify: not replaced, skipped", item.name)
                continue
            try:
                download_checkpoint(store, item.name, ensure_dir(root))
            except CheckpointCorruptError as error:
                logger.warning("MIRROR PROBLEM: %s failed verification (%s): skipped, trying the next older one",
                               error.path, error.reason)  # fmt: skip
                continue
            write_pointer(Path(root), "latest", item.name)
            why = "no usable local checkpoint" if local is None else f"newer than {local[1]} on this disk"
            logger.warning("%s: %s fetched from the mirror %s and verified", why, item.name, store)
            return item.name
    except store_errors() as error:
        if local is not None:
            logger.warning("the mirror %s could not be read (%s: %s): continuing from %s on this disk", store,
                           type(error).__name__, error, local[1])  # fmt: skip
            return None
        raise CheckpointError(
            f"the mirror {store} could not be read ({type(error).__name__}: {error}), and no local checkpoint "
            "verifies: not starting over at step 0. Check the store's endpoint and credentials (AWS_ENDPOINT_URL, "
            "AWS_ACCESS_KEY_ID, ...) and launch again, or drop --ckpt.mirror to start from scratch"
        ) from None
    return None


def prune_mirror(store: MirrorStore, keep: int, *, protected: set[str], dry_run: bool = False) -> list[str]:
    """Apply `keep_latest_k` to the mirror: keep the `keep` newest complete checkpoints plus `protected`, the mirror's
    `latest` and `best`; remove the others (manifest object first, so none is ever half a checkpoint) and partial
    uploads older than the newest complete one. Returns the names removed (to be removed, with `dry_run`)."""
    items = mirrored_checkpoints(store)
    pointed = (store.read_pointer("latest"), store.read_pointer("best"))
    protected = protected | {name for name in pointed if name is not None}
    complete = [item for item in items if item.manifest is not None]
    doomed = [item.name for item in complete[keep:] if item.name not in protected]
    if complete:
        newest = complete[0].order
        doomed += [item.name for item in items if item.manifest is None and item.order < newest]
        doomed = [name for name in doomed if name not in protected]
    if not dry_run:
        for name in doomed:
            store.remove(f"{name}/{MANIFEST_NAME}")
            store.remove_tree(name)
    return doomed
