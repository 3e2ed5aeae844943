"""The Kubernetes worker backend of mergepipe search (KubernetesMerger) against a fake API that
plays the operator: a candidate becomes a child ModelMerge, its committed MergedSnapshot is the
candidate's snapshot; InvalidSpec/JobFailed fail the candidate; QuotaExceeded is waited out; a
resumed driver finds its ModelMerge already there (409)."""

from __future__ import annotations

import copy

import pytest

from mergepipe.request import PlanningOptions
from mergepipe.search.runner import SearchConfig
from mergepipe_kube.search import CandidateFailed, KubernetesMerger, candidate_name

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

    def create_namespaced_custom_object(self, group, version, ns, plural, body, _headers=None):
        assert (_headers or {}).get("Content-Type") == "application/json"  # a real API server needs it (415)
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
            st = {
                "observedGeneration": 1,
                "conditions": [{"type": "Ready", "status": status, "reason": reason, "message": f"{reason} message"}],
            }
            if reason == "Committed":
                snap = f"{name}-0123456789ab"
                st.update(snapshot=snap, realized={"expertReadBytes": 4096})
                self.objects[("mergedsnapshots", ns, snap)] = {
                    "metadata": {"name": snap},
                    "spec": {"uri": o["spec"]["output"]["uri"], "manifestHash": "ab" * 32},
                }
            o["status"] = st
        return copy.deepcopy(o)


def cfg(**kw):
    d = dict(
        base="s3://models/base",
        experts=[["code", "s3://models/code"], ["math", "s3://models/math"]],
        method="task_arithmetic",
        vary=["weight=0:1"],
        objectives=["a", "b"],
        evaluations=4,
        initial=2,
        budget="1Gi",
        seed=3,
    )
    d.update(kw)
    return SearchConfig(**d)


CAND = {
    "id": 7,
    "params": {
        "parameters": {"normalize": True},
        "experts": {
            "code": {"weight": 0.5},
            "math": {"weight": [{"filter": "layers.0.", "value": 0.25}, {"value": 0.25}]},
        },
    },
}


def merger(api, **kw):
    return KubernetesMerger(
        api,
        "team",
        "front",
        UID,
        "s3://snaps/front/g1/",
        poll_seconds=1.0,
        sleep=lambda s: None,
        template={"resources": {"gpu": {"count": 0}}, "image": "x/y:1", "ignored": 1},
        **kw,
    )


