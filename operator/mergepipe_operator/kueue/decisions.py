"""Kueue (v0.19, ``kueue.x-k8s.io/v1beta2``): what the operator reads from Kueue's objects and
writes into them, as pure functions.

- A Job joins a LocalQueue through the label :data:`QUEUE_LABEL`; Kueue's webhook creates it
  suspended and Kueue unsuspends it when it admits the Job's Workload. The operator only labels
  (:func:`queue_labels`) and reports a suspended Job as queued (:func:`queued_message`); it never
  unsuspends a Job.
- MergeQuota as an AdmissionCheck: a ClusterQueue lists AdmissionChecks (``spec.
  admissionChecksStrategy.admissionChecks[].name``; v1beta1 also ``spec.admissionChecks``); an
  AdmissionCheck whose ``spec.controllerName`` is :data:`CONTROLLER_NAME` is this operator's. Kueue
  adds a ``Pending`` entry per check to a Workload's ``status.admissionChecks`` and admits the
  Workload once it has reserved quota and every check is ``Ready``. For a merge Job's Workload the
  operator reserves the plan's expert bytes in the namespace's MergeQuotas (the same ledger as
  without Kueue) and sets the check ``Ready``; when they do not cover it, ``Retry`` (Kueue releases
  its quota reservation and requeues the Workload after ``requeueAfterSeconds``), or ``Rejected``
  when no amount of waiting could cover it (a plan above a quota's hard limit). Workloads of other
  Jobs (analysis, search, evaluation, or not mergepipe's at all) read no expert bytes: ``Ready``.

Sources: Kueue's API (``apis/kueue/v1beta2``: ``workload_types.go`` AdmissionCheckState and
conditions, ``admissioncheck_types.go`` CheckState and the ``Active`` condition,
``clusterqueue_types.go`` AdmissionChecksStrategy) and its admission-check controller docs
(https://kueue.sigs.k8s.io/docs/concepts/admission_check/).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..k8s.conditions import get_condition
from ..k8s.queueing import (  # noqa: F401  (the Job side of Kueue: shared k8s code, named here too)
    QUEUE_LABEL,
    job_queue,
    job_suspended,
    queue_labels,
    queue_name,
    queued_message,
)
from ..quantities import rfc3339

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
WORKLOADS = (GROUP, VERSION, "workloads")
LOCAL_QUEUES = (GROUP, VERSION, "localqueues")
CLUSTER_QUEUES = (GROUP, VERSION, "clusterqueues")
ADMISSION_CHECKS = (GROUP, VERSION, "admissionchecks")

#: ``spec.controllerName`` of the AdmissionChecks this operator serves.
CONTROLLER_NAME = "mergepipe.io/io-budget"

CheckState = Literal["Pending", "Ready", "Retry", "Rejected"]


def cluster_queue_checks(cq: Mapping[str, Any] | None) -> list[str]:
    """Names of the AdmissionChecks a ClusterQueue applies (v1beta2 ``admissionChecksStrategy``;
    v1beta1's ``admissionChecks`` list too)."""
    spec = (cq or {}).get("spec") or {}
    names = [
        str(r.get("name"))
        for r in (spec.get("admissionChecksStrategy") or {}).get("admissionChecks") or []
        if r.get("name")
    ]
    names += [str(n) for n in spec.get("admissionChecks") or [] if n not in names]
    return names


def is_ours(check: Mapping[str, Any] | None) -> bool:
    """Is this AdmissionCheck served by this operator (``spec.controllerName``)?"""
    return ((check or {}).get("spec") or {}).get("controllerName") == CONTROLLER_NAME


def owner_job(workload: Mapping[str, Any]) -> str | None:
    """Name of the batch/v1 Job that owns a Workload (Kueue's job integration creates it so)."""
    for ref in (workload.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Job" and str(ref.get("apiVersion", "")).startswith("batch/"):
            return ref.get("name")
    return None


def pending_checks(workload: Mapping[str, Any], ours: set[str]) -> list[str]:
    """Our checks this Workload waits on now: ``Pending``, after Kueue reserved quota for it
    (Kueue evaluates checks on a quota reservation; before it there is nothing to admit)."""
    st = workload.get("status") or {}
    reserved = get_condition(st.get("conditions"), "QuotaReserved")
    if not reserved or reserved.get("status") != "True":
        return []
    if not (workload.get("spec") or {}).get("active", True):
        return []
    return [c["name"] for c in st.get("admissionChecks") or [] if c.get("name") in ours and c.get("state") == "Pending"]


def with_check_state(
    workload: Mapping[str, Any],
    name: str,
    state: CheckState,
    message: str,
    now: Any,
    requeue_after_seconds: int | None = None,
) -> list[dict[str, Any]]:
    """``status.admissionChecks`` with check ``name`` set to ``state`` (other checks unchanged;
    ``lastTransitionTime`` moves only when the state changes)."""
    out = []
    for c in (workload.get("status") or {}).get("admissionChecks") or []:
        c = dict(c)
        if c.get("name") == name:
            if c.get("state") != state:
                c["lastTransitionTime"] = rfc3339(now)
            c.update(state=state, message=message[:32768])
            if requeue_after_seconds is not None and state == "Retry":
                c["requeueAfterSeconds"] = int(requeue_after_seconds)
            else:
                c.pop("requeueAfterSeconds", None)
        out.append(c)
    return out


def active_condition(check: Mapping[str, Any], now: Any) -> list[dict[str, Any]] | None:
    """The AdmissionCheck's conditions with ``Active=True`` (Kueue keeps a ClusterQueue that uses
    an inactive check inactive); ``None`` when it already says so."""
    conds = [dict(c) for c in (check.get("status") or {}).get("conditions") or []]
    gen = (check.get("metadata") or {}).get("generation")
    cur = get_condition(conds, "Active")
    if cur and cur.get("status") == "True" and cur.get("observedGeneration") == gen:
        return None
    new = {
        "type": "Active",
        "status": "True",
        "reason": "Active",
        "observedGeneration": gen,
        "message": "the mergepipe operator checks merge Jobs' expert-I/O plans against the namespace's MergeQuotas",
        "lastTransitionTime": cur.get("lastTransitionTime") if cur and cur.get("status") == "True" else rfc3339(now),
    }
    return [c for c in conds if c.get("type") != "Active"] + [new]
