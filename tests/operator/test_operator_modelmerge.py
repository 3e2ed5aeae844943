"""ModelMerge decisions: spec validation, Job names and choice, the merge and analyze Jobs, the
spec in the core planner's terms."""

from __future__ import annotations

import dataclasses
import re

import pytest
from op_testlib import DIGEST, NOW, k8s_validate, make_merge

from mergepipe_operator.k8s import conditions as cond, names
from mergepipe_operator.modelmerge import decisions as mmd, spec as mmspec
from mergepipe_operator.modelmerge.request import merge_request, spec_where
from mergepipe_operator.snapshot import decisions as snapd

GI = 1024**3

# --- spec validation ---------------------------------------------------------------------------------


def issues(**overrides):
    return mmspec.validate_merge_spec(make_merge(**overrides)["spec"])


def paths(**overrides):
    return {p for p, _ in issues(**overrides)}


def test_valid_spec_has_no_issues():
    assert issues() == []
    assert issues(budget=None) == []
    assert issues(budget=None, fidelity=0.9) == []
    assert issues(budget=None, fidelity=1) == []


def test_budget_and_fidelity_are_exclusive_and_checked():
    assert "spec.fidelity" in paths(fidelity=0.5)
    (msg,) = [m for p, m in issues(fidelity=0.5) if p == "spec.fidelity"]
    assert "at most one" in msg
    for bad in (0, -0.1, 1.01, "0.5", float("nan")):
        assert "spec.fidelity" in paths(budget=None, fidelity=bad), bad
    assert "spec.budget" in paths(budget="10 GB")
    assert "spec.budget" in paths(budget=0)
    assert "spec.budget" in paths(budget="0")
    assert "spec.budget" in paths(budget=True)


@pytest.mark.parametrize(
    "method, n, ok",
    [
        ("slerp", 1, True),
        ("slerp", 2, False),
        ("nuslerp", 2, True),
        ("nuslerp", 1, False),
        ("nuslerp", 3, False),
        ("model_stock", 2, True),
        ("model_stock", 1, False),
        ("linear", 1, True),
        ("ties", 5, True),
    ],
)
def test_model_counts_per_method(method, n, ok):
    experts = [{"uri": f"s3://models/e{i}/"} for i in range(n)]
    got = paths(method=method, experts=experts, parameters={})
    assert ("spec.experts" not in got) == ok, got


def test_parameter_names_scopes_and_ranges():
    ps = issues(parameters={"densty": 0.5})
    ((path, msg),) = ps
    assert path == "spec.parameters.densty" and msg.startswith(
        "method 'ties' takes no parameter 'densty'; allowed: weight, density,"
    )
    experts = [{"uri": "s3://models/a/", "parameters": {"lambda": 2}}]
    assert paths(experts=experts) == {"spec.experts[0].parameters.lambda"}
    for bad in (
        0,
        1.5,
        -1,
        "0.5",
        True,
        [],
        [0.5, 2],
        [{"filter": "mlp"}],
        [{"value": 0.5, "extra": 1}],
    ):
        got = paths(parameters={"density": bad})
        assert any(p.startswith("spec.parameters.density") for p in got), (bad, got)
    assert paths(parameters={"density": 1}) == set()
    assert paths(parameters={"normalize": 1}) == {"spec.parameters.normalize"}  # booleans are booleans
    assert paths(parameters={"normalize": [True]}) == {"spec.parameters.normalize"}
    assert paths(method="slerp", experts=[{"uri": "s3://models/a/"}], parameters={"t": 1.2}) == {"spec.parameters.t"}
    assert paths(method="breadcrumbs", parameters={"gamma": 1.5}) == {"spec.parameters.gamma"}
    assert paths(method="breadcrumbs", parameters={"gamma": 0.01}) == set()
    assert paths(method="della", parameters={"epsilon": 0.15}) == set()
    assert paths(method="linear", experts=[{"uri": "s3://models/a/"}], parameters={"lambda": 1}) == {
        "spec.parameters.lambda"
    }


