"""examples/: every resource validates against the generated CRD schema (and the operator's own
checks); broken variants are rejected, by the schema or, for what a schema cannot say, by
validate_merge_spec."""

from __future__ import annotations

import copy
from datetime import datetime, timezone

import pytest
from op_testlib import ROOT, cr_errors, k8s_validate, load_docs

from mergepipe_operator.k8s import conditions as cond  # noqa: E402
from mergepipe_operator.modelmerge import (
    decisions as mmd,  # noqa: E402
    spec as mmspec,  # noqa: E402
)
from mergepipe_operator.quota import decisions as qd  # noqa: E402

EXAMPLES = ROOT / "examples"


def merges():
    return [doc for doc in load_docs(EXAMPLES / "merge.yaml")]


def quota():
    (q,) = load_docs(EXAMPLES / "quota.yaml")
    return q


def test_example_files_exist():
    for name in ("merge.yaml", "quota.yaml", "search.yaml", "argocd-application.yaml", "kserve-inferenceservice.yaml"):
        assert (EXAMPLES / name).is_file(), name


@pytest.mark.parametrize("doc", merges() + [quota()], ids=lambda doc: doc["metadata"]["name"])
def test_examples_validate_against_the_crds(doc):
    assert cr_errors(doc) == []


def test_example_merges_pass_the_operator_checks():
    for doc in merges():
        assert mmspec.validate_merge_spec(doc["spec"]) == [], doc["metadata"]["name"]
    assert {m["spec"]["method"] for m in merges()} == {"ties", "slerp"}
    limits = qd.quota_limits(quota())
    assert limits.expert_read_bytes == 200 * 1024**3 and limits.enforcement == "Clamp"


def test_example_snapshot_status_and_quota_status_validate():
    """Objects as the operator writes them (status included) fit the schemas too."""
    now = datetime(2026, 11, 22, tzinfo=timezone.utc)
    q = quota()
    adm = qd.admit(q, 10 * 1024**3, now, key="uid.1", merge="llama-code-math-chat")
    q["status"] = adm.new_status
    q["status"]["conditions"] = cond.set_condition(None, "Ready", "True", "Active", "quota enforced", 1, now)
    assert cr_errors(q) == []
    snap = {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "MergedSnapshot",
        "metadata": {"name": "llama-code-math-chat-0123456789ab", "namespace": "team-llm"},
        "spec": {
            "uri": "s3://snapshots/llama/",
            "manifestHash": "ab" * 32,
            "planDigest": "cd" * 32,
            "source": {"name": "llama-code-math-chat", "uid": "u", "generation": 1},
        },
        "status": {
            "observedGeneration": 1,
            "verifiedTime": "2026-11-22T00:00:00Z",
            "planDigest": "cd" * 32,
            "sizes": {"totalBytes": 10, "files": 2},
            "totalSize": "10B",
            "realized": {"baseReadBytes": 1, "expertReadBytes": 2, "outputWriteBytes": 3},
            "expertRead": "2B",
            "conditions": cond.set_condition(None, "Ready", "True", "Verified", "ok", 1, now),
        },
    }
    assert cr_errors(snap) == []
    mm = merges()[0]
    mm["status"] = {
        "observedGeneration": 1,
        "expertCount": 3,
        "budget": "10Gi",
        "budgetBytes": 10 * 1024**3,
        "plan": mmd.plan_status("cd" * 32, "s3://p/x.json", 1, 2, 3, 0.75, sketch="sign3", sketch_read_bytes=1),
        "jobName": "llama-cdcdcdcdcd",
        "admission": {"key": "uid.1", "budgetBytes": 1, "clamped": False, "quotas": ["q"]},
        "conditions": cond.set_condition(None, "Ready", "False", "JobRunning", "running", 1, now),
    }
    assert cr_errors(mm) == []
    assert any("sketch" in e for e in cr_errors(mutate(mm, ("status", "plan", "sketch"), "sign9")))
    flat = copy.deepcopy(mm)  # the flat plan fields of earlier versions are gone from the schema
    flat["status"]["planDigest"] = flat["status"].pop("plan")["digest"]
    assert any("planDigest" in e for e in cr_errors(flat))
    bad = copy.deepcopy(mm)
    bad["status"]["plan"]["retainedEnergy"] = 1.5
    assert any("retainedEnergy" in e for e in cr_errors(bad))


