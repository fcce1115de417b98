"""palu_mlx's modules import one way: no module reaches, directly or through others, back to itself.

Every ``import`` statement counts, function-local ones too: an import moved into a function
to dodge a circle still closes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import palu_mlx

PACKAGE = "palu_mlx"
ROOT = Path(palu_mlx.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the palu_mlx modules (and their packages, the root excluded) it imports anywhere."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = (
                    _resolve(name, is_package, node.level, node.module) if node.level else node.module or ""
                )
                # "from .pkg import mod" imports the submodule mod when there is one
                found = [
                    f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names
                ]
            for target in found:
                # importing a.b.c runs a.b's __init__ too; every module runs the root's, and a module
                # inside a package runs that package's before its own, so those are left out
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    candidate = ".".join(parts[:i])
                    if candidate in modules and not (name + ".").startswith(candidate + "."):
                        targets.add(candidate)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_the_modules_and_their_imports():
    graph = import_graph()
    # the scan must see what it checks, or the cycle test below would pass on an empty graph
    assert "palu_mlx.builder" in graph and "palu_mlx.calibration.fit" in graph
    assert "palu_mlx.models" in graph["palu_mlx.builder"]
    assert {"palu_mlx.models", "palu_mlx.calibration.file"} <= graph["palu_mlx.calibration.fit"]


def test_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, f"import circles among palu_mlx's modules: {found}"
