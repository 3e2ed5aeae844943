"""The MergeSearch reconciler (issue 7 item 5): pure decisions (validation, the driver Job, the
status mirrored from the driver's results) and the controller against FakeKube/FakeStore."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from datetime import datetime, timezone

import pytest
from op_testlib import ROOT, FakeKube, FakeStore, cr_errors, k8s_validate, load_docs, make_settings

from mergepipe_operator import controller as ctl  # noqa: E402
from mergepipe_operator.k8s.api import JOBS, PODS, SEARCHES
from mergepipe_operator.k8s.conditions import get_condition
from mergepipe_operator.k8s.jobs import JobOutcome
from mergepipe_operator.search import decisions as sd
from mergepipe_operator.snapshot.decisions import snapshot_name

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)
UID = "5e5e5e5e-0000-4000-8000-000000000001"


def search(gen: int = 1, **spec_changes) -> dict:
    (doc,) = load_docs(ROOT / "examples" / "search.yaml")
    doc["metadata"].update(uid=UID, generation=gen)
    for k, v in spec_changes.items():
        if v is None:
            doc["spec"].pop(k, None)
        else:
            doc["spec"][k] = v
    return doc


def typed(ms: dict) -> sd.MergeSearchSpec:
    """The MergeSearch's spec parsed as the reconciler parses it (valid, or the test fails)."""
    spec, issues = sd.parse_search_spec(ms["spec"])
    assert issues == [] and spec is not None
    return spec


def args_of(ms: dict, settings=None) -> list[str]:
    return sd.driver_args(ms["metadata"], typed(ms), settings or make_settings())


def status_of(ms: dict, *args, **kw) -> dict:
    return sd.search_status(ms, typed(ms), *args, **kw)


def core_results(
    objectives=("loss:python", "loss:arithmetic"), points=((1.0, 2.0), (2.0, 1.0), (3.0, 3.0)), failed: int = 1
) -> dict:
    """Results as the driver writes them: the core's own ``results()`` of a search state."""
    from mergepipe.search.runner import results

    t = time.time()
    cands = []
    for i, y in enumerate(points):
        cands.append(
            {
                "id": i,
                "x": [0.1 * i],
                "params": [f"weight={i}"],
                "values": {},
                "phase": "initial",
                "status": "done",
                "worker": 0,
                "snapshot": f"s3://snapshots/x/g1/c{i:04d}",
                "manifest_hash": hashlib.sha256(str(i).encode()).hexdigest(),
                "metrics": {},
                "objectives": list(y),
                "error": None,
                "proposal": {},
                "times": {"proposed": t, "ended": t + i + 1},
            }
        )
    for _ in range(failed):
        cands.append(
            {
                "id": len(cands),
                "x": [0.9],
                "params": [],
                "values": {},
                "phase": "bo",
                "status": "failed",
                "worker": 0,
                "snapshot": None,
                "manifest_hash": None,
                "metrics": None,
                "objectives": None,
                "error": "merge failed: boom",
                "proposal": {},
                "times": {"proposed": t, "ended": t + 9},
            }
        )
    state = {
        "search_id": "abcdef0123456789",
        "config": {"objectives": list(objectives), "strategy": "async", "ref_point": None},
        "ref_point": [4.0, 4.0],
        "candidates": cands,
        "events": [],
        "sessions": [{"started": t, "ended": t + 10}],
    }
    res = results(state)
    res.pop("trace")
    return res


# --- validation ---------------------------------------------------------------------------------


def test_the_example_is_valid():
    assert sd.validate_search_spec(search()["spec"]) == []


@pytest.mark.parametrize(
    "changes, field, needle",
    [
        ({"vary": [{"name": "density", "min": 0.1, "max": 0.9}]}, "spec.vary[0].name", "takes no parameter 'density'"),
        (
            {"method": "ties", "vary": [{"name": "lambda", "expert": "code", "min": 0.5, "max": 1.5}]},
            "spec.vary[0].expert",
            "global parameter",
        ),
        (
            {"method": "ties", "parameters": {"lambda": 1.0}, "vary": [{"name": "lambda", "min": 0.5, "max": 1.5}]},
            "spec.vary[0].name",
            "also fixed",
        ),
        ({"vary": [{"name": "weight", "min": 1.0, "max": 0.0}]}, "spec.vary[0]", "min must be below max"),
        ({"evaluations": 4, "initial": 8}, "spec", "evaluations must be at least initial"),
        ({"budget": "lots"}, "spec.budget", ""),
        ({"sketch": "sign4"}, "spec.sketch", "sign3"),
        ({"base": {"uri": "/local/base"}}, "spec.base.uri", "s3://"),
        ({"blockValue": "gradient"}, "spec.blockValue", ""),
        ({"calibration": {"uri": "/local/cal.jsonl"}}, "spec.calibration.uri", ""),
    ],
)
def test_invalid_specs_name_the_field(changes, field, needle):
    issues = sd.validate_search_spec(search(**changes)["spec"])
    assert any(p == field and needle in m for p, m in issues), issues


