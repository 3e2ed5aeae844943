"""Tenant-chosen images (issue 22 item 3): ``ModelMerge.spec.image`` is refused unless the chart's
``merges.allowedImages`` admits it; the search driver (which holds the driver's ServiceAccount
token and the S3 keys) and the analyze Job (which writes the shared catalog) always run the
operator's merger image. The kmock and real-API-server end-to-end cases are in
test_operator_kmock.py and test_real_apiserver.py."""

from __future__ import annotations

import dataclasses

import pytest
from op_testlib import NOW, FakeKube, FakeStore, make_merge, make_quota
from test_operator_controller import Planner, apply, bump, ready
from test_operator_search import search

from mergepipe_operator import controller as ctl
from mergepipe_operator.k8s.api import JOBS, MERGES, PODS, QUOTAS, SEARCHES
from mergepipe_operator.k8s.conditions import get_condition
from mergepipe_operator.k8s.images import image_allowed, image_issue
from mergepipe_operator.modelmerge import decisions as mmd
from mergepipe_operator.search import decisions as sd

DIGEST_REF = "registry.example/team-a/merger@sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("image", "allowed", "entry"),
    [
        ("registry.example/team-a/merger:1.2", ["registry.example/team-a/*"], "registry.example/team-a/*"),
        ("registry.example/team-a/x/y:1", ["registry.example/team-a/*"], None),  # * stays in one segment
        ("registry.example/team-a/x/y:1", ["registry.example/team-a/**"], "registry.example/team-a/**"),
        ("registry.example/team-a-evil/merger:1", ["registry.example/team-a/*"], None),
        ("registry.example/team-a/merger:1", ["registry.example/team-a/merger@sha256:*"], None),  # digest required
        (DIGEST_REF, ["registry.example/team-a/merger@sha256:*"], "registry.example/team-a/merger@sha256:*"),
        (DIGEST_REF, [DIGEST_REF], DIGEST_REF),  # a digest pin matches exactly
        (DIGEST_REF[:-1] + "c", [DIGEST_REF], None),
        ("REGISTRY.example/team-a/merger:1", ["registry.example/team-a/*"], None),  # case matters
        ("evil.example/merger:1", [], None),
    ],
)
def test_allowlist_entries_are_digest_pins_or_segment_globs(image, allowed, entry):
    assert image_allowed(image, allowed) == entry


def test_the_refusal_names_the_field_and_the_rule():
    off = image_issue("evil.example/x:1", [], "spec.image")
    assert off is not None and off.startswith("spec.image: image 'evil.example/x:1' refused")
    assert "merges.allowedImages is empty" in off and "\n" not in off
    miss = image_issue("evil.example/x:1", ["registry.example/team-a/*"], "spec.image")
    assert miss is not None and "matches no entry of merges.allowedImages (registry.example/team-a/*)" in miss
    assert image_issue(None, [], "spec.image") is None and image_issue("", [], "spec.image") is None
    assert image_issue("registry.example/team-a/m:1", ["registry.example/team-a/*"], "spec.image") is None


def _setup(settings, mm=None):
    kube, store = FakeKube(), FakeStore()
    kube.put(QUOTAS, make_quota())
    mm = kube.put(MERGES, mm or make_merge())
    return ctl.Controller(settings, kube, store, Planner(), clock=lambda: NOW), kube, store, mm


def test_a_merge_naming_an_image_is_refused_by_default(settings):
    c, kube, store, mm = _setup(settings, make_merge(image="evil.example/steal-keys:1"))
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    r = ready(mm)
    assert (r["status"], r["reason"]) == ("False", "InvalidSpec")
    assert "spec.image" in r["message"] and "merges.allowedImages" in r["message"]
    assert kube.list(JOBS, "ns1") == []  # no Job, no reservation, no plan written
    assert not (kube.get(QUOTAS, "ns1", "q").get("status") or {}).get("ledger") and store.objects == {}
    assert c.merges.reconcile_merge(mm) is None  # terminal for this generation
    with pytest.raises(ValueError, match="merges.allowedImages"):
        mmd.build_job(mm, "s3://p/plan.json", "ab" * 32, settings)  # defence in depth


