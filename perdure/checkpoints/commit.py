"""The checkpoint commit protocol: the one place where a checkpoint comes into existence.

Every backend (file, DCP, DeepSpeed) writes into a staging directory made by `make_staging_dir`, then calls
`commit_checkpoint`, which fsyncs every file, writes `manifest.json` last, fsyncs, renames the directory into place
and fsyncs the parent. Only after that may the `latest` / `best` pointers move (`write_pointer`). A directory whose
manifest does not verify (`verify_checkpoint`) is not a checkpoint; `quarantine` moves such a directory aside and
never deletes anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import xxhash

from perdure.atomic import RecordingWriter, fsync_dir, naming_os_error
from perdure.atomic import atomic_write_text as atomic_write_text  # re-exported: the one atomic write
from perdure.errors import CheckpointCorruptError, CheckpointError
from perdure.safe_io import (
    UnsafeFileError,
    ensure_dir,
    escape_terminal,
    is_symlink,
    kind_of,
    loads_json,
    open_regular,
    read_json,
    read_regular,
    safe_name,
)

HASH_ALGORITHM = "xxh3_128"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "perdure-checkpoint/1"
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(?:s(?P<step>\d{12,})|e(?P<epoch>\d{6,}))$")
STAGING_PREFIX = ".tmp-"
QUARANTINE_DIR = "quarantine"
POINTERS = ("latest", "best")
_RESERVED_KEYS = ("format", "name", "created", "hash", "files")


@dataclass(frozen=True)
class FileRecord:
    """Size in bytes and `HASH_ALGORITHM` hex digest of one file in a checkpoint."""

    size: int
    digest: str


class HashingWriter(RecordingWriter):
    """Binary file wrapper that hashes and counts every byte on its way to disk (works with `torch.save`)."""

    def __init__(self, file: BinaryIO):
        super().__init__(file)
        self._hasher = xxhash.xxh3_128()

    def accepted(self, data: memoryview) -> None:
        """Hash exactly the bytes the file accepted."""
        self._hasher.update(data)

    def record(self) -> FileRecord:
        """Size and digest of everything written so far."""
        return FileRecord(self.tell(), self._hasher.hexdigest())


def checkpoint_name(*, step: int | None = None, epoch: int | None = None) -> str:
    """Directory name of a checkpoint: `ckpt-s{step:012d}` or `ckpt-e{epoch:06d}`; give exactly one of them."""
    if (step is None) == (epoch is None):
        raise ValueError(f"checkpoint_name needs exactly one of step / epoch, got step={step!r} epoch={epoch!r}")
    value = step if step is not None else epoch
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"checkpoint step / epoch must be a non-negative int, got {value!r}")
    return f"ckpt-s{step:012d}" if step is not None else f"ckpt-e{epoch:06d}"


def write_file(path: Path, write: Callable[[BinaryIO], object]) -> FileRecord:
    """Create `path` (never overwrites), let `write(fileobj)` fill it, fsync it; return its size and digest.

    The digest is computed while writing, so the file is never read back. A partial file is removed on failure; an
    I/O failure is raised as an `OSError` naming `path`, whatever the writing library made of it.
    """
    path = Path(path)
    with open(path, "xb") as file:
        writer = HashingWriter(file)
        try:
            write(writer)  # type: ignore[arg-type]
            file.flush()
            os.fsync(file.fileno())
        except BaseException as error:
            with contextlib.suppress(OSError):
                file.close()  # a full disk fails the close's flush too
            path.unlink(missing_ok=True)
            named = naming_os_error(error, writer.error, path)
            if named is not None:
                raise named from error
            raise
    return writer.record()


def hash_file(path: Path, chunk: int = 8 << 20) -> FileRecord:
    """Size and digest of an existing regular file (never a FIFO or a symlink), read in `chunk`-byte pieces."""
    hasher, size = xxhash.xxh3_128(), 0
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    with os.fdopen(open_regular(path), "rb", buffering=0) as file:
        while n := file.readinto(buffer):
            hasher.update(view[:n])
            size += n
    return FileRecord(size, hasher.hexdigest())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_staging_dir(root: Path, name: str) -> Path:
    """Create a fresh staging directory `root/.tmp-<name>-<pid>-<random>` (and `root` if needed)."""
    root = ensure_dir(root)
    staging = root / f"{STAGING_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    return staging


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def _is_safe_relpath(rel: str) -> bool:
    pure = PurePosixPath(rel)
    return bool(rel) and not pure.is_absolute() and ".." not in pure.parts and "\\" not in rel and rel == str(pure)


def commit_checkpoint(
    staging: Path, final: Path, files: Mapping[str, FileRecord], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """Turn a fully written staging directory into the committed checkpoint `final`; return its manifest.

    `files` maps the relative posix path of every file in `staging` (written by any rank) to its record. Refuses
    (CheckpointError) when `final` exists, is not a checkpoint name or not a sibling of `staging`, or when a listed
    file is missing / has another size, or when `staging` holds a file that is not listed (it could not be verified).
    Every listed file and directory is fsynced, `manifest.json` is written last, then the directory is renamed into
    place and the parent fsynced. Pointers are the caller's job, after this returns.
    """
    staging, final = Path(staging), Path(final)
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists; committed checkpoints are immutable")
    if not CHECKPOINT_PATTERN.match(final.name):
        raise CheckpointError(f"{final.name!r} is not a checkpoint name; use checkpoint_name(step=...|epoch=...)")
    if staging.resolve().parent != final.resolve().parent:
        raise CheckpointError(f"staging dir {staging} must be a sibling of {final} (the commit is a rename)")
    if clash := [k for k in _RESERVED_KEYS if k in meta]:
        raise CheckpointError(f"manifest metadata may not set {clash}: commit_checkpoint owns those keys")
    if (staging / MANIFEST_NAME).exists() or MANIFEST_NAME in files:
        raise CheckpointError(f"{staging}: {MANIFEST_NAME} is written by commit_checkpoint, not by the backend")

    for rel, record in files.items():
        if not _is_safe_relpath(rel):
            raise CheckpointError(f"{staging}: file key {rel!r} must be a relative posix path inside the checkpoint")
        path = staging / rel
        if not path.is_file():
            raise CheckpointError(f"{staging}: {rel} is listed but missing")
        if (size := path.stat().st_size) != record.size:
            raise CheckpointError(f"{staging}: {rel}: size {size} != {record.size} recorded when it was written")
    on_disk = {(Path(d) / f).relative_to(staging).as_posix() for d, _, names in os.walk(staging) for f in names}
    if unlisted := sorted(on_disk - set(files)):
        raise CheckpointError(f"{staging}: files not listed for the manifest (they could not be verified): {unlisted}")

    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "name": final.name,
        "created": _utc_now().isoformat(timespec="milliseconds"),
        "hash": HASH_ALGORITHM,
        **meta,
        "files": {rel: {"size": r.size, "digest": r.digest} for rel, r in sorted(files.items())},
    }
    text = json.dumps(manifest, indent=2) + "\n"  # serialise before touching the disk: bad meta leaves no manifest

    # Files written by other ranks or by a library (DCP, DeepSpeed) may not have been fsynced; fsync of an already
    # clean file costs next to nothing.
    for rel in files:
        _fsync_file(staging / rel)
    write_file(staging / MANIFEST_NAME, lambda f: f.write(text.encode("utf-8")))
    for directory, _, _ in os.walk(staging, topdown=False):
        fsync_dir(Path(directory))
    os.rename(staging, final)
    fsync_dir(final.parent)
    return manifest


def write_pointer(root: Path, pointer: str, target_name: str) -> None:
    """Atomically point `root/<pointer>` (`latest` or `best`) at the committed checkpoint `target_name`."""
    if pointer not in POINTERS:
        raise ValueError(f"pointer must be one of {POINTERS}, got {pointer!r}")
    if not CHECKPOINT_PATTERN.match(target_name):
        raise ValueError(f"pointer target must be a checkpoint directory name, got {target_name!r}")
    atomic_write_text(Path(root) / pointer, target_name + "\n")


MAX_POINTER_BYTES = 4096


def read_pointer(root: Path, pointer: str) -> str | None:
    """Content of `root/<pointer>`, stripped; None if the file is missing. Never raises: garbage is returned as is
    (show it with `safe_name`). Only a regular file is read (a symlink or a FIFO is reported as unreadable, never
    followed or waited on), and at most `MAX_POINTER_BYTES` of it."""
    try:
        return read_regular(Path(root) / pointer, MAX_POINTER_BYTES).decode("utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except UnsafeFileError as exc:
        return f"<unreadable: {exc.reason.split(';')[0]}>"
    except OSError as exc:
        return f"<unreadable: {exc.strerror or exc}>"


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """Parse and structurally check `ckpt_dir/manifest.json`; CheckpointCorruptError says what is wrong."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / MANIFEST_NAME
    try:
        manifest = read_json(path, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} missing") from None
    except UnsafeFileError as exc:
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} {exc.reason}") from None
    except OSError as exc:
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} unreadable: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, nested too deeply
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} is not valid JSON: {exc}") from None
    return check_manifest(manifest, ckpt_dir)


