"""The reconciliation (mergepipe_operator.controller.Controller), driven with in-memory fakes of the API server and
of object storage (no kopf runtime; test_operator_kmock.py runs the real operator against kmock and
SeaweedFS, test_operator_planning.py the real planner)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from datetime import timedelta

import pytest
from op_testlib import DIGEST, NOW, FakeKube, FakeStore, make_merge, make_quota

from mergepipe.catalog.sketch import DEFAULT_SKETCH
from mergepipe_operator import (
    controller as ctl,  # noqa: E402
    kopfglue,  # noqa: E402
    quantities as qty,  # noqa: E402
    reconcile,  # noqa: E402
)
from mergepipe_operator.k8s import (
    conditions as cond,  # noqa: E402
    names,  # noqa: E402
)
from mergepipe_operator.modelmerge import (
    decisions as mmd,  # noqa: E402
    planning,  # noqa: E402
)
from mergepipe_operator.quota.controller import QuotaLedger  # noqa: E402
from mergepipe_operator.snapshot import decisions as snapd  # noqa: E402

kopf = pytest.importorskip("kopf", reason="kopf (the operator framework) is not installed")
from mergepipe_operator.k8s.api import JOBS, MERGES, PODS, QUOTAS, SNAPSHOTS  # noqa: E402

GI = 1024**3


class Planner:
    """A stand-in for the core planner: expert reads = min(budget, what the fidelity needs)."""

    def __init__(self, full=8 * GI, missing=()):
        self.full, self.missing, self.calls = full, tuple(missing), []

    def __call__(self, spec, catalog_uri):
        self.calls.append((spec.get("budget"), catalog_uri))
        if self.missing:
            return planning.PlanSummary(
                missing_experts=self.missing,
                analysis_id=mmd.analysis_id("b" * 64, ["e" * 64], catalog_uri, spec["method"]),
            )
        budget = spec.get("budget")
        read = self.full if budget is None else min(self.full, budget)
        digest = hashlib.sha256(f"{read}".encode()).hexdigest()
        return planning.PlanSummary(
            digest=digest,
            plan_json=json.dumps({"digest": digest}).encode(),
            base_read_bytes=GI,
            expert_read_bytes=read,
            output_write_bytes=GI,
            budget_bytes=budget,
            retained_energy=read / self.full,
            missing_experts=self.missing,
        )


def setup(settings, *quotas, planner=None, mm=None):
    kube, store = FakeKube(), FakeStore()
    for q in quotas:
        kube.put(QUOTAS, q)
    mm = kube.put(MERGES, mm or make_merge())
    c = ctl.Controller(settings, kube, store, planner or Planner(), clock=lambda: NOW)
    return c, kube, store, mm


def apply(kube, mm, status):
    kube.patch_status(MERGES, mm["metadata"]["namespace"], mm["metadata"]["name"], status)
    return kube.get(MERGES, mm["metadata"]["namespace"], mm["metadata"]["name"])


def ready(obj):
    return cond.get_condition((obj.get("status") or {}).get("conditions"), "Ready")


def commit(store, out, plan_digest, realized, files_prefix="runs/r1", earlier=None):
    """What the worker leaves behind: shards under a run prefix, then manifest.json (core format);
    ``earlier``: expert bytes earlier attempts read before a resume (``io.earlier_attempts``)."""
    from mergepipe.commit.manifest import manifest_bytes, snapshot_id

    shard = b"x" * 100
    store.put(f"{out}{files_prefix}/model.safetensors", shard)
    outputs = {"model.safetensors": {"size": 100, "sha256": hashlib.sha256(shard).hexdigest()}}
    m = {
        "format": "mergepipe.manifest/v1",
        "snapshot_id": snapshot_id(plan_digest, outputs),
        "plan_digest": plan_digest,
        "files_prefix": files_prefix,
        "outputs": outputs,
        "io": {
            "expert_budget_bytes": 10 * GI,
            "estimated": {"expert_read_bytes": 8 * GI},
            "realized": {"base_read_bytes": GI, "expert_read_bytes": realized, "output_write_bytes": 100},
        },
    }
    if earlier is not None:
        m["io"]["earlier_attempts"] = {"base_read_bytes": 0, "expert_read_bytes": earlier, "output_write_bytes": 0}
    raw = manifest_bytes(m)
    store.put(out + "manifest.json", raw)
    return raw


def test_plan_merge_needs_a_catalog():
    with pytest.raises(planning.PlanInputError, match="no catalog"):
        planning.plan_merge(make_merge()["spec"], None)


def test_storage_trouble_while_planning_waits_in_planning(settings):
    def planner(spec, catalog):
        raise ConnectionError("s3 endpoint unreachable")

    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    r = cond.get_condition(e.value.status["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("False", "Planning") and "s3 endpoint unreachable" in r["message"]
    assert kube.list(JOBS, "ns1") == []
    assert kube.get(QUOTAS, "ns1", "q").get("status") is None  # nothing reserved before a plan exists


def test_inputs_the_core_refuses_are_an_invalid_spec_naming_the_field(settings):
    def planner(spec, catalog):
        msg = "s3://models/math/model.safetensors: tensor 'lm_head.weight' is BF16[256, 64] but the base has F32"
        raise planning.PlanInputError(msg, "spec.experts[1].uri")  # the core's loc, rendered (test_operator_planning)

    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    st = c.merges.reconcile_merge(mm)
    r = cond.get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("False", "InvalidSpec")
    assert r["message"].startswith("spec.experts[1].uri: the planner refused the inputs: s3://models/math/")
    assert kube.list(JOBS, "ns1") == [] and kube.get(QUOTAS, "ns1", "q").get("status") is None
    assert c.merges.reconcile_merge(apply(kube, mm, st)) is None  # terminal for this generation


def test_happy_path_budget_mode(settings):
    c, kube, store, mm = setup(settings, make_quota(bytes_="100Gi", merges=5))
    st = c.merges.reconcile_merge(mm)
    mm = apply(kube, mm, st)
    assert ready(mm)["reason"] == "JobRunning" and st["observedGeneration"] == 1
    assert st["budget"] == "10Gi" and st["plan"]["estimated"]["expertReadBytes"] == 8 * GI
    (job,) = kube.list(JOBS, "ns1")
    assert job["metadata"]["name"] == st["jobName"] == mmd.job_name("mm1", st["plan"]["digest"])
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][1] == st["plan"]["uri"]
    assert store.get(st["plan"]["uri"]) is not None  # the operator wrote the plan
    q = kube.get(QUOTAS, "ns1", "q")
    # the quota reserves what the plan reads (8Gi), not the whole 10Gi budget
    assert q["status"]["ledger"][0]["state"] == "Reserved" and q["status"]["used"]["expertReadBytes"] == 8 * GI
    assert c.merges.reconcile_merge(mm) is None  # same generation: nothing more to do (resume, retries)

    # the Job runs, then completes; the worker committed a manifest
    running = dict(job, status={"active": 1})
    assert cond.get_condition(c.merges.sync_job(mm, running)["conditions"], "Ready")["message"].startswith(
        "merge Job running"
    )
    out = "s3://snapshots/mm1/"
    manifest = commit(store, out, st["plan"]["digest"], realized=7 * GI)
    done = dict(job, status={"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    patch = c.merges.sync_job(mm, done)
    mm = apply(kube, mm, patch)
    r = ready(mm)
    assert (r["status"], r["reason"]) == ("True", "Committed")
    assert mm["status"]["expertRead"] == "7Gi" and mm["status"]["realized"]["expertReadBytes"] == 7 * GI
    q = kube.get(QUOTAS, "ns1", "q")
    assert q["status"]["ledger"][0]["state"] == "Charged" and q["status"]["used"] == {
        "expertReadBytes": 7 * GI,
        "merges": 1,
    }
    (snap,) = kube.list(SNAPSHOTS, "ns1")
    assert (
        snap["metadata"]["name"]
        == mm["status"]["snapshot"]
        == snapd.snapshot_name("mm1", snapd.manifest_hash(manifest))
    )
    assert "ownerReferences" not in snap["metadata"]  # not garbage-collected with its ModelMerge
    assert snap["spec"]["manifestHash"] == snapd.manifest_hash(manifest)
    # the snapshot becomes Ready only through verification
    assert ready(snap) is None
    sst = c.snapshots.verify_snapshot(snap)
    assert (cond.get_condition(sst["conditions"], "Ready")["status"], sst["sizes"]) == (
        "True",
        {"totalBytes": 100, "files": 1},
    )
    # the committed model folder (what KServe's storageUri loads): the run prefix the manifest names
    assert sst["storageUri"] == "s3://snapshots/mm1/runs/r1/" and store.get(sst["storageUri"] + "model.safetensors")
    # replays are harmless
    assert c.merges.sync_job(mm, done) is None
    assert kube.get(QUOTAS, "ns1", "q")["status"]["used"]["expertReadBytes"] == 7 * GI


def test_invalid_spec_creates_nothing(settings):
    c, kube, store, mm = setup(settings, make_quota(), mm=make_merge(budget="10 GB"))
    st = c.merges.reconcile_merge(mm)
    r = cond.get_condition(st["conditions"], "Ready")
    assert (r["reason"], r["observedGeneration"]) == ("InvalidSpec", 1) and "spec.budget" in r["message"]
    assert kube.list(JOBS, "ns1") == [] and kube.writes == []


def test_quota_reject_keeps_the_merge_waiting(settings):
    q = make_quota(bytes_="5Gi")
    c, kube, store, mm = setup(settings, q)
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    assert e.value.delay == settings.quota_retry_seconds
    r = cond.get_condition(e.value.status["conditions"], "Ready")
    assert r["reason"] == "QuotaExceeded" and "requested 8Gi but only 5Gi is left" in r["message"]
    assert kube.list(JOBS, "ns1") == []


def test_an_output_holding_another_snapshot_is_refused_before_any_job(settings):
    c, kube, store, mm = setup(settings, make_quota())
    commit(store, "s3://snapshots/mm1/", "ef" * 32, realized=GI)
    st = c.merges.reconcile_merge(mm)
    r = cond.get_condition(st["conditions"], "Ready")
    assert r["reason"] == "InvalidSpec" and "already holds a committed snapshot" in r["message"]
    assert kube.list(JOBS, "ns1") == [] and kube.get(QUOTAS, "ns1", "q")["status"]["ledger"] == []


def test_a_broken_quota_blocks_admission(settings):
    c, kube, store, mm = setup(settings, make_quota(bytes_="lots"))
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    r = cond.get_condition(e.value.status["conditions"], "Ready")
    assert (
        r["reason"] == "QuotaExceeded"
        and "invalid MergeQuota" in r["message"]
        and "spec.hard.expertReadBytes" in r["message"]
    )


def test_quota_clamp_in_fidelity_mode_replans_under_the_lower_budget(settings):
    planner = Planner(full=8 * GI)
    c, kube, store, mm = setup(
        settings,
        make_quota(bytes_="3Gi", enforcement="Clamp"),
        planner=planner,
        mm=make_merge(budget=None, fidelity=0.99),
    )
    st = c.merges.reconcile_merge(mm)
    assert planner.calls == [(None, "s3://mergepipe/catalog/"), (3 * GI, "s3://mergepipe/catalog/")]
    assert st["budgetBytes"] == 3 * GI and st["admission"]["clamped"] is True
    assert cond.get_condition(st["conditions"], "QuotaAdmitted")["reason"] == "Clamped"
    assert kube.get(QUOTAS, "ns1", "q")["status"]["used"]["expertReadBytes"] == 3 * GI


def test_missing_statistics_start_one_analyze_job_then_the_merge_is_planned(settings):
    planner = Planner(missing=["s3://models/math"])
    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    for _ in range(2):  # retries (and a restarted operator) find the Job instead of creating another
        with pytest.raises(reconcile.RetryWithStatus) as e:
            c.merges.reconcile_merge(mm)
        assert e.value.delay == settings.analyze_poll_seconds
        r = cond.get_condition(e.value.status["conditions"], "Ready")
        assert (r["status"], r["reason"]) == ("False", "Analyzing") and "s3://models/math" in r["message"]
        assert cond.get_condition(e.value.status["conditions"], "Analyzed")["reason"] == "Analyzing"
    (job,) = kube.list(JOBS, "ns1")
    assert job["metadata"]["name"] == mmd.analyze_job_name(
        "mm1", mmd.analysis_id("b" * 64, ["e" * 64], settings.catalog_uri, "ties")
    )
    assert job["metadata"]["labels"][names.LABEL_COMPONENT] == "analyze"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "analyze",
        "--base",
        "s3://models/base",
        "--expert",
        "s3://models/math",
        "--catalog",
        settings.catalog_uri,
        "--json",
    ]
    assert kube.get(QUOTAS, "ns1", "q").get("status") is None  # nothing reserved while analyzing
    # the Job finished and wrote the statistics: the next retry plans and starts the merge Job
    planner.missing = ()
    st = c.merges.reconcile_merge(mm)
    assert cond.get_condition(st["conditions"], "Ready")["reason"] == "JobRunning"
    assert cond.get_condition(st["conditions"], "Analyzed")["status"] == "True"
    assert sorted(j["metadata"]["labels"][names.LABEL_COMPONENT] for j in kube.list(JOBS, "ns1")) == [
        "analyze",
        "merge",
    ]


@pytest.mark.parametrize("outcome", ["Failed", "Complete"])
def test_a_failed_or_useless_analyze_job_fails_the_merge(settings, outcome):
    planner = Planner(missing=["s3://models/math"])
    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    with pytest.raises(reconcile.RetryWithStatus):
        c.merges.reconcile_merge(mm)
    (job,) = kube.list(JOBS, "ns1")
    kube.objects[("jobs", "ns1", job["metadata"]["name"])]["status"] = {
        "conditions": [{"type": outcome, "status": "True", "reason": "BackoffLimitExceeded", "message": "exit 2"}]
    }
    st = c.merges.reconcile_merge(mm)
    r = cond.get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("False", "JobFailed") and job["metadata"]["name"] in r["message"]
    assert ("exit 2" in r["message"]) if outcome == "Failed" else ("still has no statistics" in r["message"])
    assert len(kube.list(JOBS, "ns1")) == 1 and kube.get(QUOTAS, "ns1", "q").get("status") is None
    assert c.merges.reconcile_merge(apply(kube, mm, st)) is None  # terminal for this generation


def test_an_analysis_that_completes_while_planning_is_not_a_failure(settings):
    """The planner read the catalog just before the analyze Job wrote the statistics, and the Job
    is complete by the time the operator looks: it plans again instead of failing the merge."""
    planner = Planner(missing=["s3://models/math"])
    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    with pytest.raises(reconcile.RetryWithStatus):
        c.merges.reconcile_merge(mm)
    (job,) = kube.list(JOBS, "ns1")
    kube.objects[("jobs", "ns1", job["metadata"]["name"])]["status"] = {
        "conditions": [{"type": "Complete", "status": "True"}]
    }

    def racing(spec, catalog):  # missing on the first read, there on the next
        plan = planner(spec, catalog)
        planner.missing = ()
        return plan

    c.merges.planner = racing
    st = c.merges.reconcile_merge(mm)
    assert ready({"status": st})["reason"] == "JobRunning" and len(planner.calls) == 3


def test_no_analysis_for_a_merge_the_quota_cannot_admit(settings):
    used = {
        "ledger": [
            {"key": "other.1", "merge": "other", "bytes": 0, "state": "Reserved", "time": "2026-11-22T11:00:00Z"}
        ]
    }
    c, kube, store, mm = setup(
        settings, make_quota(merges=1, status=used), planner=Planner(missing=["s3://models/math"])
    )
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    assert e.value.delay == settings.quota_retry_seconds
    r = cond.get_condition(e.value.status["conditions"], "Ready")
    assert r["reason"] == "QuotaExceeded" and "1 of 1 merges" in r["message"]
    assert kube.list(JOBS, "ns1") == []


def test_pair_statistics_methods_analyze_with_pairs(settings):
    mm = make_merge(
        method="nuslerp",
        parameters={"nuslerp_flatten": False},
        seed=3,
        experts=[
            {"uri": "s3://models/code/", "weight": 0.3},
            {"name": "7", "uri": "s3://models/math/", "parameters": {"weight": [0.2, 0.8]}},
        ],
    )
    # a missing pair names both of its experts (MissingAnalysis.uris)
    planner = Planner(missing=["s3://models/code", "s3://models/math/"])
    c, kube, store, mm = setup(settings, make_quota(), planner=planner, mm=mm)
    with pytest.raises(reconcile.RetryWithStatus):
        c.merges.reconcile_merge(mm)
    (job,) = kube.list(JOBS, "ns1")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "analyze",
        "--base",
        "s3://models/base",
        "--expert",
        "s3://models/code",
        "--expert",
        "s3://models/math",
        "--pairs",
        "--catalog",
        settings.catalog_uri,
        "--json",
    ]
    assert mmd.analyze_args({"base": {"uri": "s3://m/b/"}, "method": "ties"}, ["s3://m/e/"], "s3://c") == [
        "analyze",
        "--base",
        "s3://m/b",
        "--expert",
        "s3://m/e",
        "--catalog",
        "s3://c",
        "--json",
    ]  # no pairs for ties


def test_superseding_keeps_the_analyze_job(settings):
    planner = Planner(missing=["s3://models/math"])
    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    with pytest.raises(reconcile.RetryWithStatus):
        c.merges.reconcile_merge(mm)
    planner.missing = ()
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    kube.objects[("modelmerges", "ns1", "mm1")]["spec"]["budget"] = "4Gi"
    kube.objects[("modelmerges", "ns1", "mm1")]["metadata"]["generation"] = 2
    mm = apply(kube, kube.get(MERGES, "ns1", "mm1"), c.merges.reconcile_merge(kube.get(MERGES, "ns1", "mm1")))
    comps = sorted(
        (j["metadata"]["labels"][names.LABEL_COMPONENT], j["metadata"]["name"]) for j in kube.list(JOBS, "ns1")
    )
    assert [k for k, _ in comps] == ["analyze", "merge"] and comps[1][1] == mm["status"]["jobName"]


def test_job_failure_charges_the_reservation(settings):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    failed = dict(
        job,
        status={
            "failed": 1,  # a pod of it ran (and failed)
            "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too slow"}],
        },
    )
    mm = apply(kube, mm, c.merges.sync_job(mm, failed))
    assert (ready(mm)["reason"], ready(mm)["message"]) == ("JobFailed", "too slow")
    (entry,) = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert (entry["state"], entry["bytes"]) == ("Charged", 8 * GI)  # the reservation: its reads are unknown
    assert c.merges.reconcile_merge(mm) is None  # a failed generation waits for a spec change


def test_a_job_that_failed_before_any_pod_ran_is_released(settings):
    """activeDeadlineSeconds passed while the pod was pending (unschedulable, image pull): nothing
    was read, so nothing is charged (issue 22 item 8)."""
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    _pod_of(kube, job, {"phase": "Pending", "containerStatuses": [{"name": "merge", "state": {"waiting": {}}}]})
    failed = dict(
        job,
        status={"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "x"}]},
    )
    mm = apply(kube, mm, c.merges.sync_job(mm, failed))
    assert ready(mm)["reason"] == "JobFailed"
    assert kube.get(QUOTAS, "ns1", "q")["status"]["ledger"] == []


def _failed_pod(kube, job, message):
    """The Job's pod as the kubelet leaves it: the worker's one-line error as the termination message."""
    name = job["metadata"]["name"]
    kube.put(
        PODS,
        {
            "metadata": {"name": name + "-x7k2p", "namespace": "ns1", "labels": {"job-name": name}},
            "status": {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "merge",
                        "state": {"terminated": {"exitCode": 2, "reason": "Error", "message": message + "\n"}},
                    }
                ],
            },
        },
    )


SHARD_GONE = "error: s3://models/math/model-00001.safetensors: missing; it was present when the plan was made. Restore it or re-plan."


def test_job_failed_names_the_pods_cause(settings):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    _failed_pod(kube, job, SHARD_GONE)
    kube.put(
        PODS,
        {
            "metadata": {"name": "other", "namespace": "ns1", "labels": {"job-name": "another-job"}},
            "status": {"containerStatuses": [_term_status(1, "not this one")]},
        },
    )
    mm = apply(kube, mm, c.merges.sync_job(mm, _fail_job(kube, job, "Job has reached the specified backoff limit")))
    assert (ready(mm)["reason"], ready(mm)["message"]) == (
        "JobFailed",
        SHARD_GONE + " (Job has reached the specified backoff limit)",
    )


def test_a_failed_analyze_job_names_the_pods_cause(settings):
    c, kube, store, mm = setup(settings, make_quota(), planner=Planner(missing=["s3://models/math"]))
    with pytest.raises(reconcile.RetryWithStatus):
        c.merges.reconcile_merge(mm)
    (job,) = kube.list(JOBS, "ns1")
    _failed_pod(kube, job, "error: s3://models/math: not a safetensors checkpoint (no *.safetensors under it).")
    _fail_job(kube, job, "Job has reached the specified backoff limit")
    r = cond.get_condition(c.merges.reconcile_merge(mm)["conditions"], "Ready")
    assert r["reason"] == "JobFailed" and "s3://models/math: not a safetensors checkpoint" in r["message"]


def _term_status(code, message):
    return {"name": "merge", "state": {"terminated": {"exitCode": code, "message": message}}}


def _fail_job(kube, job, message="OOMKilled"):
    kube.objects[("jobs", "ns1", job["metadata"]["name"])]["status"] = {
        "failed": 3,  # backoffLimit + 1 pods ran and failed
        "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": message}],
    }
    return kube.get(JOBS, "ns1", job["metadata"]["name"])


def test_spec_change_after_job_failed_retries_with_a_new_job(settings):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    mm = apply(kube, mm, c.merges.sync_job(mm, _fail_job(kube, job)))
    assert ready(mm)["reason"] == "JobFailed" and c.merges.reconcile_merge(mm) is None
    # more memory: the same plan (same digest), but this generation gets a Job of its own
    mm = bump(kube, resources={"memory": "64Gi"})
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    assert ready(mm)["reason"] == "JobRunning" and mm["status"]["observedGeneration"] == 2
    assert mm["status"]["plan"]["digest"] == job["metadata"]["annotations"][names.ANN_PLAN_DIGEST]
    new = kube.get(JOBS, "ns1", mm["status"]["jobName"])
    assert new["metadata"]["name"] == mmd.job_name("mm1", mm["status"]["plan"]["digest"], 2) != job["metadata"]["name"]
    assert new["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "64Gi"
    # the failed Job's (replayed) events no longer fail the merge; the new Job's do count
    assert c.merges.sync_job(mm, kube.get(JOBS, "ns1", job["metadata"]["name"])) is None
    # a restarted operator reconciling generation 2 again finds the retry Job
    again = c.merges.reconcile_merge(dict(mm, status={}))
    assert again["jobName"] == new["metadata"]["name"] and len(kube.list(JOBS, "ns1")) == 2
    ledger = {e["key"]: e for e in kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]}
    uid = mm["metadata"]["uid"]
    assert ledger[f"{uid}.1"]["state"] == "Charged" and ledger[f"{uid}.2"]["state"] == "Reserved"


def test_spec_change_after_a_failed_analysis_retries_it(settings):
    planner = Planner(missing=["s3://models/math"])
    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    with pytest.raises(reconcile.RetryWithStatus):
        c.merges.reconcile_merge(mm)
    (an,) = kube.list(JOBS, "ns1")
    _fail_job(kube, an, "exit code 1: s3 access denied")
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    assert ready(mm)["reason"] == "JobFailed"
    mm = bump(kube, resources={"cpu": "8"})
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    assert cond.get_condition(e.value.status["conditions"], "Ready")["reason"] == "Analyzing"
    names = sorted(j["metadata"]["name"] for j in kube.list(JOBS, "ns1"))
    retry = mmd.analyze_job_name("mm1", an["metadata"]["annotations"][mmd.ANN_ANALYSIS], 2)
    assert names == sorted([an["metadata"]["name"], retry])
    assert (
        kube.get(JOBS, "ns1", retry)["spec"]["template"]["spec"]["containers"][0]["image"]
        == settings.merger_image  # an analyze Job writes the shared catalog: always the operator's image
    )


def test_job_success_without_manifest_retries_then_bad_manifest_fails(settings):
    c, kube, store, mm = setup(settings)
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    done = dict(job, status={"conditions": [{"type": "Complete", "status": "True"}]})
    with pytest.raises(reconcile.Retry):
        c.merges.sync_job(mm, done)
    commit(store, "s3://snapshots/mm1/", DIGEST, realized=GI)  # a manifest of another plan
    st = c.merges.sync_job(mm, done)
    r = cond.get_condition(st["conditions"], "Ready")
    assert r["reason"] == "JobFailed" and "PlanDigestMismatch" in r["message"]


def test_stale_job_events_are_ignored(settings):
    c, kube, store, mm = setup(settings)
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    job["metadata"]["annotations"][names.ANN_PLAN_DIGEST] = "ef" * 32
    assert c.merges.sync_job(mm, dict(job, status={"conditions": [{"type": "Failed", "status": "True"}]})) is None


def test_spec_change_supersedes_the_running_job(settings):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (old_job,) = kube.list(JOBS, "ns1")
    _pod_of(kube, old_job, {"phase": "Running", "containerStatuses": [{"name": "merge", "state": {"running": {}}}]})
    mm = bump(kube, budget="4Gi")
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (new_job,) = kube.list(JOBS, "ns1")
    assert new_job["metadata"]["name"] != old_job["metadata"]["name"]
    ledger = {e["key"]: e for e in kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]}
    uid = mm["metadata"]["uid"]
    assert ledger[f"{uid}.1"]["state"] == "Charged" and ledger[f"{uid}.2"]["state"] == "Reserved"


@pytest.mark.parametrize("started", [True, False], ids=["running", "pending"])
def test_a_spec_made_invalid_retires_the_running_job(settings, started):
    """The new generation is refused (InvalidSpec): the previous generation's Job stops and its
    reservation is settled (charged if it ran, released if not), not left Reserved forever."""
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (old_job,) = kube.list(JOBS, "ns1")
    if started:
        _pod_of(kube, old_job, {"phase": "Running", "containerStatuses": [{"name": "merge", "state": {"running": {}}}]})
    mm = bump(kube, budget="10 GB")  # refused: not a Kubernetes quantity
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    assert ready(mm)["reason"] == "InvalidSpec" and "spec.budget" in ready(mm)["message"]
    assert kube.list(JOBS, "ns1") == []
    uid = mm["metadata"]["uid"]
    ledger = [(e["key"], e["state"]) for e in kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]]
    assert ledger == ([(f"{uid}.1", "Charged")] if started else [])
    assert not mm["status"].get("admission") and not mm["status"].get("jobName")
    c.merges.finalize_merge(mm)  # deleting it now settles nothing twice
    assert [(e["key"], e["state"]) for e in kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]] == ledger


def _pod_of(kube, job, status):
    name = job["metadata"]["name"]
    kube.put(
        PODS,
        {"metadata": {"name": name + "-p0d01", "namespace": "ns1", "labels": {"job-name": name}}, "status": status},
    )


@pytest.mark.parametrize(
    "pods",
    [
        [],  # no pod yet (or a suspended Job)
        [{"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}],
        [
            {
                "phase": "Pending",
                "containerStatuses": [{"name": "merge", "state": {"waiting": {"reason": "ImagePullBackOff"}}}],
            }
        ],
    ],
    ids=["no-pod", "unschedulable", "image-pull"],
)
def test_a_superseded_job_that_never_started_is_released_not_charged(settings, pods):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (old_job,) = kube.list(JOBS, "ns1")
    kube.objects[("jobs", "ns1", old_job["metadata"]["name"])]["status"] = {
        "active": 1,
        "startTime": "2026-11-22T12:00:00Z",
    }
    for st in pods:
        _pod_of(kube, old_job, st)
    mm = bump(kube, budget="4Gi")
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (new_job,) = kube.list(JOBS, "ns1")
    assert new_job["metadata"]["name"] != old_job["metadata"]["name"]
    uid = mm["metadata"]["uid"]
    ledger = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert [(e["key"], e["state"]) for e in ledger] == [(f"{uid}.2", "Reserved")]  # generation 1: released


def test_job_ever_started():
    from mergepipe_operator.k8s.jobs import job_ever_started

    assert not job_ever_started({"status": {"active": 1, "startTime": "t"}}, [])
    assert job_ever_started({"status": {"ready": 1}}, [])
    assert job_ever_started({"status": {"failed": 1}}, [])
    assert job_ever_started({}, [{"status": {"phase": "Failed"}}])
    assert job_ever_started(
        {},
        [
            {
                "status": {
                    "phase": "Pending",
                    "containerStatuses": [
                        {"name": "merge", "state": {"waiting": {}}, "lastState": {"terminated": {"exitCode": 1}}}
                    ],
                }
            }
        ],
    )
    assert not job_ever_started(
        {},
        [
            {
                "status": {
                    "phase": "Pending",
                    "containerStatuses": [{"name": "merge", "state": {"waiting": {"reason": "ContainerCreating"}}}],
                }
            }
        ],
    )


def bump(kube, **spec):
    o = kube.objects[("modelmerges", "ns1", "mm1")]
    o["spec"].update(spec)
    o["metadata"]["generation"] += 1
    return kube.get(MERGES, "ns1", "mm1")


def test_spec_change_with_the_same_plan_keeps_the_job_and_moves_the_reservation(settings):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    mm = bump(kube, resources={"cpu": "8"})  # the planner gives the same digest
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    assert [j["metadata"]["name"] for j in kube.list(JOBS, "ns1")] == [job["metadata"]["name"]]
    ledger = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert [(e["key"].split(".")[1], e["state"]) for e in ledger] == [("2", "Reserved")]


def test_committed_merge_with_an_unchanged_plan_stays_committed(settings):
    c, kube, store, mm = setup(settings, make_quota())
    st = c.merges.reconcile_merge(mm)
    st["conditions"] = cond.set_condition(st["conditions"], "Ready", "True", "Committed", "snapshot s1", 1, NOW)
    mm = apply(kube, mm, st)
    writes = len(kube.writes)
    mm = bump(kube, resources={"cpu": "8"})
    st = c.merges.reconcile_merge(mm)
    r = cond.get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"], r["observedGeneration"]) == ("True", "Committed", 2)
    assert len(kube.writes) == writes  # no new reservation, no Job


def test_finalizer_deletes_jobs_and_settles(settings):
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    _failed_pod(kube, job, "killed")  # a container of it ran
    c.merges.finalize_merge(mm)
    assert kube.list(JOBS, "ns1") == []
    (entry,) = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert entry["state"] == "Charged"  # it may have read: charge the reservation


def test_finalizer_releases_a_merge_whose_job_never_started(settings):
    """Deleted while its Job's pod was still pending (or suspended, no pod): nothing was read."""
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    name = job["metadata"]["name"]
    kube.put(
        PODS,
        {
            "metadata": {"name": name + "-p", "namespace": "ns1", "labels": {"job-name": name}},
            "status": {"phase": "Pending", "containerStatuses": [{"name": "merge", "state": {"waiting": {}}}]},
        },
    )
    assert [e["state"] for e in kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]] == ["Reserved"]
    c.merges.finalize_merge(mm)
    assert kube.list(JOBS, "ns1") == []
    assert kube.get(QUOTAS, "ns1", "q")["status"]["ledger"] == []  # the reservation is dropped, not charged