def test_candidate_body_is_a_modelmerge_owned_by_the_search():
    body = merger(FakeOperator([("True", "Committed")])).candidate_body(cfg(), CAND)
    meta, spec = body["metadata"], body["spec"]
    assert meta["name"] == "front-c0007" and meta["labels"]["mergepipe.io/search-candidate"] == "7"
    assert meta["ownerReferences"][0] == {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "MergeSearch",
        "name": "front",
        "uid": UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert spec["parameters"] == {"normalize": True}
    assert spec["experts"] == [
        {"name": "code", "uri": "s3://models/code/", "parameters": {"weight": 0.5}},
        {
            "name": "math",
            "uri": "s3://models/math/",
            "parameters": {"weight": [{"filter": "layers.0.", "value": 0.25}, {"value": 0.25}]},
        },
    ]
    assert spec["output"] == {"uri": "s3://snaps/front/g1/c0007/"} and spec["budget"] == "1Gi" and spec["seed"] == 3
    assert spec["image"] == "x/y:1" and "ignored" not in spec
    assert "sketch" not in spec  # no --sketch: the ModelMerge's default (the operator's) applies
    assert (
        merger(FakeOperator([])).candidate_body(cfg(planning=PlanningOptions(sketch="sign1")), CAND)["spec"]["sketch"]
        == "sign1"
    )


def test_candidates_get_the_searchs_block_value_and_calibration_set():
    """``--value``/``--calibration`` reach each candidate ModelMerge as ``spec.blockValue`` and
    ``spec.calibration.uri`` (the operator's analyze Job records the base's Fisher on it); the
    driver checks the search on the centre point with the energy value and no calibration set,
    so the driver pod never runs the base's forward/backward passes."""
    cal = "s3://data/calibration/code.jsonl"
    c = cfg(planning=PlanningOptions(value="fisher", calibration=cal, sketch="sign2"))
    m = merger(FakeOperator([]))
    spec = m.candidate_body(c, CAND)["spec"]
    assert (spec["blockValue"], spec["calibration"], spec["sketch"]) == ("fisher", {"uri": cal}, "sign2")
    plain = m.candidate_body(cfg(), CAND)["spec"]
    assert "blockValue" not in plain and "calibration" not in plain  # the ModelMerge's defaults apply
    req = m.validation_request(c, CAND["params"])
    assert (req.planning.value, req.planning.calibration, req.planning.sketch) == ("energy", None, "sign2")
    assert c.request(CAND["params"]).planning == c.planning  # the candidates' own request keeps them


def test_committed_candidate_returns_its_snapshot_after_waiting_out_the_quota():
    api = FakeOperator(
        [("False", "Planning"), ("False", "QuotaExceeded"), ("False", "JobRunning"), ("True", "Committed")]
    )
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
        def create_namespaced_custom_object(self, *a, **kw):
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


# --- evaluation Jobs ---------------------------------------------------------------------------


class FakeBatch:
    """BatchV1Api's two calls; ``states`` are the Job conditions on successive reads; ``on_done``
    plays the Job's pod (writes the metrics object) when it completes."""

    def __init__(self, states, on_done=None):
        self.jobs, self.states, self.reads, self.on_done = {}, list(states), 0, on_done

    def create_namespaced_job(self, ns, body, _headers=None):
        assert (_headers or {}).get("Content-Type") == "application/json"  # a real API server needs it (415)
        if body["metadata"]["name"] in self.jobs:
            raise ApiError(409)
        self.jobs[body["metadata"]["name"]] = copy.deepcopy(body)

    def read_namespaced_job(self, name, ns):
        state = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        job = copy.deepcopy(self.jobs[name])
        if state in ("Complete", "Failed"):
            if state == "Complete" and self.on_done:
                self.on_done(job)
            job["status"] = {"conditions": [{"type": state, "status": "True", "reason": "R", "message": "m"}]}
        return job


TEMPLATE = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"name": "x-e0000", "labels": {"a": "b"}},
    "spec": {
        "template": {
            "metadata": {"labels": {"a": "b"}},
            "spec": {
                "containers": [
                    {"name": "evaluate", "image": "m:1", "command": ["mergepipe"], "args": ["--device", "cuda"]}
                ]
            },
        }
    },
}


def evaluator(batch, tmp_path, **kw):
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage
    from mergepipe_kube.search import KubernetesJobEvaluator

    return KubernetesJobEvaluator(
        batch,
        "team",
        "front",
        UID,
        TEMPLATE,
        "python score.py {checkpoint}",
        str(tmp_path / "state"),
        open_storage(None, IOCounters()),
        poll_seconds=0,
        sleep=lambda s: None,
        **kw,
    )


def play_eval(job):
    """What the Job's pod does: `mergepipe search-eval` with the Job's args, here a fixed outcome."""
    import json as _json
    from pathlib import Path

    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    out = Path(args[args.index("--metrics-out") + 1])
    out.parent.mkdir(parents=True, exist_ok=True)
    cid = int(job["metadata"]["labels"]["mergepipe.io/search-candidate"])
    out.write_text(_json.dumps({"metrics": {"a": cid, "b": -cid}} if cid != 9 else {"error": "the evaluator exited 1"}))


