"""Pure decisions: units, spec validation, conditions, quota admission, the Job, snapshots."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from datetime import timedelta

import pytest
from op_testlib import DIGEST, NOW, k8s_validate, make_merge, make_quota

from mergepipe_operator import decisions as d
from mergepipe_operator.decisions import Reason

GI = 1024**3

# --- quantities ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0), (4096, 4096), ("4096", 4096), ("512MiB", 512 * 1024**2), ("512Mi", 512 * 1024**2),
        ("10Gi", 10 * GI), ("10GiB", 10 * GI), ("1G", 10**9), ("1GB", 10**9), ("1k", 1000), ("1K", 1000),
        ("1kB", 1000), ("1KiB", 1024), ("1.5Gi", 3 * GI // 2), ("1.5TB", 15 * 10**11), ("2E", 2 * 10**18),
        ("1Ei", 2**60), ("7B", 7), ("0.5Ki", 512),
    ],
)
def test_parse_quantity(value, expected):
    assert d.parse_quantity(value) == expected


@pytest.mark.parametrize(
    "value, needle",
    [
        ("10 GB", "contains spaces"), (" 10Gi", "contains spaces"), ("-1Gi", "negative"), (-5, "negative"),
        ("1gb", "case-sensitive"), ("10mb", "milli"), ("10Gib", "unknown unit"), ("1e9", "exponent notation"),
        ("Gi", "not a byte quantity"), ("", "not a byte quantity"), ("1.5", "whole number"), ("0.1Ki", "whole number"),
        (1.5, "floating-point"), (True, "got True"), (None, "got None"), ([1], "list"),
    ],
)
def test_parse_quantity_errors_name_the_field_and_fix(value, needle):
    with pytest.raises(d.QuantityError) as e:
        d.parse_quantity(value, field="spec.budget")
    assert str(e.value).startswith("spec.budget: ") and needle in str(e.value), str(e.value)


def test_human_bytes():
    assert d.human_bytes(None) is None
    assert d.human_bytes(512) == "512B"
    assert d.human_bytes(10 * GI) == "10Gi"
    assert d.human_bytes(3412345678) == "3.18Gi"
    assert d.human_bytes(1536 * 1024**2) == "1.5Gi"
    for n in (1024, 5 * 1024**2, 10 * GI, 2**60):
        assert d.parse_quantity(d.human_bytes(n)) == n


def test_parse_duration():
    assert d.parse_duration("24h") == timedelta(hours=24)
    assert d.parse_duration("1h30m") == timedelta(minutes=90)
    assert d.parse_duration("7d") == d.parse_duration("1w")
    for bad in ("", "24", "1.5h", "h", "0s", "24H", 24):
        with pytest.raises(d.QuantityError):
            d.parse_duration(bad)


# --- spec validation ---------------------------------------------------------------------------------


def issues(**overrides):
    return d.validate_merge_spec(make_merge(**overrides)["spec"])


def paths(**overrides):
    return {p for p, _ in issues(**overrides)}


def test_valid_spec_has_no_issues():
    assert issues() == []
    assert issues(budget=None) == []
    assert issues(budget=None, fidelity=0.9) == []
    assert issues(budget=None, fidelity=1) == []


def test_budget_and_fidelity_are_exclusive_and_checked():
    assert ("spec.fidelity" in paths(fidelity=0.5))
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
    [("slerp", 1, True), ("slerp", 2, False), ("nuslerp", 2, True), ("nuslerp", 1, False), ("nuslerp", 3, False),
     ("model_stock", 2, True), ("model_stock", 1, False), ("linear", 1, True), ("ties", 5, True)],
)
def test_model_counts_per_method(method, n, ok):
    experts = [{"uri": f"s3://models/e{i}/"} for i in range(n)]
    got = paths(method=method, experts=experts, parameters={})
    assert ("spec.experts" not in got) == ok, got


def test_parameter_names_scopes_and_ranges():
    ps = issues(parameters={"densty": 0.5})
    ((path, msg),) = ps
    assert path == "spec.parameters.densty" and msg.startswith("method ties takes no parameter 'densty'; allowed: weight, density,")
    experts = [{"uri": "s3://models/a/", "parameters": {"lambda": 2}}]
    assert paths(experts=experts) == {"spec.experts[0].parameters.lambda"}
    for bad in (0, 1.5, -1, "0.5", True, [], [0.5, 2], [{"filter": "mlp"}], [{"value": 0.5, "extra": 1}]):
        got = paths(parameters={"density": bad})
        assert any(p.startswith("spec.parameters.density") for p in got), (bad, got)
    assert paths(parameters={"density": 1}) == set()
    assert paths(parameters={"normalize": 1}) == {"spec.parameters.normalize"}  # booleans are booleans
    assert paths(parameters={"normalize": [True]}) == {"spec.parameters.normalize"}
    assert paths(method="slerp", experts=[{"uri": "s3://models/a/"}], parameters={"t": 1.2}) == {"spec.parameters.t"}
    assert paths(method="breadcrumbs", parameters={"gamma": 1.5}) == {"spec.parameters.gamma"}
    assert paths(method="breadcrumbs", parameters={"gamma": 0.01}) == set()
    assert paths(method="della", parameters={"epsilon": 0.15}) == set()
    assert paths(method="linear", experts=[{"uri": "s3://models/a/"}], parameters={"lambda": 1}) == {"spec.parameters.lambda"}


def test_layer_wise_values():
    good = [
        [0.1, 0.5, 0.9],
        [{"filter": "self_attn", "value": 0.3}, {"filter": "mlp", "value": [0.2, 0.8]}, {"value": 0.5}],
        [{"filter": "mlp", "value": 0.4}],
    ]
    for v in good:
        assert issues(parameters={"density": v}) == [], v
    got = issues(parameters={"density": [{"value": 0.5}, {"filter": "mlp", "value": 0.4}]})
    assert got == [("spec.parameters.density[0]", "the entry without filter matches every tensor, so the entries after it are never used; move it last.")]
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
    assert "spec.experts[0].weight" in paths(method="slerp", experts=[{"uri": "s3://models/a/", "weight": 1}], parameters={})


def test_output_must_not_overlap_inputs():
    assert "spec.output.uri" in paths(output={"uri": "s3://models/base/merged/"})
    assert "spec.output.uri" in paths(output={"uri": "s3://models/"})
    assert "spec.output.uri" not in paths(output={"uri": "s3://models/base-merged/"})


def test_schema_level_problems_are_reported_with_paths():
    got = dict(issues(method="frankenmerge", extra_field=1, output={"uri": "s3://bucket"}, experts=[]))
    assert "spec.method" in got and "linear" in got["spec.method"]
    assert got["spec.extra_field"].startswith("unknown field")
    assert "not a bucket root" in got["spec.output.uri"]
    assert "spec.experts" in got
    assert dict(d.validate_merge_spec({}))["spec.base"] == "required field is missing."
    assert d.validate_merge_spec("nope") == [("spec", "spec must be an object.")]


def test_format_issues_limits_length():
    text = d.format_issues([(f"spec.x{i}", "bad.") for i in range(12)], limit=3)
    assert text == "spec.x0: bad.; spec.x1: bad.; spec.x2: bad.; and 9 more"


def test_requested_budget(settings):
    spec = make_merge()["spec"]
    assert d.requested_budget(spec, settings) == 10 * GI
    s2 = dataclasses.replace(settings, default_budget="5Gi")
    assert d.requested_budget({**spec, "budget": None}, s2) == 5 * GI
    assert d.requested_budget({**spec, "budget": None, "fidelity": 0.9}, s2) is None
    assert d.requested_budget({**spec, "budget": None}, settings) is None


# --- conditions ------------------------------------------------------------------------------------


def test_set_condition_follows_api_conventions():
    t0, t1, t2 = NOW, NOW + timedelta(minutes=1), NOW + timedelta(minutes=2)
    c0 = d.set_condition(None, "Ready", "False", "Planning", "planning", 1, t0)
    assert c0 == [{"type": "Ready", "status": "False", "reason": "Planning", "message": "planning",
                   "lastTransitionTime": "2026-11-22T12:00:00Z", "observedGeneration": 1}]
    c1 = d.set_condition(c0, "Ready", "False", "JobRunning", "running", 2, t1)  # same status
    assert c1[0]["lastTransitionTime"] == "2026-11-22T12:00:00Z"
    assert (c1[0]["reason"], c1[0]["message"], c1[0]["observedGeneration"]) == ("JobRunning", "running", 2)
    c2 = d.set_condition(c1, "Ready", True, "Committed", "done", 2, t2)  # flip
    assert c2[0]["status"] == "True" and c2[0]["lastTransitionTime"] == "2026-11-22T12:02:00Z"
    c3 = d.set_condition(c2, "QuotaAdmitted", "True", "Admitted", "", 2, t2)
    assert [c["type"] for c in c3] == ["Ready", "QuotaAdmitted"]
    assert c0[0]["reason"] == "Planning"  # inputs untouched
    assert d.get_condition(c3, "Ready")["reason"] == "Committed" and d.get_condition(c3, "Nope") is None
    assert d.condition_current(c3[0], 2) and not d.condition_current(c3[0], 3)
    with pytest.raises(ValueError):
        d.set_condition([], "Ready", "Maybe", "X", "", 1, t0)
    for bad in ("", "job running", "1Bad"):
        with pytest.raises(ValueError):
            d.set_condition([], "Ready", "True", bad, "", 1, t0)


# --- quota admission -------------------------------------------------------------------------------


def ledger_entry(key, bytes_, state="Charged", at=NOW, merge="m"):
    return {"key": key, "merge": merge, "bytes": bytes_, "state": state, "time": d.rfc3339(at)}


def test_admit_without_limits():
    q = make_quota(bytes_=None)
    a = d.admit(q, 5 * GI, NOW, key="k1", merge="m1")
    assert a.allowed and a.budget == 5 * GI and a.reason == Reason.ADMITTED
    assert a.new_status["ledger"] == [ledger_entry("k1", 5 * GI, "Reserved", merge="m1")]
    assert a.new_status["used"] == {"expertReadBytes": 5 * GI, "merges": 1}
    assert d.admit(q, None, NOW).budget is None


def test_admit_reject_and_clamp():
    used = {"ledger": [ledger_entry("old", 90 * GI)]}
    rej = make_quota(status=used)
    a = d.admit(rej, 10 * GI, NOW, key="k")
    assert a.allowed and a.budget == 10 * GI
    a = d.admit(rej, 11 * GI, NOW, key="k")
    assert not a.allowed and a.reason == Reason.QUOTA_EXCEEDED and a.new_status is None
    assert "requested 11Gi but only 10Gi is left" in a.message and "MergeQuota q (Reject)" in a.message
    clamp = make_quota(enforcement="Clamp", status=used)
    a = d.admit(clamp, 50 * GI, NOW, key="k")
    assert a.allowed and a.clamped and a.budget == 10 * GI
    assert "lowered from 50Gi to 10Gi" in a.message
    assert a.new_used == {"expertReadBytes": 100 * GI, "merges": 2}
    full = make_quota(enforcement="Clamp", status={"ledger": [ledger_entry("old", 100 * GI)]})
    a = d.admit(full, 1, NOW, key="k")
    assert not a.allowed and a.reason == Reason.QUOTA_EXCEEDED
    # an unbounded request under a byte limit
    assert d.admit(clamp, None, NOW, key="k").budget == 10 * GI
    a = d.admit(rej, None, NOW, key="k")
    assert not a.allowed and "set spec.budget" in a.message


def test_admit_counts_merges():
    q = make_quota(bytes_=None, merges=2, status={"ledger": [ledger_entry("a", 0), ledger_entry("b", 0, "Reserved")]})
    a = d.admit(q, 1, NOW, key="c")
    assert not a.allowed and "2 of 2 merges used in the last 24h" in a.message
    zero = make_quota(bytes_="1Ti", merges=0, enforcement="Clamp")
    assert not d.admit(zero, 1, NOW, key="c").allowed


def test_rolling_window():
    old = NOW - timedelta(hours=25)
    st = {"ledger": [ledger_entry("charged-old", 60 * GI, at=old), ledger_entry("reserved-old", 30 * GI, "Reserved", at=old),
                     ledger_entry("recent", 5 * GI, at=NOW - timedelta(hours=1))]}
    q = make_quota(status=st)
    a = d.admit(q, 65 * GI, NOW, key="k")  # 100 - (30 reserved + 5 recent) = 65 left
    assert a.allowed and a.budget == 65 * GI
    assert [e["key"] for e in a.new_status["ledger"]] == ["reserved-old", "recent", "k"]  # the old charge left
    assert not d.admit(q, 66 * GI, NOW, key="k").allowed
    lifetime = make_quota(window=None, status=st)
    assert not d.admit(lifetime, 6 * GI, NOW, key="k").allowed  # without a window nothing expires


def test_admission_is_idempotent_per_key():
    q = make_quota(enforcement="Clamp")
    a = d.admit(q, 150 * GI, NOW, key="k")
    assert a.budget == 100 * GI
    q["status"] = a.new_status
    again = d.admit(q, 150 * GI, NOW + timedelta(seconds=5), key="k")
    assert again.allowed and again.reason == Reason.ALREADY_ADMITTED and again.budget == 100 * GI
    assert again.new_status is None


def test_settle_and_release():
    q = make_quota()
    q["status"] = d.admit(q, 10 * GI, NOW, key="k").new_status
    st = d.settle(q, "k", 3 * GI, NOW + timedelta(minutes=5))
    assert st["ledger"] == [ledger_entry("k", 3 * GI, at=NOW + timedelta(minutes=5), merge="")]
    assert st["used"] == {"expertReadBytes": 3 * GI, "merges": 1}
    q2 = copy.deepcopy(q)
    q2["status"] = st
    assert d.settle(q2, "k", 1, NOW) is None  # already charged: idempotent
    assert d.release(q2, "k", NOW) is None  # charged entries are not released
    assert d.settle(q, "nope", 1, NOW) is None
    kept = d.settle(q, "k", None, NOW)  # failed Job: charge the reservation
    assert kept["ledger"][0]["bytes"] == 10 * GI and kept["ledger"][0]["state"] == "Charged"
    rel = d.release(q, "k", NOW)
    assert rel["ledger"] == [] and rel["used"] == {"expertReadBytes": 0, "merges": 0}


def test_ledger_is_bounded_by_folding_into_carry():
    n = d.MAX_LEDGER + 10
    st = {"ledger": [ledger_entry(f"k{i:04d}", 1, at=NOW - timedelta(minutes=n - i)) for i in range(n)]}
    q = make_quota(bytes_=None, status=st)
    new = d.quota_status(q, NOW)
    assert len(new["ledger"]) == d.MAX_LEDGER
    assert new["carry"]["merges"] == 10 and new["carry"]["expertReadBytes"] == 10
    assert new["used"] == {"expertReadBytes": n, "merges": n}
    assert new["ledger"][0]["key"] == "k0010"  # the oldest were folded
    later = copy.deepcopy(q)
    later["status"] = new
    assert d.quota_status(later, NOW + timedelta(hours=25))["used"] == {"expertReadBytes": 0, "merges": 0}


def test_quota_status_echoes_hard_limits_and_rejects_bad_specs():
    q = make_quota(bytes_="1Ti", merges=3)
    st = d.quota_status(q, NOW)
    assert st["hard"] == {"expertReadBytes": 2**40, "merges": 3} and st["observedGeneration"] == 1
    with pytest.raises(d.QuantityError, match="spec.hard.expertReadBytes"):
        d.quota_limits(make_quota(bytes_="lots"))
    with pytest.raises(d.QuantityError, match="spec.window"):
        d.quota_limits(make_quota(window="forever"))
    with pytest.raises(d.QuantityError, match="enforcement"):
        d.quota_limits(make_quota(enforcement="Soft"))


# --- names -------------------------------------------------------------------------------------------

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def test_job_name_is_deterministic_and_valid():
    assert d.job_name("mm1", DIGEST) == "mm1-abababab" + "ab"
    assert d.job_name("mm1", DIGEST) == d.job_name("mm1", DIGEST)
    assert d.job_name("mm1", DIGEST) != d.job_name("mm1", "cd" * 32)
    names = ["a" * 253, "My.Merge.v2", "my-merge-v2", "x", "a." * 100 + "b", "-weird--name-", "a" * 52, "a" * 53]
    out = [d.job_name(n, DIGEST) for n in names]
    for n, j in zip(names, out):
        assert len(j) <= 63 and DNS1123_LABEL.match(j), (n, j)
    assert len(set(out)) == len(out)  # sanitized/truncated names stay distinct
    assert d.job_name("a" * 52, DIGEST) == "a" * 52 + "-" + DIGEST[:10]
    with pytest.raises(ValueError):
        d.job_name("mm1", "XYZ")
    assert d.snapshot_name("mm1", "sha256:" + DIGEST) == "mm1-" + DIGEST[:12]
    # a retry after a failed generation is a Job of its own, still a valid label
    assert d.job_name("mm1", DIGEST, 3) == f"mm1-{DIGEST[:10]}-g3" != d.job_name("mm1", DIGEST, 4)
    assert DNS1123_LABEL.match(d.job_name("a" * 253, DIGEST, 12345)) and len(d.job_name("a" * 253, DIGEST, 12345)) <= 63
    assert d.analyze_job_name("mm1", "cd" * 32, 2) == "mm1-analyze-" + "cd" * 5 + "-g2"
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError):
            d.job_name("mm1", DIGEST, bad)


def _job(name, gen, state=None, value=DIGEST, deleting=False):
    j = {"metadata": {"name": name, "annotations": {d.ANN_PLAN_DIGEST: value, d.ANN_GENERATION: str(gen)}}, "status": {}}
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
        ([_job("a", 1)], 2, "a", None),  # spec change, same plan: the running Job carries on
        ([_job("a", 1, "Complete")], 2, "a", None),
        ([_job("a", 2, "Failed")], 2, "a", None),  # failed for this generation: the outcome stands
        ([_job("a", 1, "Failed")], 2, None, 2),  # failed for an earlier generation: retry, new name
        ([_job("a", 1, "Failed"), _job("a-g2", 2, "Failed")], 3, None, 3),
        ([_job("a", 1, "Failed"), _job("a-g3", 3)], 3, "a-g3", None),  # the retry, found again
        ([_job("a", 1, "Failed"), _job("a-g3", 3, "Failed")], 3, "a-g3", None),
        ([_job("other", 1, value="ef" * 32)], 2, None, None),  # another plan's Job is not ours
        ([_job("a", 1, deleting=True)], 1, None, None),  # being deleted (superseded): create
    ],
)
def test_choose_job(jobs, gen, follow, retry):
    c = d.choose_job(jobs, d.ANN_PLAN_DIGEST, DIGEST, gen)
    assert (c.follow["metadata"]["name"] if c.follow else None, c.retry_generation) == (follow, retry)


def test_plan_status_is_nested_and_complete():
    st = d.plan_status(DIGEST, "s3://plans/ns/mm/x.json", 10, 20, 30, 0.5)
    assert st == {"digest": DIGEST, "uri": "s3://plans/ns/mm/x.json",
                  "estimated": {"baseReadBytes": 10, "expertReadBytes": 20, "outputWriteBytes": 30}, "retainedEnergy": 0.5}
    # every key present, so a merge patch replaces an earlier plan's retained energy with "unknown"
    assert d.plan_status(DIGEST, "s3://p/x.json", 0, 0, 0, None)["retainedEnergy"] is None
    assert d.status_plan_digest({"plan": st}) == DIGEST
    assert d.status_plan_digest({"planDigest": DIGEST}) is None  # the flat field of older operators is not read
    assert d.status_plan_digest(None) is None and d.status_plan_digest({"plan": None}) is None
    with pytest.raises(ValueError, match="64 lowercase hex"):
        d.plan_status("ABC", "s3://p/x.json", 0, 0, 0, None)
    with pytest.raises(ValueError, match="expertReadBytes"):
        d.plan_status(DIGEST, "s3://p/x.json", 0, -1, 0, None)


def test_choose_job_for_analysis_treats_a_complete_job_as_spent():
    # in _await_analysis the statistics are still missing, so a complete analyze Job did not help
    jobs = [_job("an", 1, "Complete")]
    only_running = frozenset({"Running"})
    assert d.choose_job(jobs, d.ANN_PLAN_DIGEST, DIGEST, 1, usable=only_running).follow["metadata"]["name"] == "an"
    assert d.choose_job(jobs, d.ANN_PLAN_DIGEST, DIGEST, 2, usable=only_running) == d.JobChoice(None, 2)


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
    st = {} if reason is None else {
        "observedGeneration": observed,
        "conditions": d.set_condition([], "Ready", "False", reason, "m", observed, NOW),
    }
    assert d.generation_settled(st, gen) is settled


def test_label_value():
    assert d.label_value("mm1") == "mm1"
    long = d.label_value("a" * 200)
    assert len(long) <= 63 and long != d.label_value("a" * 201)


# --- the Job -----------------------------------------------------------------------------------------

PLAN_URI = "s3://mergepipe/plans/ns1/mm1/" + DIGEST + ".json"
SECRETISH = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.I)


def test_build_job_defaults(settings):
    mm = make_merge()
    job = d.build_job(mm, PLAN_URI, DIGEST, settings)
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == d.job_name("mm1", DIGEST) and meta["namespace"] == "ns1"
    assert meta["ownerReferences"] == [{
        "apiVersion": "mergepipe.io/v1alpha1", "kind": "ModelMerge", "name": "mm1",
        "uid": mm["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True,
    }]
    assert meta["labels"][d.LABEL_MERGE] == "mm1" and meta["annotations"][d.ANN_PLAN_DIGEST] == DIGEST
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (2, 21600, 86400)
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/mergepipe/merger:test"
    assert c["command"] == ["mergepipe"]
    assert c["args"] == ["execute", PLAN_URI, "--out", "s3://snapshots/mm1/", "--json", "--device", "cuda"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "mergepipe-s3", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "mergepipe-s3", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://seaweedfs:8333"
    for e in c["env"]:  # credentials never as literal values
        if SECRETISH.search(e["name"]):
            assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    assert "envFrom" not in c


def test_build_job_overrides(settings):
    s = dataclasses.replace(settings, gpu_resource_name="amd.com/gpu", gpu_count=2, job_service_account="merger",
                            tmp_size_limit="50Gi", node_selector={"pool": "gpu"},
                            tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}])
    job = d.build_job(make_merge(), PLAN_URI, DIGEST, s)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["amd.com/gpu"] == "2"
    assert pod["serviceAccountName"] == "merger" and pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["volumes"][0]["emptyDir"] == {"sizeLimit": "50Gi"}
    mm = make_merge(
        resources={"gpu": {"count": 0}, "cpu": "500m", "memory": "8Gi"},
        image="registry.local/merger:dev",
        s3={"credentialsSecretRef": {"name": "team-s3", "accessKeyIdKey": "id", "secretAccessKeyKey": "secret", "sessionTokenKey": "tok"},
            "endpoint": "https://s3.team.local", "region": "eu-west-1"},
    )
    job = d.build_job(mm, PLAN_URI, DIGEST, s)
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.local/merger:dev"
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}  # 0 GPUs
    assert c["args"] == ["execute", PLAN_URI, "--out", "s3://snapshots/mm1/", "--json"]  # CPU: the CLI default
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "id"}
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "tok", "optional": True}
    assert env["AWS_ENDPOINT_URL"]["value"] == "https://s3.team.local" and env["AWS_REGION"]["value"] == "eu-west-1"
    assert env["CUDA_VISIBLE_DEVICES"]["value"] == ""
    mm = make_merge(resources={"gpu": {"resourceName": "nvidia.com/mig-1g.10gb"}})
    assert d.build_job(mm, PLAN_URI, DIGEST, s)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-1g.10gb"] == "2"


JOB_VARIANTS = {
    "defaults": ({}, {}),
    "amd-2-gpus-irsa-tainted": (
        {"gpu_resource_name": "amd.com/gpu", "gpu_count": 2, "job_service_account": "merger", "tmp_size_limit": "50Gi",
         "node_selector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        {},
    ),
    "cpu-only-own-secret": (
        {}, {"resources": {"gpu": {"count": 0}, "cpu": 2, "memory": "8Gi"},
             "s3": {"credentialsSecretRef": {"name": "team-s3", "sessionTokenKey": "tok"}, "region": "eu-west-1"}},
    ),
    "no-secret-long-name": ({"s3_secret_name": None}, {}),
}


@pytest.mark.parametrize("variant", sorted(JOB_VARIANTS))
def test_built_jobs_pass_kubernetes_validate_strict(settings, variant):
    s_over, spec_over = JOB_VARIANTS[variant]
    mm = make_merge(name="m" * 200 if "long" in variant else "mm1", **spec_over)
    job = d.build_job(mm, PLAN_URI, DIGEST, dataclasses.replace(settings, **s_over))
    k8s_validate(job)


def test_build_job_without_secret_and_owner(settings):
    s = dataclasses.replace(settings, s3_secret_name=None)
    job = d.build_job(make_merge(), PLAN_URI, DIGEST, s)  # e.g. IRSA: no credentials in env at all
    names = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not names & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    mm = make_merge()
    del mm["metadata"]["uid"]
    with pytest.raises(ValueError, match="uid"):
        d.build_job(mm, PLAN_URI, DIGEST, s)
    own = {"apiVersion": "mergepipe.io/v1alpha1", "kind": "ModelMerge", "name": "mm1", "uid": "u", "controller": True}
    assert d.build_job(mm, PLAN_URI, DIGEST, s, owner=own)["metadata"]["ownerReferences"] == [own]


def test_job_outcome():
    assert d.job_outcome({"status": {"active": 1}}).state == "Running"
    assert d.job_outcome({"status": {"conditions": [{"type": "SuccessCriteriaMet", "status": "True"}]}}).state == "Running"
    ok = d.job_outcome({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})
    assert ok.state == "Succeeded"
    bad = d.job_outcome({"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                    "message": "Job has reached the specified backoff limit"}]}})
    assert (bad.state, bad.reason) == ("Failed", "BackoffLimitExceeded") and "backoff" in bad.message
    assert d.job_outcome(None) == d.JobOutcome("Failed", "JobMissing", "the merge Job no longer exists")


# --- snapshots -----------------------------------------------------------------------------------------


def manifest(**over):
    """A manifest as mergepipe.pipeline writes it (via the core's own helpers)."""
    from mergepipe.commit.manifest import manifest_bytes, snapshot_id

    outputs = {"model.safetensors": {"size": 1000, "sha256": "cd" * 32}, "config.json": {"size": 10, "sha256": "ef" * 32}}
    m = {
        "format": "mergepipe.manifest/v1",
        "plan_digest": DIGEST,
        "files_prefix": "runs/0123456789abcdef",
        "outputs": outputs,
        "io": {"expert_budget_bytes": 10 * GI, "fidelity": None, "expert_bytes_total": 20 * GI,
               "estimated": {"base_read_bytes": 1000, "expert_read_bytes": 4 * GI, "output_write_bytes": 1010},
               "realized": {"base_read_bytes": 1000, "expert_read_bytes": 3 * GI, "output_write_bytes": 1010,
                            "output_copied_bytes": 0, "catalog_read_bytes": 5}},
    }
    m.update(over)
    try:
        m.setdefault("snapshot_id", snapshot_id(str(m.get("plan_digest") or ""), m.get("outputs") or {}))
    except KeyError:  # an output without size or digest: the core cannot compute an id either
        m.setdefault("snapshot_id", "snap-" + "0" * 16)
    return manifest_bytes(m)


SIZES = {"runs/0123456789abcdef/model.safetensors": 1000, "runs/0123456789abcdef/config.json": 10}


def test_snapshot_ready_accepts_tree_digests_of_copied_shards():
    outputs = {"model.safetensors": {"size": 1000, "tree_sha256": "ab" * 32}, "config.json": {"size": 10, "sha256": "ef" * 32}}
    ok, reason, _ = d.snapshot_ready(manifest(outputs=outputs), DIGEST, None, object_sizes=SIZES)
    assert (ok, reason) == (True, Reason.VERIFIED)


def test_snapshot_ready_accepts_a_consistent_manifest():
    raw = manifest()
    h = hashlib.sha256(raw).hexdigest()
    ok, reason, msg = d.snapshot_ready(raw, DIGEST, h, object_sizes=SIZES)
    assert (ok, reason) == (True, Reason.VERIFIED) and "2 file(s)" in msg and "3Gi expert reads" in msg
    assert d.snapshot_ready(raw, DIGEST, "sha256:" + h)[0]
    assert d.snapshot_ready(raw, None, None)[0]
    facts = d.manifest_facts(json.loads(raw))
    assert facts.total_bytes == 1010 and facts.realized["expertReadBytes"] == 3 * GI and facts.budget_bytes == 10 * GI
    assert d.output_path(facts, "config.json") == "runs/0123456789abcdef/config.json"
    doc = json.loads(raw)
    assert d.snapshot_ready(doc, DIGEST, h)[0]  # a parsed manifest hashes as the core serializes it
    local = manifest(files_prefix="")
    assert d.snapshot_ready(local, DIGEST, None, object_sizes={"model.safetensors": 1000, "config.json": 10})[0]


def test_manifest_hash_matches_the_core():
    from mergepipe.commit.manifest import manifest_hash

    raw = manifest()
    assert d.manifest_hash(raw) == manifest_hash(raw)


def _edit(raw, **over):
    doc = json.loads(raw)
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "raw, plan, mhash, sizes, reason",
    [
        (None, DIGEST, None, None, Reason.MANIFEST_MISSING),
        (b"{not json", DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(), DIGEST, "00" * 32, None, Reason.MANIFEST_HASH_MISMATCH),
        (manifest(), "cd" * 32, None, None, Reason.PLAN_DIGEST_MISMATCH),
        (manifest(plan_digest=None), DIGEST, None, None, Reason.PLAN_DIGEST_MISMATCH),
        (_edit(manifest(), snapshot_id="snap-0000000000000000"), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(outputs={}), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(outputs={"a": {"size": 1, "sha256": "zz"}}), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(outputs={"a": {"sha256": "ab" * 32}}), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(outputs={"a": {"size": 5}}), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(files_prefix="../elsewhere"), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(format="other/v9"), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(io={"expert_budget_bytes": 2 * GI, "realized": {"expert_read_bytes": 3 * GI}}), DIGEST, None, None, Reason.BUDGET_EXCEEDED),
        (manifest(io={"estimated": {"expert_read_bytes": GI}, "realized": {"expert_read_bytes": 3 * GI}}), DIGEST, None, None, Reason.BUDGET_EXCEEDED),
        (manifest(), DIGEST, None, {**SIZES, "runs/0123456789abcdef/model.safetensors": 999}, Reason.OUTPUT_MISMATCH),
        (manifest(), DIGEST, None, {**SIZES, "runs/0123456789abcdef/config.json": None}, Reason.OUTPUT_MISMATCH),
        (b"[1, 2]", DIGEST, None, None, Reason.MANIFEST_INVALID),
    ],
)
def test_snapshot_ready_refuses(raw, plan, mhash, sizes, reason):
    ok, got, msg = d.snapshot_ready(raw, plan, mhash, object_sizes=sizes)
    assert (ok, got) == (False, reason), msg
    assert msg


