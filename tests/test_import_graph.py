"""The package's modules import each other without cycles, lazy (in-function) imports included.

A cycle is hidden coupling: two modules that each need the other belong together, or share
something that belongs in a lower module both import (as ``safesparse.engine.convert`` holds what
the factories and the index checks share).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "safesparse"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The safesparse modules one ``from ... import ...`` statement names."""
    if node.level:
        base = current.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("safesparse"):
        return []
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    packages = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                deps.update(_resolve(name, path.name == "__init__.py", node))
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("safesparse."))
        # a package's __init__ re-exports its modules; edges into it say nothing about layering
        graph[name] = {d for d in deps if d in files and d != name and d not in packages}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in graph.get(stack.pop(), set()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    return [(a, b) for a in sorted(graph) for b in sorted(graph[a]) if a in reachable(b)]


def test_the_graph_sees_imports() -> None:
    graph = import_graph()
    assert "safesparse.engine.convert" in graph["safesparse.factories.core"]
    assert "safesparse.engine.convert" in graph["safesparse.engine.indices"]
    assert cycles({"a": {"b"}, "b": {"a"}}) == [("a", "b"), ("b", "a")]


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_factories_and_indices_do_not_import_each_other() -> None:
    graph = import_graph()
    assert "safesparse.factories.core" not in graph["safesparse.engine.indices"]