def test_layer_wise_values():
    good = [
        [0.1, 0.5, 0.9],
        [
            {"filter": "self_attn", "value": 0.3},
            {"filter": "mlp", "value": [0.2, 0.8]},
            {"value": 0.5},
        ],
        [{"filter": "mlp", "value": 0.4}],
    ]
    for v in good:
        assert issues(parameters={"density": v}) == [], v
    got = issues(parameters={"density": [{"value": 0.5}, {"filter": "mlp", "value": 0.4}]})
    assert got == [
        (
            "spec.parameters.density[0]",
            "the entry without filter matches every tensor, so entry 1 after it is never used (first match "
            "wins); move the catch-all last.",
        )
    ]
    got = dict(issues(parameters={"density": [0.5, {"value": 0.4}]}))
    assert "mixes numbers" in got["spec.parameters.density"]
    got = dict(issues(parameters={"density": [{"filter": "", "value": 0.4}]}))
    assert "spec.parameters.density[0].filter" in got
    got = dict(issues(parameters={"density": [{"filter": "mlp", "value": [0.5, 0]}]}))
    assert got == {"spec.parameters.density[0].value[1]": "density=0 is outside (0, 1]."}


def test_expert_checks():
    e = [{"uri": "s3://models/a/", "weight": 1, "parameters": {"weight": 2}}]
    assert "spec.experts[0].weight" in paths(experts=e)
    e = [{"name": "x", "uri": "s3://models/a/"}, {"name": "x", "uri": "s3://models/b/"}]
    assert "spec.experts[1].name" in paths(experts=e)
    e = [{"uri": "s3://models/a/"}, {"uri": "s3://models/a"}]
    assert "spec.experts[1].uri" in paths(experts=e)
    e = [{"uri": "s3://models/base"}]
    assert "spec.experts[0].uri" in paths(experts=e)
    assert "spec.experts[0].weight" in paths(
        method="slerp", experts=[{"uri": "s3://models/a/", "weight": 1}], parameters={}
    )


def test_output_must_not_overlap_inputs():
    assert "spec.output.uri" in paths(output={"uri": "s3://models/base/merged/"})
    assert "spec.output.uri" in paths(output={"uri": "s3://models/"})
    assert "spec.output.uri" not in paths(output={"uri": "s3://models/base-merged/"})


def test_schema_level_problems_are_reported_with_paths():
    got = dict(
        issues(
            method="frankenmerge",
            extra_field=1,
            output={"uri": "s3://bucket"},
            experts=[],
        )
    )
    assert "spec.method" in got and "linear" in got["spec.method"]
    assert got["spec.extra_field"].startswith("unknown field")
    assert "not a bucket root" in got["spec.output.uri"]
    assert "spec.experts" in got
    assert dict(mmspec.validate_merge_spec({}))["spec.base"] == "required field is missing."
    assert mmspec.validate_merge_spec("nope") == [("spec", "spec must be an object.")]


def test_format_issues_limits_length():
    text = mmspec.format_issues([(f"spec.x{i}", "bad.") for i in range(12)], limit=3)
    assert text == "spec.x0: bad.; spec.x1: bad.; spec.x2: bad.; and 9 more"


def test_requested_budget(settings):
    """The budget asked for, read from the typed spec (parsed once) or the default budget."""
    from mergepipe_operator.modelmerge.model import ModelMergeSpec

    typed = ModelMergeSpec.model_validate
    spec = make_merge()["spec"]
    assert mmspec.requested_budget(typed(spec), settings) == 10 * GI
    s2 = dataclasses.replace(settings, default_budget="5Gi")
    assert mmspec.requested_budget(typed({**spec, "budget": None}), s2) == 5 * GI
    assert mmspec.requested_budget(typed({**spec, "budget": None, "fidelity": 0.9}), s2) is None
    assert mmspec.requested_budget(typed({**spec, "budget": None}), settings) is None
    # methods that need whole tensors get no default budget (an explicit one is refused by the core)
    whole = {**spec, "budget": None, "method": "arcee_fusion"}
    assert mmspec.requested_budget(typed(whole), s2) is None
    sce = {**spec, "budget": None, "method": "sce", "parameters": {"select_topk": 0.5}}
    assert mmspec.requested_budget(typed(sce), s2) is None
    assert mmspec.requested_budget(typed({**sce, "parameters": {}}), s2) == 5 * GI


def test_budget_refused_for_whole_tensor_method_names_spec_budget():
    from mergepipe.errors import InputError
    from mergepipe_operator.modelmerge.request import merge_request, spec_where

    spec = {**make_merge()["spec"], "method": "ramplus_tl", "parameters": {}}
    spec["experts"] = [{k: v for k, v in ex.items() if k not in ("weight", "parameters")} for ex in spec["experts"]]
    with pytest.raises(InputError) as e:
        merge_request(spec, budget=10 * GI).resolve(spec_where(spec))
    assert str(e.value).startswith("spec.budget ") and "ramplus_tl cannot honour" in str(e.value)


