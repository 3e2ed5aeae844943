"""The core package's border: nothing under mergepipe/ imports Kubernetes code (the kubernetes
client, kopf, the operator, or mergepipe_kube) or the testbeds (mergepipe_zoo); the search's
Kubernetes backend, the zoo evaluator and the demo are found through entry points
(:mod:`mergepipe.plugins`)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "mergepipe"
FORBIDDEN = ("kubernetes", "kopf", "mergepipe_operator", "mergepipe_kube", "mergepipe_zoo")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_core_never_imports_kubernetes_code_or_the_zoo():
    bad = [
        f"{p.relative_to(CORE.parent)}: {m}"
        for p in sorted(CORE.rglob("*.py"))
        for m in _imports(p)
        if m.split(".")[0] in FORBIDDEN
    ]
    assert bad == []


def test_the_kubernetes_worker_backend_is_an_entry_point():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="mergepipe.worker_backends") if ep.name == "kubernetes"]
    mod = ep.load()
    assert mod.__name__ == "mergepipe_kube.search"
    assert callable(mod.KubernetesMerger) and callable(mod.KubernetesJobEvaluator) and callable(mod.kube_api)


def test_the_zoo_evaluator_and_the_demo_are_entry_points():
    from mergepipe.plugins import PluginMissing, load_plugin
    from mergepipe.search.evaluators import Evaluator, evaluator_from_spec

    cls = load_plugin("mergepipe.evaluators", "zoo")
    assert cls.__module__ == "mergepipe_zoo.evaluator" and issubclass(cls, Evaluator)
    ev = evaluator_from_spec({"kind": "zoo", "domains": ["json"], "tiny": True, "zoo_root": None, "max_batches": 1})
    assert type(ev) is cls and ev.known_metrics() == ["loss:json"]
    assert load_plugin("mergepipe.demos", "zoo").__module__ == "mergepipe_zoo.demo"
    try:
        load_plugin("mergepipe.evaluators", "no-such-kind")
    except PluginMissing as e:
        assert "no-such-kind" in str(e)
    else:
        raise AssertionError("an unknown plugin was found")
