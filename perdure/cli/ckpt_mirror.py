"""`perdure ckpt ls | verify | export | prune` on a run's mirror (`ckpt.mirror`): URL instead of a local path.

    perdure ckpt ls s3://bucket/prefix/LINEAGE-CODE/ID              the run's checkpoints in the mirror
    perdure ckpt verify s3://bucket/prefix/LINEAGE-CODE/ID[/checkpoints/ckpt-s...]
    perdure ckpt export s3://.../ID[/checkpoints/ckpt-s...] OUT.pth  (latest when no checkpoint is named)
    perdure ckpt prune s3://.../ID --keep K [--dry-run]

A checkpoint is in the mirror only when its manifest object is; a name with objects but no manifest is an upload in
flight or one that was interrupted. Nothing is written to the mirror but by `prune`, which never removes the `latest`
or `best` target, nor an upload newer than the newest complete checkpoint (a live run may be writing it).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from perdure.checkpoints.commit import CHECKPOINT_PATTERN, POINTERS
from perdure.checkpoints.mirror import MirrorStore, store_errors
from perdure.checkpoints.mirror_restore import (
    download_checkpoint,
    mirrored_checkpoints,
    prune_mirror,
    verify_mirrored,
)
from perdure.errors import CheckpointCorruptError, CheckpointError, PerdureError
from perdure.safe_io import echo, safe_name
from perdure.wording import human_size


def is_url(location: str | Path) -> bool:
    return isinstance(location, str)


def location(text: str) -> str | Path:
    """An argparse type: a URL (`scheme://...`) stays text, anything else is a local path."""
    return text if "://" in text else Path(text)


def mirror_target(url: str) -> tuple[MirrorStore, str | None]:
    """(the store of a run's `checkpoints/` prefix, the checkpoint named or None) for a run, checkpoints or
    checkpoint URL."""
    url = url.rstrip("/")
    last = PurePosixPath(url.split("://", 1)[1]).name
    name = None
    if CHECKPOINT_PATTERN.match(last) or last in POINTERS:
        url, name = url.rsplit("/", 1)
        last = PurePosixPath(url.split("://", 1)[1]).name
    if last != "checkpoints":
        url = f"{url}/checkpoints"
    try:
        return MirrorStore(url), name
    except (ImportError, ValueError) as error:
        raise PerdureError(f"cannot open {url}: {error} (s3:// needs pip install 'perdure[s3]')") from None


def _resolve_name(store: MirrorStore, name: str | None) -> str:
    if name in POINTERS or name is None:
        pointer = name or "latest"
        target = store.read_pointer(pointer)
        if target is None or not CHECKPOINT_PATTERN.match(target):
            raise CheckpointError(f"{store}/{pointer}: missing or not a checkpoint name ({safe_name(target)})")
        return target
    return name


def mirror_ls(args: argparse.Namespace) -> int:
    store, _ = mirror_target(args.run)
    pointers = {p: store.read_pointer(p) for p in POINTERS}
    echo(f"checkpoints in {store}")
    items = mirrored_checkpoints(store)
    if not items:
        echo("  no checkpoints")
    for item in items:
        marks = ",".join(p for p, target in pointers.items() if target == item.name) or "-"
        if item.manifest is None:
            echo(f"  {item.name}  NOT A CHECKPOINT: {item.error}")
            continue
        try:
            verify_mirrored(store, item.name, deep=not args.quick)
            verified = "sizes ok" if args.quick else "ok"
        except CheckpointCorruptError as error:
            verified = f"FAILED: {error.reason}"
        size = sum(entry["size"] for entry in item.manifest["files"].values())
        step = item.manifest.get("global_step")
        echo(f"  {item.name}  step {step}  {human_size(size)}  {verified}  {marks}")
    return 0


def mirror_verify(args: argparse.Namespace) -> int:
    store, name = mirror_target(args.path)
    deep = not args.quick
    names = [_resolve_name(store, name)] if name else [i.name for i in mirrored_checkpoints(store) if i.manifest]
    failures = 0
    for each in names:
        try:
            manifest = verify_mirrored(store, each, deep=deep)
            files = manifest["files"]
            size = sum(entry["size"] for entry in files.values())
            how = "checksums" if deep else "sizes only"
            echo(f"OK      {store}/{each}  ({len(files)} files, {human_size(size)}, {how})")
        except CheckpointCorruptError as error:
            echo(f"FAILED  {store}/{each}: {error.reason}")
            failures += 1
    if not names:
        echo(f"FAILED  {store}: no complete checkpoint")
        failures += 1
    if name is None:
        for pointer in POINTERS:
            target = store.read_pointer(pointer)
            if target is not None and target not in names:
                echo(f"FAILED  {store}/{pointer}: names {safe_name(target)}, which is no complete checkpoint")
                failures += 1
            elif target is not None:
                echo(f"OK      {pointer} -> {target}")
    return 1 if failures else 0


def mirror_download(url: str, into: Path) -> Path:
    """Download (and verify) the checkpoint a URL names, or the run's latest, under `into/<run id>/checkpoints/`."""
    store, name = mirror_target(url)
    name = _resolve_name(store, name)
    run_id = PurePosixPath(store.url.split("://", 1)[1]).parent.name or "run"
    root = into / run_id / "checkpoints"
    root.mkdir(parents=True)
    return download_checkpoint(store, name, root)


def mirror_export(args: argparse.Namespace, export: Callable[[argparse.Namespace], int]) -> int:
    """`perdure ckpt export URL OUT`: download the checkpoint into a temporary directory, export it from there."""
    with tempfile.TemporaryDirectory(prefix="perdure-export-") as tmp:
        args.checkpoint = on_mirror(lambda: mirror_download(args.checkpoint, Path(tmp)))
        return export(args)


def on_mirror(call: Callable[[], Any]) -> Any:
    """`call()`, with a store's error (unreachable, refused, no such bucket) said as a PerdureError."""
    try:
        return call()
    except store_errors() as error:
        raise PerdureError(f"the mirror could not be read: {type(error).__name__}: {error}") from None


def mirror_prune(args: argparse.Namespace) -> int:
    store, _ = mirror_target(args.run)
    removed = prune_mirror(store, args.keep, protected=set(), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        echo(f"{verb} {store}/{name}")
    kept = [item.name for item in mirrored_checkpoints(store) if item.manifest and item.name not in removed]
    echo(f"kept {len(kept)}: {', '.join(kept) or '-'}")
    return 0
