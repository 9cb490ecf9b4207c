"""Private torch and DeepSpeed APIs are used in one place, perdure/private_api.py (issue 39): no other module of perdure
imports a private module or name of theirs or reaches one through an attribute (a name segment starting with `_`
after `torch.` / `deepspeed.`, aliases followed), and the adapter imports nothing of perdure."""

from __future__ import annotations

import ast

from tests.test_import_cycles import ROOT, import_graph

ADAPTER = "perdure.private_api"
LIBRARIES = ("torch", "deepspeed")
PUBLIC_DUNDERS = frozenset({"__future__", "__version__"})  # torch.__future__ is documented API


def is_private(dotted: str) -> bool:
    """Whether a dotted name of torch or DeepSpeed has a private segment after the library's own name."""
    parts = dotted.split(".")
    return parts[0] in LIBRARIES and any(p.startswith("_") and p not in PUBLIC_DUNDERS for p in parts[1:])


def _attribute_chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` -> ["a", "b", "c"]; None for a chain that does not start at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(source: str, filename: str = "<source>") -> list[str]:
    """Where `source` touches a private torch / DeepSpeed name: `line: dotted name`."""
    tree = ast.parse(source, filename)
    bound: dict[str, str] = {}  # local name -> the dotted torch / DeepSpeed name it stands for
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
                    if is_private(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    bound[alias.asname or alias.name] = dotted
                    if is_private(dotted):
                        found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain and chain[0] in bound:
                base = bound[chain[0]]
                dotted = ".".join([base, *chain[1:]])
                if is_private(dotted) and not is_private(base):  # reported once, at its import, when the base is
                    found.append(f"{node.lineno}: {dotted}")
    return sorted(set(found), key=lambda entry: int(entry.split(":")[0]))


def test_only_the_adapter_touches_private_torch_and_deepspeed_apis() -> None:
    package = ROOT / "perdure"
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        if path == package / "private_api.py":
            continue
        uses = private_uses(path.read_text(encoding="utf-8"), str(path))
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, f"private torch / DeepSpeed APIs outside perdure/private_api.py: {offenders}"


def test_the_adapter_imports_nothing_of_perdure() -> None:
    assert import_graph(ROOT / "perdure")[ADAPTER] == set()


def test_the_check_finds_each_form_of_a_private_use() -> None:
    source = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "from torch import nn",
            "from torch.utils._pytree import tree_map",  # 4: a private module
            "from torch.distributed.checkpoint.filesystem import _StorageInfo",  # 5: a private name
            "import deepspeed.ops",
            "def f(module, engine):",
            "    torch._foreach_lerp_([], [], 0.5)",  # 8
            "    dist._functional_collectives",  # 9: through an alias
            "    nn.Module._save_to_state_dict",  # 10: a private member of a public class
            "    deepspeed.ops.__compatible_ops__",  # 11
            "    torch.__future__.get_swap_module_params_on_conversion()",  # documented: not reported
            "    module._parameters",  # an instance's: not what this check can see
        ]
    )
    assert [entry.split(":")[0] for entry in private_uses(source)] == ["4", "5", "8", "9", "10", "11"]


def test_the_adapter_is_where_the_private_uses_are() -> None:
    # the check is not vacuous: the adapter itself holds what it finds elsewhere
    assert private_uses((ROOT / "perdure" / "private_api.py").read_text(encoding="utf-8"))


def test_the_adapter_names_the_tested_version_of_each_private_use() -> None:
    # every function of the adapter says, in its comment, the torch / DeepSpeed release it is tested with
    source = (ROOT / "perdure" / "private_api.py").read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    undated = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if "torch 2.13" not in body and "DeepSpeed 0.19.8" not in body:
                undated.append(node.name)
    assert not undated, f"functions of perdure/private_api.py without the release they are tested with: {undated}"