def mutate(doc, path, value):
    doc = copy.deepcopy(doc)
    node = doc
    *head, last = path
    for p in head:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


DELETE = object()

SCHEMA_REJECTS = [
    (("spec", "budget"), "10 GB"),
    (("spec", "budget"), "-1Gi"),
    (("spec", "budget"), 0),
    (("spec", "budget"), 1.5),
    (("spec", "method"), "frankenmerge"),
    (("spec", "output"), DELETE),
    (("spec", "output", "uri"), "s3://bucket"),
    (("spec", "output", "uri"), "/local/path"),
    (("spec", "base", "uri"), "http://models/base"),
    (("spec", "experts"), []),
    (("spec", "experts", 0, "name"), "Code_Expert"),
    (("spec", "experts", 0, "weight"), "heavy"),
    (("spec", "experts", 0, "parameters"), [0.5]),
    (("spec", "resources", "gpu", "count"), -1),
    (("spec", "resources", "gpu", "resourceName"), "not a resource"),
    (("spec", "resources", "memory"), "32 gigs"),
    (("spec", "seed"), -1),
    (("spec", "s3", "credentialsSecretRef", "name"), "Bad_Name"),
    (("spec", "typo"), 1),
    (("spec", "calibration", "uri"), "/local/calibration.jsonl"),
    (("spec", "calibration"), {"configMap": "cal"}),
    (("spec", "blockValue"), "magnitude"),
    (("spec", "sketch"), "sign4"),
    (("spec", "sketch"), "Sign3"),
]


@pytest.mark.parametrize("path, value", SCHEMA_REJECTS, ids=lambda x: str(x))
def test_schema_rejects_broken_merges(path, value):
    bad = mutate(merges()[0], path, value)
    assert cr_errors(bad), f"schema accepted {path}={value!r}"
    assert mmspec.validate_merge_spec(bad["spec"]), f"operator accepted {path}={value!r}"


FIDELITY_REJECTS = [0, -0.5, 1.5, "high"]


@pytest.mark.parametrize("value", FIDELITY_REJECTS)
def test_schema_rejects_bad_fidelity(value):
    bad = mutate(merges()[1], ("spec", "fidelity"), value)
    assert cr_errors(bad)
    assert any(p == "spec.fidelity" for p, _ in mmspec.validate_merge_spec(bad["spec"]))


OPERATOR_REJECTS = [  # a structural schema (or an unevaluated CEL rule) lets these through
    ((("spec", "fidelity"), 0.9), "spec.fidelity"),  # both budget and fidelity (CEL rule)
    ((("spec", "parameters", "density"), 1.5), "spec.parameters.density"),
    ((("spec", "parameters", "densty"), 0.5), "spec.parameters.densty"),
    ((("spec", "parameters", "normalize"), "yes"), "spec.parameters.normalize"),
    (
        (("spec", "experts", 1, "parameters", "density"), [{"value": 0.5}, {"filter": "mlp", "value": 0.3}]),
        "spec.experts[1].parameters.density[0]",
    ),
    ((("spec", "experts", 1, "parameters", "lambda"), 1.0), "spec.experts[1].parameters.lambda"),
    ((("spec", "budget"), "0"), "spec.budget"),
    ((("spec", "output", "uri"), "s3://models/llama-3.1-8b/merged/"), "spec.output.uri"),
]


