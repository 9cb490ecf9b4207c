"""Careful I/O for files that may come from someone else (see docs/security.md).

Everything a run directory, a checkpoint or a config file holds may have been written by another person: a sidecar
nested 100,000 levels deep, a FIFO named `latest`, a `run.lock` that is a symlink to a file outside, a YAML alias
bomb, a run id full of terminal escapes. The helpers here are what the rest of perdure reads and writes through:

- reading: `read_regular` opens regular files only (never a FIFO, device or socket, so nothing hangs), without
  following a symlink unless the user named the file, and with a size bound; `read_json` / `loads_json` add a
  nesting bound; `load_yaml` bounds size, nesting and alias expansion (`yaml.safe_load` semantics otherwise);
- writing: `ensure_dir` creates directories and refuses a symlink where a directory belongs; `create_new` creates
  a file with `O_EXCL | O_NOFOLLOW`; `open_writable` opens for writing without following a symlink; `move_aside`
  renames an unexpected symlink (the link, never its target) out of the way;
- output: `escape_terminal` / `safe_name` make any on-disk text inert on a terminal; `csv_text` neutralises
  spreadsheet formulas.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from perdure.errors import UnsafeFileError as UnsafeFileError  # the error of every helper here

MAX_JSON_BYTES = 64 << 20  # a manifest of a very large checkpoint, or a sidecar with a long history, stays far below
MAX_JSON_DEPTH = 64  # perdure's own JSON files nest at most 5 levels
MAX_YAML_BYTES = 4 << 20
MAX_YAML_NODES = 100_000  # nodes after alias expansion; a config has a few hundred
MAX_NAME_SHOWN = 64  # characters of a hostile name (a pointer's content, ...) ever echoed


# ---------------------------------------------------------------------- reading


def kind_of(mode: int) -> str:
    """`a FIFO`, `a directory`, `a symlink`, ...: what a file of `st_mode` is, for messages."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = False) -> int:
    """A read-only descriptor of `path`, which must be a regular file (else `UnsafeFileError`, before anything could
    block). Without `follow_symlinks` a symlink is refused too. FileNotFoundError passes through."""
    info = os.stat(path) if follow_symlinks else os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(path, f"is {kind_of(info.st_mode)}, not a regular file; perdure reads regular files only")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_symlinks:
            raise UnsafeFileError(path, "is a symlink; perdure does not follow symlinks inside a run") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # replaced between the lstat and the open
        os.close(fd)
        raise UnsafeFileError(path, f"is {kind_of(info.st_mode)}, not a regular file; perdure reads regular files only")
    return fd


