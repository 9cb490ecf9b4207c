"""Config validators: each checks one value of one key and raises a `ConfigError` naming the key, the value and the fix.

Pure functions used by `RunnerConfig.check` (and `check_path_component` by the workspace, for names read back), and
the registry of config sections: a layer that owns a config section (a stack, TorchFT, the checkpoint mirror) registers
its check here (`register_section_check`), and a section whose keys are all its own (`parallel`, `deepspeed`, `ft`)
declares its keys, defaults, help and plain validation here too (`register_section`), so `perdure/config.py` imports
none of them and a new stack with keys of its own edits no shared file.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SectionKey:
    """One key of a registered section: `name` inside the section (`axes.shard` for `parallel.axes.shard`), its
    default (copied into every config), its `--help` line, and its plain validation, run by `RunnerConfig.check()`
    with perdure's own keys of the same kind: `choices` (`check_choice`), `count` = (minimum, None allowed)
    (`check_int`), `boolean` (`check_bool`)."""

    name: str
    default: Any
    help: str
    choices: tuple | None = None
    count: tuple[int, bool] | None = None
    boolean: bool = False


_SECTIONS: dict[str, tuple[SectionKey, ...]] = {}
_SECTION_STACKS: dict[str, str] = {}
_NOT_IDENTITY: dict[str, tuple[str, ...]] = {}


def register_section(
    section: str,
    keys: tuple[SectionKey, ...],
    check: SectionCheck | None = None,
    stack: str | None = None,
    not_identity: tuple[str, ...] = (),
) -> None:
    """Declare config section `section` (`parallel`, `deepspeed`, `ft`, ...): `RunnerConfig.__init__` sets its
    `keys` to their defaults after perdure's own keys, sections in the order of their names, keys in the order given;
    `--help` and docs/config.md show each key's help; `check`, if given, is registered as `register_section_check`
    would. `stack`: the section belongs to that stack and is no part of another stack's config identity
    (`workspace.identity.canonical_config`). `not_identity`: dotted prefixes inside the section (`parallel.axes`, or
    the section itself) whose keys are no part of any run's config identity (`workspace.identity.NON_IDENTITY_KEYS`
    says what may be). Called once, at import, by the module that owns the section (see `register_section_check`);
    registering a section again replaces it."""
    outside = [prefix for prefix in not_identity if prefix != section and not prefix.startswith(section + ".")]
    if outside:
        raise ValueError(f"section {section!r}: not_identity names {outside[0]!r}, a key outside the section")
    _SECTIONS[section] = tuple(keys)
    _NOT_IDENTITY[section] = tuple(not_identity)
    _SECTION_STACKS.pop(section, None)
    if stack is not None:
        _SECTION_STACKS[section] = stack
    if check is not None:
        register_section_check(section, check)


def non_identity_keys() -> tuple[str, ...]:
    """The registered sections' prefixes that are no part of a run's config identity (`register_section`)."""
    return tuple(prefix for _, prefixes in sorted(_NOT_IDENTITY.items()) for prefix in prefixes)


def section_stacks() -> dict[str, str]:
    """The sections that belong to one stack (`register_section(..., stack=)`): section -> stack."""
    return dict(_SECTION_STACKS)


@dataclass(frozen=True)
class Stack:
    """A training stack `config.stack` may name: its runner class as `module:Class` (imported only when a runner of
    that stack is built) and the other names it answers to."""

    name: str
    runner: str
    aliases: tuple[str, ...] = ()


# torch, the default stack, is the registry's own; every other stack registers itself (`register_stack`) from the
# light module that declares its section, imported with the package (`perdure/sections.py`, whose order is this one's).
_STACKS: dict[str, Stack] = {"torch": Stack("torch", "perdure.runners.torch_runner:TorchRunner")}


def register_stack(name: str, runner: str, aliases: tuple[str, ...] = ()) -> None:
    """Make `name` (and its `aliases`) a value of `config.stack` whose runner is `runner` (`module:Class`). Stacks are
    listed (`stack_names`, errors) in the order they were registered; registering a stack again replaces it."""
    _STACKS[name] = Stack(name, runner, tuple(aliases))


def stack_names() -> tuple[str, ...]:
    """Every value `config.stack` may hold: each stack's name followed by its aliases, in registration order."""
    return tuple(name for stack in _STACKS.values() for name in (stack.name, *stack.aliases))


def find_stack(name: Any) -> Stack | None:
    """The stack `name` names (its own name or an alias), or None."""
    return next((stack for stack in _STACKS.values() if name == stack.name or name in stack.aliases), None)


def sections() -> dict[str, tuple[SectionKey, ...]]:
    """The registered sections' keys, by section, in the order `RunnerConfig` holds them."""
    return dict(sorted(_SECTIONS.items()))


def section_keys() -> dict[str, SectionKey]:
    """Every registered section's keys, by dotted key (`parallel.axes.shard`), in the order `RunnerConfig` has."""
    return {f"{section}.{key.name}": key for section, keys in sections().items() for key in keys}


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