# --- names -------------------------------------------------------------------------------------------

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def test_job_name_is_deterministic_and_valid():
    assert mmd.job_name("mm1", DIGEST) == "mm1-abababab" + "ab"
    assert mmd.job_name("mm1", DIGEST) == mmd.job_name("mm1", DIGEST)
    assert mmd.job_name("mm1", DIGEST) != mmd.job_name("mm1", "cd" * 32)
    names = [
        "a" * 253,
        "My.Merge.v2",
        "my-merge-v2",
        "x",
        "a." * 100 + "b",
        "-weird--name-",
        "a" * 52,
        "a" * 53,
    ]
    out = [mmd.job_name(n, DIGEST) for n in names]
    for n, j in zip(names, out):
        assert len(j) <= 63 and DNS1123_LABEL.match(j), (n, j)
    assert len(set(out)) == len(out)  # sanitized/truncated names stay distinct
    assert mmd.job_name("a" * 52, DIGEST) == "a" * 52 + "-" + DIGEST[:10]
    with pytest.raises(ValueError):
        mmd.job_name("mm1", "XYZ")
    assert snapd.snapshot_name("mm1", "sha256:" + DIGEST) == "mm1-" + DIGEST[:12]
    # a retry after a failed generation is a Job of its own, still a valid label
    assert mmd.job_name("mm1", DIGEST, 3) == f"mm1-{DIGEST[:10]}-g3" != mmd.job_name("mm1", DIGEST, 4)
    assert (
        DNS1123_LABEL.match(mmd.job_name("a" * 253, DIGEST, 12345))
        and len(mmd.job_name("a" * 253, DIGEST, 12345)) <= 63
    )
    assert mmd.analyze_job_name("mm1", "cd" * 32, 2) == "mm1-analyze-" + "cd" * 5 + "-g2"
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError):
            mmd.job_name("mm1", DIGEST, bad)


def _job(name, gen, state=None, value=DIGEST, deleting=False):
    j = {
        "metadata": {
            "name": name,
            "annotations": {
                names.ANN_PLAN_DIGEST: value,
                names.ANN_GENERATION: str(gen),
            },
        },
        "status": {},
    }
    if state in ("Complete", "Failed"):
        j["status"]["conditions"] = [{"type": state, "status": "True", "reason": "BackoffLimitExceeded"}]
    if deleting:
        j["metadata"]["deletionTimestamp"] = "2026-11-22T00:00:00Z"
    return j


@pytest.mark.parametrize(
    "jobs, gen, follow, retry",
    [
        ([], 1, None, None),  # first Job of the plan
        ([_job("a", 1)], 1, "a", None),  # retry / restart: the running Job is found
        (
            [_job("a", 1)],
            2,
            "a",
            None,
        ),  # spec change, same plan: the running Job carries on
        ([_job("a", 1, "Complete")], 2, "a", None),
        (
            [_job("a", 2, "Failed")],
            2,
            "a",
            None,
        ),  # failed for this generation: the outcome stands
        (
            [_job("a", 1, "Failed")],
            2,
            None,
            2,
        ),  # failed for an earlier generation: retry, new name
        ([_job("a", 1, "Failed"), _job("a-g2", 2, "Failed")], 3, None, 3),
        (
            [_job("a", 1, "Failed"), _job("a-g3", 3)],
            3,
            "a-g3",
            None,
        ),  # the retry, found again
        ([_job("a", 1, "Failed"), _job("a-g3", 3, "Failed")], 3, "a-g3", None),
        (
            [_job("other", 1, value="ef" * 32)],
            2,
            None,
            None,
        ),  # another plan's Job is not ours
        (
            [_job("a", 1, deleting=True)],
            1,
            None,
            None,
        ),  # being deleted (superseded): create
    ],
)
def test_choose_job(jobs, gen, follow, retry):
    c = mmd.choose_job(jobs, names.ANN_PLAN_DIGEST, DIGEST, gen)
    assert (c.follow["metadata"]["name"] if c.follow else None, c.retry_generation) == (
        follow,
        retry,
    )


