"""Argo CD Lua health checks, executed with lupa's Lua 5.1 (Argo CD runs gopher-lua, a Lua 5.1)
in a sandbox without os/io, against the statuses the operator writes."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
import yaml
from op_testlib import ROOT

from mergepipe_operator import crdgen
from mergepipe_operator.k8s import conditions as cond  # noqa: E402
from mergepipe_operator.modelmerge import decisions as mmd  # noqa: E402
from mergepipe_operator.snapshot import decisions as snapd  # noqa: E402

lua51 = pytest.importorskip("lupa.lua51", reason="lupa (Lua runtime) is not installed")

ARGOCD = ROOT / "helm" / "mergepipe" / "argocd"
NOW = datetime(2026, 11, 22, tzinfo=timezone.utc)


def run_health(script: str, obj: dict) -> dict:
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    g = lua.globals()
    for lib in ("os", "io", "require", "dofile", "loadfile", "package", "debug"):
        g[lib] = None  # Argo CD's sandbox has no os/io
    g.obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(script)
    return {"status": hs["status"], "message": hs["message"]}


def script(kind: str) -> str:
    return (ARGOCD / crdgen.ARGOCD_SCRIPTS[kind]).read_text()


def obj(generation=2, observed=2, ready=None, cond_gen=None, status=True):
    o = {"apiVersion": "mergepipe.io/v1alpha1", "kind": "X", "metadata": {"name": "x", "generation": generation}}
    if not status:
        return o
    st = {"observedGeneration": observed} if observed is not None else {}
    if ready is not None:
        st["conditions"] = cond.set_condition(
            [
                {
                    "type": "QuotaAdmitted",
                    "status": "True",
                    "reason": "Admitted",
                    "message": "",
                    "lastTransitionTime": "2026-11-22T00:00:00Z",
                }
            ],
            "Ready",
            ready[0],
            ready[1],
            ready[2],
            cond_gen if cond_gen is not None else observed,
            NOW,
        )
    o["status"] = st
    return o


@pytest.mark.parametrize(
    "o, health",
    [
        (obj(status=False), "Progressing"),
        (obj(observed=None), "Progressing"),
        (obj(observed=1, ready=("True", "Committed", "done")), "Progressing"),  # spec changed, not yet observed
        (obj(ready=None), "Progressing"),
        (obj(ready=("True", "Committed", "snapshot mm1-abc")), "Healthy"),
        (obj(ready=("True", "Committed", "ok"), cond_gen=1), "Progressing"),  # stale condition
        (obj(ready=("False", "Planning", "planning")), "Progressing"),
        (obj(ready=("False", "Analyzing", "analyzing")), "Progressing"),
        (obj(ready=("False", "JobRunning", "running")), "Progressing"),
        (obj(ready=("False", "InvalidSpec", "spec.budget: bad")), "Degraded"),
        (obj(ready=("False", "JobFailed", "BackoffLimitExceeded")), "Degraded"),
        (obj(ready=("False", "QuotaExceeded", "no room")), "Degraded"),
        (obj(ready=("Unknown", "Planning", "")), "Progressing"),
    ],
)
def test_modelmerge_health(o, health):
    got = run_health(script("ModelMerge"), o)
    assert got["status"] == health, got
    assert isinstance(got["message"], str)


def test_modelmerge_degraded_message_names_reason_and_detail():
    got = run_health(script("ModelMerge"), obj(ready=("False", "InvalidSpec", "spec.budget: contains spaces")))
    assert got == {"status": "Degraded", "message": "InvalidSpec: spec.budget: contains spaces"}
    got = run_health(script("ModelMerge"), obj(ready=("True", "Committed", "snapshot s1 verified")))
    assert got == {"status": "Healthy", "message": "snapshot s1 verified"}


@pytest.mark.parametrize("reason", sorted(mmd.TERMINAL_MERGE_REASONS))
def test_every_terminal_merge_reason_is_degraded(reason):
    assert run_health(script("ModelMerge"), obj(ready=("False", reason, "x")))["status"] == "Degraded"


@pytest.mark.parametrize("reason", sorted(snapd.TERMINAL_SNAPSHOT_REASONS))
def test_every_terminal_snapshot_reason_is_degraded(reason):
    assert run_health(script("MergedSnapshot"), obj(ready=("False", reason, "x")))["status"] == "Degraded"


@pytest.mark.parametrize(
    "o, health",
    [
        (obj(status=False), "Progressing"),
        (obj(ready=("True", "Verified", "manifest abc verified")), "Healthy"),
        (obj(ready=("False", "ManifestMissing", "no committed manifest yet")), "Progressing"),
        (obj(ready=("False", "Verifying", "")), "Progressing"),
        (obj(ready=("False", "ManifestHashMismatch", "x")), "Degraded"),
        (obj(observed=1, ready=("True", "Verified", "x")), "Progressing"),
    ],
)
def test_mergedsnapshot_health(o, health):
    assert run_health(script("MergedSnapshot"), o)["status"] == health


@pytest.mark.parametrize(
    "o, health",
    [
        (obj(status=False), "Progressing"),
        (obj(ready=("False", "Searching", "3/32 candidates evaluated")), "Progressing"),
        (obj(ready=("True", "Completed", "32/32 candidates evaluated")), "Healthy"),
        (obj(observed=1, ready=("True", "Completed", "x")), "Progressing"),  # new generation: a new search
        (obj(ready=("False", "Failed", "driver Job failed")), "Degraded"),
        (obj(ready=("False", "InvalidSpec", "spec.vary[0].name: ...")), "Degraded"),
    ],
)
def test_mergesearch_health(o, health):
    assert run_health(script("MergeSearch"), o)["status"] == health


def test_non_terminal_reasons_are_progressing():
    for r in ("Planning", "Analyzing", "JobRunning"):
        assert r not in mmd.TERMINAL_MERGE_REASONS
    assert cond.Reason.MANIFEST_MISSING not in snapd.TERMINAL_SNAPSHOT_REASONS


def test_checked_in_scripts_are_generated_from_one_template():
    for kind, name in crdgen.ARGOCD_SCRIPTS.items():
        assert (ARGOCD / name).read_text() == crdgen.health_script(kind), "run: python -m mergepipe_operator.crdgen"
    mm, snap = crdgen.health_script("ModelMerge"), crdgen.health_script("MergedSnapshot")
    assert "mergepipe.io/ModelMerge" in mm and "mergepipe.io/MergedSnapshot" in snap
    for reason in mmd.TERMINAL_MERGE_REASONS:
        assert f"  {reason} = true," in mm and reason not in snap
    for reason in snapd.TERMINAL_SNAPSHOT_REASONS:
        assert f"  {reason} = true," in snap and f"{reason} = true" not in mm


def test_crdgen_check_detects_a_stale_health_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(crdgen, "argocd_dir", lambda: tmp_path)
    assert crdgen.main(["--check"]) == 1  # nothing generated there yet
    assert crdgen.main([]) == 0  # writes the scripts and the patch (the CRDs are current)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*crdgen.ARGOCD_SCRIPTS.values(), crdgen.ARGOCD_PATCH])
    assert crdgen.main(["--check"]) == 0
    lua = tmp_path / crdgen.ARGOCD_SCRIPTS["ModelMerge"]
    lua.write_text(lua.read_text().replace("  JobFailed = true,\n", ""))
    capsys.readouterr()
    assert crdgen.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "+  JobFailed = true," in out and out.count("+++ generated") == 1  # only the edited script


def test_argocd_cm_patch_ships_the_scripts():
    text = (ARGOCD / crdgen.ARGOCD_PATCH).read_text()
    assert text == crdgen.argocd_patch(), "run: python -m mergepipe_operator.crdgen"
    data = yaml.safe_load(text)["data"]
    assert data == {
        "resource.customizations.health.mergepipe.io_ModelMerge": script("ModelMerge"),
        "resource.customizations.health.mergepipe.io_MergedSnapshot": script("MergedSnapshot"),
        "resource.customizations.health.mergepipe.io_MergeSearch": script("MergeSearch"),
    }