def test_finalizer_charges_when_the_recorded_job_is_gone(settings):
    """status.jobName names a Job that no longer exists: it may have run, charge."""
    c, kube, store, mm = setup(settings, make_quota())
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    kube.delete(JOBS, "ns1", job["metadata"]["name"])
    c.merges.finalize_merge(mm)
    (entry,) = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert entry["state"] == "Charged"
    c2, kube2, _, mm2 = setup(settings, make_quota())
    c2.merges.finalize_merge(mm2)  # never admitted: nothing to do
    assert kube2.get(QUOTAS, "ns1", "q").get("status") is None


def test_concurrent_admission_never_overspends_a_quota(settings):
    """Two merges admitted at once: the second writer's resourceVersion is stale, it re-reads and
    sees the first reservation."""
    kube = FakeKube()
    kube.put(QUOTAS, make_quota(bytes_="15Gi"))
    c = ctl.Controller(settings, kube, FakeStore(), Planner(), clock=lambda: NOW)
    results = {}

    def admit_b(_):
        results["b"] = c.quotas.reserve("ns1", "b", "uid-b.1", 10 * GI, NOW)

    kube.before_replace = admit_b  # b slips in between a's read and a's write
    results["a"] = c.quotas.reserve("ns1", "a", "uid-a.1", 10 * GI, NOW)
    assert results["b"][0].allowed and not results["a"][0].allowed
    st = kube.get(QUOTAS, "ns1", "q")["status"]
    assert [e["key"] for e in st["ledger"]] == ["uid-b.1"] and st["used"]["expertReadBytes"] == 10 * GI