def is_regular_or_missing(path: str | os.PathLike) -> bool:
    """True if `path` is a regular file (not a symlink to one), False if nothing is there; `UnsafeFileError` when
    something else is (a symlink, a FIFO, a directory, ...)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(path, f"is {kind_of(info.st_mode)}, not a regular file")
    return True


def read_regular(path: str | os.PathLike, limit: int, *, follow_symlinks: bool = False) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (`UnsafeFileError` beyond)."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        if os.fstat(fd).st_size > limit:
            raise UnsafeFileError(path, f"is larger than {limit:,} bytes, the most perdure reads from such a file")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # grew while being read
                raise UnsafeFileError(path, f"is larger than {limit:,} bytes, the most perdure reads from such a file")
        return b"".join(chunks)
    finally:
        os.close(fd)


MAX_TREE_ENTRIES = 1_000_000  # files and folders of one checkpoint tree walked at most
MAX_TREE_DEPTH = 32


def regular_files_under(root: str | os.PathLike) -> list[Path]:
    """Every regular file under directory `root`, found by walking it entry by entry without following anything: a
    symlink anywhere (to a file or to a folder), a FIFO, a device or a socket is an `UnsafeFileError` naming it, as is
    a tree deeper or larger than perdure ever writes. `root` itself must be a real directory. For trees that code
    other than perdure's then opens by name (`Path.rglob` does not descend into a symlinked folder: what lies behind
    one was never looked at)."""
    root = Path(root)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFileError(root, f"is {kind_of(info.st_mode)}, not a directory")
    files: list[Path] = []
    pending, seen = [(root, 0)], 0
    while pending:
        directory, depth = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_TREE_ENTRIES:
                    raise UnsafeFileError(root, f"holds more than {MAX_TREE_ENTRIES:,} entries")
                mode = entry.stat(follow_symlinks=False).st_mode
                path = Path(entry.path)
                if stat.S_ISREG(mode):
                    files.append(path)
                elif stat.S_ISDIR(mode):
                    if depth + 1 >= MAX_TREE_DEPTH:
                        raise UnsafeFileError(path, f"lies more than {MAX_TREE_DEPTH} folders deep")
                    pending.append((path, depth + 1))
                else:
                    raise UnsafeFileError(path, f"is {kind_of(mode)}; perdure reads regular files and folders only")
    return sorted(files)


def check_real_path(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """`path`, after checking each of its components below `root` (which must be its prefix, not resolved): every
    one exists and none is a symlink (`UnsafeFileError` naming the first that is). Unlike `check_inside`, a symlink
    that points back inside is refused too: code that opens `path` by name later must meet the same files."""
    path, root = Path(path), Path(root)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeFileError(
                current, f"is a symlink (to {_link_target(current)}); perdure does not follow one here"
            )
    return path


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth_exceeds(data: bytes, limit: int) -> bool:
    """Whether the JSON text `data` nests arrays / objects deeper than `limit` (a cheap scan outside strings)."""
    depth = 0
    for byte in _JSON_STRING.sub(b'""', data).translate(None, _NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


def loads_json(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads`, refusing (ValueError) text nested deeper than `max_depth` levels."""
    import json

    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if json_depth_exceeds(raw, max_depth):
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None


def read_json(
    path: str | os.PathLike,
    *,
    limit: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    follow_symlinks: bool = False,
) -> Any:
    """Parse the JSON file `path`: a regular file of at most `limit` bytes nested at most `max_depth` levels.

    Raises OSError (`UnsafeFileError` for a FIFO, symlink or oversized file) or ValueError (not JSON, too deep).
    """
    return loads_json(read_regular(path, limit, follow_symlinks=follow_symlinks), max_depth=max_depth)


def load_yaml(text: str | bytes, *, max_nodes: int = MAX_YAML_NODES, scalars_as_text: bool = False) -> Any:
    """`yaml.safe_load(text)` that refuses (`yaml.YAMLError`) documents whose aliases expand to more than `max_nodes`
    nodes (the "billion laughs"), recursive aliases, and nesting beyond Python's recursion limit. `scalars_as_text`:
    every scalar as the text written (`0755` stays `"0755"`, not 493), as `yaml.BaseLoader` reads it."""
    loader = (yaml.BaseLoader if scalars_as_text else yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, max_nodes)
        return loader.construct_document(node)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node, limit: int) -> None:
    """Count the nodes of `root` with every alias expanded, without expanding them (sizes are memoised)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]

    def children(node: yaml.Node) -> list[yaml.Node]:
        if isinstance(node, yaml.MappingNode):
            return [item for pair in node.value for item in pair]
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        return []

    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children(node))
            if sizes[key] > limit:
                raise yaml.YAMLError(f"its aliases expand to more than {limit:,} nodes (an alias bomb?)")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.YAMLError("an alias refers to a node that contains it (a recursive document)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children(node) if id(child) not in sizes)


def read_yaml(path: str | os.PathLike, *, limit: int = MAX_YAML_BYTES, follow_symlinks: bool = False) -> Any:
    """`load_yaml` of the regular file `path` (at most `limit` bytes). Raises OSError or `yaml.YAMLError`."""
    return load_yaml(read_regular(path, limit, follow_symlinks=follow_symlinks))


# ---------------------------------------------------------------------- writing


def ensure_dir(path: str | os.PathLike, *, parents: bool = True) -> Path:
    """Create directory `path` if needed (with its parents) and check that it is a directory, not a symlink to one.

    An existing symlink where the directory belongs is refused with `UnsafeFileError`: writing through it would put
    the run's files wherever it points. Only the last component is checked; see `check_inside` for a whole path.
    """
    path = Path(path)
    try:
        path.mkdir(parents=parents, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling symlink is there: reported below
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise _symlinked_dir(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFileError(path, f"is {kind_of(info.st_mode)} where a directory belongs; move it away")
    return path


def refuse_symlinked_dir(path: str | os.PathLike) -> None:
    """`UnsafeFileError` if `path` is a symlink (where perdure keeps a directory of its own); nothing if it is
    anything else or missing."""
    if is_symlink(path):
        raise _symlinked_dir(Path(path))


def _symlinked_dir(path: Path) -> UnsafeFileError:
    return UnsafeFileError(
        path,
        f"is a symlink (to {_link_target(path)}); perdure never writes through a symlink in a run directory. Replace "
        "it by a real directory (to keep runs on another disk, point --workspace.root there instead).",
    )


def check_inside(path: str | os.PathLike, root: str | os.PathLike, *, what: str = "path") -> Path:
    """`path` if, with every symlink resolved, it lies inside `root` (or is it); `UnsafeFileError` otherwise."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved != base and base not in resolved.parents:
        raise UnsafeFileError(path, f"({what}) resolves to {resolved}, outside {base}")
    return Path(path)


