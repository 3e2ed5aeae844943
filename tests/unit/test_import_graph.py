"""The import graph has no circle: not between modules of the shipped packages (core, testbeds,
operator, Kubernetes backend), not between the top-level packages (those four, bench/, testkit/ and
tests/: the core never imports the testbeds, bench/ never imports tests/), and not between the
operator's sub-packages (shared Kubernetes code imports no resource).

Every import counts, module-level or inside a function (a function-local import that runs back
up is still a circle, only a deferred one): an edge goes from a module to each module of the same
tree it names (``from pkg.mod import name`` names ``pkg.mod``, or ``pkg.mod.name`` when that is a
module). Packages' ``__init__`` files re-export and are left out, as is the implicit import of a
parent package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = {
    "mergepipe": ROOT / "mergepipe",
    "mergepipe_zoo": ROOT / "mergepipe_zoo",
    "mergepipe_operator": ROOT / "operator" / "mergepipe_operator",
    "mergepipe_kube": ROOT / "operator" / "mergepipe_kube",
}
#: not shipped, but their packages must not form circles with each other or the shipped ones
SUPPORT_TREES = {"bench": ROOT / "bench", "testkit": ROOT / "testkit", "tests": ROOT / "tests"}


def _modules(trees: dict[str, Path] = TREES) -> dict[str, Path]:
    out = {}
    for name, folder in trees.items():
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


def _packages(graph: dict[str, set[str]], package) -> dict[str, set[str]]:
    """``graph`` with every module replaced by ``package(module)`` (None: left out), self-edges dropped."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        p = package(m)
        if p is None:
            continue
        out.setdefault(p, set())
        out[p] |= {q for q in map(package, targets) if q is not None and q != p}
    for targets in list(out.values()):
        for q in targets:
            out.setdefault(q, set())
    return out


def _operator_part(mod: str) -> str | None:
    """``mergepipe_operator.<name>``: the operator's sub-package, or top-level module (main,
    controller, settings, ...), that ``mod`` belongs to; None outside the operator."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if parts[0] == "mergepipe_operator" else None


def test_the_graph_finds_a_circle_when_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    g = {"p.x": {"q.y"}, "q.y": {"q.z"}, "q.z": {"p.w"}, "p.w": set()}
    assert _cycles(g) == [] and _cycles(_packages(g, lambda m: m.split(".")[0])) == [["p", "q"]]


def test_no_import_circle_in_the_core_or_the_operator():
    modules = _modules()
    assert "mergepipe.storage.routing" in modules and "mergepipe_operator.main" in modules
    graph = {m: _edges(m, p, modules) for m, p in modules.items()}
    assert "mergepipe.storage.base" in graph["mergepipe.storage.routing"]  # edges are found
    assert _cycles(graph) == []


def test_no_circle_between_top_level_packages():
    """Today's edges: mergepipe_zoo, the operator and bench/ use the core; tests/ use everything.
    A circle here (the core importing the zoo, bench/ importing tests/) means neither side can be
    understood, packaged or tested without the other."""
    modules = _modules({**TREES, **SUPPORT_TREES})
    graph = _packages({m: _edges(m, p, modules) for m, p in modules.items()}, lambda m: m.split(".")[0])
    assert "mergepipe" in graph["mergepipe_zoo"] and "bench" in graph["tests"]  # edges are found
    assert _cycles(graph) == []


def test_no_circle_between_the_operators_subpackages():
    """Each resource's sub-package (modelmerge, search, snapshot, quota, ...), the shared
    Kubernetes code (k8s) and the operator's top-level modules form no loop: shared code imports
    no resource, resources do not import each other back (issue 25 item 5)."""
    modules = _modules()
    graph = _packages({m: _edges(m, p, modules) for m, p in modules.items()}, _operator_part)
    assert "mergepipe_operator.k8s" in graph and len(graph) > 3
    loops = _cycles(graph)
    if loops:  # reported, not failed, until the operator's restructuring (issue 25 item 5) lands
        edges = "; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(c)))}" for c in loops for a in c)
        pytest.xfail(f"the operator's sub-packages still form {len(loops)} loop(s): {edges}")
