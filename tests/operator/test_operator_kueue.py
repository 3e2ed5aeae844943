"""Kueue (issue 14 item 3): Jobs labelled for a LocalQueue, a suspended Job shown as Queued, and
MergeQuota as a Kueue AdmissionCheck (controllerName mergepipe.io/io-budget) deciding a merge
Job's Workload from the reservation ledger. Pure decisions and the reconcilers over in-memory
fakes; the whole flow with the real operator and a played Kueue is in test_operator_kmock.py."""

from __future__ import annotations

import dataclasses

import pytest
from op_testlib import NOW, make_merge, make_quota
from test_operator_controller import GI, Planner, apply, ready, setup

from mergepipe_operator.k8s import conditions as cond
from mergepipe_operator.k8s.api import JOBS, MERGES, QUOTAS
from mergepipe_operator.k8s.jobs import job_outcome
from mergepipe_operator.kueue import decisions as kq
from mergepipe_operator.modelmerge import decisions as mmd
from mergepipe_operator.search import decisions as sd

CHECK = "io-budget"


def kueue_objects(kube, *, checks=(CHECK,), controller=kq.CONTROLLER_NAME, ns="ns1", queue="llm"):
    """LocalQueue ``queue`` in ``ns`` -> ClusterQueue gpu (v1beta2 admissionChecksStrategy) ->
    AdmissionChecks."""
    kube.put(
        kq.LOCAL_QUEUES,
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": queue, "namespace": ns},
            "spec": {"clusterQueue": "gpu"},
        },
    )
    kube.put(
        kq.CLUSTER_QUEUES,
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": "gpu"},
            "spec": {"admissionChecksStrategy": {"admissionChecks": [{"name": c} for c in checks]}},
        },
    )
    for c in checks:
        kube.put(
            kq.ADMISSION_CHECKS,
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "AdmissionCheck",
                "metadata": {"name": c},
                "spec": {"controllerName": controller},
            },
        )


def workload_for(kube, job, *, reserved=True, states=(("io-budget", "Pending"),)):
    """The Workload Kueue's job integration creates for ``job``, after Kueue reserved quota."""
    wl = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": f"job-{job['metadata']['name']}-1a2b3",
            "namespace": job["metadata"]["namespace"],
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job["metadata"]["name"],
                    "uid": "job-uid",
                    "controller": True,
                }
            ],
        },
        "spec": {"queueName": kq.job_queue(job), "podSets": [{"name": "main", "count": 1}]},
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "True" if reserved else "False",
                    "reason": "QuotaReserved" if reserved else "Pending",
                    "message": "Quota reserved in ClusterQueue gpu"
                    if reserved
                    else "couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu",
                    "lastTransitionTime": "2026-11-22T12:00:00Z",
                }
            ],
            "admissionChecks": [
                {"name": n, "state": s, "message": "", "lastTransitionTime": "2026-11-22T12:00:00Z"} for n, s in states
            ],
        },
    }
    return kube.put(kq.WORKLOADS, wl)


def check_state(kube, wl, name=CHECK):
    (c,) = [
        c
        for c in kube.get(kq.WORKLOADS, wl["metadata"]["namespace"], wl["metadata"]["name"])["status"][
            "admissionChecks"
        ]
        if c["name"] == name
    ]
    return c


# --- labels and Queued ------------------------------------------------------------------------------


def test_jobs_carry_the_queue_label_from_the_spec_or_the_default(settings):
    mm = make_merge(queueName="llm")
    job = mmd.build_job(mm, "s3://p/x.json", "ab" * 32, settings)
    assert job["metadata"]["labels"][kq.QUEUE_LABEL] == "llm"
    assert kq.QUEUE_LABEL not in job["spec"]["template"]["metadata"]["labels"]  # Kueue reads the Job's label
    assert "suspend" not in job["spec"]  # Kueue's webhook suspends it; the operator never touches suspend
    an = mmd.build_analyze_job(mm, ["s3://models/code/"], "cd" * 32, settings)
    assert an["metadata"]["labels"][kq.QUEUE_LABEL] == "llm"
    dflt = dataclasses.replace(settings, queue_name="team-default")
    assert (
        mmd.build_job(make_merge(), "s3://p/x.json", "ab" * 32, dflt)["metadata"]["labels"][kq.QUEUE_LABEL]
        == "team-default"
    )
    assert mmd.build_job(mm, "s3://p/x.json", "ab" * 32, dflt)["metadata"]["labels"][kq.QUEUE_LABEL] == "llm"
    assert kq.QUEUE_LABEL not in mmd.build_job(make_merge(), "s3://p/x.json", "ab" * 32, settings)["metadata"]["labels"]