@pytest.mark.parametrize("enforcement", ["Reject", "Clamp"])
def test_many_threads_never_overspend(settings, enforcement):
    kube = FakeKube()
    kube.put(QUOTAS, make_quota(bytes_="100Gi", enforcement=enforcement))
    c = ctl.Controller(settings, kube, FakeStore(), Planner(), clock=lambda: NOW)
    orig_get = kube.get

    def slow_get(*a):  # widen the read-modify-write window
        o = orig_get(*a)
        time.sleep(0.001)
        return o

    kube.get = slow_get
    orig_list = kube.list
    kube.list = lambda *a, **k: (time.sleep(0.001), orig_list(*a, **k))[1]
    out = []

    def worker(i):
        try:
            out.append(c.quotas.reserve("ns1", f"m{i}", f"uid{i}.1", 30 * GI, NOW)[0])
        except reconcile.Retry:
            out.append(None)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = kube.get(QUOTAS, "ns1", "q")["status"]
    reserved = sum(e["bytes"] for e in st["ledger"])
    admitted = [a for a in out if a is not None and a.allowed]
    assert reserved == sum(a.budget for a in admitted) <= 100 * GI
    assert len(st["ledger"]) == len(admitted)
    if enforcement == "Reject":
        assert len(admitted) == 3
    else:
        assert reserved == 100 * GI


