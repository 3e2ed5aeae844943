"""The fake API server of the API-level tests behaves like a real one where the operator relies on
it (kmock 0.8 alone does not: see kmock_realistic.py)."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

pytest.importorskip("kmock", reason="kmock (fake Kubernetes API) is not installed")
from kmock_realistic import parse_selector, selector_matches  # noqa: E402
from kubeharness import Api, KubeServer  # noqa: E402


@pytest.fixture(scope="module")
def api():
    with KubeServer() as ks:
        yield Api(ks.url)


def mm(name, ns="ns1", **labels):
    return {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "ModelMerge",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"method": "ties"},
        "status": {"ignored": True},
    }


def raw(api, method, path, body=None, ctype="application/json"):
    req = urllib.request.Request(
        api.url + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": ctype},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_metadata_generation_and_status_split(api):
    a = api.create(mm("a"))
    meta = a["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1 and int(meta["resourceVersion"]) > 0
    assert "status" not in a  # ignored on create (status subresource)
    b = api.patch("ModelMerge", "ns1", "a", {"status": {"x": 1}, "metadata": {"labels": {"l": "1"}}})
    assert "status" not in b and b["metadata"]["generation"] == 1 and b["metadata"]["labels"] == {"l": "1"}
    c = api.patch("ModelMerge", "ns1", "a", {"status": {"x": 1}, "spec": {"method": "linear"}}, sub="status")
    assert c["status"] == {"x": 1} and c["spec"]["method"] == "ties" and c["metadata"]["generation"] == 1
    d = api.patch("ModelMerge", "ns1", "a", {"spec": {"method": "linear"}, "metadata": {"uid": "forged"}})
    assert d["metadata"]["generation"] == 2 and d["metadata"]["uid"] == meta["uid"] and d["status"] == {"x": 1}
    rv = d["metadata"]["resourceVersion"]
    assert (
        api.patch("ModelMerge", "ns1", "a", {"spec": {"method": "linear"}})["metadata"]["resourceVersion"] == rv
    )  # no-op
    assert raw(api, "POST", "/apis/mergepipe.io/v1alpha1/namespaces/ns1/modelmerges", mm("a"))[0] == 409


def test_optimistic_concurrency(api):
    a = api.create(mm("oc"))
    path = "/apis/mergepipe.io/v1alpha1/namespaces/ns1/modelmerges/oc/status"
    body = dict(a, status={"n": 1})
    code, b = raw(api, "PUT", path, body)
    assert code == 200 and b["status"] == {"n": 1}
    assert raw(api, "PUT", path, dict(a, status={"n": 2}))[0] == 409  # stale resourceVersion
    test = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": a["metadata"]["resourceVersion"]},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    path = "/apis/mergepipe.io/v1alpha1/namespaces/ns1/modelmerges/oc"
    assert raw(api, "PATCH", path, test, "application/json-patch+json")[0] == 422
    test[0]["value"] = b["metadata"]["resourceVersion"]
    code, c = raw(api, "PATCH", path, test, "application/json-patch+json")
    assert code == 200 and c["metadata"]["finalizers"] == ["x/y"]


def test_label_selectors_and_lists(api):
    for n, lab in (("s1", {"app": "a", "tier": "x"}), ("s2", {"app": "b"}), ("s3", {})):
        api.create(mm(n, ns="sel", **lab))
    assert [o["metadata"]["name"] for o in api.list("ModelMerge", "sel", "app=a")] == ["s1"]
    assert [o["metadata"]["name"] for o in api.list("ModelMerge", "sel", "app!=a")] == ["s2", "s3"]
    assert [o["metadata"]["name"] for o in api.list("ModelMerge", "sel", "app in (a,b),!tier")] == ["s2"]
    _, lst = raw(api, "GET", "/apis/mergepipe.io/v1alpha1/namespaces/sel/modelmerges")
    assert lst["kind"] == "ModelMergeList" and int(lst["metadata"]["resourceVersion"]) > 0
    assert selector_matches({"a": "1"}, parse_selector("a,b notin (2)"))


def test_finalizers_and_garbage_collection(api):
    owner = api.create(dict(mm("own"), metadata={"name": "own", "namespace": "gc", "finalizers": ["x/y"]}))
    ref = {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "ModelMerge",
        "name": "own",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    api.create(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "j", "namespace": "gc", "ownerReferences": [ref]},
            "spec": {},
        }
    )
    api.create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "free", "namespace": "gc"}, "spec": {}})
    d = api.delete("ModelMerge", "gc", "own")
    assert d["metadata"]["deletionTimestamp"] and api.get("ModelMerge", "gc", "own") is not None
    assert api.get("Job", "gc", "j") is not None  # the owner still exists
    api.patch("ModelMerge", "gc", "own", {"metadata": {"finalizers": None}})
    assert api.get("ModelMerge", "gc", "own") is None
    assert api.get("Job", "gc", "j") is None and api.get("Job", "gc", "free") is not None


def test_watch_resumes_from_a_resource_version(api):
    lst = raw(api, "GET", "/apis/mergepipe.io/v1alpha1/namespaces/w/modelmerges")[1]
    rv = lst["metadata"]["resourceVersion"]
    api.create(mm("before", ns="w"))
    events = []

    def watch():
        url = f"{api.url}/apis/mergepipe.io/v1alpha1/namespaces/w/modelmerges?watch=true&resourceVersion={rv}&timeoutSeconds=1"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r:
                events.append(json.loads(line))

    t = threading.Thread(target=watch)
    t.start()
    t.join(5)
    assert [e["object"]["metadata"]["name"] for e in events] == ["before"]  # changed after rv, then timeout
