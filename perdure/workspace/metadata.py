"""Run metadata: what config and what code produced a run, written into `<run dir>/metadata/` at every attempt.

    metadata/
      config.full.yaml        every key of the config (first attempt)
      config.canonical.yaml   the keys that change the maths, i.e. what `config_id` hashes
      config.diff.yaml        the config against the defaults of its own class, both directions
      git.yaml                commit, code_id, branch, dirty, remote, root (`null` outside git)
      git.diff                `git diff HEAD` of tracked files (empty when clean or outside git)
      attempts/<attempt>/     the same five files as this attempt saw them

The top-level files describe the first attempt and are never replaced; every attempt (the first included) keeps its
own copy under `attempts/`, so nothing an earlier attempt wrote is ever overwritten.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

from perdure.atomic import atomic_write_text
from perdure.config import RunnerConfig, flatten
from perdure.errors import CodeIdentityError, PerdureError
from perdure.safe_io import ensure_dir
from perdure.workspace.identity import canonical_config, git_state

METADATA_DIR = "metadata"
ATTEMPTS_DIR = "attempts"
METADATA_FILES = ("config.full.yaml", "config.canonical.yaml", "config.diff.yaml", "git.yaml", "git.diff")
_ATTEMPT = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]*$")


def write_metadata(
    run_dir: Path, config: RunnerConfig, attempt: str, *, code_path: str | os.PathLike | None = None
) -> Path:
    """Write the metadata of attempt `attempt` (a sortable UTC timestamp such as `20261122T023011.123456Z`).

    Every file goes to `run_dir/metadata/attempts/<attempt>/`; the top-level copies are written only where they do
    not exist yet (the first attempt's). `code_path` is where to look for the git repository (default: the script's
    directory, else the cwd, as for `code_id`). Returns the `metadata/` directory.
    """
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise PerdureError(f"attempt {attempt!r} is not a valid directory name; pass a timestamp like 20261122T023011Z")
    metadata = Path(run_dir) / METADATA_DIR
    attempt_dir = metadata / ATTEMPTS_DIR / attempt
    for directory in (metadata, attempt_dir.parent, attempt_dir):  # never through a symlink
        ensure_dir(directory)
    for name, text in metadata_texts(config, code_path=code_path).items():
        atomic_write_text(attempt_dir / name, text)
        if not (metadata / name).exists():
            atomic_write_text(metadata / name, text)
    return metadata


def metadata_texts(config: RunnerConfig, *, code_path: str | os.PathLike | None = None) -> dict[str, str]:
    """The content of each file in `METADATA_FILES`, by name."""
    try:
        state = git_state(code_path)
    except CodeIdentityError as error:  # reached only with `workspace.code_id` set (see `run_dir._running_code_id`)
        state = {"error": str(error), "diff": ""}
    git_facts = None if state is None else {key: value for key, value in state.items() if key != "diff"}
    return {
        "config.full.yaml": _yaml(config.to_plain()),
        "config.canonical.yaml": _yaml(canonical_config(config)),
        "config.diff.yaml": _yaml(diff_against_defaults(config)),
        "git.yaml": _yaml(git_facts),
        "git.diff": "" if state is None else state["diff"],
    }


def diff_against_defaults(config: RunnerConfig) -> dict[str, Any]:
    """How `config` differs from a fresh `type(config)()`, by dotted key, in both directions.

    `{"defaults": "<module>.<Class>", "changed": {key: {"default": d, "value": v}}, "added": {key: {"value": v}},
    "removed": {key: {"default": d}}}`: `added` are keys the defaults lack, `removed` keys only the defaults hold.
    Values are compared as JSON, so `1` and `1.0` differ (as they do for `config_id`). When the class cannot be
    built without arguments, the defaults are those of `RunnerConfig`.
    """
    cls = type(config)
    try:
        defaults = cls()
    except Exception:
        cls, defaults = RunnerConfig, RunnerConfig()
    ours, theirs = flatten(config.to_plain()), flatten(defaults.to_plain())
    changed: dict[str, Any] = {}
    added: dict[str, Any] = {}
    removed: dict[str, Any] = {}
    for key in sorted(ours.keys() | theirs.keys()):
        if key not in theirs:
            added[key] = {"value": ours[key]}
        elif key not in ours:
            removed[key] = {"default": theirs[key]}
        elif _json(ours[key]) != _json(theirs[key]):
            changed[key] = {"default": theirs[key], "value": ours[key]}
    return {"defaults": f"{cls.__module__}.{cls.__qualname__}", "changed": changed, "added": added, "removed": removed}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _yaml(data: Any) -> str:
    if data is None:
        return "null\n"  # not safe_dump's "null\n...\n"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