def test_a_varied_weight_cannot_also_be_fixed_per_expert():
    spec = search()["spec"]
    spec["experts"][1]["weight"] = 0.5
    assert (
        "spec.experts[1].parameters.weight",
        "weight is varied by spec.vary[0]; do not fix it here.",
    ) in sd.validate_search_spec(spec)


# --- the driver Job -----------------------------------------------------------------------------


def test_driver_job_is_deterministic_owned_and_secure():
    s = make_settings()
    ms = search(gen=3)
    job = sd.build_driver_job(ms, s)
    assert job == sd.build_driver_job(copy.deepcopy(ms), s)
    meta = job["metadata"]
    assert meta["name"] == "llama-code-math-front-search-g3" == sd.driver_job_name("llama-code-math-front", 3)
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "mergepipe.io/v1alpha1",
            "kind": "MergeSearch",
            "name": "llama-code-math-front",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert (
        meta["labels"][sd.LABEL_SEARCH] == "llama-code-math-front"
        and meta["labels"]["app.kubernetes.io/component"] == "search"
    )
    assert sd.job_generation(job) == 3
    assert job["spec"]["activeDeadlineSeconds"] == 7 * 86400 and job["spec"]["backoffLimit"] >= 6
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mergepipe-search-driver" and pod["automountServiceAccountToken"] is True
    (c,) = pod["containers"]
    assert c["command"] == ["mergepipe"] and c["image"] == s.merger_image
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}  # no GPU
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == s.s3_secret_name
    k8s_validate(job)


