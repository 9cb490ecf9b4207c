"""`perdure ckpt`: list, verify, export and prune the checkpoints of a run.

    perdure ckpt ls RUN                       every committed checkpoint, newest first, with its verification
    perdure ckpt verify RUN|CKPT              exit 1 if any checkpoint or pointer fails; says which file and how
                                              (also a .safetensors file or a save_pretrained directory)
    perdure ckpt export CKPT OUT.pth|OUT.safetensors [--dtype bf16] [--ema]
                                              CKPT may also be a weights file (.pth, .safetensors) or a
                                              save_pretrained directory (see checkpoints/read.py)
    perdure ckpt export CKPT OUT_DIR --format hf    a directory transformers' from_pretrained loads
    perdure ckpt prune RUN --keep K [--dry-run]

RUN is a run directory or its `checkpoints/` directory, or the run's URL in its mirror (`ckpt.mirror`; see
`perdure/cli/ckpt_mirror.py`). Only `prune` writes, and only while it holds the run's lock
(`perdure.resilience.run_lock`), so it never races a live run's saves. `ls`, `verify` and `export` never write into a
run: they do not quarantine or repair anything (the next start of the run does that).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.commit import (
    CHECKPOINT_PATTERN,
    MANIFEST_NAME,
    POINTERS,
    QUARANTINE_DIR,
    STAGING_PREFIX,
    fsync_dir,
    read_manifest,
    read_pointer,
    verify_checkpoint,
)
from perdure.checkpoints.hf_export import HF_META, read_hf_meta, write_hf_dir
from perdure.checkpoints.hf_read import hf_dir_files, is_hf_dir, is_hf_source
from perdure.checkpoints.read import (
    WeightsLocation,
    checkpoint_backends,
    checkpoint_format,
    locate_weights,
    read_located,
    read_weights,
    weight_files,
)
from perdure.checkpoints.resolve import committed_checkpoints
from perdure.checkpoints.retire import leftovers, remove_leftover, retire
from perdure.cli.ckpt_mirror import is_url, location, mirror_export, mirror_ls, mirror_prune, mirror_verify, on_mirror
from perdure.errors import CheckpointCorruptError, CheckpointError, PerdureError
from perdure.resilience.run_lock import RunLock
from perdure.runners.export import EXPORT_DTYPES, cast_weights, export_weights, save_safetensors
from perdure.safe_io import echo, escape_terminal, read_regular, safe_name
from perdure.wording import human_size

EXPORT_SUFFIXES = (".pth", ".safetensors")
RUN_DIR_MARKERS = ("checkpoints", "metadata", "run.lock")  # what a run dir holds (checkpoints/ may not exist yet)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `perdure ckpt` and its subcommands; each sets `handler(args) -> exit code`."""
    parser = subparsers.add_parser(
        "ckpt",
        help="list, verify, export and prune checkpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="ckpt_command", required=True)

    ls = commands.add_parser("ls", help="list a run's checkpoints, newest first")
    ls.add_argument("run", type=location, help="run dir or its checkpoints dir, or the run's mirror URL (s3://...)")
    ls.add_argument("--quick", action="store_true", help="verify sizes only (skip re-hashing every file)")
    ls.set_defaults(handler=cmd_ls)

    verify = commands.add_parser("verify", help="verify one checkpoint, or every checkpoint and pointer of a run")
    verify.add_argument("path", type=location, help="checkpoint dir, run dir or checkpoints dir, or a mirror URL")
    verify.add_argument("--quick", action="store_true", help="verify sizes only (skip re-hashing every file)")
    verify.set_defaults(handler=cmd_verify)

    export = commands.add_parser("export", help="write model (or EMA) weights only, as .pth or .safetensors")
    export.add_argument(
        "checkpoint",
        type=location,
        help="checkpoint dir, a run / checkpoints dir (its latest), or RUN/best, RUN/latest; any backend; or the same "
        "in a mirror (s3://...)",
    )
    export.add_argument("out", type=Path, help="output file (.pth or .safetensors), or directory with --format hf")
    export.add_argument(
        "--format",
        choices=("pth", "safetensors", "hf"),
        help="output format (default: from OUT's suffix); hf: a save_pretrained directory",
    )
    export.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="cast floating-point tensors")
    export.add_argument("--ema", action="store_true", help="export the EMA weights instead of the model's")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    export.set_defaults(handler=cmd_export)

    prune = commands.add_parser("prune", help="delete all but the newest K checkpoints (never latest or best)")
    prune.add_argument("run", type=location, help="run dir or its checkpoints dir, or the run's mirror URL")
    prune.add_argument("--keep", type=int, required=True, metavar="K", help="how many verifying checkpoints to keep")
    prune.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    prune.add_argument("--quick", action="store_true", help="verify sizes only (skip re-hashing every file)")
    prune.set_defaults(handler=cmd_prune)