def test_plan_status_is_nested_and_complete():
    st = mmd.plan_status(DIGEST, "s3://plans/ns/mm/x.json", 10, 20, 30, 0.5)
    assert st == {
        "digest": DIGEST,
        "uri": "s3://plans/ns/mm/x.json",
        "estimated": {
            "baseReadBytes": 10,
            "expertReadBytes": 20,
            "outputWriteBytes": 30,
        },
        "retainedEnergy": 0.5,
        "sketch": "none",
        "sketchReadBytes": 0,
    }
    tiered = mmd.plan_status(DIGEST, "s3://p/x.json", 10, 20, 30, 0.5, sketch="sign3", sketch_read_bytes=5)
    assert (tiered["sketch"], tiered["sketchReadBytes"]) == ("sign3", 5)
    with pytest.raises(ValueError, match="sketchReadBytes"):  # sketch bytes are part of the expert reads
        mmd.plan_status(DIGEST, "s3://p/x.json", 10, 20, 30, 0.5, sketch="sign3", sketch_read_bytes=21)
    # every key present, so a merge patch replaces an earlier plan's retained energy with "unknown"
    assert mmd.plan_status(DIGEST, "s3://p/x.json", 0, 0, 0, None)["retainedEnergy"] is None
    assert mmd.status_plan_digest({"plan": st}) == DIGEST
    assert mmd.status_plan_digest({"planDigest": DIGEST}) is None  # the flat field of older operators is not read
    assert mmd.status_plan_digest(None) is None and mmd.status_plan_digest({"plan": None}) is None
    with pytest.raises(ValueError, match="64 lowercase hex"):
        mmd.plan_status("ABC", "s3://p/x.json", 0, 0, 0, None)
    with pytest.raises(ValueError, match="expertReadBytes"):
        mmd.plan_status(DIGEST, "s3://p/x.json", 0, -1, 0, None)


def test_choose_job_for_analysis_treats_a_complete_job_as_spent():
    # in _await_analysis the statistics are still missing, so a complete analyze Job did not help
    jobs = [_job("an", 1, "Complete")]
    only_running = frozenset({"Running"})
    assert (
        mmd.choose_job(jobs, names.ANN_PLAN_DIGEST, DIGEST, 1, usable=only_running).follow["metadata"]["name"] == "an"
    )
    assert mmd.choose_job(jobs, names.ANN_PLAN_DIGEST, DIGEST, 2, usable=only_running) == mmd.JobChoice(None, 2)


@pytest.mark.parametrize(
    "observed, reason, gen, settled",
    [
        (2, "JobRunning", 2, True),
        (2, "Committed", 2, True),
        (2, "JobFailed", 2, True),
        (2, "InvalidSpec", 2, True),
        (2, "JobFailed", 3, False),  # a spec change after a failure is reconciled again
        (2, "InvalidSpec", 3, False),
        (2, "Committed", 3, False),
        (2, "QuotaExceeded", 2, False),  # retried within the generation
        (2, "Analyzing", 2, False),
        (2, "Planning", 2, False),
        (None, None, 1, False),
    ],
)
def test_generation_settled(observed, reason, gen, settled):
    st = (
        {}
        if reason is None
        else {
            "observedGeneration": observed,
            "conditions": cond.set_condition([], "Ready", "False", reason, "m", observed, NOW),
        }
    )
    assert mmd.generation_settled(st, gen) is settled


# --- the Job -----------------------------------------------------------------------------------------

PLAN_URI = "s3://mergepipe/plans/ns1/mm1/" + DIGEST + ".json"
SECRETISH = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.I)