def test_quota_refresh_ages_the_window(settings):
    old = qty.rfc3339(NOW - timedelta(hours=30))
    q = make_quota(status={"ledger": [{"key": "k", "merge": "m", "bytes": 5, "state": "Charged", "time": old}]})
    c, kube, _, _ = setup(settings, q)
    c.quotas.refresh_quota(kube.get(QUOTAS, "ns1", "q"))
    st = kube.get(QUOTAS, "ns1", "q")["status"]
    assert st["ledger"] == [] and st["used"] == {"expertReadBytes": 0, "merges": 0}
    assert cond.get_condition(st["conditions"], "Ready")["status"] == "True"
    writes = len(kube.writes)
    c.quotas.refresh_quota(kube.get(QUOTAS, "ns1", "q"))
    assert len(kube.writes) == writes  # nothing changed: no write
    kube.objects[("mergequotas", "ns1", "q")]["spec"]["window"] = "soon"
    c.quotas.refresh_quota(kube.get(QUOTAS, "ns1", "q"))
    assert cond.get_condition(kube.get(QUOTAS, "ns1", "q")["status"]["conditions"], "Ready")["reason"] == "InvalidSpec"


def test_kopf_handlers_are_registered():
    from mergepipe_operator import main  # noqa: F401  (importing the entry point registers every handler)

    registry = kopf.get_default_registry()
    changing = {(h.id, h.reason) for h in registry._changing.get_all_handlers()}  # noqa: SLF001
    assert ("merge_changed", "create") in changing and ("merge_deleted", "delete") in changing
    assert ("snapshot_changed", "create") in changing and ("quota_changed", "create") in changing
    watching = [h.id for h in registry._watching.get_all_handlers()]  # noqa: SLF001
    assert "job_event" in watching
    spawning = [h.id for h in registry._spawning.get_all_handlers()]  # noqa: SLF001
    assert "merge_job_poll" in spawning