def create_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A write descriptor of a file created now: `O_CREAT | O_EXCL | O_NOFOLLOW`, so an existing file or a symlink
    planted under that name is never written through (FileExistsError)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def open_writable(path: str | os.PathLike, *, append: bool = False, readable: bool = False, mode: int = 0o644) -> int:
    """A write descriptor (appending with `append`; also for reading with `readable`, as a shared mapping needs) of the
    regular file `path`, created if missing, never through a symlink and never a FIFO or device (`UnsafeFileError`)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_APPEND if append else 0)
    flags |= os.O_RDWR if readable else os.O_WRONLY
    try:
        fd = os.open(path, flags, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeFileError(path, "is a symlink; perdure never writes through a symlink in a run") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeFileError(path, f"is {kind_of(info.st_mode)}, not a regular file; move it away")
    os.set_blocking(fd, True)
    return fd


def is_symlink(path: str | os.PathLike) -> bool:
    """Whether `path` itself is a symlink (dangling ones included)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def move_aside(path: str | os.PathLike, why: str) -> Path:
    """Rename `path` (the entry itself: a symlink is moved, its target untouched) to `<name>.<why>-<UTC stamp>` in the
    same directory; return the new path. Used for an unexpected symlink or file where perdure writes its own."""
    path = Path(path)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = path.with_name(f"{path.name}.{why}-{stamp}")
    os.rename(path, aside)
    return aside


def _link_target(path: Path) -> str:
    try:
        return safe_name(os.readlink(path), limit=200)
    except OSError:
        return "?"


# ---------------------------------------------------------------------- output

_BIDI_AND_SEPARATORS = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI_AND_SEPARATORS}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f\x7f-\x9f{_BIDI_AND_SEPARATORS}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_terminal(text: Any, *, keep_newlines: bool = False) -> str:
    """`text` (made a str) with every control character (ESC, CR, BEL, C1, bidi overrides; newlines too unless
    `keep_newlines`) written as a visible escape such as `\\x1b`: safe to print to a terminal."""
    text = str(text)
    return (_CONTROL_BUT_NEWLINE if keep_newlines else _CONTROL).sub(_escape, text)


def safe_name(text: Any, limit: int = MAX_NAME_SHOWN) -> str:
    """At most `limit` characters of `text`, escaped and quoted (`'…'` marks a cut): how a hostile name is shown."""
    text = str(text)
    cut = len(text) > limit
    return "'" + escape_terminal(text[:limit]) + ("…" if cut else "") + "'"


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")


def csv_text(value: str) -> str:
    """A string cell that no spreadsheet reads as a formula: a leading `= + - @`, tab or line break gets a `'`."""
    return "'" + value if value.startswith(_FORMULA_START) else value


def echo(*parts: Any, file: Any = None) -> None:
    """`print` for text that holds values read from disk: every control character but the newline is escaped."""
    print(escape_terminal(" ".join(str(part) for part in parts), keep_newlines=True), file=file)
