"""Identity of a run: `code_id` (git commit + hash of uncommitted changes) and `config_id` (hash of the maths).

The same code and config always map to the same ids, hence the same run directory: that is what makes a requeue or
a rerun of the same command continue the run instead of starting another one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from perdure.config import flatten, plain_dict
from perdure.config_checks import find_stack, non_identity_keys, section_stacks
from perdure.errors import CodeIdentityError

# Keys that do not change the maths, as dotted prefixes (`*` matches one section name, e.g. a dataloader split).
# They are left out of `config_id`: logging, where the run lives, where it restores from, how checkpoints are
# written, the step / epoch budget (so a run can be extended by resuming it with a larger budget), loader
# performance knobs, and `deterministic` and `compile` (which kernels compute the same maths: a run may turn them on
# or off to continue), `perf` (what MFU is measured against).
# A registered section's keys that are no part of the identity are declared with the section
# (`config_checks.register_section(..., not_identity=)`, with the reasons): all of `ft`, the whole parallel layout.
NON_IDENTITY_KEYS = (
    "workspace",
    "log",
    "tensorboard",
    "wandb",
    "dist",
    "resilience",
    "checkpoint",
    "resume",
    "pretrained",
    "ckpt",
    "steps",
    "epochs",
    "dataloader.num_workers",
    "dataloader.pin_memory",
    "dataloader.*.num_workers",
    "dataloader.*.pin_memory",
    "deterministic",
    "compile",
    "perf",
)


def _stack_name(value: Any) -> Any:
    """A stack's own name for `value`, one of its aliases (`ds` is `deepspeed`); any other value as it is."""
    found = find_stack(value)
    return value if found is None else found.name


# Fixed diff options, so the hash of a dirty tree does not depend on the user's git configuration.
_DIFF_ARGS = (
    "HEAD",
    "--binary",
    "--no-color",
    "--no-ext-diff",
    "--no-textconv",
    "--no-renames",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--unified=3",
    "--inter-hunk-context=0",
    "--diff-algorithm=myers",
    "--indent-heuristic",
)


def _excluded(key: str) -> bool:
    parts = key.split(".")
    for pattern in (*NON_IDENTITY_KEYS, *non_identity_keys()):
        segments = pattern.split(".")
        if len(parts) >= len(segments) and all(s in ("*", p) for s, p in zip(segments, parts)):
            return True
    return False