def parse_manifest(data: bytes, where: object) -> dict[str, Any]:
    """`read_manifest` for manifest bytes read from elsewhere (a mirror's object): bounded, then checked alike."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(where, f"{MANIFEST_NAME} is larger than {MAX_MANIFEST_BYTES:,} bytes")
    try:
        manifest = loads_json(data)
    except ValueError as exc:
        raise CheckpointCorruptError(where, f"{MANIFEST_NAME} is not valid JSON: {exc}") from None
    return check_manifest(manifest, where)


def check_manifest(manifest: Any, ckpt_dir: object) -> dict[str, Any]:
    """The structural checks of a parsed manifest (format, fields and their types, safe file keys)."""
    if not isinstance(manifest, dict):
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} is not a JSON object")
    if (fmt := manifest.get("format")) != MANIFEST_FORMAT:
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} format {safe_name(fmt)}, expected {MANIFEST_FORMAT!r}")
    if missing := [k for k in _RESERVED_KEYS if k not in manifest]:
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} lacks field(s) {missing}")
    if manifest["hash"] != HASH_ALGORITHM:
        raise CheckpointCorruptError(
            ckpt_dir, f"{MANIFEST_NAME} uses hash {safe_name(manifest['hash'])}, not {HASH_ALGORITHM}"
        )
    for key, kinds in _MANIFEST_FIELDS.items():
        value = manifest.get(key)
        if (value is not None or key == "name") and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} field '{key}' has the wrong type")
    states = manifest.get("states")
    if states is not None and (
        len(states) > MAX_STATE_NAMES or not all(isinstance(name, str) and 0 < len(name) <= 64 for name in states)
    ):
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} field 'states' is not a list of names")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} 'files' is not an object")
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        ok = isinstance(size, int) and not isinstance(size, bool) and size >= 0 and isinstance(entry.get("digest"), str)
        if not ok or not _is_safe_relpath(rel):
            raise CheckpointCorruptError(ckpt_dir, f"{MANIFEST_NAME} has a malformed entry for {safe_name(rel)}")
    return manifest


MAX_MANIFEST_BYTES = 64 << 20
# Fields perdure's readers use, with their types (absent or null is fine but for `name`).
_MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "created": (str,),
    "global_step": (int,),
    "epoch": (int,),
    "samples_in_epoch": (int,),
    "world_size": (int,),
    "backend": (str,),
    "config_id": (str,),
    "code_id": (str,),
    "reason": (str,),
    "score": (int, float),
    "states": (list,),
}
MAX_STATE_NAMES = 1024


def verify_checkpoint(ckpt_dir: Path, *, deep: bool = True, check_name: bool = True) -> dict[str, Any]:
    """Check that `ckpt_dir` is exactly what its manifest describes; return the manifest.

    Every listed file must exist with its listed size; `deep` also re-hashes each file. With `check_name` the
    manifest's name must equal the directory name (a renamed checkpoint would break the step order). Raises
    CheckpointCorruptError whose reason names the file, e.g. "state.pth: checksum mismatch".
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointCorruptError(ckpt_dir, "not a directory" if ckpt_dir.exists() else "does not exist")
    manifest = read_manifest(ckpt_dir)
    if check_name and manifest["name"] != ckpt_dir.name:
        raise CheckpointCorruptError(
            ckpt_dir, f"{MANIFEST_NAME} names {safe_name(manifest['name'])}, not {ckpt_dir.name!r}"
        )
    files: dict[str, dict[str, Any]] = manifest["files"]
    for rel, entry in files.items():  # all sizes first: cheap, and catches truncation before any hashing
        shown = escape_terminal(rel)
        try:
            info = os.lstat(ckpt_dir / rel)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointCorruptError(ckpt_dir, f"{shown} missing") from None
        if not stat.S_ISREG(info.st_mode):  # a symlink (perdure never writes one), a FIFO, a directory
            raise CheckpointCorruptError(ckpt_dir, f"{shown} is {kind_of(info.st_mode)}, not a regular file")
        if (size := info.st_size) != entry["size"]:
            raise CheckpointCorruptError(ckpt_dir, f"{shown}: size {size} != {entry['size']} in manifest")
    if deep:
        for rel, entry in files.items():
            try:
                record = hash_file(ckpt_dir / rel)
            except OSError as exc:
                raise CheckpointCorruptError(ckpt_dir, f"{escape_terminal(rel)}: unreadable: {exc}") from None
            if record.digest != entry["digest"] or record.size != entry["size"]:
                raise CheckpointCorruptError(ckpt_dir, f"{escape_terminal(rel)}: checksum mismatch")
    return manifest


