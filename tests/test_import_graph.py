"""The import graph of the shipped packages (core, testbeds, operator, Kubernetes backend) has no
circle.

Every import counts, module-level or inside a function (a function-local import that runs back
up is still a circle, only a deferred one): an edge goes from a module to each module of the same
tree it names (``from pkg.mod import name`` names ``pkg.mod``, or ``pkg.mod.name`` when that is a
module). Packages' ``__init__`` files re-export and are left out, as is the implicit import of a
parent package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = {
    "mergepipe": ROOT / "mergepipe",
    "mergepipe_zoo": ROOT / "mergepipe_zoo",
    "mergepipe_operator": ROOT / "operator" / "mergepipe_operator",
    "mergepipe_kube": ROOT / "operator" / "mergepipe_kube",
}


def _modules() -> dict[str, Path]:
    out = {}
    for name, folder in TREES.items():
        for p in folder.rglob("*.py"):
            if p.name == "__init__.py":
                continue
            rel = p.relative_to(folder).with_suffix("")
            out[".".join((name, *rel.parts))] = p
    return out


def _edges(mod: str, path: Path, modules: dict[str, Path]) -> set[str]:
    pkg = mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules and n != mod}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_finds_a_circle_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_core_or_the_operator():
    modules = _modules()
    assert "mergepipe.storage.routing" in modules and "mergepipe_operator.main" in modules
    graph = {m: _edges(m, p, modules) for m, p in modules.items()}
    assert "mergepipe.storage.base" in graph["mergepipe.storage.routing"]  # edges are found
    assert _cycles(graph) == []
