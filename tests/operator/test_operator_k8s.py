"""Shared Kubernetes helpers: units, conditions and their Events, label values, Job outcomes."""

from __future__ import annotations

from datetime import timedelta

import pytest
from op_testlib import NOW

from mergepipe_operator import quantities as qty
from mergepipe_operator.k8s import conditions as cond, jobs as kjobs, names

GI = 1024**3

# --- quantities ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 1024**2),
        ("512Mi", 512 * 1024**2),
        ("10Gi", 10 * GI),
        ("10GiB", 10 * GI),
        ("1G", 10**9),
        ("1GB", 10**9),
        ("1k", 1000),
        ("1K", 1000),
        ("1kB", 1000),
        ("1KiB", 1024),
        ("1.5Gi", 3 * GI // 2),
        ("1.5TB", 15 * 10**11),
        ("2E", 2 * 10**18),
        ("1Ei", 2**60),
        ("7B", 7),
        ("0.5Ki", 512),
    ],
)
def test_parse_quantity(value, expected):
    assert qty.parse_quantity(value) == expected


@pytest.mark.parametrize(
    "value, needle",
    [
        ("10 GB", "contains spaces"),
        (" 10Gi", "contains spaces"),
        ("-1Gi", "negative"),
        (-5, "negative"),
        ("1gb", "case-sensitive"),
        ("10mb", "milli"),
        ("10Gib", "unknown unit"),
        ("1e9", "exponent notation"),
        ("Gi", "not a byte quantity"),
        ("", "not a byte quantity"),
        ("1.5", "whole number"),
        ("0.1Ki", "whole number"),
        (1.5, "floating-point"),
        (True, "got True"),
        (None, "got None"),
        ([1], "list"),
    ],
)
def test_parse_quantity_errors_name_the_field_and_fix(value, needle):
    with pytest.raises(qty.QuantityError) as e:
        qty.parse_quantity(value, field="spec.budget")
    assert str(e.value).startswith("spec.budget: ") and needle in str(e.value), str(e.value)


def test_human_bytes():
    assert qty.human_bytes(None) is None
    assert qty.human_bytes(512) == "512B"
    assert qty.human_bytes(10 * GI) == "10Gi"
    assert qty.human_bytes(3412345678) == "3.18Gi"
    assert qty.human_bytes(1536 * 1024**2) == "1.5Gi"
    for n in (1024, 5 * 1024**2, 10 * GI, 2**60):
        assert qty.parse_quantity(qty.human_bytes(n)) == n


def test_parse_duration():
    assert qty.parse_duration("24h") == timedelta(hours=24)
    assert qty.parse_duration("1h30m") == timedelta(minutes=90)
    assert qty.parse_duration("7d") == qty.parse_duration("1w")
    for bad in ("", "24", "1.5h", "h", "0s", "24H", 24):
        with pytest.raises(qty.QuantityError):
            qty.parse_duration(bad)


# --- conditions ------------------------------------------------------------------------------------


def test_set_condition_follows_api_conventions():
    t0, t1, t2 = NOW, NOW + timedelta(minutes=1), NOW + timedelta(minutes=2)
    c0 = cond.set_condition(None, "Ready", "False", "Planning", "planning", 1, t0)
    assert c0 == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Planning",
            "message": "planning",
            "lastTransitionTime": "2026-11-22T12:00:00Z",
            "observedGeneration": 1,
        }
    ]
    c1 = cond.set_condition(c0, "Ready", "False", "JobRunning", "running", 2, t1)  # same status
    assert c1[0]["lastTransitionTime"] == "2026-11-22T12:00:00Z"
    assert (c1[0]["reason"], c1[0]["message"], c1[0]["observedGeneration"]) == (
        "JobRunning",
        "running",
        2,
    )
    c2 = cond.set_condition(c1, "Ready", True, "Committed", "done", 2, t2)  # flip
    assert c2[0]["status"] == "True" and c2[0]["lastTransitionTime"] == "2026-11-22T12:02:00Z"
    c3 = cond.set_condition(c2, "QuotaAdmitted", "True", "Admitted", "", 2, t2)
    assert [c["type"] for c in c3] == ["Ready", "QuotaAdmitted"]
    assert c0[0]["reason"] == "Planning"  # inputs untouched
    assert cond.get_condition(c3, "Ready")["reason"] == "Committed" and cond.get_condition(c3, "Nope") is None
    assert cond.condition_current(c3[0], 2) and not cond.condition_current(c3[0], 3)
    with pytest.raises(ValueError):
        cond.set_condition([], "Ready", "Maybe", "X", "", 1, t0)
    for bad in ("", "job running", "1Bad"):
        with pytest.raises(ValueError):
            cond.set_condition([], "Ready", "True", bad, "", 1, t0)


def test_label_value():
    assert names.label_value("mm1") == "mm1"
    long = names.label_value("a" * 200)
    assert len(long) <= 63 and long != names.label_value("a" * 201)


def test_job_outcome():
    assert kjobs.job_outcome({"status": {"active": 1}}).state == "Running"
    assert (
        kjobs.job_outcome({"status": {"conditions": [{"type": "SuccessCriteriaMet", "status": "True"}]}}).state
        == "Running"
    )
    ok = kjobs.job_outcome({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})
    assert ok.state == "Succeeded"
    bad = kjobs.job_outcome(
        {
            "status": {
                "conditions": [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": "Job has reached the specified backoff limit",
                    }
                ]
            }
        }
    )
    assert (bad.state, bad.reason) == (
        "Failed",
        "BackoffLimitExceeded",
    ) and "backoff" in bad.message
    assert kjobs.job_outcome(None) == kjobs.JobOutcome("Failed", "JobMissing", "the merge Job no longer exists")