def test_evaluation_job_template_gets_the_gpu_and_no_token():
    s = make_settings()
    ms = search(gen=2)
    job = sd.build_driver_job(ms, s)
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    tmpl = json.loads(env["MERGEPIPE_EVAL_JOB_TEMPLATE"])
    assert tmpl == json.loads(json.dumps(sd.eval_job_template(ms, s)))
    assert json.loads(env["MERGEPIPE_CANDIDATE_TEMPLATE"]) == {"resources": {"gpu": {"count": 1}}}
    pod = tmpl["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["securityContext"]["runAsNonRoot"]
    assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == "evaluate"
    assert tmpl["metadata"]["ownerReferences"][0]["uid"] == UID
    k8s_validate(tmpl)


def test_driver_args_are_the_spec_as_mergepipe_search_options():
    """The options the core's CLI already has parse back to the spec (typer/click parsing of
    ``mergepipe search``); the Kubernetes worker backend's options come last."""
    import typer.main

    from mergepipe.cli import app

    ms = search(
        gen=2,
        evaluator={"command": "python eval.py {checkpoint}", "timeoutSeconds": 600},
        refPoint=[3.0, 3.5],
        prior=False,
        sketch="sign1",
    )
    ms["spec"]["objectives"][1]["sense"] = "max"
    args = args_of(ms)
    assert "--sketch" not in args_of(search(gen=2, sketch=None))  # the ModelMerge default
    model_level = args_of(search(gen=2, layerBlocks=None))  # the CLI's default
    assert model_level[model_level.index("--layer-blocks") + 1] == "1"
    k = args.index("--worker-backend")
    assert args[k:] == [
        "--worker-backend",
        "kubernetes",
        "--namespace",
        "team-llm",
        "--search-name",
        "llama-code-math-front",
        "--search-uid",
        UID,
        "--resume-existing",
        "--json",
    ]
    cmd = typer.main.get_command(app).commands["search"]
    p = cmd.make_context("search", args[1:k] + ["--json"]).params
    assert str(p["out"]).startswith("s3:") and args[2] == "s3://snapshots/team-llm/llama-code-math-front/g2/"
    assert p["base"] == "s3://models/llama-3-8b"
    assert p["expert"] == ["code=s3://models/llama-3-8b-code", "math=s3://models/llama-3-8b-math"]
    assert p["vary"] == ["weight=0.0:1.0"] and p["layer_blocks"] == 4
    assert p["objective"] == ["loss:python", "loss:arithmetic@max"]
    assert p["eval_command"] == "python eval.py {checkpoint}" and p["eval_timeout"] == 600
    assert (p["evaluations"], p["initial"], p["workers"], p["strategy"], p["seed"]) == (32, 8, 4, "async", 7)
    assert p["no_prior"] is True and p["ref_point"] == "3.0,3.5" and p["catalog"] == "s3://mergepipe/catalog/"
    assert p["sketch"] == "sign1"


# --- status -------------------------------------------------------------------------------------


def test_status_mirrors_the_core_results():
    ms = search()
    res = core_results()
    st = status_of(ms, res, JobOutcome("Running", "JobRunning", "running"), "llama-code-math-front-search-g1", NOW)
    assert (st["evaluations"], st["failed"], st["paretoSize"]) == (4, 1, 2)
    assert [p["candidate"] for p in st["pareto"]] == [0, 1]
    assert st["pareto"][0]["objectives"] == {"loss:python": 1.0, "loss:arithmetic": 2.0}
    assert st["pareto"][1]["snapshot"] == snapshot_name(
        sd.candidate_merge_name("llama-code-math-front", 1), hashlib.sha256(b"1").hexdigest()
    )
    assert st["pareto"][1]["uri"] == "s3://snapshots/x/g1/c0001"
    # exact hypervolume of {(1,2), (2,1)} against (4,4): 3*2 + 2*3 - 2*2 = 8
    assert st["hypervolume"] == pytest.approx(8.0) and st["refPoint"] == [4.0, 4.0]
    assert st["stateURI"] == "s3://snapshots/team-llm/llama-code-math-front/g1/state.json"
    r = get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("False", "Searching") and "4/32 candidates evaluated (1 failed)" in r[
        "message"
    ]
    ms["status"] = st
    assert cr_errors(ms) == []


def test_maximised_objectives_are_reported_in_their_own_units():
    res = core_results(objectives=("loss:python", "accuracy@max"), points=((1.0, -0.9), (2.0, -0.95)), failed=0)
    st = status_of(search(), res, JobOutcome("Running", "JobRunning", ""), "j", NOW)
    assert {p["candidate"]: p["objectives"]["accuracy"] for p in st["pareto"]} == {0: 0.9, 1: 0.95}
    assert st["refPoint"][1] == -4.0


@pytest.mark.parametrize(
    "outcome, results, want",
    [
        (JobOutcome("Succeeded", "Complete", "done"), True, ("True", "Completed")),
        (JobOutcome("Succeeded", "Complete", "done"), False, ("False", "Failed")),
        (
            JobOutcome("Failed", "BackoffLimitExceeded", "the merge Job failed (BackoffLimitExceeded)"),
            True,
            ("False", "Failed"),
        ),
        (JobOutcome("Running", "JobRunning", "running"), False, ("False", "Searching")),
    ],
)
def test_ready_follows_the_driver_job(outcome, results, want):
    st = status_of(search(), core_results() if results else None, outcome, "j", NOW)
    r = get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"]) == want
    if want[1] == "Failed" and results:
        assert r["message"].startswith("driver Job j failed (BackoffLimitExceeded)") and "4/32" in r["message"]


def test_a_vanished_driver_fails_the_search_naming_the_driver():
    from mergepipe_operator.k8s.jobs import job_outcome

    st = status_of(search(), None, job_outcome(None, "driver Job"), "j", NOW)
    r = get_condition(st["conditions"], "Ready")
    assert (r["reason"], r["message"]) == (
        "Failed",
        "driver Job j failed (JobMissing): the driver Job no longer exists; 0/32 candidates evaluated",
    )


def test_pareto_list_is_bounded_but_counted():
    pts = tuple((float(i), float(-i)) for i in range(70))
    st = status_of(search(), core_results(points=pts, failed=0), JobOutcome("Running", "", ""), "j", NOW)
    assert st["paretoSize"] == 70 and len(st["pareto"]) == 64 and st["pareto"][-1]["candidate"] == 63


def test_a_malformed_manifest_hash_links_no_snapshot():
    res = core_results(failed=0)
    res["pareto"][0]["manifest_hash"] = "not-a-hash"
    st = status_of(search(), res, JobOutcome("Running", "", ""), "j", NOW)
    assert "snapshot" not in st["pareto"][0] and "snapshot" in st["pareto"][1]


def test_parse_results_refuses_what_the_driver_does_not_write():
    assert sd.parse_results(None) is None
    with pytest.raises(sd.ResultsError, match="not JSON"):
        sd.parse_results(b"{")
    with pytest.raises(sd.ResultsError, match="lack pareto"):
        sd.parse_results(json.dumps({"search_id": "x", "objectives": [], "evaluations": 0, "failed": 0}))


def test_status_changed_ignores_condition_times():
    st = status_of(search(), None, JobOutcome("Running", "", "r"), "j", NOW)
    later = status_of({**search(), "status": st}, None, JobOutcome("Running", "", "r"), "j", NOW.replace(hour=13))
    assert not sd.status_changed(st, later)
    assert sd.status_changed(st, {**later, "failed": 1})


# --- the controller -----------------------------------------------------------------------------


def setup(ms=None):
    kube, store = FakeKube(), FakeStore()
    ms = kube.put(SEARCHES, ms or search())
    return ctl.Controller(make_settings(), kube, store, planner=lambda *a: None, clock=lambda: NOW), kube, store, ms


def test_reconcile_creates_one_driver_job_and_mirrors_results():
    c, kube, store, ms = setup()
    st = c.searches.reconcile_search(ms)
    jobs = kube.list(JOBS, "team-llm")
    assert [j["metadata"]["name"] for j in jobs] == ["llama-code-math-front-search-g1"]
    assert get_condition(st["conditions"], "Ready")["reason"] == "Searching"
    kube.patch_status(SEARCHES, "team-llm", "llama-code-math-front", st)
    ms = kube.get(SEARCHES, "team-llm", "llama-code-math-front")
    assert c.searches.reconcile_search(ms) is None  # again (restart, resume): 409 on the Job, nothing new
    assert len(kube.list(JOBS, "team-llm")) == 1
    assert c.searches.sync_search(ms) is None
    store.put(sd.results_uri(typed(ms), 1), json.dumps(core_results()).encode())
    st = c.searches.sync_search(ms)
    assert st["evaluations"] == 4 and st["paretoSize"] == 2
    kube.patch_status(SEARCHES, "team-llm", "llama-code-math-front", st)
    job = kube.get(JOBS, "team-llm", "llama-code-math-front-search-g1")
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    st = c.searches.sync_search(kube.get(SEARCHES, "team-llm", "llama-code-math-front"), job)
    assert get_condition(st["conditions"], "Ready")["reason"] == "Completed"


def test_a_failed_driver_names_the_pods_cause():
    c, kube, store, ms = setup()
    c.searches.reconcile_search(ms)
    jname = "llama-code-math-front-search-g1"
    kube.put(
        PODS,
        {
            "metadata": {"name": jname + "-abcde", "namespace": "team-llm", "labels": {"job-name": jname}},
            "status": {
                "containerStatuses": [
                    {
                        "name": "search",
                        "state": {
                            "terminated": {
                                "exitCode": 2,
                                "message": "error: --eval-command: the evaluator exited 127 (not found)",
                            }
                        },
                    }
                ]
            },
        },
    )
    job = kube.get(JOBS, "team-llm", jname)
    job["status"] = {
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
            }
        ]
    }
    st = c.searches.sync_search(kube.get(SEARCHES, "team-llm", "llama-code-math-front"), job)
    r = get_condition(st["conditions"], "Ready")
    assert r["reason"] == "Failed" and "the evaluator exited 127 (not found)" in r["message"], r