def test_search_jobs_and_candidates_carry_the_queue(settings):
    from test_operator_search import search

    ms = search(queueName="llm")
    driver = sd.build_driver_job(ms, settings)
    assert driver["metadata"]["labels"][kq.QUEUE_LABEL] == "llm"
    assert sd.eval_job_template(ms, settings)["metadata"]["labels"][kq.QUEUE_LABEL] == "llm"
    env = {e["name"]: e["value"] for e in driver["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    import json

    assert json.loads(env["MERGEPIPE_CANDIDATE_TEMPLATE"])["queueName"] == "llm"  # the candidate ModelMerges


def test_a_suspended_job_is_queued_naming_its_local_queue():
    job = {"metadata": {"name": "mm1-abc", "labels": {kq.QUEUE_LABEL: "llm"}}, "spec": {"suspend": True}, "status": {}}
    o = job_outcome(job)
    assert (o.state, o.reason) == ("Running", cond.Reason.QUEUED)
    assert o.message == "merge Job mm1-abc is queued in LocalQueue llm (suspended until Kueue admits it)"
    wl = {
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "message": "couldn't assign flavors to pod set main: insufficient quota",
                }
            ]
        }
    }
    assert kq.queued_message("merge Job", job, wl).endswith(
        "; Kueue: couldn't assign flavors to pod set main: insufficient quota"
    )
    wl = {
        "status": {
            "conditions": [{"type": "QuotaReserved", "status": "True"}],
            "admissionChecks": [{"name": "io-budget", "state": "Retry", "message": "MergeQuota q: only 1000B left"}],
        }
    }
    assert kq.queued_message("merge Job", job, wl).endswith(
        "; admission checks: io-budget Retry (MergeQuota q: only 1000B left)"
    )
    done = dict(job, status={"conditions": [{"type": "Complete", "status": "True"}]})
    assert job_outcome(done).state == "Succeeded"  # finished: no longer queued
    assert job_outcome(dict(job, spec={})).reason == cond.Reason.JOB_RUNNING


def test_queued_then_admitted_merge_in_the_reconciler(settings):
    c, kube, store, mm = setup(settings, mm=make_merge(queueName="llm"))
    st = c.merges.reconcile_merge(mm)
    mm = apply(kube, mm, st)
    assert ready(mm)["reason"] == "JobRunning"
    assert st["admission"].get("admissionCheck") is None  # no Kueue objects: the operator admits itself
    (job,) = kube.list(JOBS, "ns1")
    job["spec"]["suspend"] = True  # Kueue's webhook
    st = c.merges.sync_job(mm, job)
    mm = apply(kube, mm, st)
    assert ready(mm)["reason"] == "Queued" and "LocalQueue llm" in ready(mm)["message"]
    assert mmd.generation_settled(mm["status"], 1) and c.merges.reconcile_merge(mm) is None
    job["spec"]["suspend"] = False  # Kueue admitted it
    job["status"] = {"active": 1}
    mm = apply(kube, mm, c.merges.sync_job(mm, job))
    assert ready(mm)["reason"] == "JobRunning"
    assert ("patch", "jobs") not in {(w[0], w[1]) for w in kube.writes}  # the operator never writes a Job


# --- the AdmissionCheck ------------------------------------------------------------------------------


def test_cluster_queue_checks_v1beta2_and_v1beta1():
    assert kq.cluster_queue_checks(
        {"spec": {"admissionChecksStrategy": {"admissionChecks": [{"name": "a"}, {"name": "b", "onFlavors": ["x"]}]}}}
    ) == ["a", "b"]
    assert kq.cluster_queue_checks({"spec": {"admissionChecks": ["a"]}}) == ["a"]
    assert kq.cluster_queue_checks(None) == []