# --- the spec in the core planner's terms; the analyze Job ---------------------------------------

ANALYSIS = "cd" * 32


def test_merge_params_and_experts_in_core_syntax():
    mm = make_merge(parameters={"normalize": True, "lambda": 1.0}, experts=[
        {"name": "code", "uri": "s3://models/code/", "weight": 0.5, "parameters": {"density": [0.2, 0.8]}},
        {"uri": "s3://models/math", "parameters": {"density": [{"filter": "mlp", "value": 0.4}, {"value": 0.6}]}},
        {"name": "12", "uri": "s3://models/chat/", "weight": 1},
    ])
    spec = mm["spec"]
    assert d.merge_experts(spec) == [("code", "s3://models/code"), ("expert-1", "s3://models/math"), ("12", "s3://models/chat")]
    assert d.merge_params(spec) == [
        "normalize=true", "lambda=1.0",
        "1:weight=0.5", "1:density=[0.2,0.8]",
        '2:density=[{"filter":"mlp","value":0.4},{"value":0.6}]',
        "3:weight=1",  # by position: the name "12" would read as a position
    ]
    from mergepipe.pipeline import parse_params

    glob, per = parse_params(d.merge_params(spec), [n for n, _ in d.merge_experts(spec)])
    assert glob == {"normalize": "true", "lambda": "1.0"} and per[2] == {"weight": "1"}
    assert per[1]["density"].startswith("[{")


