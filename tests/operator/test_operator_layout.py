"""The operator's shape (issue 25 item 5): each resource package owns its model, decisions and
reconciler; shared Kubernetes code imports no resource; the sub-packages form no import circle;
reconcilers are composed (their services passed in), never inherited from one another."""

from __future__ import annotations

import ast
import inspect
import textwrap

from mergepipe_operator import controller as ctl
from mergepipe_operator.reconcile import Reconciler
from tests.unit.test_import_graph import _cycles, _edges, _modules

RESOURCES = ("modelmerge", "snapshot", "quota", "search", "kueue")


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "mergepipe_operator" else parts[0]


def _package_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for m, path in modules.items():
        if not m.startswith("mergepipe_operator."):
            continue
        for dep in _edges(m, path, modules):
            if dep.startswith("mergepipe_operator.") and _package(dep) != _package(m):
                graph.setdefault(_package(m), set()).add(_package(dep))
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    return graph


def test_no_import_circle_between_the_operator_sub_packages():
    graph = _package_graph()
    assert "mergepipe_operator.modelmerge" in graph["mergepipe_operator.search"]  # edges are found
    assert _cycles(graph) == []


def test_shared_kubernetes_code_imports_no_resource():
    graph = _package_graph()
    for shared in ("mergepipe_operator.k8s", "mergepipe_operator.quantities", "mergepipe_operator.settings"):
        assert not {f"mergepipe_operator.{r}" for r in RESOURCES} & graph.get(shared, set()), shared


def test_every_resource_owns_its_model_decisions_and_reconciler():
    import importlib

    for r in ("modelmerge", "snapshot", "quota", "search"):
        for part in ("model", "decisions", "controller", "handlers"):
            importlib.import_module(f"mergepipe_operator.{r}.{part}")


def test_reconcilers_are_composed_not_inherited():
    """Every reconciler derives from the base only; the controller builds them with their
    services (a reconciler that needs another gets it in its constructor)."""
    reconcilers = {c for c in _subclasses(Reconciler)}
    assert {c.__name__ for c in reconcilers} >= {
        "MergeReconciler",
        "SearchReconciler",
        "SnapshotVerifier",
        "QuotaLedger",
        "IOBudgetCheck",
    }
    for c in reconcilers:
        assert c.__bases__ == (Reconciler,), f"{c.__name__} inherits {c.__bases__}"
    assert ctl.Controller.__bases__ == (object,)
    src = ast.parse(textwrap.dedent(inspect.getsource(ctl.Controller.__init__)))
    built = {n.func.id for n in ast.walk(src) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"MergeReconciler", "SearchReconciler", "SnapshotVerifier", "QuotaLedger", "IOBudgetCheck"} <= built


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out