def canonical_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `config` that changes the maths (user keys included), as nested plain dicts.

    Drops every key matched by `NON_IDENTITY_KEYS` and empty-dict leaves; the `deepspeed` section counts only for
    `stack=deepspeed` (whose alias `ds` counts as `deepspeed`).
    """
    canonical: dict[str, Any] = {}
    stack = _stack_name(plain_dict(config).get("stack"))
    owned = section_stacks()  # sections of one stack (`deepspeed`): no part of another stack's identity
    for key, value in flatten(plain_dict(config)).items():
        section, dot, _ = key.partition(".")
        owner = owned.get(section) if dot else None
        if _excluded(key) or (owner is not None and owner != stack):
            continue
        if key == "stack":
            value = _stack_name(value)
        node = canonical
        *sections, leaf = key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    _keep_earlier_form(canonical)
    # The budget's size is not identity but its unit is: intervals count steps or epochs depending on it.
    plain = plain_dict(config)
    if plain.get("epochs") is not None:
        canonical["budget_unit"] = "epochs"
    elif plain.get("steps") is not None:
        canonical["budget_unit"] = "steps"
    return canonical


def _keep_earlier_form(canonical: dict[str, Any]) -> None:
    """Keys added or renamed since runs were first made, in the form those runs hashed, as long as they hold what an
    earlier run could express: the run directory (and `--checkpoint`'s config check) of a run made before stays the
    same after an upgrade of perdure. `eval.interval` was `eval_interval`, and `eval.steps` did not exist: while
    `eval.steps` is null, the section is hashed as the single key `eval_interval`. `loss.normalize` did not exist:
    its default (`mean`, what every earlier run did) is left out."""
    if canonical.get("loss") == {"normalize": "mean"}:
        del canonical["loss"]
    section = canonical.get("eval")
    if isinstance(section, dict) and set(section) == {"steps", "interval"} and section["steps"] is None:
        items = [
            ("eval_interval", section["interval"]) if key == "eval" else (key, value)
            for key, value in canonical.items()
        ]
        canonical.clear()
        canonical.update(items)  # in its place, as the canonical config files show it


def _serialise(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def config_id(config: Mapping[str, Any]) -> str:
    """12 hex chars of sha256 over the canonical config as sorted-key JSON. Types count: `1` and `1.0` differ."""
    return hashlib.sha256(_serialise(canonical_config(config)).encode()).hexdigest()[:12]


def config_diff(
    a: Mapping[str, Any], b: Mapping[str, Any], a_label: str = "checkpoint", b_label: str = "current"
) -> list[str]:
    """Lines naming each dotted key whose value differs between `a` and `b`, either way, sorted by key.

    e.g. `optim.lr: 0.001 (checkpoint) != 0.0003 (current)`, `only in checkpoint: foo = 1`. Values are shown as
    JSON (so `1` and `1.0` are told apart, as `config_id` does). Pass canonical configs to compare the maths only.
    """
    flat_a, flat_b = flatten(plain_dict(a)), flatten(plain_dict(b))
    lines = []
    for key in sorted(flat_a.keys() | flat_b.keys()):
        if key not in flat_b:
            lines.append(f"only in {a_label}: {key} = {_serialise(flat_a[key])}")
        elif key not in flat_a:
            lines.append(f"only in {b_label}: {key} = {_serialise(flat_b[key])}")
        elif _serialise(flat_a[key]) != _serialise(flat_b[key]):
            lines.append(f"{key}: {_serialise(flat_a[key])} ({a_label}) != {_serialise(flat_b[key])} ({b_label})")
    return lines


def _default_path() -> Path:
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return script.resolve().parent if script is not None and script.is_file() else Path.cwd()


def checkout_root(path: str | os.PathLike | None = None) -> Path | None:
    """The git checkout holding `path` (default: the script's directory, else the cwd): the nearest directory at or
    above it with a `.git` entry (a directory, or a file for a worktree or a submodule); None outside any checkout.
    Found without running git, so that a checkout git cannot read is still known to be one."""
    where = (Path(path) if path is not None else _default_path()).absolute()
    if where.is_file():
        where = where.parent
    for directory in (where, *where.parents):
        if os.path.lexists(directory / ".git"):
            return directory.resolve()
    return None


# Variables that would point git at another repository or index than the checkout's own.
_GIT_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR")
_GIT_TIMEOUT_S = 300.0


def _git(root: Path, *args: str, allowed: tuple[int, ...] = (0,)) -> tuple[int, bytes]:
    """Run a read-only git query in the checkout `root`; (exit status, stdout) when the status is in `allowed`, else
    `CodeIdentityError` with git's own message and the fix.

    `safe.directory=<root>`: git refuses a checkout owned by another user ("dubious ownership") because its
    configuration could run that user's commands. The program we identify lives in that very checkout and is
    running already, so trusting its configuration for these queries adds nothing: the code identity stays the one
    its owner gets.
    """
    git = shutil.which("git")
    if git is None:
        raise CodeIdentityError(
            f"{root} is a git checkout, but no `git` program is on PATH ({os.environ.get('PATH', '')}): perdure names "
            "the run by the commit and the diff that run. Install git or put it on PATH, or name the run's code "
            "yourself with --workspace.code_id NAME"
        )
    env = {key: value for key, value in os.environ.items() if key not in _GIT_REDIRECTS}
    command = [git, "-c", f"safe.directory={root}", "-C", str(root), *args]
    try:
        result = subprocess.run(command, capture_output=True, env=env, timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise CodeIdentityError(f"cannot run `git {args[0]}` in the checkout {root}: {error}. {_GIT_FIX}") from None
    if result.returncode not in allowed:
        said = result.stderr.decode("utf-8", errors="replace").strip()[-2000:] or f"exit {result.returncode}"
        raise CodeIdentityError(f"`git {args[0]}` failed in the checkout {root}: {said}. {_GIT_FIX}")
    return result.returncode, result.stdout


_GIT_FIX = (
    "perdure names the run by the commit and the diff that run, and starts nothing it cannot name: repair the "
    "checkout (`git status` there shows the same error; a broken index is rebuilt with `rm .git/index && git "
    "reset`), or name the run's code yourself with --workspace.code_id NAME"
)


def _head(root: Path) -> str | None:
    """The full sha of HEAD, None in a repository without commits."""
    status, out = _git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}", allowed=(0, 1))
    return out.decode().strip() if status == 0 else None


def _diff(root: Path) -> bytes:
    """`git diff HEAD` of tracked files (staged or not, binary included); untracked files do not count."""
    return _git(root, "diff", *_DIFF_ARGS)[1]


def code_id(path: str | os.PathLike | None = None) -> str | None:
    """Short sha of HEAD of the checkout containing `path`, plus `-d<10 hex>` hashing the diff when tracked files
    are dirty. `path` defaults to the script's directory (else the cwd). None outside a git checkout or in one
    without commits; `CodeIdentityError` (git's message and the fix) when git cannot read the checkout."""
    root = checkout_root(path)
    if root is None:
        return None
    sha = _head(root)
    if sha is None:
        return None
    diff = _diff(root)
    return f"{sha[:7]}-d{hashlib.sha256(diff).hexdigest()[:10]}" if diff else sha[:7]


SOURCE_PREFIX = "src-"
_MAX_SOURCE_FILES = 5000
_MAX_SOURCE_BYTES = 64 << 20


def program_files(path: str | os.PathLike | None = None) -> list[Path]:
    """The program's own Python files: the script, and every module imported so far from under its directory
    (installed packages and virtual environments below it excluded). Sorted, at most a few thousand."""
    root = (Path(path) if path is not None else _default_path()).resolve()
    if root.is_file():
        root = root.parent
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    files: set[Path] = set()
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    candidates = [script] if script is not None and script.suffix == ".py" else []
    candidates += [Path(f) for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)]
    for candidate in candidates:
        try:
            resolved = candidate.resolve()
        except OSError:
            continue
        if resolved.suffix != ".py" or not resolved.is_relative_to(root) or not resolved.is_file():
            continue
        parts = resolved.relative_to(root).parts
        if any(part in ("site-packages", "dist-packages") for part in parts) or any(
            resolved.is_relative_to(prefix) for prefix in prefixes
        ):
            continue
        files.add(resolved)
    return sorted(files)[:_MAX_SOURCE_FILES]


def source_code_id(path: str | os.PathLike | None = None) -> str:
    """`src-<10 hex>`: a content hash of the program's own Python files (see `program_files`), the code identity of
    a program that is not in a git repository. Editing the script or a module beside it changes it."""
    root = (Path(path) if path is not None else _default_path()).resolve()
    if root.is_file():
        root = root.parent
    digest = hashlib.sha256()
    budget = _MAX_SOURCE_BYTES
    for file in program_files(path):
        try:
            data = file.read_bytes()[:budget]
        except OSError:
            continue
        budget -= len(data)
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return f"{SOURCE_PREFIX}{digest.hexdigest()[:10]}"


def program_code_id(path: str | os.PathLike | None = None) -> str:
    """The code identity of the running program: `code_id()` in a git repository, else `source_code_id()`."""
    return code_id(path) or source_code_id(path)


def git_state(path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Git facts for run metadata: commit, code_id, branch (None when detached), dirty, remote (origin url or None),
    root and the diff text. None outside a git checkout or in one without commits; `CodeIdentityError` as
    `code_id`."""
    root = checkout_root(path)
    if root is None:
        return None
    commit = _head(root)
    if commit is None:
        return None
    diff = _diff(root)
    status, branch = _git(root, "symbolic-ref", "--quiet", "--short", "HEAD", allowed=(0, 1))
    found, remote = _git(root, "config", "--get", "remote.origin.url", allowed=(0, 1))
    return {
        "commit": commit,
        "code_id": f"{commit[:7]}-d{hashlib.sha256(diff).hexdigest()[:10]}" if diff else commit[:7],
        "branch": branch.decode().strip() if status == 0 else None,
        "dirty": bool(diff),
        "remote": remote.decode().strip() if found == 0 else None,
        "root": str(root),
        "diff": diff.decode("utf-8", errors="replace"),
    }