# --- events --------------------------------------------------------------------------------------------


def _conds(*items, gen=1):
    out = []
    for typ, status, reason, msg in items:
        out = cond.set_condition(out, typ, status, reason, msg, gen, NOW)
    return out


def test_transition_events_one_per_reason_ready_last():
    old = []
    new = _conds(
        ("Analyzed", "True", "Analyzed", "all stats"),
        ("QuotaAdmitted", "True", "Admitted", "ok"),
        ("Planned", "True", "Planned", "plan ab"),
        ("Ready", "False", "JobRunning", "merge Job x created"),
    )
    evs = cond.transition_events(old, new)
    assert [(e.type, e.reason) for e in evs] == [
        ("Normal", "Analyzed"),
        ("Normal", "Admitted"),
        ("Normal", "Planned"),
        ("Normal", "JobRunning"),
    ]
    assert evs[-1].message == "merge Job x created"
    # a message-only update (the running Job's pods) is no Event; Committed is
    running = _conds(("Ready", "False", "JobRunning", "1 active pod"))
    assert (
        cond.transition_events(
            new,
            cond.set_condition(new, "Ready", "False", "JobRunning", "1 active pod", 1, NOW),
        )
        == []
    )
    (ev,) = cond.transition_events(running, _conds(("Ready", "True", "Committed", "snapshot s1")))
    assert (ev.type, ev.reason, ev.message) == ("Normal", "Committed", "snapshot s1")


@pytest.mark.parametrize("reason", ["QuotaExceeded", "JobFailed", "InvalidSpec", "ManifestHashMismatch"])
def test_transition_events_warn_on_failures(reason):
    old = _conds(("Ready", "False", "Planning", "planning"))
    new = _conds(
        ("QuotaAdmitted", "False", reason, "short"),
        ("Ready", "False", reason, "the full story"),
    )
    (ev,) = cond.transition_events(old, new)  # QuotaAdmitted and Ready say the same: one Event, Ready's message
    assert (ev.type, ev.reason, ev.message) == ("Warning", reason, "the full story")


def test_transition_events_new_generation_same_reason_is_an_event():
    old = _conds(("Ready", "False", "InvalidSpec", "spec.budget: bad"), gen=2)
    new = _conds(("Ready", "False", "InvalidSpec", "spec.fidelity: bad"), gen=3)
    (ev,) = cond.transition_events(old, new)
    assert (ev.type, ev.reason, ev.message) == (
        "Warning",
        "InvalidSpec",
        "spec.fidelity: bad",
    )
    assert cond.transition_events(new, new) == [] and cond.transition_events(None, None) == []


# --- pod failure causes --------------------------------------------------------------------------


def _pod(*statuses):
    return {"metadata": {"name": "p"}, "status": {"containerStatuses": list(statuses)}}


def _term(code, message=None, reason="Error", at="2026-11-22T12:00:00Z", last=False):
    t = {"exitCode": code, "reason": reason, "finishedAt": at}
    if message is not None:
        t["message"] = message
    return {"name": "merge", "lastState" if last else "state": {"terminated": t}}


def test_pod_failure_message_is_the_latest_failed_containers_last_line():
    assert kjobs.pod_failure_message([]) is None
    assert kjobs.pod_failure_message([_pod(_term(0, "fine"))]) is None  # nothing failed
    assert kjobs.pod_failure_message([_pod({"name": "merge", "state": {"running": {}}})]) is None
    one = "error: s3://m/e/model-00001.safetensors: missing; it was present when the plan was made. Restore it or re-plan.\n"
    assert kjobs.pod_failure_message([_pod(_term(2, one))]) == one.strip()
    # FallbackToLogsOnError: a log tail; the last non-empty line is the exception
    tail = "Traceback (most recent call last):\n  File x\nMemoryError: cannot allocate\n\n"
    assert kjobs.pod_failure_message([_pod(_term(1, tail))]) == "MemoryError: cannot allocate"
    # no message: the kubelet's reason and the exit code
    assert kjobs.pod_failure_message([_pod(_term(137, reason="OOMKilled"))]) == "OOMKilled (exit code 137)"
    # several attempts (pods): the latest; a restarted container's lastState counts too
    early, late = _term(1, "first", at="2026-11-22T11:00:00Z"), _term(2, "second", at="2026-11-22T12:30:00Z", last=True)
    assert kjobs.pod_failure_message([_pod(late), _pod(early)]) == "second"
    assert len(kjobs.pod_failure_message([_pod(_term(1, "x" * 5000))])) == kjobs.MAX_CAUSE_CHARS


def test_with_cause_puts_the_cause_first_only_for_failures():
    failed = kjobs.JobOutcome("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    assert (
        kjobs.with_cause(failed, "error: boom").message == "error: boom (Job has reached the specified backoff limit)"
    )
    assert kjobs.with_cause(failed, None) == failed
    running = kjobs.JobOutcome("Running", "JobRunning", "merge Job running (1 active pod(s))")
    assert kjobs.with_cause(running, "error: boom") == running
