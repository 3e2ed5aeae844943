"""The CRDs, examples and schema rules against a real Kubernetes API server (apiextensions-apiserver
on etcd, see realapi.py and tests/k8s_apiserver/build.sh), not only against the offline checks.

What only a real server checks: that a CRD is installable at all (it refused ``maximum:
9223372036854775807``, which kmock and jsonschema let through), CEL ``x-kubernetes-validations``
rules, pruning of unknown fields, defaulting, and the server-side printer columns. Every verdict of
the offline checker (``op_testlib.cr_errors``) is compared with the server's. The end-to-end
operator scenarios run against this server too (test_operator_kmock.py, the ``apiserver`` variant).
"""

from __future__ import annotations

import copy
import urllib.parse
from typing import Any

import pytest
from op_testlib import ROOT, cr_errors, load_docs
from realapi import load_crds
from test_operator_examples import DELETE, FIDELITY_REJECTS, OPERATOR_REJECTS, SCHEMA_REJECTS, merges, mutate, quota
from test_operator_search_crd import example as search_example

from mergepipe_operator.crd import GROUP, RESOURCES, VERSION
from mergepipe_operator.k8s import conditions as cond
from mergepipe_operator.k8s.model import SEED_MAX
from mergepipe_operator.modelmerge import decisions as mmd, spec as mmspec
from mergepipe_operator.quota import decisions as qd

pytestmark = pytest.mark.apiserver

#: Kinds in examples/ whose CRDs are other projects' (not installable offline); every other
#: example must be one of ours and is applied.
FOREIGN_KINDS = {
    ("argoproj.io/v1alpha1", "Application"),
    ("serving.kserve.io/v1beta1", "InferenceService"),
    ("v1", "ServiceAccount"),
} | {("kueue.x-k8s.io/v1beta2", k) for k in ("ResourceFlavor", "AdmissionCheck", "ClusterQueue", "LocalQueue")}


def _path(obj: dict[str, Any], name: bool = False) -> str:
    plural = RESOURCES[obj["kind"]]["plural"]
    p = f"/apis/{GROUP}/{VERSION}/namespaces/{obj['metadata']['namespace']}/{plural}"
    return p + f"/{obj['metadata']['name']}" if name else p


def create(server, obj: dict[str, Any], *, dry_run: bool = True) -> tuple[int, Any]:
    """POST the object as `kubectl apply` would (strict field validation: an unknown field is an
    error, not silently pruned); a server-side dry run unless ``dry_run`` is False."""
    q = {"fieldValidation": "Strict"}
    if dry_run:
        q["dryRun"] = "All"
    return server.request("POST", _path(obj) + "?" + urllib.parse.urlencode(q), obj)


def message(body: Any) -> str:
    return body.get("message", "") if isinstance(body, dict) else str(body)


