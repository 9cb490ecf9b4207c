"""MATRIX.yaml: the training command and the overrides of each job, expanded into jobs with stable ids.

```yaml
command: [python, train.py, --steps, "200"]   # argv of the training program (a list, never a shell string)
grid:                                          # key -> list of values; every combination is a job
  optim.lr: [0.001, 0.0003]
  seed: [1, 2, 3]
jobs:                                          # more jobs, each a mapping of overrides (added after the grid's)
  - {optim.lr: 0.01, seed: 1, width: 64}
env: {WANDB_MODE: offline}                     # added to every job's environment
workdir: ..                                    # where jobs run (relative to this file); default: where init runs
```

A job runs `command + --key value ...` (overrides in the order written). Its id is a readable slug of the
overrides sorted by key (the last part of each key, then the value) plus 8 hex digits of a hash of the overrides:
`lr0.001-seed1-5c1f0e2a`. Key order does not matter; `1`, `1.0`, `"1"` and `true` all differ. The same overrides
always give the same id, which is how `init` recognises the jobs it already has when the matrix grows.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from perdure.errors import PerdureError

MATRIX_KEYS = ("command", "grid", "jobs", "env", "workdir")
MAX_MATRIX_BYTES = 1 << 20
MAX_JOBS = 100_000
KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
ENV_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}$")
_SLUG_LIMIT = 40

Scalar = str | int | float | bool | None


class SweepError(PerdureError):
    """A sweep cannot be set up or changed as asked (bad matrix, corrupt state, unknown job...)."""


@dataclass(frozen=True)
class MatrixJob:
    """One job: its id and its overrides, in the order they go on the command line."""

    id: str
    overrides: dict[str, Scalar]

    def argv(self, command: Sequence[str]) -> list[str]:
        """`command` followed by `--key value` for each override."""
        args = list(command)
        for key, value in self.overrides.items():
            args += [f"--{key}", render_value(value)]
        return args


@dataclass(frozen=True)
class Matrix:
    """A checked matrix: the command, the jobs (grid product first, then listed jobs, duplicates dropped)."""

    command: list[str]
    jobs: list[MatrixJob]
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    duplicates: int = 0


def load_matrix(path: str | os.PathLike) -> Matrix:
    """Read and check MATRIX.yaml; raises `SweepError` naming the key, the value and the fix."""
    path = Path(path)
    try:
        if not path.is_file():
            raise SweepError(f"matrix {path} is not a file: give the path of a MATRIX.yaml")
        if path.stat().st_size > MAX_MATRIX_BYTES:
            raise SweepError(f"matrix {path} is larger than {MAX_MATRIX_BYTES} bytes: is it really a matrix?")
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SweepError(f"matrix {path} cannot be read: {error}") from None
    except UnicodeDecodeError as error:
        raise SweepError(f"matrix {path} is not UTF-8 text: {error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SweepError(f"matrix {path} is not valid YAML: {error}") from None
    return parse_matrix(data, where=str(path), base=path.resolve().parent)


def parse_matrix(data: Any, *, where: str = "matrix", base: Path | None = None) -> Matrix:
    """Check a matrix already parsed from YAML (a mapping) and expand its jobs."""
    if not isinstance(data, Mapping):
        raise SweepError(f"{where}: the top level must be a mapping with keys {', '.join(MATRIX_KEYS)}")
    unknown = [str(key) for key in data if key not in MATRIX_KEYS]
    if unknown:
        raise SweepError(f"{where}: unknown top-level key(s) {', '.join(unknown)}; allowed: {', '.join(MATRIX_KEYS)}")
    command = _command(data.get("command"), where)
    jobs: list[dict[str, Scalar]] = []
    if "grid" in data:
        jobs += _grid(data["grid"], where)
    if "jobs" in data:
        jobs += _listed_jobs(data["jobs"], where)
    if "grid" not in data and "jobs" not in data:
        raise SweepError(f"{where}: no jobs: give a 'grid' (key -> list of values) and/or 'jobs' (list of mappings)")
    env = _env(data.get("env"), where)
    workdir = data.get("workdir")
    if workdir is not None:
        if not isinstance(workdir, str) or not workdir:
            raise SweepError(f"{where}: 'workdir' = {workdir!r}: give a directory path (relative to the matrix)")
        workdir = (base or Path.cwd()) / workdir
    unique: dict[str, MatrixJob] = {}
    for overrides in jobs:
        job = MatrixJob(job_id(overrides), overrides)
        unique.setdefault(job.id, job)
    return Matrix(command, list(unique.values()), env, workdir, duplicates=len(jobs) - len(unique))


def job_id(overrides: Mapping[str, Scalar]) -> str:
    """`<slug>-<8 hex>`: readable, and the same for the same overrides in any key order."""
    ordered = dict(sorted(overrides.items()))
    digest = hashlib.sha256(json.dumps(ordered, separators=(",", ":")).encode()).hexdigest()[:8]
    parts = [f"{key.rsplit('.', 1)[-1]}{render_value(value)}" for key, value in ordered.items()]
    slug = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", part) for part in parts)
    slug = re.sub(r"^[^A-Za-z0-9]+", "", slug)[:_SLUG_LIMIT].rstrip("-_.")
    return f"{slug}-{digest}" if slug else digest


def render_value(value: Scalar) -> str:
    """A value as command-line text: true/false, null, numbers as Python writes them, strings verbatim."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if not isinstance(value, float) else repr(value)