def test_analysis_id_is_a_content_address():
    a = d.analysis_id("b" * 64, ["e1", "e2"], "s3://c/cat/", "ties")
    assert a == d.analysis_id("b" * 64, ["e2", "e1", "e1"], "s3://c/cat", "linear")  # order, duplicates, slash
    assert a != d.analysis_id("b" * 64, ["e1", "e3"], "s3://c/cat/", "ties")  # a changed checkpoint
    assert a != d.analysis_id("b" * 64, ["e1", "e2"], "s3://c/cat/", "model_stock")  # pair statistics too
    name = d.analyze_job_name("m" * 80, a)
    assert len(name) <= 63 and name.endswith("-analyze-" + a[:10])
    with pytest.raises(ValueError):
        d.analyze_job_name("mm1", "not-hex")


def test_analyze_job_matches_the_merge_job_security_and_credentials(settings):
    mm = make_merge(resources={"gpu": {"count": 2}, "cpu": "2", "memory": "8Gi"})
    merge = d.build_job(mm, PLAN_URI, DIGEST, settings)
    job = d.build_analyze_job(mm, ["s3://models/math/", "s3://models/code"], ANALYSIS, settings)
    assert job["metadata"]["name"] == d.analyze_job_name("mm1", ANALYSIS)
    assert job["metadata"]["ownerReferences"] == merge["metadata"]["ownerReferences"]
    assert job["metadata"]["labels"][d.LABEL_COMPONENT] == "analyze" and job["metadata"]["annotations"][d.ANN_ANALYSIS] == ANALYSIS
    pod, mpod = job["spec"]["template"]["spec"], merge["spec"]["template"]["spec"]
    (c,), (mc,) = pod["containers"], mpod["containers"]
    assert c["command"] == ["mergepipe"] and c["args"] == [
        "analyze", "--base", "s3://models/base", "--expert", "s3://models/math", "--expert", "s3://models/code",
        "--catalog", "s3://mergepipe/catalog/", "--json"]
    assert c["securityContext"] == mc["securityContext"] and pod["securityContext"] == mpod["securityContext"]
    for k in ("automountServiceAccountToken", "enableServiceLinks", "restartPolicy", "volumes"):
        assert pod[k] == mpod[k]
    assert c["image"] == mc["image"] and c["volumeMounts"] == mc["volumeMounts"]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}  # never a GPU
    env = {e["name"]: e for e in c["env"]}
    assert env["CUDA_VISIBLE_DEVICES"]["value"] == "" and "MERGEPIPE_PLAN_DIGEST" not in env
    menv = {e["name"]: e for e in mc["env"]}
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION"):
        assert env[k] == menv[k]
    for e in c["env"]:  # credentials never as literal values
        if SECRETISH.search(e["name"]):
            assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    for k in ("backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "podFailurePolicy"):
        assert job["spec"][k] == merge["spec"][k]
    k8s_validate(job)
    with pytest.raises(ValueError, match="catalog"):
        d.build_analyze_job(mm, ["s3://models/math"], ANALYSIS, dataclasses.replace(settings, catalog_uri=None))


# --- events --------------------------------------------------------------------------------------------


def _conds(*items, gen=1):
    out = []
    for typ, status, reason, msg in items:
        out = d.set_condition(out, typ, status, reason, msg, gen, NOW)
    return out


def test_transition_events_one_per_reason_ready_last():
    old = []
    new = _conds(("Analyzed", "True", "Analyzed", "all stats"), ("QuotaAdmitted", "True", "Admitted", "ok"),
                 ("Planned", "True", "Planned", "plan ab"), ("Ready", "False", "JobRunning", "merge Job x created"))
    evs = d.transition_events(old, new)
    assert [(e.type, e.reason) for e in evs] == [("Normal", "Analyzed"), ("Normal", "Admitted"), ("Normal", "Planned"),
                                                  ("Normal", "JobRunning")]
    assert evs[-1].message == "merge Job x created"
    # a message-only update (the running Job's pods) is no Event; Committed is
    running = _conds(("Ready", "False", "JobRunning", "1 active pod"))
    assert d.transition_events(new, d.set_condition(new, "Ready", "False", "JobRunning", "1 active pod", 1, NOW)) == []
    (ev,) = d.transition_events(running, _conds(("Ready", "True", "Committed", "snapshot s1")))
    assert (ev.type, ev.reason, ev.message) == ("Normal", "Committed", "snapshot s1")


@pytest.mark.parametrize("reason", ["QuotaExceeded", "JobFailed", "InvalidSpec", "ManifestHashMismatch"])
def test_transition_events_warn_on_failures(reason):
    old = _conds(("Ready", "False", "Planning", "planning"))
    new = _conds(("QuotaAdmitted", "False", reason, "short"), ("Ready", "False", reason, "the full story"))
    (ev,) = d.transition_events(old, new)  # QuotaAdmitted and Ready say the same: one Event, Ready's message
    assert (ev.type, ev.reason, ev.message) == ("Warning", reason, "the full story")


def test_transition_events_new_generation_same_reason_is_an_event():
    old = _conds(("Ready", "False", "InvalidSpec", "spec.budget: bad"), gen=2)
    new = _conds(("Ready", "False", "InvalidSpec", "spec.fidelity: bad"), gen=3)
    (ev,) = d.transition_events(old, new)
    assert (ev.type, ev.reason, ev.message) == ("Warning", "InvalidSpec", "spec.fidelity: bad")
    assert d.transition_events(new, new) == [] and d.transition_events(None, None) == []