# ---- locating checkpoints ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """One committed checkpoint directory and what verifying it found."""

    path: Path
    manifest: dict[str, Any] | None  # also read for a failed one, when it parses; None when it does not
    error: str | None  # CheckpointCorruptError.reason when it failed

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def name(self) -> str:
        return self.path.name


def is_checkpoint_dir(path: Path) -> bool:
    """A directory that claims to be one checkpoint: named `ckpt-*`, or holding a manifest (a renamed copy)."""
    return path.is_dir() and (bool(CHECKPOINT_PATTERN.match(path.name)) or (path / MANIFEST_NAME).exists())


def checkpoints_root(path: Path) -> tuple[Path, Path | None]:
    """(checkpoints dir, run dir or None) for a user-given run dir or checkpoints dir; PerdureError otherwise."""
    path = path.expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; give a run dir or its checkpoints/ dir")
    if is_checkpoint_dir(path):
        raise CheckpointError(
            f"{path} is one checkpoint; give its run dir or checkpoints dir ({path.parent}), "
            "or use `perdure ckpt verify` / `export` on the checkpoint itself"
        )
    if any((path / marker).exists() for marker in RUN_DIR_MARKERS):
        return path / "checkpoints", path
    names = [p.name for p in path.iterdir()]
    markers = any(CHECKPOINT_PATTERN.match(n) or n.startswith(STAGING_PREFIX) for n in names)
    if path.name == "checkpoints" or markers or any(n in (*POINTERS, QUARANTINE_DIR) for n in names):
        return path, (path.parent if path.name == "checkpoints" else None)
    raise CheckpointError(
        f"{path} is not a run: found no checkpoints/ subdir (a run dir), no ckpt-* dirs and no `latest` pointer "
        "(a checkpoints dir)"
    )


def check(path: Path, *, deep: bool, check_name: bool = True) -> Checked:
    """Verify one checkpoint dir without raising."""
    try:
        return Checked(path, verify_checkpoint(path, deep=deep, check_name=check_name), None)
    except CheckpointCorruptError as exc:
        try:
            manifest = read_manifest(path)  # for display only: step, epoch, created
        except CheckpointCorruptError:
            manifest = None
        return Checked(path, manifest, exc.reason)


def check_all(root: Path, *, deep: bool) -> list[Checked]:
    """Every committed checkpoint in `root`, newest first, verified."""
    return [check(path, deep=deep) for path in committed_checkpoints(root)]


def pointer_targets(root: Path) -> dict[str, str]:
    """{pointer: what it holds} for the pointers present in `root`."""
    return {p: value for p in POINTERS if (value := read_pointer(root, p)) is not None}


# ---- formatting ----------------------------------------------------------------------------------------------------


def tree_size(path: Path) -> int:
    """Bytes in the regular files under `path` (symlinks not followed)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for directory, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    return total


def local_time(created: object) -> str:
    """The manifest's ISO `created` time in the local timezone, to the second ('-' if absent or unparsable)."""
    try:
        return datetime.fromisoformat(str(created)).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return "-"