def quarantine(ckpt_dir: Path, reason: str) -> Path:
    """Move `ckpt_dir` to `<root>/quarantine/<name>-<UTC time>` with a REASON.txt inside; return the new path.

    Nothing is deleted: the user can inspect the directory and move it back. Leading dots are dropped from the new
    name so that quarantined staging directories (`.tmp-*`) are visible.
    """
    ckpt_dir = Path(ckpt_dir)
    now = _utc_now()
    qroot = ensure_dir(ckpt_dir.parent / QUARANTINE_DIR, parents=False)  # a symlink there is refused (an OSError)
    base = f"{ckpt_dir.name.lstrip('.')}-{now.strftime('%Y%m%dT%H%M%SZ')}"
    dest, n = qroot / base, 0
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = qroot / f"{base}-{n}"
    os.rename(ckpt_dir, dest)
    fsync_dir(qroot)
    fsync_dir(ckpt_dir.parent)

    text = (
        f"quarantined: {now.isoformat(timespec='seconds')}\n"
        f"original path: {ckpt_dir}\n"
        f"reason: {reason}\n"
        "perdure never deletes a quarantined checkpoint: inspect it, then delete it or move it back yourself.\n"
    )
    if dest.is_dir() and not is_symlink(dest):  # a quarantined symlink gets its note beside it, never inside
        note, n = dest / "REASON.txt", 0
        while os.path.lexists(note):  # never overwrite (or write through) anything that came with the directory
            n += 1
            note = dest / f"REASON-{n}.txt"
    else:
        note, n = dest.with_name(dest.name + ".REASON.txt"), 0
        while os.path.lexists(note):
            n += 1
            note = dest.with_name(f"{dest.name}.REASON-{n}.txt")
    write_file(note, lambda f: f.write(text.encode("utf-8")))
    fsync_dir(note.parent)
    return dest