def test_build_job_defaults(settings):
    mm = make_merge()
    job = mmd.build_job(mm, PLAN_URI, DIGEST, settings)
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == mmd.job_name("mm1", DIGEST) and meta["namespace"] == "ns1"
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "mergepipe.io/v1alpha1",
            "kind": "ModelMerge",
            "name": "mm1",
            "uid": mm["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert meta["labels"][names.LABEL_MERGE] == "mm1" and meta["annotations"][names.ANN_PLAN_DIGEST] == DIGEST
    assert (
        spec["backoffLimit"],
        spec["activeDeadlineSeconds"],
        spec["ttlSecondsAfterFinished"],
    ) == (2, 21600, 86400)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"
    }
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/mergepipe/merger:test"
    assert c["command"] == ["mergepipe"]
    assert c["args"] == [
        "execute",
        PLAN_URI,
        "--out",
        "s3://snapshots/mm1/",
        "--resume",
        "--json",
        "--device",
        "cuda",
    ]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {
        "secretKeyRef": {"name": "mergepipe-s3", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "mergepipe-s3", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://seaweedfs:8333"
    for e in c["env"]:  # credentials never as literal values
        if SECRETISH.search(e["name"]):
            assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    assert "envFrom" not in c


def test_build_job_overrides(settings):
    s = dataclasses.replace(
        settings,
        gpu_resource_name="amd.com/gpu",
        gpu_count=2,
        job_service_account="merger",
        tmp_size_limit="50Gi",
        node_selector={"pool": "gpu"},
        tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        allowed_images=("registry.local/*",),
    )
    job = mmd.build_job(make_merge(), PLAN_URI, DIGEST, s)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "2"
    assert pod["serviceAccountName"] == "merger" and pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["volumes"][0]["emptyDir"] == {"sizeLimit": "50Gi"}
    mm = make_merge(
        resources={"gpu": {"count": 0}, "cpu": "500m", "memory": "8Gi"},
        image="registry.local/merger:dev",
        s3={
            "credentialsSecretRef": {
                "name": "team-s3",
                "accessKeyIdKey": "id",
                "secretAccessKeyKey": "secret",
                "sessionTokenKey": "tok",
            },
            "endpoint": "https://s3.team.local",
            "region": "eu-west-1",
        },
    )
    job = mmd.build_job(mm, PLAN_URI, DIGEST, s)
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.local/merger:dev"
    assert c["resources"] == {
        "requests": {"cpu": "500m", "memory": "8Gi"},
        "limits": {"memory": "8Gi"},
    }  # 0 GPUs
    assert c["args"] == [
        "execute",
        PLAN_URI,
        "--out",
        "s3://snapshots/mm1/",
        "--resume",
        "--json",
    ]  # CPU: the CLI default
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "team-s3",
        "key": "id",
    }
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "team-s3",
        "key": "tok",
        "optional": True,
    }
    assert env["AWS_ENDPOINT_URL"]["value"] == "https://s3.team.local" and env["AWS_REGION"]["value"] == "eu-west-1"
    assert env["CUDA_VISIBLE_DEVICES"]["value"] == ""
    mm = make_merge(resources={"gpu": {"resourceName": "nvidia.com/mig-1g.10gb"}})
    assert (
        mmd.build_job(mm, PLAN_URI, DIGEST, s)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/mig-1g.10gb"
        ]
        == "2"
    )


