"""No import circle among the library's modules (kquant_cute, kernels, planners,
compile_cache), counting every import statement of a module: top-level and inside
functions alike (an import moved into a function to dodge a circle still closes it)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Source folder -> the package it installs as (pyproject's package-dir).
ROOTS = {"kquant_cute": "kquant_cute", "kernels": "kquant_cute.kernels",
         "planners": "kquant_cute.planners", "compile_cache": "kquant_cute.compile_cache"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package __init__)."""
    out = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out[".".join([package, *parts])] = (path, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the library modules its import statements name (``from pkg import name``
    counts as the submodule ``pkg.name`` when there is one, else as ``pkg``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{target}.{alias.name}" in mods:
                        deps.add(f"{target}.{alias.name}")
                    elif target in mods:
                        deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle_and_its_members():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_function_level_and_package_imports():
    graph = import_graph()
    assert "kquant_cute.qsrt.format" in graph["kquant_cute.weights"]     # from .qsrt import format
    assert "kquant_cute.weights" in graph["kquant_cute.qsrt.read"]       # from ..weights import
    assert "kquant_cute.kernels.format" in graph["kquant_cute.trellis"]  # kernels/ as a subpackage
    assert "kquant_cute.quantize" in graph["kquant_cute.weights"]        # inside a function
    assert len(graph) > 40


def test_no_import_circle_among_the_library_modules():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)