def test_a_new_generation_starts_a_new_driver_and_stops_the_old_one():
    c, kube, store, ms = setup()
    c.searches.reconcile_search(ms)
    ms2 = copy.deepcopy(ms)
    ms2["metadata"]["generation"] = 2
    ms2["spec"]["evaluations"] = 40
    st = c.searches.reconcile_search(ms2)
    assert [j["metadata"]["name"] for j in kube.list(JOBS, "team-llm")] == ["llama-code-math-front-search-g2"]
    assert st["stateURI"].endswith("/g2/state.json")


def test_invalid_spec_starts_nothing():
    c, kube, store, ms = setup(search(vary=[{"name": "density", "min": 0.1, "max": 0.5}]))
    st = c.searches.reconcile_search(ms)
    r = get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("False", "InvalidSpec") and "spec.vary[0].name" in r["message"]
    assert kube.list(JOBS, "team-llm") == []


def test_fisher_without_any_calibration_set_starts_nothing_and_names_spec_block_value():
    """``blockValue: fisher`` needs a calibration set: the spec's, else the operator's default
    (``merges.calibration.uri``); with neither every candidate's planning would refuse it, so the
    search is refused up front, naming the field."""
    c, kube, store, ms = setup(search(blockValue="fisher"))
    st = c.searches.reconcile_search(ms)
    r = get_condition(st["conditions"], "Ready")
    assert (r["status"], r["reason"]) == ("False", "InvalidSpec")
    assert r["message"].startswith("spec.blockValue: fisher needs a calibration set")
    assert kube.list(JOBS, "team-llm") == []