def table(rows: list[list[str]], right: frozenset[int] = frozenset()) -> str:
    """Left-aligned columns (right-aligned where listed), two spaces apart; control characters escaped."""
    rows = [[escape_terminal(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _position(checked: Checked) -> tuple[str, str]:
    """(step, epoch) as text, from the manifest, else from the directory name."""
    manifest = checked.manifest or {}
    match = CHECKPOINT_PATTERN.match(checked.name)
    step = manifest.get("global_step", int(match["step"]) if match and match["step"] else None)
    epoch = manifest.get("epoch", int(match["epoch"]) if match and match["epoch"] else None)
    return ("-" if step is None else str(step)), ("-" if epoch is None else str(epoch))


def _quarantine_reason(entry: Path) -> str:
    """The `reason:` line of a quarantined entry's REASON.txt (else its first line), or '' if there is none."""
    note = (
        entry / "REASON.txt"
        if entry.is_dir() and not entry.is_symlink()
        else entry.with_name(entry.name + ".REASON.txt")
    )
    try:
        text = read_regular(note, 64 << 10).decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line.removeprefix("reason:").strip() for line in lines if line.startswith("reason:")]
    return (reasons or lines or [""])[0]


# ---- ls ------------------------------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    """Print a table of the run's committed checkpoints, then quarantined entries and leftover staging dirs."""
    if is_url(args.run):
        return on_mirror(lambda: mirror_ls(args))
    root, _ = checkpoints_root(args.run)
    checked = check_all(root, deep=not args.quick)
    pointers = pointer_targets(root)
    echo(f"checkpoints in {root}")
    if checked:
        rows = [["NAME", "STEP", "EPOCH", "CREATED", "SIZE", "VERIFIED", "POINTERS"]]
        for item in checked:
            step, epoch = _position(item)
            verified = "FAILED" if not item.ok else "sizes ok" if args.quick else "ok"
            marks = ",".join(p for p, target in pointers.items() if target == item.name)
            created = local_time((item.manifest or {}).get("created"))
            rows.append([item.name, step, epoch, created, human_size(tree_size(item.path)), verified, marks or "-"])
        echo(table(rows, right=frozenset({1, 2, 4})))
        for item in checked:
            if not item.ok:
                echo(f"  {item.name} FAILED: {item.error}")
    else:
        echo("  no committed checkpoints")
    names = {item.name for item in checked}
    for pointer, target in pointers.items():
        if target not in names:
            echo(f"pointer {pointer} names {safe_name(target)}, which is not a committed checkpoint here")
    for link in sorted(p for p in root.iterdir() if CHECKPOINT_PATTERN.match(p.name) and p.is_symlink()):
        echo(f"ignored {link.name}: a symlink, not a checkpoint (perdure never follows one in a checkpoints dir)")

    quarantine = root / QUARANTINE_DIR
    entries = (
        sorted(p for p in quarantine.iterdir() if not p.name.endswith(".REASON.txt"))
        if quarantine.is_dir() and not quarantine.is_symlink()
        else []
    )
    if entries:
        echo(f"quarantined ({quarantine}; perdure never deletes these):")
        echo(table([[f"  {p.name}", human_size(tree_size(p)), _quarantine_reason(p) or "-"] for p in entries]))
    others = sorted(root.iterdir()) if root.is_dir() else []
    staging = [p for p in others if p.name.startswith(STAGING_PREFIX)]
    if staging:
        echo("staging dirs (a save in flight if the run is live, else an interrupted one the next start quarantines):")
        echo(table([[f"  {p.name}", human_size(tree_size(p))] for p in staging]))
    ours, foreign = leftovers(root) if root.is_dir() else ([], [])
    if ours:
        echo("leftovers of an interrupted prune (removed by the next prune):")
        echo(table([[f"  {p.name}", human_size(tree_size(p))] for p in ours]))
    if foreign:
        echo("not perdure's (named like a prune leftover, but never marked by one; prune leaves them alone):")
        echo(table([[f"  {p.name}", human_size(tree_size(p))] for p in foreign]))
    return 0


# ---- verify --------------------------------------------------------------------------------------------------------


def _ok_line(item: Checked, deep: bool) -> str:
    files = (item.manifest or {}).get("files", {})
    size = sum(entry["size"] for entry in files.values())
    how = "checksums" if deep else "sizes only"
    return f"OK      {item.path}  ({len(files)} files, {human_size(size)}, {how})"


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify one checkpoint, or every checkpoint and pointer of a run; 1 if anything fails."""
    if is_url(args.path):
        return on_mirror(lambda: mirror_verify(args))
    path, deep = args.path.expanduser(), not args.quick
    if is_checkpoint_dir(path):
        item = check(path, deep=deep, check_name=bool(CHECKPOINT_PATTERN.match(path.name)))
        echo(_ok_line(item, deep) if item.ok else f"FAILED  {item.path}: {item.error}")
        return 0 if item.ok else 1

    if is_hf_dir(path) or (path.is_file() and path.suffix == ".safetensors"):
        return _verify_weights(path)
    root, _ = checkpoints_root(path)
    checked = check_all(root, deep=deep)
    failures = 0
    for item in checked:
        echo(_ok_line(item, deep) if item.ok else f"FAILED  {item.path}: {item.error}")
        failures += not item.ok
    if not checked:
        echo(f"FAILED  {root}: no committed checkpoint")
        failures += 1

    by_name = {item.name: item for item in checked}
    newest_ok = next((item.name for item in checked if item.ok), None)
    pointers = pointer_targets(root)
    if "latest" not in pointers and checked:
        echo(f"WARNING latest: missing; the next start points it at the newest checkpoint that verifies ({newest_ok})")
    for pointer, target in pointers.items():
        problem = None
        if not CHECKPOINT_PATTERN.match(target):
            problem = f"holds {safe_name(target)}, which is not a checkpoint name"
        elif target not in by_name:
            problem = f"names {target}, which does not exist"
        elif not by_name[target].ok:
            problem = f"names {target}, which does not verify"
        if problem:
            echo(f"FAILED  {root / pointer}: {problem}")
            failures += 1
        else:
            echo(f"OK      {pointer} -> {target}")
            if pointer == "latest" and newest_ok and newest_ok != target:
                echo(f"NOTE    latest names {target} but {newest_ok} is newer and verifies; a resume uses {newest_ok}")
    if failures:
        echo(f"{failures} failure(s) in {root}")
    return 1 if failures else 0


def _verify_weights(path: Path) -> int:
    """`verify` of a safetensors file or a `save_pretrained` directory: every file's header checked, every tensor read
    (`read.read_weights`); 1 if any of it fails."""
    files = hf_dir_files(path) if path.is_dir() else [path]
    try:
        weights = read_weights(path)
    except (CheckpointError, OSError) as error:
        echo(f"FAILED  {path}: {error}")
        return 1
    size = sum(file.stat().st_size for file in files)
    layout = "Hugging Face layout" if is_hf_source(path) else "perdure's names"
    echo(f"OK      {path}  ({len(files)} files, {human_size(size)}, {len(weights)} tensors, {layout})")
    return 0


# ---- export --------------------------------------------------------------------------------------------------------


def _locate_source(path: Path, ema: bool) -> tuple[WeightsLocation, str, dict[str, str]]:
    """(where the weights are, a description of it, the safetensors metadata naming it) for a checkpoint /
    checkpoints / run dir, a `best` / `latest` pointer (also `RUN/best` for `RUN/checkpoints/best`) or a weights file,
    located by the read path (`checkpoints/read.py`: a checkpoint is resolved and verified here, once; `read_located`
    reads it). DCP checkpoints are gathered into one full state dict in this process: no process group is needed. The
    metadata is published with the file: it names the run id and checkpoint (or the file name), never a path of this
    machine."""
    path = _run_pointer(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if ema and weight_files(path) is not None:
        raise CheckpointError(f"{path} holds one set of weights; --ema needs a checkpoint (it holds both sets)")
    where = locate_weights(path, ema)
    if where.checkpoint is None:
        # Weights in the Hugging Face layout stay marked as such (`hf_read.is_hf_source`): not perdure's `source`.
        return where, str(path), {"format": "pt", ("hf" if is_hf_source(path) else "source"): path.name}
    info = where.checkpoint
    backend = info.manifest.get("backend", "file")
    if checkpoint_format(backend) is None:
        raise CheckpointError(
            f"checkpoint {info.path} was written by backend {safe_name(backend)}; export reads "
            f"{', '.join(checkpoint_backends())} checkpoints"
        )
    described = [f"{k} {v}" for k, v in (("step", info.global_step), ("epoch", info.epoch)) if v is not None]
    described.append(f"backend {backend}")  # a registered one, checked above
    published = {"format": "pt", "run": info.path.parent.parent.name, "checkpoint": info.name}
    return where, f"{info.path} ({', '.join(described)})", published


def _run_pointer(path: Path) -> Path:
    """`RUN/best` (or `RUN/latest`) for `RUN/checkpoints/best` when the run dir holds no such file itself."""
    if not path.exists() and path.name in POINTERS and (path.parent / "checkpoints" / path.name).is_file():
        return path.parent / "checkpoints" / path.name
    return path


def _output_format(out: Path, requested: str | None) -> str:
    """The output format, pth or safetensors: OUT's suffix, or `--format` (which must agree with a known suffix)."""
    from_suffix = {".pth": "pth", ".safetensors": "safetensors"}.get(out.suffix)
    if requested == "hf" and from_suffix:
        raise PerdureError(f"--format hf writes a directory, but {out} ends in {out.suffix}; give a directory name")
    if requested and from_suffix and requested != from_suffix:
        raise PerdureError(f"--format {requested} but {out} ends in {out.suffix}; use a matching name or drop one")
    if not (requested or from_suffix):
        raise PerdureError(f"output {out} must end in {' or '.join(EXPORT_SUFFIXES)}, or pass --format pth|safetensors")
    chosen = requested or from_suffix
    assert chosen is not None  # one of them is given: refused just above otherwise
    return chosen


def cmd_export(args: argparse.Namespace) -> int:
    """Write model (or EMA) weights of a checkpoint to OUT (.pth or .safetensors), optionally cast."""
    if is_url(args.checkpoint):
        return mirror_export(args, cmd_export)
    out = args.out.expanduser()
    fmt = _output_format(out, args.format)
    if out.exists() and not args.force:
        raise PerdureError(f"{out} exists; pass --force to replace it")
    if fmt == "hf":
        return _export_hf(args, out)
    if out.is_dir():
        raise PerdureError(f"{out} is a directory; give a file name ending in {' or '.join(EXPORT_SUFFIXES)}")
    where, source, published = _locate_source(args.checkpoint.expanduser(), args.ema)
    weights = read_located(where, args.ema)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_safetensors(weights, out, args.dtype, published)
    else:
        export_weights(weights, out, args.dtype)
    count = sum(t.numel() for t in weights.values() if isinstance(t, torch.Tensor))
    what = "EMA weights" if args.ema else "model weights"
    cast = f" as {args.dtype}" if args.dtype else ""
    echo(
        f"exported {what} of {source}{cast} to {out}: {len(weights)} tensors, {count:,} values, "
        f"{human_size(out.stat().st_size)}"
    )
    return 0


def _export_hf(args: argparse.Namespace, out: Path) -> int:
    """`--format hf`: the checkpoint's weights with the Hugging Face config its training program stored (`hf.json`)."""
    path = _run_pointer(args.checkpoint.expanduser())
    if path.is_file() and path.name not in POINTERS:
        raise CheckpointError(f"{path} is a weights file; --format hf needs a checkpoint (its {HF_META} config)")
    where, source, _ = _locate_source(path, args.ema)
    meta = read_hf_meta(where.info.path)  # before the weights are read: a checkpoint without it fails at once
    weights = read_located(where, args.ema)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_hf_dir(out, cast_weights(weights, args.dtype), meta, source)
    what = "EMA weights" if args.ema else "model weights"
    cast = f" as {args.dtype}" if args.dtype else ""
    size = sum(file.stat().st_size for file in out.iterdir())
    echo(f"exported {what} of {source}{cast} to {out}/ (Hugging Face, {meta['config']['model_type']}): "
         f"{len(list(out.iterdir()))} files, {human_size(size)}")  # fmt: skip
    return 0


# ---- prune ---------------------------------------------------------------------------------------------------------


def cmd_prune(args: argparse.Namespace) -> int:
    """Keep the newest K checkpoints that verify, plus the latest / best targets; remove the other verifying ones.

    A checkpoint that fails verification is never removed (the next start quarantines it, keeping it for inspection).
    Under a run dir the run lock is taken first: pruning beside a live run could race its saves.
    """
    if args.keep < 1:
        raise PerdureError(f"--keep {args.keep}: keep at least 1 checkpoint")
    if is_url(args.run):
        return on_mirror(lambda: mirror_prune(args))
    root, run_dir = checkpoints_root(args.run)
    if args.dry_run or run_dir is None:
        return _prune(root, args.keep, deep=not args.quick, dry_run=args.dry_run)
    try:
        with RunLock(run_dir):
            return _prune(root, args.keep, deep=not args.quick, dry_run=False)
    except OSError as exc:
        raise PerdureError(f"prune of {root} failed: {exc}") from exc


def _prune(root: Path, keep: int, *, deep: bool, dry_run: bool) -> int:
    if not root.is_dir():
        echo(f"no checkpoints in {root}: nothing to prune")
        return 0
    verb = "would remove" if dry_run else "removed"
    ours, foreign = leftovers(root)
    for leftover in ours:
        if not dry_run:
            remove_leftover(leftover)
        echo(f"{verb} {leftover.name} (left by an interrupted prune)")
    for entry in foreign:
        echo(f"left {entry.name}: not perdure's (no prune marker); remove it yourself if it is not needed")
    checked = check_all(root, deep=deep)
    good = [item for item in checked if item.ok]
    protected = set(pointer_targets(root).values())
    for item in checked:
        if not item.ok:
            echo(f"left {item.name}: it fails verification ({item.error}); the next start of the run quarantines it")
    kept = [item.name for item in good[:keep]] + [i.name for i in good[keep:] if i.name in protected]
    freed = 0
    for item in good[keep:]:
        if item.name in protected:
            continue
        size = tree_size(item.path)
        if not dry_run:
            retire(item.path)  # a kill mid-delete leaves a marked .prune-* dir, never half a checkpoint
        freed += size
        echo(f"{verb} {item.name} ({human_size(size)})")
    if not dry_run:
        fsync_dir(root)
    echo(f"kept {len(kept)}: {', '.join(kept) or '-'}; {'would free' if dry_run else 'freed'} {human_size(freed)}")
    return 0
