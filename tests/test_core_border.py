"""The core package's border: nothing under mergepipe/ imports Kubernetes code (the kubernetes
client, kopf, the operator, or mergepipe_kube); the search's Kubernetes backend is found through
the ``mergepipe.worker_backends`` entry point."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "mergepipe"
FORBIDDEN = ("kubernetes", "kopf", "mergepipe_operator", "mergepipe_kube")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_core_never_imports_kubernetes_code():
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