def test_planning_options_reach_the_driver_and_parse_back():
    """``spec.blockValue`` and ``spec.calibration.uri`` become the driver's ``--value`` and
    ``--calibration`` (typer parses them back); without a calibration set the operator's default
    is passed, as a ModelMerge gets it; ``energy`` needs none and gets none."""
    import dataclasses

    import typer.main

    from mergepipe.cli import app

    cal = "s3://data/calibration/code.jsonl"
    args = args_of(search(gen=2, blockValue="fisher", calibration={"uri": cal}))
    k = args.index("--worker-backend")
    p = typer.main.get_command(app).commands["search"].make_context("search", args[1:k] + ["--json"]).params
    assert (p["value"], p["calibration"]) == ("fisher", cal)
    default = dataclasses.replace(make_settings(), calibration_uri="s3://data/default.jsonl")
    args = args_of(search(gen=2), default)
    assert "--value" not in args and args[args.index("--calibration") + 1] == "s3://data/default.jsonl"
    args = args_of(search(gen=2, blockValue="fisher", calibration={"uri": cal}), default)
    assert args[args.index("--calibration") + 1] == cal  # the spec's set wins
    args = args_of(search(gen=2, blockValue="energy"), default)
    assert args[args.index("--value") + 1] == "energy" and "--calibration" not in args
    assert "--calibration" not in args_of(search(gen=2)) and "--value" not in args_of(search(gen=2))


# --- the driver's candidates (core: mergepipe_kube.search) ---------------------------------------


@pytest.mark.parametrize("name", ["front", "llama-code-math-front", "a" * 80, "team.front", "x" * 56])
def test_core_and_operator_name_candidates_alike(name):
    from mergepipe_kube.search import candidate_name

    for i in (0, 7, 12345):
        assert candidate_name(name, i) == sd.candidate_merge_name(name, i)


def test_a_candidate_of_the_example_is_a_valid_modelmerge():
    """The driver's child ModelMerge for a candidate point of the example search passes the CRD
    schema and the operator's checks (layer-wise weights as filter lists)."""
    from mergepipe.request import PlanningOptions
    from mergepipe.search.runner import SearchConfig
    from mergepipe_kube.search import KubernetesMerger
    from mergepipe_operator.modelmerge.spec import validate_merge_spec

    ms = search()
    spec = ms["spec"]
    cfg = SearchConfig(
        base=spec["base"]["uri"],
        experts=[[e["name"], e["uri"]] for e in spec["experts"]],
        method=spec["method"],
        vary=["weight=0:1"],
        objectives=["loss:python", "loss:arithmetic"],
        evaluations=32,
        initial=8,
        budget=spec["budget"],
        seed=7,
        planning=PlanningOptions(value="fisher", calibration="s3://data/calibration/code.jsonl"),
    )
    params = {
        "parameters": {
            "weight": [{"filter": "layers.0.", "value": 0.2}, {"filter": "layers.1.", "value": 0.8}, {"value": 0.5}]
        }
    }
    m = KubernetesMerger(
        None,
        "team-llm",
        ms["metadata"]["name"],
        UID,
        sd.state_prefix(typed(ms), 1),
        template={k: spec[k] for k in ("resources",) if k in spec},
    )
    body = m.candidate_body(cfg, {"id": 3, "params": params})
    assert cr_errors(body) == []
    assert validate_merge_spec(body["spec"]) == []
    assert body["spec"]["blockValue"] == "fisher"
    assert body["spec"]["calibration"] == {"uri": "s3://data/calibration/code.jsonl"}
    assert body["metadata"]["name"] == sd.candidate_merge_name(ms["metadata"]["name"], 3)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("10Gi", 10 * 1024**3),
        ("1.5G", 1_500_000_000),
        ("1Pi", 1024**5),
        ("7E", 7 * 10**18),
    ],
)
def test_the_search_budget_reaches_the_driver_in_bytes_by_the_operator_grammar(budget, expected):
    """A MergeSearch budget is read by the operator's one byte grammar (the CRD's) and handed to
    ``mergepipe search`` as bytes with a unit: the core's ``--budget`` grammar refuses a bare
    number ("needs a unit") and has no Pi/E units, so passing the spec's text through failed
    the driver for budgets the CRD accepts. The core reads the argument back to the same bytes."""
    from mergepipe.request import parse_bytes

    args = args_of(search(gen=2, budget=budget))
    arg = args[args.index("--budget") + 1]
    assert arg == f"{expected}B"
    assert parse_bytes(arg, total=None, bare=False) == expected