@pytest.mark.parametrize("change, field", OPERATOR_REJECTS, ids=lambda x: str(x))
def test_operator_rejects_what_the_schema_cannot(change, field):
    bad = mutate(merges()[0], *change)
    assert cr_errors(bad) == []
    assert field in {p for p, _ in mmspec.validate_merge_spec(bad["spec"])}


def test_slerp_with_two_experts_is_rejected_by_the_operator():
    bad = copy.deepcopy(merges()[1])
    bad["spec"]["experts"].append({"uri": "s3://models/other/"})
    assert cr_errors(bad) == []  # a CEL rule catches it on a real API server
    assert "spec.experts" in {p for p, _ in mmspec.validate_merge_spec(bad["spec"])}


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "enforcement"), "Soft"),
        (("spec", "window"), "1 day"),
        (("spec", "hard", "expertReadBytes"), "lots"),
        (("spec", "hard", "merges"), -1),
        (("spec", "hard"), DELETE),
    ],
    ids=str,
)
def test_schema_rejects_broken_quotas(path, value):
    assert cr_errors(mutate(quota(), path, value))


def test_argocd_application_example():
    apps = load_docs(EXAMPLES / "argocd-application.yaml")
    assert [a["kind"] for a in apps] == ["Application", "Application"]
    for a in apps:
        assert a["apiVersion"] == "argoproj.io/v1alpha1" and a["metadata"]["namespace"] == "argocd"
        assert (ROOT / a["spec"]["source"]["path"]).is_dir()
    chart_app, merges_app = apps
    assert chart_app["spec"]["source"]["path"] == "helm/mergepipe"
    assert int(chart_app["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"]) < int(
        merges_app["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"]
    )
    helm_values = chart_app["spec"]["source"]["helm"]["valuesObject"]
    pytest.importorskip("jsonschema")
    import json

    import jsonschema

    schema = json.loads((ROOT / "helm/mergepipe/values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(helm_values)
    include = merges_app["spec"]["source"]["directory"]["include"].strip("{}").split(",")
    for f in include:
        assert (ROOT / merges_app["spec"]["source"]["path"] / f).is_file()


def test_kserve_example_serves_a_snapshot_storage_uri():
    """The InferenceService reads the model folder a MergedSnapshot's status.storageUri names (the
    shape snapshot.decisions.storage_uri gives an object-store commit), through a ServiceAccount
    holding the merge Jobs' S3 Secret (the chart's default name)."""
    import re

    import yaml

    from mergepipe_operator.snapshot import decisions as snapd

    sa, isvc = load_docs(EXAMPLES / "kserve-inferenceservice.yaml")
    k8s_validate(sa)
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert sa["metadata"]["namespace"] == isvc["metadata"]["namespace"] == merges()[0]["metadata"]["namespace"]
    pred = isvc["spec"]["predictor"]
    assert pred["serviceAccountName"] == sa["metadata"]["name"]
    values = yaml.safe_load((ROOT / "helm/mergepipe/values.yaml").read_text())
    assert [s["name"] for s in sa["secrets"]] == [values["s3"]["credentialsSecret"]["name"]]
    assert pred["model"]["modelFormat"]["name"] == "huggingface"
    uri = pred["model"]["storageUri"]
    out = merges()[0]["spec"]["output"]["uri"]
    rid = re.fullmatch(re.escape(out) + r"runs/([0-9a-f]{16})/", uri)
    assert rid, uri
    facts = snapd.ManifestFacts(
        plan_digest=None,
        snapshot_id=None,
        files_prefix=f"runs/{rid.group(1)}",
        budget_bytes=None,
        outputs={},
        estimated={},
        realized={},
    )
    assert snapd.storage_uri(out, facts) == uri
    snap = isvc["metadata"]["labels"]["mergepipe.io/snapshot"]
    assert re.fullmatch(re.escape(merges()[0]["metadata"]["name"]) + r"-[0-9a-f]{12}", snap)