JOB_VARIANTS = {
    "defaults": ({}, {}),
    "amd-2-gpus-irsa-tainted": (
        {
            "gpu_resource_name": "amd.com/gpu",
            "gpu_count": 2,
            "job_service_account": "merger",
            "tmp_size_limit": "50Gi",
            "node_selector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        {},
    ),
    "cpu-only-own-secret": (
        {},
        {
            "resources": {"gpu": {"count": 0}, "cpu": 2, "memory": "8Gi"},
            "s3": {
                "credentialsSecretRef": {"name": "team-s3", "sessionTokenKey": "tok"},
                "region": "eu-west-1",
            },
        },
    ),
    "no-secret-long-name": ({"s3_secret_name": None}, {}),
}


@pytest.mark.parametrize("variant", sorted(JOB_VARIANTS))
def test_built_jobs_pass_kubernetes_validate_strict(settings, variant):
    s_over, spec_over = JOB_VARIANTS[variant]
    mm = make_merge(name="m" * 200 if "long" in variant else "mm1", **spec_over)
    job = mmd.build_job(mm, PLAN_URI, DIGEST, dataclasses.replace(settings, **s_over))
    k8s_validate(job)


def test_build_job_without_secret_and_owner(settings):
    s = dataclasses.replace(settings, s3_secret_name=None)
    job = mmd.build_job(make_merge(), PLAN_URI, DIGEST, s)  # e.g. IRSA: no credentials in env at all
    names = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    mm = make_merge()
    del mm["metadata"]["uid"]
    with pytest.raises(ValueError, match="uid"):
        mmd.build_job(mm, PLAN_URI, DIGEST, s)
    own = {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "ModelMerge",
        "name": "mm1",
        "uid": "u",
        "controller": True,
    }
    assert mmd.build_job(mm, PLAN_URI, DIGEST, s, owner=own)["metadata"]["ownerReferences"] == [own]


# --- the spec in the core planner's terms; the analyze Job ---------------------------------------

ANALYSIS = "cd" * 32


def test_the_spec_is_the_cores_merge_request():
    mm = make_merge(
        parameters={"normalize": True, "lambda": 1.0},
        experts=[
            {
                "name": "code",
                "uri": "s3://models/code/",
                "weight": 0.5,
                "parameters": {"density": [0.2, 0.8]},
            },
            {
                "uri": "s3://models/math",
                "parameters": {"density": [{"filter": "mlp", "value": 0.4}, {"value": 0.6}]},
            },
            {"name": "12", "uri": "s3://models/chat/", "weight": 1},
        ],
    )
    spec = mm["spec"]
    req = merge_request(spec)
    assert [(e.name, e.uri) for e in req.experts] == [
        ("code", "s3://models/code"),
        ("expert-1", "s3://models/math"),
        ("12", "s3://models/chat"),
    ]
    assert req.parameters == {"normalize": True, "lambda": 1.0}  # structured, as in the spec
    assert req.experts[0].parameters == {"weight": 0.5, "density": [0.2, 0.8]}
    assert req.experts[1].parameters == {"density": [{"filter": "mlp", "value": 0.4}, {"value": 0.6}]}
    assert req.experts[2].parameters == {"weight": 1}
    # the core's field paths, named as spec fields (the weight shorthand where it was used)
    where = spec_where(spec)
    assert where(("parameters", "lambda")) == "spec.parameters.lambda"
    assert where(("experts", 2, "parameters", "weight")) == "spec.experts[2].weight"
    assert where(("experts", 0, "parameters", "density", 1)) == "spec.experts[0].parameters.density[1]"
    assert where(("experts", 1, "parameters", "density", 0, "value")) == "spec.experts[1].parameters.density[0].value"
    assert where(("experts", 1, "uri")) == "spec.experts[1].uri" and where(("base",)) == "spec.base.uri"
    assert req.resolve(where).params.experts[2]["weight"] == 1.0


def test_spec_sketch_is_the_requests_fidelity_tiers():
    """spec.sketch reaches the core's request as is; unset leaves the planner's default (None);
    a value the schema would refuse is refused by the operator's check and, should it reach the
    core, by the core's validator at spec.sketch."""
    from mergepipe.errors import InputError

    assert merge_request(make_merge()["spec"]).planning.sketch is None
    for kind in ("none", "sign1", "sign2", "sign3"):
        spec = make_merge(sketch=kind)["spec"]
        assert issues(sketch=kind) == []
        assert merge_request(spec, budget=GI).planning.sketch == kind
        assert merge_request(spec, budget=GI).resolve(spec_where(spec)).request.planning.sketch == kind
    assert paths(sketch="sign4") == {"spec.sketch"} and paths(sketch=True) == {"spec.sketch"}
    spec = make_merge(sketch="sign4")["spec"]
    with pytest.raises(InputError) as e:
        merge_request(spec, budget=GI).resolve(spec_where(spec))
    assert e.value.loc == ("planning", "sketch") and str(e.value).startswith(
        "spec.sketch 'sign4': use one of none, sign1"
    )


def test_the_operators_default_sketch_is_read_and_checked():
    from mergepipe_operator.settings import Settings

    assert Settings.from_env({}).sketch is None
    assert Settings.from_env({"MERGEPIPE_SKETCH": "none"}).sketch == "none"
    with pytest.raises(ValueError, match="MERGEPIPE_SKETCH must be one of none, sign1, sign2, sign3"):
        Settings.from_env({"MERGEPIPE_SKETCH": "sign4"})
    by_ns = Settings.from_env({"MERGEPIPE_SKETCH_BY_NAMESPACE": '{"team-a": "none", "team-b": "sign1"}'})
    assert by_ns.sketch_by_namespace == {"team-a": "none", "team-b": "sign1"} and by_ns.sketch is None
    for bad in ('{"team-a": "sign4"}', '["none"]'):
        with pytest.raises(ValueError, match="MERGEPIPE_SKETCH_BY_NAMESPACE must map namespaces"):
            Settings.from_env({"MERGEPIPE_SKETCH_BY_NAMESPACE": bad})


def test_analysis_id_is_a_content_address():
    a = mmd.analysis_id("b" * 64, ["e1", "e2"], "s3://c/cat/", "ties")
    assert a == mmd.analysis_id("b" * 64, ["e2", "e1", "e1"], "s3://c/cat", "linear")  # order, duplicates, slash
    assert a != mmd.analysis_id("b" * 64, ["e1", "e3"], "s3://c/cat/", "ties")  # a changed checkpoint
    assert a != mmd.analysis_id("b" * 64, ["e1", "e2"], "s3://c/cat/", "model_stock")  # pair statistics too
    name = mmd.analyze_job_name("m" * 80, a)
    assert len(name) <= 63 and name.endswith("-analyze-" + a[:10])
    with pytest.raises(ValueError):
        mmd.analyze_job_name("mm1", "not-hex")


def test_analyze_job_matches_the_merge_job_security_and_credentials(settings):
    mm = make_merge(resources={"gpu": {"count": 2}, "cpu": "2", "memory": "8Gi"})
    merge = mmd.build_job(mm, PLAN_URI, DIGEST, settings)
    job = mmd.build_analyze_job(mm, ["s3://models/math/", "s3://models/code"], ANALYSIS, settings)
    assert job["metadata"]["name"] == mmd.analyze_job_name("mm1", ANALYSIS)
    assert job["metadata"]["ownerReferences"] == merge["metadata"]["ownerReferences"]
    assert (
        job["metadata"]["labels"][names.LABEL_COMPONENT] == "analyze"
        and job["metadata"]["annotations"][mmd.ANN_ANALYSIS] == ANALYSIS
    )
    pod, mpod = job["spec"]["template"]["spec"], merge["spec"]["template"]["spec"]
    (c,), (mc,) = pod["containers"], mpod["containers"]
    assert c["command"] == ["mergepipe"] and c["args"] == [
        "analyze",
        "--base",
        "s3://models/base",
        "--expert",
        "s3://models/math",
        "--expert",
        "s3://models/code",
        "--catalog",
        "s3://mergepipe/catalog/",
        "--json",
    ]
    assert c["securityContext"] == mc["securityContext"] and pod["securityContext"] == mpod["securityContext"]
    for k in (
        "automountServiceAccountToken",
        "enableServiceLinks",
        "restartPolicy",
        "volumes",
    ):
        assert pod[k] == mpod[k]
    assert c["image"] == mc["image"] and c["volumeMounts"] == mc["volumeMounts"]
    assert c["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"memory": "8Gi"},
    }  # never a GPU
    env = {e["name"]: e for e in c["env"]}
    assert env["CUDA_VISIBLE_DEVICES"]["value"] == "" and "MERGEPIPE_PLAN_DIGEST" not in env
    menv = {e["name"]: e for e in mc["env"]}
    for k in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
        "AWS_REGION",
    ):
        assert env[k] == menv[k]
    for e in c["env"]:  # credentials never as literal values
        if SECRETISH.search(e["name"]):
            assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    for k in (
        "backoffLimit",
        "activeDeadlineSeconds",
        "ttlSecondsAfterFinished",
        "podFailurePolicy",
    ):
        assert job["spec"][k] == merge["spec"][k]
    k8s_validate(job)
    with pytest.raises(ValueError, match="catalog"):
        mmd.build_analyze_job(
            mm,
            ["s3://models/math"],
            ANALYSIS,
            dataclasses.replace(settings, catalog_uri=None),
        )