def contains(big: Any, small: Any) -> bool:
    """Every value of ``small`` is in ``big`` unchanged (``big`` may have more: defaults)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(big) == len(small) and all(contains(b, s) for b, s in zip(big, small))
    return big == small and type(big) is type(small) or (isinstance(small, float) and big == small)


def examples() -> list[dict[str, Any]]:
    return [doc for f in sorted((ROOT / "examples").glob("*.yaml")) for doc in load_docs(f)]


@pytest.fixture(scope="module")
def server(real_crd_server):
    return real_crd_server


# --- CRDs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["helm/mergepipe/crds", "crds"])
def test_every_crd_is_accepted_and_served(server, folder):
    """Each CRD file is accepted (created, or replaced over the copy installed before: validated
    in full either way), becomes Established, and its kind is served with the printer columns."""
    crds = load_crds(ROOT / folder)  # the chart's include kopf's peering CRDs (replicas > 1)
    ours = [c for c in crds if c["spec"]["group"] == GROUP]
    assert {c["spec"]["names"]["kind"] for c in ours} == {
        k for k, r in RESOURCES.items() if r.get("chart", True) or folder == "crds"
    }
    for crd in crds:
        got = server.apply_crd(crd)
        assert got["status"]["acceptedNames"]["kind"] == crd["spec"]["names"]["kind"]
        g, v, plural = crd["spec"]["group"], crd["spec"]["versions"][0]["name"], crd["spec"]["names"]["plural"]
        code, lst = server.request("GET", f"/apis/{g}/{v}/{plural}")
        assert code == 200 and lst["kind"] == f"{crd['spec']['names']['kind']}List"
    code, group = server.request("GET", f"/apis/{GROUP}/{VERSION}")
    assert code == 200
    served = {r["name"]: r for r in group["resources"]}
    for crd in ours:
        r = served[crd["spec"]["names"]["plural"]]
        assert sorted(r["shortNames"]) == sorted(crd["spec"]["names"]["shortNames"])
        assert r["namespaced"] is True and f"{crd['spec']['names']['plural']}/status" in served


def test_the_old_seed_bound_is_refused_by_a_real_server(server):
    """The defect this server found: an int64-max bound (2^63-1) is refused as a CRD (bounds are
    float64 there); 2^53-1 is what the CRDs use now."""
    (crd,) = [c for c in load_crds(ROOT / "crds") if c["spec"]["names"]["kind"] == "MergeSearch"]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["seed"]["maximum"] == SEED_MAX == 2**53 - 1
    bad = copy.deepcopy(crd)
    bad["metadata"]["name"] = "oldmergesearches.mergepipe.io"
    bad["spec"]["names"] = {
        "kind": "OldMergeSearch",
        "plural": "oldmergesearches",
        "singular": "oldmergesearch",
        "listKind": "OldMergeSearchList",
    }
    bad["spec"]["versions"][0].pop("additionalPrinterColumns", None)
    bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["seed"]["maximum"] = (
        2**63 - 1
    )
    code, body = server.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions?dryRun=All", bad)
    assert code == 422 and "Maximum boundary value must be of type integer" in message(body), body


# --- examples --------------------------------------------------------------------------------------


def test_every_example_is_accepted_unchanged(server):
    """Every mergepipe object in examples/ is created (strict field validation), stored without
    any field pruned or changed, and listed in the server's Table with the CRD's printer columns
    (what `kubectl get` prints); then removed."""
    ours = [doc for doc in examples() if (doc["apiVersion"], doc["kind"]) not in FOREIGN_KINDS]
    assert {doc["kind"] for doc in ours} >= {"ModelMerge", "MergeQuota", "MergeSearch"}
    assert all(doc["apiVersion"] == f"{GROUP}/{VERSION}" for doc in ours)
    crds = {c["spec"]["names"]["kind"]: c for c in load_crds(ROOT / "crds")}
    try:
        for doc in ours:
            assert cr_errors(doc) == []
            code, got = create(server, doc, dry_run=False)
            assert code == 201, f"{doc['kind']}/{doc['metadata']['name']}: HTTP {code}: {message(got)}"
            assert contains(got["spec"], doc["spec"]), (doc["spec"], got["spec"])
            assert got["metadata"]["generation"] == 1 and "status" not in got
        for doc in ours:
            code, table = _table(server, doc)
            want = [c["name"] for c in crds[doc["kind"]]["spec"]["versions"][0]["additionalPrinterColumns"]]
            assert code == 200 and [c["name"] for c in table["columnDefinitions"]][1:] == want, table
            assert doc["metadata"]["name"] in [r["cells"][0] for r in table["rows"]]
    finally:
        for doc in ours:
            server.request("DELETE", _path(doc, name=True))


def _table(server, doc) -> tuple[int, Any]:
    """The server-side Table of the object's kind in its namespace."""
    import json
    import urllib.error
    import urllib.request

    from realapi import TOKEN

    req = urllib.request.Request(
        server.url + _path(doc),
        headers={"Authorization": f"Bearer {TOKEN}", "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30, context=server._ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_operator_written_status_is_kept_whole(server):
    """Status as the operator writes it (the offline test's objects) goes through the status
    subresource without a field pruned: every field the operator writes is in the schema."""
    from datetime import datetime, timezone

    now = datetime(2026, 11, 22, tzinfo=timezone.utc)
    q = quota()
    adm = qd.admit(q, 10 * 1024**3, now, key="uid.1", merge="llama-code-math-chat")
    q_status = dict(
        adm.new_status, conditions=cond.set_condition(None, "Ready", "True", "Active", "quota enforced", 1, now)
    )
    mm = merges()[0]
    mm_status = {
        "observedGeneration": 1,
        "expertCount": 3,
        "budget": "10Gi",
        "budgetBytes": 10 * 1024**3,
        "plan": mmd.plan_status("cd" * 32, "s3://p/x.json", 1, 2, 3, 0.75, sketch="sign2", sketch_read_bytes=1),
        "jobName": "llama-cdcdcdcdcd",
        "parts": {
            k: v for k, v in mmd.parts_status({"status": {"completedIndexes": "0,2", "failed": 1}}, 4).items() if v
        },
        "admission": {"key": "uid.1", "budgetBytes": 1, "clamped": False, "quotas": ["q"]},
        "conditions": cond.set_condition(None, "Ready", "False", "JobRunning", "running", 1, now),
    }
    try:
        for obj, status in ((q, q_status), (mm, mm_status)):
            code, got = create(server, obj, dry_run=False)
            assert code == 201, message(got)
            code, got = server.request(
                "PATCH",
                _path(obj, name=True) + "/status?fieldValidation=Strict",
                {"status": status},
                "application/merge-patch+json",
            )
            assert code == 200, message(got)
            assert contains(got["status"], status), (status, got["status"])
            assert got["metadata"]["generation"] == 1  # status writes are not a new generation
    finally:
        for obj in (q, mm):
            server.request("DELETE", _path(obj, name=True))


# --- hidden invalid objects ------------------------------------------------------------------------


def _merge_rejects() -> list[tuple[str, dict[str, Any]]]:
    out = [(f"{'.'.join(map(str, p))}={v!r}", mutate(merges()[0], p, v)) for p, v in SCHEMA_REJECTS]
    out += [(f"fidelity={v!r}", mutate(merges()[1], ("spec", "fidelity"), v)) for v in FIDELITY_REJECTS]
    out += [(f"seed={v}", mutate(merges()[0], ("spec", "seed"), v)) for v in (SEED_MAX + 1, 2**63 - 1)]
    out += [(f"parallelism={v!r}", mutate(merges()[0], ("spec", "parallelism"), v)) for v in (0, 1025, "2")]
    return out


def _quota_rejects() -> list[tuple[str, dict[str, Any]]]:
    changes = [
        (("spec", "enforcement"), "Soft"),
        (("spec", "window"), "1 day"),
        (("spec", "hard", "expertReadBytes"), "lots"),
        (("spec", "hard", "merges"), -1),
        (("spec", "hard"), DELETE),
    ]
    return [(f"quota {'.'.join(map(str, p))}", mutate(quota(), p, v)) for p, v in changes]


def _search_rejects() -> list[tuple[str, dict[str, Any]]]:
    def with_(fn):
        doc = copy.deepcopy(search_example())
        fn(doc["spec"])
        return doc

    return [
        ("search strategy", with_(lambda s: s.update(strategy="grid"))),
        ("search workers", with_(lambda s: s.update(workers=0))),
        ("search typo", with_(lambda s: s.update(evaluatons=10))),
        ("search seed", with_(lambda s: s.update(seed=SEED_MAX + 1))),
    ]


@pytest.mark.parametrize(
    "name, bad", _merge_rejects() + _quota_rejects() + _search_rejects(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_schema_violations_are_refused_like_the_offline_check_says(server, name, bad):
    assert cr_errors(bad), f"the offline check accepted {name}"
    code, body = create(server, bad)
    if code == 400:  # strict field validation: an unknown field is a bad request, not pruned
        assert "unknown field" in message(body), body
        return
    assert code == 422, f"the API server accepted {name}: HTTP {code}"
    assert body["reason"] == "Invalid" and body["details"]["causes"], body


#: Cross-field rules a structural schema cannot state: CEL rules in the CRD, evaluated only by a
#: real server (the offline check passes them; the operator/model check them too).
CEL_REJECTS = [
    (
        "budget and fidelity",
        lambda: mutate(merges()[0], ("spec", "fidelity"), 0.9),
        "set at most one of budget and fidelity",
    ),
    ("slerp with two experts", lambda: _slerp_two(), "slerp"),
    ("search min >= max", lambda: _search(lambda s: s["vary"][0].update(min=1.0, max=0.5)), "min must be below max"),
    (
        "search evaluations < initial",
        lambda: _search(lambda s: s.update(evaluations=4, initial=8)),
        "evaluations must be at least initial",
    ),
    (
        "search refPoint size",
        lambda: _search(lambda s: s.update(refPoint=[1.0])),
        "refPoint needs one value per objective",
    ),
    ("search vary.expert", lambda: _search(lambda s: s["vary"][0].update(expert="chat")), "vary[].expert must name"),
    (
        "search two evaluators",
        lambda: _search(lambda s: s.update(evaluator={"command": "e {checkpoint}", "zooBatches": 2})),
        "set at most one of command and zooBatches",
    ),
]


def _slerp_two() -> dict[str, Any]:
    doc = copy.deepcopy(merges()[1])
    doc["spec"]["experts"].append({"uri": "s3://models/other/"})
    return doc


def _search(fn) -> dict[str, Any]:
    doc = copy.deepcopy(search_example())
    fn(doc["spec"])
    return doc


@pytest.mark.parametrize("name, make, text", CEL_REJECTS, ids=[c[0] for c in CEL_REJECTS])
def test_cel_rules_are_enforced_by_the_server(server, name, make, text):
    bad = make()
    assert cr_errors(bad) == []  # structurally valid: only the rule catches it
    code, body = create(server, bad)
    assert code == 422 and text in message(body), (code, message(body))


@pytest.mark.parametrize(
    "change, field", [c for c in OPERATOR_REJECTS if c[1] != "spec.fidelity"], ids=lambda x: str(x)
)
def test_what_no_schema_can_say_is_accepted_then_reported_as_invalid_spec(server, change, field):
    """Values the schema leaves free-form (layer-wise parameters) pass the server; the operator
    reports them (Ready=False, InvalidSpec naming the field: the end-to-end tests show it)."""
    bad = mutate(merges()[0], *change)
    code, body = create(server, bad)
    assert code == 201, message(body)
    assert field in {p for p, _ in mmspec.validate_merge_spec(bad["spec"])}


def test_seed_range_ends_at_2_pow_53_minus_1(server):
    for kind, doc in (("ModelMerge", merges()[0]), ("MergeSearch", search_example())):
        ok = mutate(doc, ("spec", "seed"), SEED_MAX)
        code, body = create(server, ok)
        assert code == 201 and body["spec"]["seed"] == SEED_MAX, (kind, message(body))
        code, body = create(server, mutate(doc, ("spec", "seed"), SEED_MAX + 1))
        assert code == 422 and "spec.seed" in message(body), (kind, message(body))


def test_parallelism_is_accepted_from_1_to_1024(server):
    for n in (1, 8, 1024):
        code, body = create(server, mutate(merges()[0], ("spec", "parallelism"), n))
        assert code == 201 and body["spec"]["parallelism"] == n, message(body)
