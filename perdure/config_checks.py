"""Config validators: each checks one value of one key and raises a `ConfigError` naming the key, the value and the fix.

Pure functions used by `RunnerConfig.check` (and `check_path_component` by the workspace, for names read back), and
the registry of section checks: a layer that owns a config section (a stack, TorchFT, the checkpoint mirror) registers
its check here, so `perdure/config.py` imports none of them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from perdure.config_text import is_int, is_number
from perdure.errors import ConfigError

# (the config, `get(dotted key)` -> its value or None) -> None; raises ConfigError
SectionCheck = Callable[[Any, Callable[[str], Any]], None]
_SECTION_CHECKS: dict[str, SectionCheck] = {}


def register_section_check(section: str, check: SectionCheck) -> None:
    """Have `RunnerConfig.check()` run `check(config, get)` for `section` (a name for messages and tests: `deepspeed`,
    `ft`, ...), after perdure's own keys and before `check_user_keys`, sections in the order of their names (whatever
    order their modules were imported in).

    Called once, at import, by the module that owns the section; perdure's own are imported with the package
    (`perdure/sections.py`). The check may read the config, never change it, and raises `ConfigError(key, value, fix)`.
    Registering a section again replaces its check.
    """
    _SECTION_CHECKS[section] = check


def section_checks() -> dict[str, SectionCheck]:
    """The registered section checks, by section, in the order they run."""
    return dict(sorted(_SECTION_CHECKS.items()))


def check_int(key: str, value: Any, minimum: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value) or (minimum is not None and value < minimum):
        wanted = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ConfigError(key, value, f"use {wanted}{' or None' if optional else ''}")


def check_choice(key: str, value: Any, choices: tuple) -> None:
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        shown = ", ".join("None" if c is None else str(c).lower() if isinstance(c, bool) else c for c in choices)
        raise ConfigError(key, value, f"use one of: {shown}")


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "use true or false")


def check_number(key: str, value: Any, wanted: str, ok: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_number(value) or not ok(value):
        raise ConfigError(key, value, f"use {wanted}")
    if not math.isfinite(value):  # inf passes `x >= 0`; no setting means anything by it (an lr of inf, a timeout)
        raise ConfigError(key, value, f"use {wanted}, a finite one")


def check_path(key: str, value: Any) -> None:
    if value is None:
        return
    try:
        exists = isinstance(value, (str, os.PathLike)) and Path(value).expanduser().exists()
    except (OSError, ValueError) as error:  # a NUL byte, a name longer than the filesystem allows, ...
        raise ConfigError(key, value, f"not a usable path ({error}); pass an existing path or drop --{key}") from None
    if not exists:
        raise ConfigError(key, value, f"no such file or directory; pass an existing path or drop --{key}")


MAX_NAME_BYTES = 128  # a run id or lineage; with the code id the group folder stays far below NAME_MAX (255)
UNSAFE_NAME = re.compile(r"[\x00-\x1f\x7f-\x9f/\\]")


def check_root(value: Any) -> None:
    """`workspace.root` may be any path the user chooses, but one the filesystem can hold."""
    if value is None:
        return
    text = os.fspath(value)
    if "\0" in text:
        raise ConfigError("workspace.root", value, "a path cannot hold a NUL character")
    if too_long := [part for part in Path(text).parts if len(part.encode("utf-8", "surrogatepass")) > 255]:
        fix = f"the directory name {too_long[0][:40]!r}... is longer than 255 bytes"
        raise ConfigError("workspace.root", f"{text[:60]}...", fix)


def check_path_component(key: str, value: Any) -> None:
    """`value` (None, or a name that becomes one directory of the run's path: `workspace.id`, `workspace.lineage`)
    must be a single path component: no separator, not `.` / `..`, no NUL or control character, at most
    `MAX_NAME_BYTES` bytes. Raises `ConfigError` naming the key."""
    if value is None:
        return
    name = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(name, str) or not name:
        raise ConfigError(key, value, "use a non-empty name (one directory name), or None for the default")
    if name in (".", "..") or UNSAFE_NAME.search(name):
        raise ConfigError(
            key,
            value,
            "use a single directory name: no '/', '\\', '.' or '..', NUL or control characters (it names a folder "
            "under workspace.root; to put runs elsewhere set --workspace.root)",
        )
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ConfigError(key, f"{name[:40]}... ({len(name)} characters)", f"use at most {MAX_NAME_BYTES} bytes")


def check_loader(prefix: str, options: Mapping[str, Any], required: bool) -> None:
    for option, minimum in (("batch_size", 1), ("num_workers", 0)):
        if required or option in options:
            check_int(f"{prefix}.{option}", options.get(option), minimum)
    for option in ("shuffle", "drop_last", "pin_memory"):
        if required or option in options:
            check_bool(f"{prefix}.{option}", options.get(option))