# --- partitioned merges (Indexed Jobs) -------------------------------------------------------------

GiB = 1024**3


@pytest.mark.parametrize(
    "requested, plan_bytes, shards, maxp, per, want",
    [
        (None, 0, 8, 8, 100 * GiB, 1),  # nothing to move: one pod
        (None, 100 * GiB, 8, 8, 100 * GiB, 1),  # exactly one part's worth
        (None, 100 * GiB + 1, 8, 8, 100 * GiB, 2),  # a byte more: two
        (None, 1400 * GiB, 30, 8, 100 * GiB, 8),  # 70B x 8 at full budget: bounded by the chart
        (None, 1400 * GiB, 3, 8, 100 * GiB, 3),  # bounded by the plan's shards
        (None, 10**15, 1, 8, 100 * GiB, 1),  # one shard: one pod, whatever the bytes
        (4, 1, 8, 8, 100 * GiB, 4),  # an explicit N wins over the bytes
        (6, 1, 4, 8, 100 * GiB, 4),  # ... but not over the shards (pods would idle)
        (1, 1400 * GiB, 30, 8, 100 * GiB, 1),  # 1: the single-pod Job
    ],
)
def test_choose_parallelism(requested, plan_bytes, shards, maxp, per, want):
    assert mmd.choose_parallelism(requested, plan_bytes, shards, maxp, per) == want