# ---------------------------------------------------------------------- checks


def _command(command: Any, where: str) -> list[str]:
    if command is None:
        raise SweepError(f"{where}: 'command' is missing: give the training program as an argv list")
    if isinstance(command, str):
        raise SweepError(f"{where}: 'command' = {command!r}: write it as an argv list, e.g. [python, train.py]")
    if not isinstance(command, list) or not command:
        raise SweepError(f"{where}: 'command' = {command!r}: give a non-empty list, e.g. [python, train.py]")
    for item in command:
        if not isinstance(item, (str, int, float)) or isinstance(item, bool) or "\0" in str(item):
            raise SweepError(f"{where}: 'command' item {item!r}: each item must be a string (or a number)")
    return [str(item) for item in command]


def _grid(grid: Any, where: str) -> list[dict[str, Scalar]]:
    if not isinstance(grid, Mapping) or not grid:
        raise SweepError(f"{where}: 'grid' = {grid!r}: give a non-empty mapping of key -> list of values")
    axes: list[tuple[str, list[Scalar]]] = []
    size = 1
    for key, values in grid.items():
        key = _key(key, f"{where}: grid")
        if not isinstance(values, list):
            raise SweepError(f"{where}: grid key '{key}' = {values!r}: give a list of values, e.g. [{values!r}]")
        if not values:
            raise SweepError(f"{where}: grid key '{key}' has an empty list: give at least one value")
        axes.append((key, [_value(value, f"{where}: grid key '{key}'") for value in values]))
        size *= len(values)
    if size > MAX_JOBS:
        raise SweepError(f"{where}: the grid makes {size} jobs, more than {MAX_JOBS}: split the sweep")
    keys = [key for key, _ in axes]
    return [dict(zip(keys, combination)) for combination in itertools.product(*(values for _, values in axes))]


def _listed_jobs(jobs: Any, where: str) -> list[dict[str, Scalar]]:
    if not isinstance(jobs, list):
        raise SweepError(f"{where}: 'jobs' = {jobs!r}: give a list of override mappings, e.g. [{{seed: 1}}]")
    if len(jobs) > MAX_JOBS:
        raise SweepError(f"{where}: 'jobs' lists {len(jobs)} jobs, more than {MAX_JOBS}: split the sweep")
    out = []
    for index, job in enumerate(jobs):
        if job is None:
            job = {}
        if not isinstance(job, Mapping):
            raise SweepError(f"{where}: jobs[{index}] = {job!r}: each job is a mapping of key -> value")
        out.append(
            {
                _key(key, f"{where}: jobs[{index}]"): _value(value, f"{where}: jobs[{index}] key '{key}'")
                for key, value in job.items()
            }
        )
    return out


def _env(env: Any, where: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise SweepError(f"{where}: 'env' = {env!r}: give a mapping of VARIABLE -> value")
    out = {}
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_PATTERN.match(name):
            raise SweepError(f"{where}: env name {name!r}: use letters, digits and _ (not starting with a digit)")
        value = _value(value, f"{where}: env '{name}'")
        out[name] = "" if value is None else render_value(value)
    return out


def _key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.match(key):
        raise SweepError(f"{where}: key {key!r}: use a config key like optim.lr (letters, digits, _ . -)")
    return key


def _value(value: Any, where: str) -> Scalar:
    if isinstance(value, (Mapping, list)):
        raise SweepError(f"{where} = {value!r}: values must be scalars (string, number, true/false, null)")
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise SweepError(f"{where} = {value!r}: write it as a string, number, true/false or null")
    if isinstance(value, float) and not math.isfinite(value):
        raise SweepError(f"{where} = {value!r}: not a finite number; quote it if the program expects that text")
    if isinstance(value, str) and (value.startswith("--") or "\0" in value or "\n" in value):
        raise SweepError(f"{where} = {value!r}: a value may not start with -- or contain a newline or NUL")
    return value
