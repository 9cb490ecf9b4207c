"""Small helpers for messages people read."""

from __future__ import annotations

from typing import Any


def counted(count: Any, noun: str, plural: str | None = None) -> str:
    """`1 rank`, `2 ranks`, `? ranks` (a count that is not an integer, e.g. a manifest that lacks it)."""
    if isinstance(count, bool) or not isinstance(count, int):
        return f"{count if count is not None else '?'} {plural or noun + 's'}"
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