def test_evaluation_job_is_built_from_the_template_and_returns_the_metrics(tmp_path):
    b = FakeBatch(["Running", "Running", "Complete"], on_done=play_eval)
    ev = evaluator(b, tmp_path, timeout=60)
    assert ev.metrics("s3://snaps/front/g1/c0003/") == {"a": 3, "b": -3}
    job = b.jobs["front-e0003"]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "MergeSearch" and job["metadata"]["labels"]["a"] == "b"
    assert job["spec"]["template"]["metadata"]["labels"]["mergepipe.io/search-candidate"] == "3"
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "search-eval",
        "--command",
        "python score.py {checkpoint}",
        "--checkpoint",
        "s3://snaps/front/g1/c0003/",
        "--metrics-out",
        f"{tmp_path / 'state'}/evals/c0003.json",
        "--timeout",
        "60",
    ]
    assert TEMPLATE["metadata"]["name"] == "x-e0000"  # the template is not modified
    assert ev.metrics("s3://snaps/front/g1/c0003/") == {"a": 3, "b": -3}  # resumed: 409, same Job, same metrics


def test_failed_evaluations_fail_the_candidate(tmp_path):
    from mergepipe.search.evaluators import EvaluationFailed

    with pytest.raises(EvaluationFailed, match="the evaluator exited 1"):
        evaluator(FakeBatch(["Complete"], on_done=play_eval), tmp_path).metrics("s3://s/front/g1/c0009/")
    with pytest.raises(EvaluationFailed, match="front-e0004 failed .R: m"):
        evaluator(FakeBatch(["Failed"]), tmp_path).metrics("s3://s/front/g1/c0004/")
    with pytest.raises(EvaluationFailed, match="without metrics"):
        evaluator(FakeBatch(["Complete"]), tmp_path).metrics("s3://s/front/g1/c0005/")
    with pytest.raises(ValueError, match="not a search candidate"):
        evaluator(FakeBatch(["Complete"]), tmp_path).metrics("s3://s/front/g1/other/")


def test_search_eval_cli_writes_metrics_or_the_error(tmp_path, monkeypatch, capsys):
    import json as _json
    import sys

    from testkit.harness import run_cli

    ok = tmp_path / "ok.py"
    ok.write_text("import json, sys\nprint(json.dumps({'a': len(sys.argv[1])}))\n")
    out = tmp_path / "m" / "c0001.json"
    code, _, err = run_cli(
        [
            "search-eval",
            "--command",
            f"{sys.executable} {ok} {{checkpoint}}",
            "--checkpoint",
            "s3://b/front/c0001/",
            "--metrics-out",
            str(out),
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    assert _json.loads(out.read_text()) == {"metrics": {"a": len("s3://b/front/c0001/")}}
    code, _, err = run_cli(
        [
            "search-eval",
            "--command",
            f"{sys.executable} -c 'import sys; sys.exit(3)'",
            "--checkpoint",
            "x",
            "--metrics-out",
            str(out),
        ],
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    assert "exited with code 3" in _json.loads(out.read_text())["error"]


def test_driver_and_operator_share_one_naming_rule():
    """The driver labels and names candidates exactly as the operator selects them, also for
    names that must be shortened or sanitized (they once used two copies that differed there)."""
    from mergepipe_kube import search as kube
    from mergepipe_kube.names import label_value

    for name in ("front", "a" * 57, "a" * 58, "a" * 80, "Team.Front_search", "x" * 63, "x" * 64):
        lv = label_value(name)
        assert len(lv) <= 63 and lv[0].isalnum() and lv[-1].isalnum()
        assert kube.label_value is label_value
    assert label_value("a" * 64) != label_value("a" * 65)


def test_a_local_calibration_file_is_refused_for_the_kubernetes_backend(tmp_path, monkeypatch, capsys):
    """The candidates' merge pods read the calibration set as ``spec.calibration.uri``: the
    driver refuses a local file with one line naming ``--calibration``, exit 2, before it reads,
    writes or contacts anything."""
    from testkit.harness import run_cli

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    cal = tmp_path / "cal.jsonl"
    cal.write_text('{"text": "def f(): pass"}\n')
    args = ["search", "--out", "s3://snaps/front/g1/", "--base", "s3://models/base", "-e", "a=s3://models/a"]
    args += ["--vary", "weight=0:1", "--objective", "a", "--value", "fisher", "--calibration", str(cal)]
    args += ["--worker-backend", "kubernetes", "--namespace", "team", "--search-name", "front"]
    args += ["--search-uid", UID]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and f"--calibration {cal}" in err and "s3://" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.jsonl"]
