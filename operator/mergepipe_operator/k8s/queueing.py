"""The Job side of Kueue (v0.19), which every resource's Jobs share: a Job joins a LocalQueue
through the label :data:`QUEUE_LABEL`; Kueue's webhook creates it suspended and unsuspends it
when it admits the Job's Workload. The operator only labels (:func:`queue_labels`) and reports a
suspended Job as queued (:func:`queued_message`); it never unsuspends a Job. The AdmissionCheck
controller (Kueue's Workloads) is :mod:`mergepipe_operator.kueue`.

Source: Kueue's ``constants.QueueLabel`` and its Job integration
(https://kueue.sigs.k8s.io/docs/tasks/run/jobs/).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .conditions import get_condition

#: The label that puts a Job in a LocalQueue (Kueue's ``constants.QueueLabel``).
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def queue_name(spec: Mapping[str, Any] | None, default: str | None) -> str | None:
    """The LocalQueue of a ModelMerge's or MergeSearch's Jobs: ``spec.queueName``, else the
    operator's default (chart value ``kueue.queueName``), else none (no Kueue label)."""
    q = (spec or {}).get("queueName") or default
    return str(q) if q else None


def queue_labels(queue: str | None) -> dict[str, str]:
    """Labels that put a Job in ``queue`` (none without a queue)."""
    return {QUEUE_LABEL: queue} if queue else {}


def job_queue(job: Mapping[str, Any] | None) -> str | None:
    """The LocalQueue a Job is labelled for, or ``None``."""
    return ((job or {}).get("metadata", {}).get("labels") or {}).get(QUEUE_LABEL)


def job_suspended(job: Mapping[str, Any] | None) -> bool:
    """Is the Job held suspended (``spec.suspend``) and not finished?"""
    if not job or not (job.get("spec") or {}).get("suspend"):
        return False
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return False
    return True


def queued_message(what: str, job: Mapping[str, Any], workload: Mapping[str, Any] | None = None) -> str:
    """Ready's message while Kueue holds ``job`` suspended: names the Job, its LocalQueue and, if
    known, why its Workload waits (Kueue's QuotaReserved/Admitted condition messages, and the
    admission checks that are not Ready)."""
    name = job["metadata"]["name"]
    queue = job_queue(job)
    msg = (
        f"{what} {name} is queued in LocalQueue {queue} (suspended until Kueue admits it)"
        if queue
        else (f"{what} {name} is suspended (not started until it is unsuspended)")
    )
    if workload:
        st = workload.get("status") or {}
        reserved = get_condition(st.get("conditions"), "QuotaReserved")
        if reserved and reserved.get("status") != "True" and reserved.get("message"):
            msg += f"; Kueue: {reserved['message']}"
        waiting = [
            f"{c.get('name')} {c.get('state')}" + (f" ({c['message']})" if c.get("message") else "")
            for c in st.get("admissionChecks") or []
            if c.get("state") != "Ready" and (c.get("message") or (reserved and reserved.get("status") == "True"))
        ]
        if waiting:
            msg += "; admission checks: " + "; ".join(waiting)
    return msg
