"""No new import cycle in perdure/: the module graph (module-level and function-level imports, read with `ast`) has no
strongly connected component beyond the known ones listed below, which may only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Known cycles (issue 39), each a strongly connected component of today's graph. Break one, then shrink or remove its
# entry here; the test fails on any cycle not inside one of these, and on an entry that no longer matches. None is
# left: the last (the runner's lifecycle and the stacks, through runners/hf_export.py) went when each stack began
# writing its own Hugging Face weights (`write_hf_weights`).
KNOWN_CYCLES: list[frozenset[str]] = []


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its body (a function's imports included)."""
    package = package_dir.name
    files = {module_name(package_dir, path): path for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, one level up per extra dot
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from a import b`: the module a.b when it is one, else a itself
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source for alias in node.names
                ]
            for target in targets:
                while target and target not in files and target.split(".")[0] == package:
                    target = target.rpartition(".")[0]  # `import a.b.c` of an attribute: its module
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_perdure_has_no_import_cycle_beyond_the_known_ones() -> None:
    found = cycles(import_graph(ROOT / "perdure"))
    new = [sorted(c) for c in found if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, f"new import cycles: {new}"
    stale = [sorted(known) for known in KNOWN_CYCLES if known not in found]
    assert not stale, f"these known cycles changed or are gone, shrink KNOWN_CYCLES to what remains: {stale}"


def test_a_planted_cycle_is_found_function_level_imports_included(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\n")
    (package / "c.py").write_text("import pkg.a\ndef g():\n    pass\n")
    (package / "d.py").write_text("from pkg import a\n")  # imports into the cycle, is not part of it
    graph = import_graph(package)
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.sub.b", "pkg.c"})]