def test_choose_parallelism_refuses_bad_settings():
    with pytest.raises(ValueError):
        mmd.choose_parallelism(None, 1, 2, 0, 1)
    with pytest.raises(ValueError):
        mmd.choose_parallelism(None, 1, 2, 2, 0)


def test_parallelism_issue_names_the_field_and_the_chart_value(settings):
    s = dataclasses.replace(settings, max_parallelism=4)
    assert mmd.parallelism_issue({}, s) is None and mmd.parallelism_issue({"parallelism": 4}, s) is None
    msg = mmd.parallelism_issue({"parallelism": 5}, s)
    assert msg.startswith("spec.parallelism: 5") and "merges.parallelism.max" in msg and "4" in msg


def test_parts_status_from_an_indexed_job():
    job = {"status": {"completedIndexes": "0-2,5", "failedIndexes": "4", "failed": 3, "succeeded": 4, "active": 1}}
    assert mmd.parts_status(job, 6) == {
        "total": 6,
        "succeeded": 4,
        "progress": "4/6",
        "completedIndexes": "0-2,5",
        "failedIndexes": "4",
        "failedPods": 3,
    }
    assert mmd.parts_status({"status": {}}, 3)["progress"] == "0/3"
    assert mmd.parts_status(None, 2)["succeeded"] == 0
    assert mmd.job_parts(None) == 1 and mmd.job_parts({"metadata": {"annotations": {names.ANN_PARTS: "x"}}}) == 1


def test_build_job_indexed(settings):
    mm = make_merge()
    one = mmd.build_job(mm, PLAN_URI, DIGEST, settings)
    job = mmd.build_job(mm, PLAN_URI, DIGEST, settings, parts=3)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["backoffLimitPerIndex"] == settings.backoff_limit and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec and "completionMode" not in one["spec"]
    assert job["metadata"]["annotations"][names.ANN_PARTS] == "3" and mmd.job_parts(job) == 3
    assert names.ANN_PARTS not in one["metadata"]["annotations"] and mmd.job_parts(one) == 1
    assert job["metadata"]["name"] == one["metadata"]["name"]  # the same plan is the same work
    (c,) = spec["template"]["spec"]["containers"]
    assert c["args"] == [
        "execute",
        PLAN_URI,
        "--out",
        "s3://snapshots/mm1/",
        "--part",
        "$(JOB_COMPLETION_INDEX)/3",
        "--json",
        "--device",
        "cuda",
    ]
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "Ignore"  # evictions and preemptions are not failures
    assert rules[1] == {
        "action": "FailIndex",
        "onExitCodes": {"containerName": "merge", "operator": "In", "values": [2]},
    }
    # everything else is the single-pod Job's
    strip = lambda j: {k: v for k, v in j["spec"].items() if k not in ("template", "podFailurePolicy", "backoffLimit")}  # noqa: E731
    assert {k: v for k, v in strip(job).items() if k not in spec.keys() - one["spec"].keys()} == strip(one)
    assert spec["template"]["spec"]["securityContext"] == one["spec"]["template"]["spec"]["securityContext"]
    k8s_validate(job)
    with pytest.raises(ValueError):
        mmd.build_job(mm, PLAN_URI, DIGEST, settings, parts=0)


def test_a_bad_default_budget_is_refused_at_start_and_a_good_one_read_by_the_one_grammar():
    """The chart's merges.defaultBudget (MERGEPIPE_DEFAULT_BUDGET) is read by the same parser as
    spec.budget, once at start: a bad value stops the operator with the variable named, not each
    merge later."""
    from mergepipe_operator.settings import Settings

    assert Settings.from_env({"MERGEPIPE_DEFAULT_BUDGET": "10Gi"}).default_budget_bytes == 10 * 1024**3
    assert Settings.from_env({}).default_budget_bytes is None
    for bad, why in (("10 Gi", "spaces"), ("10gb", "unknown unit"), ("0", "at least 1 byte")):
        with pytest.raises(ValueError, match=why) as e:
            Settings.from_env({"MERGEPIPE_DEFAULT_BUDGET": bad})
        assert "MERGEPIPE_DEFAULT_BUDGET" in str(e.value)