def test_run_maps_retries_to_kopf_errors():
    patch = kopf.Patch()
    with pytest.raises(kopf.TemporaryError):
        kopfglue.run(
            lambda: (_ for _ in ()).throw(reconcile.RetryWithStatus("wait", 7, {"observedGeneration": 3})), patch, {}
        )
    assert patch["status"] == {"observedGeneration": 3}
    patch = kopf.Patch()
    kopfglue.run(lambda: {"x": 1}, patch, {})
    assert patch["status"] == {"x": 1}


def test_quota_gauges_follow_the_quota_status(settings):
    """mergepipe_quota_used / mergepipe_quota_hard per namespace, quota and resource, from what
    the operator writes: the reservation at admission, the charge from the manifest, a refresh."""
    from prometheus_client import REGISTRY

    def sample(metric, res, quota="q"):
        return REGISTRY.get_sample_value(metric, {"namespace": "ns1", "quota": quota, "resource": res})

    c, kube, store, mm = setup(settings, make_quota(bytes_="100Gi", merges=5))
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    assert sample("mergepipe_quota_used", "expertReadBytes") == 8 * GI  # reserved: the plan's bytes
    assert sample("mergepipe_quota_used", "merges") == 1
    assert (
        sample("mergepipe_quota_hard", "expertReadBytes") == 100 * GI and sample("mergepipe_quota_hard", "merges") == 5
    )
    commit(store, "s3://snapshots/mm1/", mm["status"]["plan"]["digest"], realized=3 * GI)
    job = kube.get(JOBS, "ns1", mm["status"]["jobName"])
    apply(kube, mm, c.merges.sync_job(mm, dict(job, status={"conditions": [{"type": "Complete", "status": "True"}]})))
    assert sample("mergepipe_quota_used", "expertReadBytes") == 3 * GI  # charged: the realized bytes
    # the limit on merges is dropped: its hard sample goes, used stays
    q = kube.objects[("mergequotas", "ns1", "q")]
    del q["spec"]["hard"]["merges"]
    c.quotas.refresh_quota(kube.get(QUOTAS, "ns1", "q"))
    assert sample("mergepipe_quota_hard", "merges") is None and sample("mergepipe_quota_used", "merges") == 1
    QuotaLedger.forget_quota("ns1", "q")
    assert (
        sample("mergepipe_quota_used", "expertReadBytes") is None
        and sample("mergepipe_quota_hard", "expertReadBytes") is None
    )


