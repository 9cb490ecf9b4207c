"""Small helpers for messages people read."""

from __future__ import annotations

from typing import Any


def counted(count: Any, noun: str, plural: str | None = None) -> str:
    """`1 rank`, `2 ranks`, `? ranks` (a count that is not an integer, e.g. a manifest that lacks it)."""
    if isinstance(count, bool) or not isinstance(count, int):
        return f"{count if count is not None else '?'} {plural or noun + 's'}"
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def human_size(size: float) -> str:
    """Bytes in binary units: 512 B, 1.5 KiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