def test_with_an_io_budget_check_the_operator_does_not_reserve_before_the_job(settings):
    full = 8 * GI
    c, kube, store, mm = setup(settings, make_quota(bytes_=full * 3 // 2), mm=make_merge(queueName="llm"))
    kueue_objects(kube)
    st = c.merges.reconcile_merge(mm)
    mm = apply(kube, mm, st)
    assert ready(mm)["reason"] == "JobRunning" and st["admission"]["admissionCheck"] == CHECK
    admitted = cond.get_condition(st["conditions"], "QuotaAdmitted")
    assert admitted["status"] == "Unknown" and CHECK in admitted["message"]
    assert (kube.get(QUOTAS, "ns1", "q").get("status") or {}).get("ledger") in (None, [])  # nothing reserved yet
    assert len(kube.list(JOBS, "ns1")) == 1


@pytest.mark.parametrize(
    "controller, queue, want",
    [
        (kq.CONTROLLER_NAME, "llm", CHECK),
        ("kueue.x-k8s.io/provisioning-request", "llm", None),
        (kq.CONTROLLER_NAME, "other", None),
    ],
)
def test_io_budget_check_lookup(settings, controller, queue, want):
    c, kube, *_ = setup(settings)
    kueue_objects(kube, controller=controller)
    assert c.kueue.io_budget_check("ns1", queue) == want
    assert c.kueue.io_budget_check("ns1", None) is None


def _admitted_merge(settings, quota, name="mm1"):
    c, kube, store, _ = setup(settings, quota, mm=_merge(name))
    kueue_objects(kube)
    return c, kube


def _merge(name):
    mm = make_merge(name, queueName="llm", output={"uri": f"s3://snapshots/{name}/"})
    mm["metadata"]["uid"] = f"0f0e0d0c-0000-4000-8000-{sum(map(ord, name)):012d}"
    return mm


def _plan_and_job(c, kube, name):
    mm = kube.get(MERGES, "ns1", name) or kube.put(MERGES, _merge(name))
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    job = kube.get(JOBS, "ns1", mm["status"]["jobName"])
    return mm, job


def test_the_check_reserves_the_plan_ready_then_retry_then_rejected(settings):
    full = 8 * GI
    c, kube = _admitted_merge(settings, make_quota(bytes_=full * 3 // 2))
    mm1, job1 = _plan_and_job(c, kube, "mm1")
    wl1 = workload_for(kube, job1)
    assert c.kueue.check_workload(wl1)
    st = check_state(kube, wl1)
    assert st["state"] == "Ready" and "admitted by MergeQuota q" in st["message"]
    (entry,) = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert (entry["key"], entry["bytes"], entry["state"], entry["merge"]) == (
        mm1["status"]["admission"]["key"],
        full,
        "Reserved",
        "mm1",
    )
    assert not c.kueue.check_workload(kube.get(kq.WORKLOADS, "ns1", wl1["metadata"]["name"]))  # decided: nothing more

    mm2, job2 = _plan_and_job(c, kube, "mm2")
    wl2 = workload_for(kube, job2)
    assert c.kueue.check_workload(wl2)
    st = check_state(kube, wl2)
    assert st["state"] == "Retry" and st["requeueAfterSeconds"] == settings.quota_retry_seconds
    assert "MergeQuota q" in st["message"]
    assert len(kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]) == 1  # nothing reserved for mm2

    # a plan no window of this quota could ever cover is Rejected (Kueue deactivates the Workload)
    c3, kube3 = _admitted_merge(settings, make_quota(bytes_=full // 2))
    _, job3 = _plan_and_job(c3, kube3, "mm1")
    wl3 = workload_for(kube3, job3)
    c3.kueue.check_workload(wl3)
    st = check_state(kube3, wl3)
    assert st["state"] == "Rejected" and "more than MergeQuota q ever allows" in st["message"]


def test_a_clamp_quota_cannot_clamp_an_admitted_job(settings):
    full = 8 * GI
    c, kube = _admitted_merge(settings, make_quota(bytes_=full * 3 // 2, enforcement="Clamp"))
    _plan_and_job(c, kube, "mm1")
    wl1 = workload_for(kube, kube.get(JOBS, "ns1", kube.get(MERGES, "ns1", "mm1")["status"]["jobName"]))
    c.kueue.check_workload(wl1)
    _, job2 = _plan_and_job(c, kube, "mm2")
    wl2 = workload_for(kube, job2)
    c.kueue.check_workload(wl2)
    assert check_state(kube, wl2)["state"] == "Retry"  # Clamp would lower a budget the Job's plan already fixed
    assert len(kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]) == 1


def test_the_check_ignores_what_is_not_its_business(settings):
    c, kube = _admitted_merge(settings, make_quota(bytes_="1Gi"))
    mm, job = _plan_and_job(c, kube, "mm1")
    # before Kueue reserved quota: nothing to decide
    assert not c.kueue.check_workload(workload_for(kube, job, reserved=False))
    # another controller's check: untouched
    kube.objects.clear()
    kueue_objects(kube, checks=("prov",), controller="kueue.x-k8s.io/provisioning-request")
    assert not c.kueue.check_workload(workload_for(kube, job, states=(("prov", "Pending"),)))
    # a Job that is not a mergepipe merge: Ready (it reads no expert bytes)
    kube.objects.clear()
    kueue_objects(kube)
    other = {"metadata": {"name": "train", "namespace": "ns1", "labels": {kq.QUEUE_LABEL: "llm"}}, "spec": {}}
    kube.put(JOBS, other)
    wl = workload_for(kube, other)
    assert c.kueue.check_workload(wl)
    assert check_state(kube, wl)["state"] == "Ready" and "not a mergepipe merge" in check_state(kube, wl)["message"]


def test_settling_after_an_admission_check_finds_the_reservation(settings):
    """The ModelMerge's admission names no quota (the check reserved later): success charges the
    realized bytes in whichever quota holds the key."""
    from test_operator_controller import commit

    full = 8 * GI
    c, kube = _admitted_merge(settings, make_quota(bytes_=full * 3 // 2))
    mm, job = _plan_and_job(c, kube, "mm1")
    wl = workload_for(kube, job)
    c.kueue.check_workload(wl)
    job["status"] = {"active": 1}
    mm = apply(kube, mm, c.merges.sync_job(mm, job))
    admitted = cond.get_condition(mm["status"]["conditions"], "QuotaAdmitted")
    assert admitted["status"] == "True" and CHECK in admitted["message"]
    commit(c.store, "s3://snapshots/mm1/", mm["status"]["plan"]["digest"], realized=5 * GI)
    done = dict(job, status={"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]})
    mm = apply(kube, mm, c.merges.sync_job(mm, done))
    assert ready(mm)["reason"] == "Committed"
    (entry,) = kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert (entry["state"], entry["bytes"]) == ("Charged", 5 * GI)


def test_our_admission_checks_are_marked_active(settings):
    c, kube, *_ = setup(settings)
    kueue_objects(kube, checks=(CHECK,))
    kueue_objects(kube, checks=("prov",), controller="kueue.x-k8s.io/provisioning-request")
    for ac in kube.list_cluster(kq.ADMISSION_CHECKS):
        c.kueue.activate_check(ac)
    got = {
        a["metadata"]["name"]: cond.get_condition((a.get("status") or {}).get("conditions"), "Active")
        for a in kube.list_cluster(kq.ADMISSION_CHECKS)
    }
    assert got["prov"] is None and got[CHECK]["status"] == "True"
    assert kq.active_condition(kube.get_cluster(kq.ADMISSION_CHECKS, CHECK), NOW) is None  # idempotent


def test_settings_read_the_kueue_values():
    from mergepipe_operator.settings import Settings

    s = Settings.from_env({"MERGEPIPE_QUEUE_NAME": "llm", "MERGEPIPE_KUEUE_ADMISSION_CHECK": "true"})
    assert (s.queue_name, s.kueue_admission_check) == ("llm", True)
    assert (Settings.from_env({}).queue_name, Settings.from_env({}).kueue_admission_check) == (None, False)
    with pytest.raises(ValueError, match="KUEUE_ADMISSION_CHECK"):
        Settings.from_env({"MERGEPIPE_KUEUE_ADMISSION_CHECK": "yes please"})


def test_planner_is_unused_by_the_check(settings):
    """Deciding a check reads the plan the ModelMerge's status records; it never plans again."""
    planner = Planner()
    c, kube, store, mm = setup(settings, make_quota(bytes_="100Gi"), planner=planner, mm=make_merge(queueName="llm"))
    kueue_objects(kube)
    mm = apply(kube, mm, c.merges.reconcile_merge(mm))
    calls = len(planner.calls)
    c.kueue.check_workload(workload_for(kube, kube.get(JOBS, "ns1", mm["status"]["jobName"])))
    assert len(planner.calls) == calls


def test_the_kueue_example_routes_team_llm_through_the_io_budget_check(settings):
    """examples/kueue.yaml: LocalQueue llm -> ClusterQueue llm-merges -> AdmissionCheck io-budget
    with this operator's controllerName, as the operator's own lookup finds it."""
    from op_testlib import ROOT, load_docs

    docs = {d["kind"]: d for d in load_docs(ROOT / "examples" / "kueue.yaml")}
    assert all(d["apiVersion"] == "kueue.x-k8s.io/v1beta2" for d in docs.values())
    c, kube, *_ = setup(settings)
    kube.put(kq.LOCAL_QUEUES, docs["LocalQueue"])
    kube.put(kq.CLUSTER_QUEUES, docs["ClusterQueue"])
    kube.put(kq.ADMISSION_CHECKS, docs["AdmissionCheck"])
    assert c.kueue.io_budget_check(docs["LocalQueue"]["metadata"]["namespace"], "llm") == "io-budget"
    flavors = docs["ClusterQueue"]["spec"]["resourceGroups"][0]["flavors"]
    assert [f["name"] for f in flavors] == [docs["ResourceFlavor"]["metadata"]["name"]]
