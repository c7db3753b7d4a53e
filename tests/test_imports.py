"""The modules of ``src/specpilot`` import one way: no import circle, TYPE_CHECKING imports
included (docs/ENGINE.md, "Module map")."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_graph(src: Path) -> dict[str, set[str]]:
    """Module → the package modules it imports (``from a import b`` counts ``a.b`` when that
    is a module, else ``a``; a package's ``__init__`` is a module of its own)."""
    files = {}
    for path in (src / "specpilot").rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                names = [source] + [f"{source}.{a.name}" for a in node.names]
            graph[mod] |= {n for n in names if n in files and n != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "specpilot" / "p"
    pkg.mkdir(parents=True)
    (tmp_path / "specpilot" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")  # fmt: skip
    (pkg / "b.py").write_text("from specpilot.p.a import x\n")
    graph = module_graph(tmp_path)
    assert graph["specpilot.p.a"] == {"specpilot.p", "specpilot.p.b"}  # the package runs first
    assert graph["specpilot.p.b"] == {"specpilot.p.a"}
    assert circles(graph) == [["specpilot.p.a", "specpilot.p.b"]]


def test_src_has_no_import_circle() -> None:
    found = circles(module_graph(SRC))
    assert not found, "import circles: " + "; ".join(" ↔ ".join(c) for c in found)
