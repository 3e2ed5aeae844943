"""The MergeQuota ledger is exact in every lifecycle (issue 22 item 8).

Two property tests (hypothesis):

- on the pure ledger functions (:mod:`mergepipe_operator.quota.decisions`): any sequence of
  admissions and closings keeps every entry's bytes an integer >= 0 and ``used`` equal to the sum
  of the entries; a negative, fractional or boolean charge is refused and changes nothing;
- on the reconciler's decisions driven by random event sequences (create, respec to the same or
  another plan, a spec made invalid, inputs the planner refuses, a pod that starts, Kueue
  eviction, Job success with a committed manifest, Job failure, a crash between the reservation
  and the status write, an operator restart, deletion), against in-memory fakes of the API server
  and object storage: once the merge is deleted no entry is Reserved, and the charges equal, Job
  by Job, what each read: 0 if no pod of it ever ran, its manifest's bytes if it committed, else
  its reservation (the plan's expert bytes, the most an attempt reads; the worker reports reads
  only when it commits).
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from op_testlib import NOW, FakeKube, FakeStore, make_merge, make_quota, make_settings
from test_operator_controller import GI, Planner, commit

from mergepipe_operator import controller as ctl
from mergepipe_operator.k8s.api import JOBS, MERGES, PODS, QUOTAS
from mergepipe_operator.k8s.conditions import get_condition
from mergepipe_operator.modelmerge import planning
from mergepipe_operator.quota import decisions as qd

# --- the pure ledger --------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "close"]),
        st.integers(0, 5),  # which run
        st.integers(0, 10 * GI),  # requested budget / realized bytes
        st.booleans(),  # started
        st.booleans(),  # realized bytes known
    ),
    max_size=40,
)


def _check_ledger(quota):
    st_ = quota.get("status") or {}
    ledger = st_.get("ledger") or []
    for e in ledger:
        assert isinstance(e["bytes"], int) and not isinstance(e["bytes"], bool) and e["bytes"] >= 0
        assert e["state"] in ("Reserved", "Charged")
    assert len({e["key"] for e in ledger}) == len(ledger)
    if "used" in st_:
        assert st_["used"]["expertReadBytes"] == sum(e["bytes"] for e in ledger)
        assert st_["used"]["merges"] == len(ledger)


@hsettings(max_examples=200, deadline=None)
@given(ops)
def test_ledger_entries_stay_non_negative_and_used_is_their_sum(seq):
    quota = make_quota(bytes_="1000Gi", window=None)
    for op, run, n, started, known in seq:
        key = f"uid.{run}"
        if op == "admit":
            a = qd.admit(quota, n, NOW, key=key, merge="m")
            if a.new_status is not None:
                quota = {**quota, "status": a.new_status}
        else:
            new = qd.close(quota, key, qd.closing(started, n if known else None), NOW)
            if new is not None:
                quota = {**quota, "status": new}
        _check_ledger(quota)
        for bad in (-1, -(10**12), 1.5, True, "5"):
            with pytest.raises(ValueError):
                qd.close(quota, key, qd.closing(True, bad), NOW)  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                qd.settle(quota, key, bad, NOW)  # type: ignore[arg-type]


def test_closing_is_release_exact_or_the_reservation():
    assert qd.closing(False, None) == qd.Closing("release")
    assert qd.closing(True, None) == qd.Closing("settle", None)
    assert qd.closing(True, 7) == qd.Closing("settle", 7)
    assert qd.closing(False, 7) == qd.Closing("release")  # the manifest is an earlier run's
    with pytest.raises(ValueError, match="negative"):
        qd.closing(True, -1)


def test_a_manifest_with_negative_realized_bytes_is_invalid_and_charges_the_reservation():
    from mergepipe_operator.snapshot.decisions import manifest_facts, snapshot_ready

    doc = {
        "format": "mergepipe.manifest/v1",
        "outputs": {"model.safetensors": {"size": 1, "sha256": "ab" * 32}},
        "io": {"realized": {"expert_read_bytes": -500 * GI}},
    }
    with pytest.raises(ValueError, match=r"io.realized.expert_read_bytes is -536870912000"):
        manifest_facts(doc)
    ok, reason, _ = snapshot_ready(doc, None, None)
    assert not ok and reason == "ManifestInvalid"


# --- the reconciler over random lifecycles ------------------------------------------------------

EVENTS = [
    "respec_same",  # a change that plans the same (more CPU): the same Job carries on
    "respec_new",  # a new budget: another plan, another Job; the old one is superseded
    "invalid",  # a spec the operator refuses: the run is retired
    "refused",  # inputs the planner refuses (Done): the run is retired
    "start",  # a pod of the current Job runs (reads)
    "evict",  # Kueue evicts it: pods gone, the Job suspended again
    "succeed",  # the Job commits a manifest and completes
    "fail",  # the Job fails
    "crash",  # a respec whose reconcile wrote the reservation and the Job, but not the status
    "restart",  # a new operator process
]


class World:
    """A ModelMerge, its quota and the truth of what each Job read."""

    def __init__(self):
        self.kube, self.store = FakeKube(), FakeStore()
        self.kube.put(QUOTAS, make_quota(bytes_="1000Gi", window="24h"))
        self.kube.put(MERGES, make_merge())
        self.planner = Planner()
        self.refuse = False
        self.budgets = iter(["5Gi", "6Gi", "7Gi", "3Gi", "4Gi", "2Gi", "1Gi"] * 3)
        self.cpus = iter(range(2, 100))
        # per Job (by uid: a Job deleted and created again under the same name is another Job)
        self.started: dict[str, bool] = {}  # a pod of it ran
        self.read: dict[str, int] = {}  # bytes of its committed manifest
        self.planned: dict[str, int] = {}  # its plan's expert bytes (its reservation)
        self.controller()

    def controller(self):
        def planner(spec, catalog):
            if self.refuse:
                raise planning.PlanInputError("tensor x: shape differs from the base", "spec.experts[0].uri")
            return self.planner(spec, catalog)

        self.c = ctl.Controller(make_settings(), self.kube, self.store, planner, clock=lambda: NOW)

    def mm(self):
        return self.kube.get(MERGES, "ns1", "mm1")

    def reconcile(self, apply=True):
        mm = self.mm()
        try:
            st_ = self.c.merges.reconcile_merge(mm)
        except Exception as e:  # RetryWithStatus (QuotaExceeded, ...) never happens under 1000Gi
            raise AssertionError(f"unexpected {e!r}") from None
        if st_ and apply:
            self.kube.patch_status(MERGES, "ns1", "mm1", st_)
        self.note_job()

    def note_job(self):
        mm = self.mm()
        name = (mm.get("status") or {}).get("jobName")
        for j in self.kube.list(JOBS, "ns1"):
            n = j["metadata"]["uid"]
            self.started.setdefault(n, False)
            if n not in self.planned:
                # the Job's plan is the merge's plan when the Job was created (its digest annotation)
                self.planned[n] = self.plan_bytes.get(j["metadata"]["annotations"]["mergepipe.io/plan-digest"], 0)
        return name

    @property
    def plan_bytes(self):
        out = {}
        for b in [None, *[f"{k}Gi" for k in range(1, 11)]]:
            read = self.planner.full if b is None else min(self.planner.full, int(b[:-2]) * GI)
            out[hashlib.sha256(f"{read}".encode()).hexdigest()] = read
        return out

    def bump(self, **spec):
        o = self.kube.objects[("modelmerges", "ns1", "mm1")]
        o["spec"].update(spec)
        o["metadata"]["generation"] += 1

    def current_job(self):
        st_ = self.mm().get("status") or {}
        ready = get_condition(st_.get("conditions"), "Ready") or {}
        if ready.get("reason") not in ("JobRunning", "Queued") or not st_.get("jobName"):
            return None
        return self.kube.get(JOBS, "ns1", st_["jobName"])

    def sync(self, job):
        res = self.c.merges.sync_job(self.mm(), job)
        if res:
            self.kube.patch_status(MERGES, "ns1", "mm1", res)

    def pending_generation(self):
        mm = self.mm()
        return (mm.get("status") or {}).get("observedGeneration") != mm["metadata"]["generation"]

    def event(self, ev):
        if self.pending_generation():
            self.reconcile()  # kopf retries an unfinished reconcile (after a crash, a restart)
        if ev == "respec_same":
            self.refuse = False
            self.bump(resources={"cpu": str(next(self.cpus))})
            self.reconcile()
        elif ev == "respec_new":
            self.refuse = False
            self.bump(budget=next(self.budgets))
            self.reconcile()
        elif ev == "invalid":
            self.bump(budget="10 GB")
            self.reconcile()
        elif ev == "refused":
            self.refuse = True
            self.bump(seed=next(self.cpus))
            self.reconcile()
        elif ev == "crash":
            self.refuse = False
            self.bump(budget=next(self.budgets))
            self.reconcile(apply=False)
        elif ev == "restart":
            self.controller()
        elif (job := self.current_job()) is not None:
            name, uid = job["metadata"]["name"], job["metadata"]["uid"]
            o = self.kube.objects[("jobs", "ns1", name)]
            if ev == "start":
                self.started[uid] = True
                o["spec"].pop("suspend", None)
                o["status"] = {"active": 1, "ready": 1}
                self.kube.put(
                    PODS,
                    {
                        "metadata": {
                            "name": name + "-p",
                            "namespace": "ns1",
                            "labels": {"job-name": name},
                            "ownerReferences": [{"kind": "Job", "name": name, "uid": uid}],
                        },
                        "status": {"phase": "Running"},
                    },
                )
            elif ev == "evict":
                self.kube.objects.pop(("pods", "ns1", name + "-p"), None)
                o["spec"]["suspend"] = True
                o["status"] = {}
            elif ev == "succeed":
                if not self.started[uid]:
                    return  # a Job completes only after a pod ran
                mm = self.mm()
                digest = mm["status"]["plan"]["digest"]
                realized = self.planned[uid] - 12345 if self.planned[uid] > 12345 else 0
                commit(self.store, mm["spec"]["output"]["uri"], digest, realized, files_prefix=f"runs/{name}")
                self.read[uid] = realized
                o["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
            elif ev == "fail":
                o["status"] = {
                    "failed": 1 if self.started[uid] else 0,
                    "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}],
                }
            self.sync(self.kube.get(JOBS, "ns1", name))

    def delete(self):
        self.c.merges.finalize_merge(self.mm())

    def expected(self):
        return {
            n: (self.read[n] if n in self.read else self.planned[n] if self.started[n] else 0) for n in self.planned
        }


@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(EVENTS), max_size=14))
def test_every_lifecycle_ends_with_the_ledger_equal_to_the_bytes_read(events):
    w = World()
    w.reconcile()
    for ev in events:
        w.event(ev)
    w.delete()
    ledger = (w.kube.get(QUOTAS, "ns1", "q").get("status") or {}).get("ledger") or []
    assert [e for e in ledger if e["state"] == "Reserved"] == [], "a deleted merge left a reservation"
    for e in ledger:
        assert isinstance(e["bytes"], int) and e["bytes"] >= 0
    # each commit is charged its manifest once (a snapshot survives any later spec change)
    want = w.expected()
    assert sum(e["bytes"] for e in ledger) == sum(want.values()), (events, ledger, want)
    assert sorted(e["bytes"] for e in ledger) == sorted(v for v in want.values() if v), (events, ledger, want)


def test_the_known_leaks_are_closed():
    """The two leaks the issue names, as fixed sequences: a merge made invalid (here: inputs the
    planner refuses) while its Job runs, and a deleted merge whose current Job never started
    though an earlier generation's Job of the same plan ran."""
    w = World()
    w.reconcile()
    for ev in ["start", "refused"]:
        w.event(ev)
    ledger = w.kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert [(e["state"], e["bytes"]) for e in ledger] == [("Charged", 8 * GI)]
    w = World()
    w.reconcile()
    for ev in ["start", "fail", "respec_same"]:
        w.event(ev)
    w.delete()
    ledger = w.kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert [(e["state"], e["bytes"]) for e in ledger] == [("Charged", 8 * GI)]  # only the Job that ran


def test_a_snapshot_already_committed_is_adopted_not_merged_and_charged_again():
    """Committed, then a refused generation retires the run, then a spec that plans the same: the
    output already holds this plan's snapshot, so no Job runs and nothing is charged twice."""
    w = World()
    w.reconcile()
    for ev in ["start", "succeed", "refused", "respec_same"]:
        w.event(ev)
    r = get_condition(w.mm()["status"]["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("True", "Committed") and "nothing to run" in r["message"]
    assert [j for j in w.kube.list(JOBS, "ns1")] == []
    w.delete()
    ledger = w.kube.get(QUOTAS, "ns1", "q")["status"]["ledger"]
    assert [(e["state"], e["bytes"]) for e in ledger] == [("Charged", 8 * GI - 12345)]