# --- partitioned merges: an Indexed Job, then the operator commits ---------------------------------


class ShardedPlanner(Planner):
    """Plans with ``shards`` output shards (the most parts a plan splits into)."""

    def __init__(self, shards, **kw):
        super().__init__(**kw)
        self.shards = shards

    def __call__(self, spec, catalog_uri):
        import dataclasses

        return dataclasses.replace(super().__call__(spec, catalog_uri), shards=self.shards)


def test_parallelism_runs_an_indexed_job_and_the_operator_commits_its_parts(settings):
    import dataclasses

    calls = []

    def committer(plan_uri, out_uri, n):
        calls.append((plan_uri, out_uri, n))
        commit(store, out_uri, st["plan"]["digest"], realized=6 * GI)
        return "h" * 64

    settings = dataclasses.replace(settings, bytes_per_part=4 * GI)  # 1 + 8 + 1 GiB moved: auto = 3 parts
    c, kube, store, mm = setup(settings, make_quota(bytes_="100Gi", merges=5), planner=ShardedPlanner(6))
    c.merges.committer = committer
    st = c.merges.reconcile_merge(mm)
    mm = apply(kube, mm, st)
    (job,) = kube.list(JOBS, "ns1")
    assert (job["spec"]["completions"], mmd.job_parts(job)) == (3, 3) and st["parts"]["progress"] == "0/3"
    assert "Indexed Job of 3 parts" in ready(mm)["message"]
    running = dict(job, status={"active": 2, "completedIndexes": "1", "failed": 1})
    p = c.merges.sync_job(mm, running)
    assert p["parts"]["progress"] == "1/3" and p["parts"]["failedPods"] == 1
    assert cond.get_condition(p["conditions"], "Ready")["message"] == (
        f"merge Job {job['metadata']['name']}: 1/3 parts done, 2 pod(s) running, 1 failed attempt(s) retried per index"
    )
    mm = apply(kube, mm, p)
    assert c.merges.sync_job(mm, running) is None  # nothing new
    assert calls == []  # nothing is committed before every index succeeded
    done = dict(
        job, status={"completedIndexes": "0-2", "succeeded": 3, "conditions": [{"type": "Complete", "status": "True"}]}
    )
    mm = apply(kube, mm, c.merges.sync_job(mm, done))
    assert calls == [(st["plan"]["uri"], "s3://snapshots/mm1/", 3)]
    assert ready(mm)["reason"] == "Committed" and mm["status"]["parts"]["progress"] == "3/3"
    assert kube.get(QUOTAS, "ns1", "q")["status"]["used"]["expertReadBytes"] == 6 * GI  # the manifest's sum
    assert c.merges.sync_job(mm, done) is None and len(calls) == 1  # a replayed event commits nothing more


