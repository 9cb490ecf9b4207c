"""Plain-dict helpers: nested mappings as plain dicts, lists and scalars (YAML / JSON dumpable), and dotted keys.
A leaf module: it imports nothing else of perdure (`perdure.config` re-exports both functions)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def plain_dict(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """Deep copy of `mapping` as plain dicts / lists / scalars; empty-dict leaves dropped, tuples and paths made
    YAML-friendly (lists, strings)."""
    result: dict[str, Any] = {}
    for key, value in mapping.items():
        value = _plain_value(value)
        if not (isinstance(value, dict) and not value):
            result[key] = value
    return result


def _plain_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return plain_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain_value(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`. Lists are leaves; empty dicts vanish. Reads mappings without creating."""
    result: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            result.update(flatten(value, dotted + "."))
        else:
            result[dotted] = _plain_value(value)
    return result
