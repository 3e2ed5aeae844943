"""The Kubernetes worker backend of mergepipe search (KubernetesMerger) against a fake API that
plays the operator: a candidate becomes a child ModelMerge, its committed MergedSnapshot is the
candidate's snapshot; InvalidSpec/JobFailed fail the candidate; QuotaExceeded is waited out; a
resumed driver finds its ModelMerge already there (409)."""

from __future__ import annotations

import copy

import pytest

from mergepipe.search.kube import CandidateFailed, KubernetesMerger, candidate_name
from mergepipe.search.runner import SearchConfig

UID = "11111111-2222-4333-8444-555555555555"


class ApiError(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeOperator:
    """CustomObjectsApi's two calls; ``script`` gives the Ready (status, reason) the operator
    reports on the successive reads of a ModelMerge (the last one sticks)."""

    def __init__(self, script):
        self.objects, self.script, self.reads, self.creates = {}, list(script), 0, 0

    def create_namespaced_custom_object(self, group, version, ns, plural, body):
        self.creates += 1
        key = (plural, ns, body["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409)
        o = copy.deepcopy(body)
        o["metadata"].update(uid="u", generation=1)
        self.objects[key] = o
        return o

    def get_namespaced_custom_object(self, group, version, ns, plural, name):
        o = self.objects.get((plural, ns, name))
        if o is None:
            raise ApiError(404)
        if plural == "modelmerges":
            status, reason = self.script[min(self.reads, len(self.script) - 1)]
            self.reads += 1
            st = {"observedGeneration": 1, "conditions": [{"type": "Ready", "status": status, "reason": reason,
                                                           "message": f"{reason} message"}]}
            if reason == "Committed":
                snap = f"{name}-0123456789ab"
                st.update(snapshot=snap, realized={"expertReadBytes": 4096})
                self.objects[("mergedsnapshots", ns, snap)] = {"metadata": {"name": snap}, "spec": {
                    "uri": o["spec"]["output"]["uri"], "manifestHash": "ab" * 32}}
            o["status"] = st
        return copy.deepcopy(o)


def cfg(**kw):
    d = dict(base="s3://models/base", experts=[["code", "s3://models/code"], ["math", "s3://models/math"]],
             method="task_arithmetic", vary=["weight=0:1"], objectives=["a", "b"], evaluations=4, initial=2,
             budget="1Gi", seed=3)
    d.update(kw)
    return SearchConfig(**d)


CAND = {"id": 7, "params": ["normalize=true", "1:weight=0.5",
                            'math:weight=[{"filter":"layers.0.","value":0.25},{"value":0.25}]']}


def merger(api, **kw):
    return KubernetesMerger(api, "team", "front", UID, "s3://snaps/front/g1/", poll_seconds=1.0, sleep=lambda s: None,
                            template={"resources": {"gpu": {"count": 0}}, "image": "x/y:1", "ignored": 1}, **kw)


def test_candidate_body_is_a_modelmerge_owned_by_the_search():
    body = merger(FakeOperator([("True", "Committed")])).candidate_body(cfg(), CAND)
    meta, spec = body["metadata"], body["spec"]
    assert meta["name"] == "front-c0007" and meta["labels"]["mergepipe.io/search-candidate"] == "7"
    assert meta["ownerReferences"][0] == {"apiVersion": "mergepipe.io/v1alpha1", "kind": "MergeSearch", "name": "front",
                                          "uid": UID, "controller": True, "blockOwnerDeletion": True}
    assert spec["parameters"] == {"normalize": True}
    assert spec["experts"] == [
        {"name": "code", "uri": "s3://models/code/", "parameters": {"weight": 0.5}},
        {"name": "math", "uri": "s3://models/math/", "parameters": {"weight": [{"filter": "layers.0.", "value": 0.25},
                                                                               {"value": 0.25}]}}]
    assert spec["output"] == {"uri": "s3://snaps/front/g1/c0007/"} and spec["budget"] == "1Gi" and spec["seed"] == 3
    assert spec["image"] == "x/y:1" and "ignored" not in spec


def test_committed_candidate_returns_its_snapshot_after_waiting_out_the_quota():
    api = FakeOperator([("False", "Planning"), ("False", "QuotaExceeded"), ("False", "JobRunning"), ("True", "Committed")])
    m = merger(api).merge(cfg(), CAND, None, {}, None)
    assert (m.snapshot, m.manifest_hash, m.expert_read_bytes) == ("s3://snaps/front/g1/c0007/", "ab" * 32, 4096)
    assert api.reads == 4
    # a resumed driver re-dispatches the candidate: the ModelMerge exists (409), no second one
    m2 = merger(api).merge(cfg(), CAND, None, {}, None)
    assert m2 == m and api.creates == 2 and len([k for k in api.objects if k[0] == "modelmerges"]) == 1


@pytest.mark.parametrize("reason", ["InvalidSpec", "JobFailed"])
def test_terminal_reasons_fail_the_candidate(reason):
    with pytest.raises(CandidateFailed, match=f"front-c0007: {reason}: {reason} message"):
        merger(FakeOperator([("False", "JobRunning"), ("False", reason)])).merge(cfg(), CAND, None, {}, None)


def test_timeout_fails_the_candidate():
    t = iter(range(0, 1000, 10))
    m = merger(FakeOperator([("False", "QuotaExceeded")]), timeout_seconds=25, clock=lambda: next(t))
    with pytest.raises(CandidateFailed, match="no snapshot after 25 s .QuotaExceeded"):
        m.merge(cfg(), CAND, None, {}, None)


def test_other_api_errors_propagate_and_local_outputs_are_refused():
    class Broken(FakeOperator):
        def create_namespaced_custom_object(self, *a):
            raise ApiError(403)

    with pytest.raises(ApiError):
        merger(Broken([])).merge(cfg(), CAND, None, {}, None)
    with pytest.raises(ValueError, match="s3://"):
        KubernetesMerger(None, "team", "front", UID, "/tmp/out")


def test_candidate_names_are_dns_labels():
    assert candidate_name("front", 12) == "front-c0012"
    long = candidate_name("a" * 80, 3)
    assert len(long) <= 63 and long.endswith("-c0003") and long != candidate_name("a" * 81, 3)
    assert candidate_name("team.front", 0).endswith("-c0000") and "." not in candidate_name("team.front", 0)
    with pytest.raises(ValueError):
        candidate_name("x", -1)
