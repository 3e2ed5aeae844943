"""The operator commits a partitioned merge in its own process, with the core's `mergepipe commit`
code, and the operator image has no torch: the commit's import path must stay torch-free.

Checked twice: statically (every module-level import reachable from the operator's commit module,
as tests/unit/test_core_border.py reads imports) and by running the commit with torch made
unimportable, on parts executed by the real engine."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit.manifest import verify_snapshot
from mergepipe.engine.partition import PartSpec
from mergepipe.parts import execute_part
from mergepipe.pipeline import build_plan, execute_and_commit
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"mergepipe": ROOT / "mergepipe", "mergepipe_operator": ROOT / "operator" / "mergepipe_operator"}
FORBIDDEN = ("torch", "transformers", "safetensors.torch", "botorch", "gpytorch")
ENTRY = "mergepipe_operator.modelmerge.committing"


def _module_file(mod: str) -> Path | None:
    top, *rest = mod.split(".")
    if top not in SOURCES:
        return None
    p = SOURCES[top].joinpath(*rest)
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").exists() else None


def _top_level_imports(mod: str, path: Path) -> list[str]:
    """Modules imported when ``mod`` is imported: its module-level import statements (also
    inside top-level ``if``/``try``, except ``if TYPE_CHECKING``), relative ones resolved.
    Imports inside functions run only when called, so they are not followed."""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                out.append(target)
                out.extend(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return out


def test_the_commit_import_path_is_torch_free_statically():
    seen: dict[str, str] = {}
    todo = [(ENTRY, "")]
    bad = []
    while todo:
        mod, via = todo.pop()
        if mod in seen:
            continue
        seen[mod] = via
        if mod == "torch" or mod.startswith(FORBIDDEN) or mod in FORBIDDEN:
            bad.append(f"{mod} (imported by {via})")
            continue
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c imports a and a.b first
            parent = ".".join(parts[:i])
            f = _module_file(parent)
            if f is not None and parent not in seen:
                todo.append((parent, via or parent))
        f = _module_file(mod)
        if f is None:
            continue
        todo.extend((m, mod) for m in _top_level_imports(mod, f))
    assert bad == []
    assert "mergepipe.parts" in seen and "mergepipe.commit.objectstore" in seen  # the walk reached the core


COMMIT_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None  # `import torch` now raises ImportError, as in the operator image
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from mergepipe_operator.modelmerge.committing import commit_parts
plan_file, out, base = sys.argv[1], sys.argv[2], sys.argv[3]
mh = commit_parts(open_storage(base, IOCounters()), plan_file, out, 2)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "botorch", "kopf", "kubernetes"))
print(json.dumps({"manifest_hash": mh, "torch": sys.modules["torch"] is not None, "heavy": heavy}))
"""


def test_the_operator_commits_parts_without_torch(family, tmp_path):
    base, experts = family
    st = open_storage(str(base), IOCounters())
    plan = build_plan(
        Catalog(tmp_path / "c.sqlite"),
        st,
        request_from_args(str(base), [(e.name, str(e)) for e in experts], "ties", ["density=0.5"], budget="50%"),
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    out = str(tmp_path / "snap")
    for i in range(2):  # what the Indexed Job's two pods do
        assert execute_part(plan, open_storage(str(base), IOCounters()), out, PartSpec(i, 2)) is not None
    r = subprocess.run(
        [sys.executable, "-c", COMMIT_WITHOUT_TORCH, str(plan_file), out, str(base)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["torch"] is False and res["heavy"] == []
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    assert verify_snapshot(out)["ok"] and len(manifest["parts"]) == 2
    # the workers' versions (torch included) are recorded, not the committing process's
    assert "torch" in manifest["versions"]
    one = execute_and_commit(plan, open_storage(str(base), IOCounters()), str(tmp_path / "one"))
    assert manifest["snapshot_id"] == one.manifest["snapshot_id"]
    assert manifest["io"]["realized"]["expert_read_bytes"] == one.manifest["io"]["realized"]["expert_read_bytes"]