def test_an_allowed_image_runs_the_merge_job_but_never_the_analyze_job(settings):
    s = dataclasses.replace(settings, allowed_images=("registry.example/team-a/*",))
    c, kube, store, mm = _setup(s, make_merge(image="registry.example/team-a/merger:2"))
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    assert ready(mm)["reason"] == "JobRunning"
    (job,) = kube.list(JOBS, "ns1")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/team-a/merger:2"
    an = mmd.build_analyze_job(mm, ["s3://models/code"], "cd" * 32, s)
    assert an["spec"]["template"]["spec"]["containers"][0]["image"] == s.merger_image
    c2, kube2, _, mm2 = _setup(s, make_merge(image="registry.example/team-b/merger:2"))
    r = ready(apply(kube2, mm2, c2.merges.reconcile_merge(mm2)))
    assert r["reason"] == "InvalidSpec" and "matches no entry" in r["message"] and kube2.list(JOBS, "ns1") == []


def test_a_running_merge_whose_spec_gains_a_refused_image_is_retired(settings):
    c, kube, store, mm = _setup(settings)
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    name = job["metadata"]["name"]
    kube.put(
        PODS,
        {
            "metadata": {"name": name + "-x", "namespace": "ns1", "labels": {"job-name": name}},
            "status": {"phase": "Running"},
        },
    )
    mm = apply(kube, mm, c.merges.reconcile_merge(bump(kube, image="evil.example/x:1")))
    assert ready(mm)["reason"] == "InvalidSpec" and kube.list(JOBS, "ns1") == []
    (entry,) = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert entry["state"] == "Charged"  # it ran: settled, not left Reserved


def _search_controller(settings, ms):
    kube, store = FakeKube(), FakeStore()
    ms = kube.put(SEARCHES, ms)
    return ctl.Controller(settings, kube, store, planner=lambda *a: None, clock=lambda: NOW), kube, ms


def test_the_search_driver_runs_the_operator_image_whatever_the_spec_asks(settings):
    s = dataclasses.replace(settings, allowed_images=("registry.example/team-a/*",))
    ms = search(image="registry.example/team-a/evaluator:3")
    job = sd.build_driver_job(ms, s)
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True  # the pod that holds the token...
    assert [c["image"] for c in pod["containers"]] == [s.merger_image]  # ...runs the operator's code only
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    ev = __import__("json").loads(env["MERGEPIPE_EVAL_JOB_TEMPLATE"])
    ev_pod = ev["spec"]["template"]["spec"]
    assert ev_pod["containers"][0]["image"] == "registry.example/team-a/evaluator:3"
    assert ev_pod["automountServiceAccountToken"] is False and "serviceAccountName" not in ev_pod


def test_a_search_naming_a_refused_image_starts_nothing(settings):
    c, kube, ms = _search_controller(settings, search(image="evil.example/x:1"))
    st = c.searches.reconcile_search(ms)
    r = get_condition(st["conditions"], "Ready")
    assert r["reason"] == "InvalidSpec" and "spec.image" in r["message"] and "merges.allowedImages" in r["message"]
    assert kube.list(JOBS, "team-llm") == []
    with pytest.raises(ValueError, match="merges.allowedImages"):
        sd.eval_job_template(ms, settings)


def test_the_evaluator_runs_with_its_own_scoped_keys_when_the_chart_names_them(settings):
    """The evaluation Job runs the tenant's command: with search.evaluator.credentialsSecret its
    S3 keys come from that Secret, never from the merge Jobs' (nor from a spec.s3 override); the
    driver and the candidates keep theirs."""
    s = dataclasses.replace(settings, eval_s3_secret_name="search-eval-s3")
    ms = search(s3={"credentialsSecretRef": {"name": "team-s3"}})
    ev = sd.eval_job_template(ms, s)["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in ev["env"] if "valueFrom" in e}
    assert refs == {"AWS_ACCESS_KEY_ID": "search-eval-s3", "AWS_SECRET_ACCESS_KEY": "search-eval-s3"}
    drv = sd.build_driver_job(ms, s)["spec"]["template"]["spec"]["containers"][0]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in drv["env"] if "valueFrom" in e} == {"team-s3"}
    ev0 = sd.eval_job_template(ms, settings)["spec"]["template"]["spec"]["containers"][0]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in ev0["env"] if "valueFrom" in e} == {"team-s3"}