def test_an_explicit_parallelism_above_the_chart_limit_is_an_invalid_spec(settings):
    c, kube, store, mm = setup(settings, mm=make_merge(parallelism=settings.max_parallelism + 1))
    st = c.merges.reconcile_merge(mm)
    r = cond.get_condition(st["conditions"], "Ready")
    assert r["reason"] == "InvalidSpec" and "spec.parallelism" in r["message"] and kube.list(JOBS, "ns1") == []


def test_a_refused_commit_fails_the_merge_and_storage_trouble_retries(settings):
    from mergepipe.errors import CommitConflict

    c, kube, store, mm = setup(
        settings, make_quota(bytes_="100Gi", merges=5), mm=make_merge(parallelism=2), planner=ShardedPlanner(2)
    )
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    (job,) = kube.list(JOBS, "ns1")
    done = dict(
        job, status={"completedIndexes": "0-1", "succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}
    )

    def flaky(plan_uri, out_uri, n):
        raise ConnectionError("endpoint unreachable")

    c.merges.committer = flaky
    with pytest.raises(reconcile.Retry, match="endpoint unreachable"):
        c.merges.sync_job(mm, done)

    def refuses(plan_uri, out_uri, n):
        raise CommitConflict("run plan-x: part 1/2 has no record; run `mergepipe execute ...` again.")

    c.merges.committer = refuses
    st = c.merges.sync_job(mm, done)
    r = cond.get_condition(st["conditions"], "Ready")
    assert r["reason"] == "JobFailed" and "part 1/2 has no record" in r["message"]
    q = kube.get(QUOTAS, "ns1", "q")
    assert q["status"]["ledger"][0]["state"] == "Charged"  # the pods ran: the reservation is charged


class CalibrationPlanner(Planner):
    """The catalog has the experts' statistics but not the base's sensitivity on the merge's
    calibration set until ``sensitivity`` is set (what plan_merge reports, planning.PlanSummary)."""

    def __init__(self):
        super().__init__()
        self.sensitivity, self.specs = False, []

    def __call__(self, spec, catalog_uri):
        self.specs.append(spec)
        cal = (spec.get("calibration") or {}).get("uri")
        if cal and not self.sensitivity:
            return planning.PlanSummary(
                missing_sensitivity=True,
                analysis_id=mmd.analysis_id("b" * 64, [], catalog_uri, spec["method"], "c" * 64),
                calibration_uri=cal,
                block_value="fisher",
            )
        return super().__call__(spec, catalog_uri)


@pytest.mark.parametrize("gpus", [1, 0])
def test_a_missing_sensitivity_starts_an_analyze_job_with_the_calibration_set_on_the_gpu(settings, gpus):
    """spec.calibration.uri: the analyze Job records the base's Fisher on it (`--calibration`),
    with the merge Job's GPU (`--device cuda`, the GPU limit) unless the merge runs on CPU; the
    spec's experts are passed (their cached statistics are not recomputed); then the merge is planned."""
    cal = "s3://models/calibration/code.jsonl"
    mm = make_merge(calibration={"uri": cal}, resources={"gpu": {"count": gpus}})
    planner = CalibrationPlanner()
    c, kube, store, mm = setup(settings, make_quota(), planner=planner, mm=mm)
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    r = cond.get_condition(e.value.status["conditions"], "Ready")
    assert r["reason"] == "Analyzing" and f"sensitivity on {cal}" in r["message"]
    (job,) = kube.list(JOBS, "ns1")
    assert job["metadata"]["name"] == mmd.analyze_job_name(
        "mm1", mmd.analysis_id("b" * 64, [], settings.catalog_uri, "ties", "c" * 64)
    )
    assert job["metadata"]["annotations"][mmd.ANN_CALIBRATION] == cal
    pod = job["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert ctr["args"] == [
        "analyze",
        "--base",
        "s3://models/base",
        "--expert",
        "s3://models/code",
        "--expert",
        "s3://models/math",
        "--calibration",
        cal,
        "--catalog",
        settings.catalog_uri,
        "--json",
        *(["--device", "cuda"] if gpus else []),
    ]
    assert (ctr["resources"].get("limits", {}).get(settings.gpu_resource_name) == "1") == bool(gpus)
    planner.sensitivity = True
    st = c.merges.reconcile_merge(mm)
    assert cond.get_condition(st["conditions"], "Ready")["reason"] == "JobRunning"
    assert cond.get_condition(st["conditions"], "Analyzed")["status"] == "True"


def test_the_operators_default_calibration_set_applies_to_merges_without_one(settings):
    import dataclasses

    s = dataclasses.replace(settings, calibration_uri="s3://models/calibration/default.jsonl")
    planner = CalibrationPlanner()
    planner.sensitivity = True
    c, kube, store, mm = setup(s, make_quota(), planner=planner)
    c.merges.reconcile_merge(mm)
    assert planner.specs[0]["calibration"] == {"uri": s.calibration_uri}
    own = make_merge(name="mm2", calibration={"uri": "s3://models/calibration/own.jsonl"})
    c2, _, _, mm2 = setup(s, make_quota(), planner=planner, mm=own)
    c2.merges.reconcile_merge(mm2)
    assert planner.specs[-1]["calibration"] == {"uri": "s3://models/calibration/own.jsonl"}
    # the analyze Job of a merge without a calibration set gets no GPU (task-vector statistics are numpy)
    plain = mmd.build_analyze_job(make_merge(), ["s3://models/math"], "a" * 64, settings)
    assert "--calibration" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--device" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_resumed_merge_is_charged_what_every_attempt_read(settings):
    """A pod that died and was retried resumed: the manifest's realized bytes are the final
    attempt's, io.earlier_attempts what the dead one had read; the quota is charged both."""
    c, kube, store, mm = setup(settings, make_quota(bytes_="100Gi", merges=5))
    st = c.merges.reconcile_merge(mm)
    mm = apply(kube, mm, st)
    (job,) = kube.list(JOBS, "ns1")
    commit(store, "s3://snapshots/mm1/", st["plan"]["digest"], realized=5 * GI, earlier=2 * GI)
    done = dict(job, status={"succeeded": 1, "failed": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    mm = apply(kube, mm, c.merges.sync_job(mm, done))
    assert ready(mm)["reason"] == "Committed" and mm["status"]["realized"]["expertReadBytes"] == 5 * GI
    q = kube.get(QUOTAS, "ns1", "q")
    assert q["status"]["ledger"][0]["state"] == "Charged" and q["status"]["used"]["expertReadBytes"] == 7 * GI
    facts = snapd.manifest_facts(json.loads(store.get("s3://snapshots/mm1/manifest.json")))
    assert facts.spent_expert_bytes == 7 * GI and facts.earlier["expertReadBytes"] == 2 * GI


class SketchPlanner(Planner):
    """Records the spec it plans; a spec with fidelity tiers (``sketch`` other than none) plans
    a quarter of its expert reads from block sketches (what plan_merge reports)."""

    def __init__(self):
        super().__init__()
        self.specs = []

    def __call__(self, spec, catalog_uri):
        self.specs.append(spec)
        p = super().__call__(spec, catalog_uri)
        kind = spec.get("sketch") or DEFAULT_SKETCH  # the core's default
        if kind == "none" or spec.get("budget") is None:
            return p
        return dataclasses.replace(p, sketch=kind, sketch_read_bytes=p.expert_read_bytes // 4)


def test_spec_sketch_or_the_operators_default_reaches_the_plan_and_its_status(settings):
    """spec.sketch goes to the planner as is; a merge without one gets its namespace's default
    (chart merges.sketchByNamespace), else the chart's merges.sketch (none without it: the core's
    default); status.plan records the tiers and the sketch bytes,
    the Planned condition says how many of the expert reads are sketches."""
    planner = SketchPlanner()
    c, kube, store, mm = setup(settings, make_quota(), planner=planner)
    st = c.merges.reconcile_merge(mm)
    assert "sketch" not in planner.specs[-1]  # the core's default applies
    assert (st["plan"]["sketch"], st["plan"]["sketchReadBytes"]) == (DEFAULT_SKETCH, 2 * GI)
    assert f"2Gi of them block sketches, {DEFAULT_SKETCH}" in cond.get_condition(st["conditions"], "Planned")["message"]

    s = dataclasses.replace(settings, sketch="none")
    c, kube, store, mm = setup(s, make_quota(), planner=planner)
    st = c.merges.reconcile_merge(mm)
    assert planner.specs[-1]["sketch"] == "none"
    assert (st["plan"]["sketch"], st["plan"]["sketchReadBytes"]) == ("none", 0)
    assert "block sketches" not in cond.get_condition(st["conditions"], "Planned")["message"]
    # the namespace's default (chart merges.sketchByNamespace) comes before the operator's
    s2 = dataclasses.replace(s, sketch_by_namespace={"ns1": "sign2", "other": "sign1"})
    c, kube, store, mm = setup(s2, make_quota(), planner=planner)
    st = c.merges.reconcile_merge(mm)
    assert planner.specs[-1]["sketch"] == "sign2" and st["plan"]["sketch"] == "sign2"
    # the merge's own spec.sketch wins over both defaults
    c, kube, store, mm = setup(s2, make_quota(), planner=planner, mm=make_merge(sketch="sign1"))
    st = c.merges.reconcile_merge(mm)
    assert planner.specs[-1]["sketch"] == "sign1" and st["plan"]["sketch"] == "sign1"
    assert mm["spec"]["sketch"] == "sign1" and "sketch" not in make_merge()["spec"]  # the object is not changed


def test_a_quota_clamp_on_a_method_that_refuses_budgets_waits_and_says_why(settings):
    """arcee_fusion reads whole tensors: a Clamp quota with less left than its plan reads does
    not hand it a budget the core would refuse as if the user had set spec.budget; the merge
    waits (QuotaExceeded, retried) with a message naming the quota, the clamp and the method."""
    planner = Planner(full=8 * GI)
    mm = make_merge(
        method="arcee_fusion",
        parameters={},
        budget=None,
        experts=[{"name": "code", "uri": "s3://models/code/"}],
    )
    c, kube, store, mm = setup(settings, make_quota(bytes_="3Gi", enforcement="Clamp"), planner=planner, mm=mm)
    with pytest.raises(reconcile.RetryWithStatus) as e:
        c.merges.reconcile_merge(mm)
    assert e.value.delay == settings.quota_retry_seconds
    assert planner.calls == [(None, "s3://mergepipe/catalog/")]  # never re-planned under a clamped budget
    r = cond.get_condition(e.value.status["conditions"], "Ready")
    assert r["reason"] == "QuotaExceeded" and "spec.budget" not in r["message"]
    assert r["message"].startswith("MergeQuota q (Clamp) would lower the budget to 3Gi, but arcee_fusion reads every")
    assert "cannot run under a clamped budget" in r["message"] and "8Gi of expert reads left" in r["message"]
    assert kube.list(JOBS, "ns1") == [] and kube.get(QUOTAS, "ns1", "q").get("status", {}).get("ledger", []) == []
    # with room for its whole read it is admitted as usual
    c, kube, store, mm = setup(settings, make_quota(bytes_="10Gi", enforcement="Clamp"), planner=planner, mm=mm)
    st = c.merges.reconcile_merge(mm)
    assert cond.get_condition(st["conditions"], "Ready")["reason"] == "JobRunning"
    assert st["admission"]["clamped"] is False


def test_post_events_posts_a_racing_transition_once(monkeypatch):
    """Two handlers of one MergeSearch (its driver Job's event and its timer) both compute
    Searching -> Completed from the same old status: one Event, not two. A later real transition
    (a new generation, or Completed -> Searching -> Completed) is posted again."""
    from mergepipe_operator import kopfglue

    posted: list[str] = []
    monkeypatch.setattr(kopfglue.kopf, "event", lambda obj, type, reason, message: posted.append(reason))
    monkeypatch.setattr(kopfglue, "_POSTED", type(kopfglue._POSTED)())

    def status(reason: str, gen: int, st: str = "True") -> dict:
        return {"conditions": [{"type": "Ready", "status": st, "reason": reason, "observedGeneration": gen}]}

    obj = {"metadata": {"uid": "u-1", "name": "front"}}
    searching, completed = status("Searching", 1, "False"), status("Completed", 1)
    kopfglue.post_events(obj, searching, completed)
    kopfglue.post_events(obj, searching, completed)  # the racing handler, same old status
    assert posted == ["Completed"]
    kopfglue.post_events(obj, completed, status("Searching", 2, "False"))
    kopfglue.post_events(obj, status("Searching", 2, "False"), status("Completed", 2))
    assert posted == ["Completed", "Searching", "Completed"]
    kopfglue.post_events({"metadata": {"uid": "u-2"}}, searching, completed)  # another object
    kopfglue.post_events({"metadata": {}}, searching, completed)  # no uid: never deduplicated
    kopfglue.post_events({"metadata": {}}, searching, completed)
    assert posted == ["Completed", "Searching", "Completed", "Completed", "Completed", "Completed"]
