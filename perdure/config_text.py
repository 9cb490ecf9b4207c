"""Command-line text to config values: splitting argv, typing each value by the key it sets, suggesting keys.

Pure functions used by `RunnerConfig.parse`; they know nothing of a config beyond what they are given.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

import yaml

from perdure.errors import ConfigError
from perdure.safe_io import load_yaml

TRUE = ("true", "yes", "1")
FALSE = ("false", "no", "0")
NULL = ("none", "null", "~")
NUMBER = re.compile(r"^[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?$")
BARE = object()  # marker: an option given without a value

# Counts that also take the word `auto` (perdure.checkpoints.auto_interval), whatever number a program set.
AUTO_COUNT_KEYS = frozenset({"ckpt.interval"})
# Keys holding a path or a name: command-line text is kept verbatim (no YAML typing); "none" / "null" clear them.
OPTIONAL_STR_KEYS = frozenset(
    {
        "checkpoint",
        "pretrained",
        "workspace.root",
        "workspace.lineage",
        "workspace.id",
        "workspace.code_id",  # a short git hash can read as a number: 1234567, 73327e9
        "ckpt.export_dtype",
        "wandb.project",
        "wandb.entity",
    }
)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_argv(argv: list[str]) -> tuple[list[str], list[tuple[str, Any]]]:
    """Split argv into `--config` files and `(key, text)` overrides; a bare option's text is `BARE`. `-h` / `--help`
    is the override `("--help", BARE)`, wherever it stands, so that help can show the values the rest sets."""
    files: list[str] = []
    overrides: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            overrides.append(("--help", BARE))
            i += 1
            continue
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError("argv", token, "positional arguments are not accepted; write options as --key value")
        name, text = token[2:], BARE
        if "=" in name:
            name, text = name.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            text = argv[i]
        i += 1
        if name == "config":
            if text is BARE:
                raise ConfigError("config", None, "--config needs a file: --config path/to/config.yaml")
            assert isinstance(text, str)  # an argument's text: only BARE is not one
            files.append(text)
        else:
            overrides.append((name, text))
    return files, overrides


def coerce_text(key: str, text: Any, current: Any) -> Any:
    """Turn command-line text into a value of the type `key` holds now."""
    if text is BARE:
        if key == "resume" or isinstance(current, bool):
            return True
        raise ConfigError(key, current, f"--{key} was given without a value; write --{key} VALUE")
    low = text.strip().lower()
    if key == "resume":
        if low == "auto":
            return "auto"
        if low in TRUE or low in FALSE:
            return low in TRUE
        raise ConfigError(key, text, "use auto, true or false (a bare --resume means true)")
    if key in OPTIONAL_STR_KEYS:
        return None if low in NULL or not low else text
    if key in AUTO_COUNT_KEYS and low == "auto":
        return "auto"
    if isinstance(current, bool):
        if low in TRUE or low in FALSE:
            return low in TRUE
        raise ConfigError(key, text, "use true or false (also yes/no, 1/0)")
    if low in NULL and isinstance(current, (int, float, list, tuple)):
        return None
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(key, text, f"use an integer, e.g. --{key} {current}") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(key, text, f"use a number, e.g. --{key} {current}") from None
    if isinstance(current, str):
        return text
    if isinstance(current, (list, tuple)):
        return parse_list(key, text, current)
    return parse_scalar(text)


def coerce_value(key: str, value: Any, current: Any) -> Any:
    """Adapt a value read from a config file: strings are coerced like command-line text, ints widen to floats."""
    if isinstance(value, str) and (key == "resume" or not isinstance(current, str)):
        return coerce_text(key, value, current)
    if key in OPTIONAL_STR_KEYS and value is not None:
        return str(value)
    if isinstance(current, float) and is_number(value):
        return float(value)
    return value


def parse_scalar(text: str) -> Any:
    """YAML typing for a value whose key holds None: `1e-3` is a float, `none` / `null` are None."""
    if text.strip().lower() in NULL:
        return None
    if NUMBER.match(text.strip()):
        number = float(text)
        return int(text) if re.fullmatch(r"[+-]?\d[\d_]*", text.strip()) else number
    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (type(None), bool, int, float, str, list, dict)) else text


def parse_list(key: str, text: str, current: Sequence[Any]) -> list[Any]:
    """`[1, 2]` (YAML flow) or `1,2`; items of a list of floats become floats."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = load_yaml(stripped)
        except yaml.YAMLError:
            items = None
        if not isinstance(items, list):
            raise ConfigError(key, text, f"use a list like --{key} [1, 2] or --{key} 1,2")
        items = [parse_scalar(item) if isinstance(item, str) else item for item in items]
    else:
        items = [parse_scalar(item.strip()) for item in stripped.split(",")] if stripped else []
    if current and all(isinstance(item, float) for item in current):
        items = [float(item) if is_number(item) else item for item in items]
    return items


def shown(value: Any) -> Any:
    return None if value is BARE else value


def suggest(name: str, known: set[str]) -> str:
    """`did you mean 'x'?` when a key is spelled alike (or has the same option name in another section), else the
    keys of the section `name` names, or the top-level keys: never a guess that only shares a few letters."""
    leaf = name.rsplit(".", 1)[-1]

    def similar(a: str, b: str, cutoff: float) -> bool:
        return difflib.SequenceMatcher(None, a, b).ratio() >= cutoff

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
    if not close:  # same option name in another section: `--lr` -> `optim.lr`
        close = [key for key in sorted(known) if similar(leaf, key.rsplit(".", 1)[-1], 0.75)]
    if len(close) == 1:
        return f"did you mean '{close[0]}'?"
    if close:
        return f"did you mean one of {', '.join(close[:5])}?"
    section = name.rsplit(".", 1)[0] + "." if "." in name else ""
    nearby = [key for key in sorted(known) if section and key.startswith(section)]
    if not nearby:
        nearby = sorted({key.split(".")[0] for key in known})
        return f"top-level keys and sections are: {', '.join(nearby)}"
    return f"keys in '{section[:-1]}' are: {', '.join(nearby)}"
