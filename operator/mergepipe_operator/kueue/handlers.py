"""kopf handlers of the io-budget AdmissionCheck controller (registered by
:mod:`mergepipe_operator.main` only when ``MERGEPIPE_KUEUE_ADMISSION_CHECK`` is true: the chart's
``kueue.admissionCheck.enabled``, which also grants the RBAC on Kueue's objects)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from ..controller import controller, post_events
from ..k8s.api import JOBS, MERGES
from ..k8s.names import ANN_MERGE, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGER
from ..reconcile import Retry
from .decisions import ADMISSION_CHECKS, WORKLOADS, owner_job

log = logging.getLogger("mergepipe.operator")


@kopf.on.resume(*ADMISSION_CHECKS)
@kopf.on.create(*ADMISSION_CHECKS)
@kopf.on.update(*ADMISSION_CHECKS)
def admission_check_changed(body: kopf.Body, **_: Any) -> None:
    """Our AdmissionChecks are Active (Kueue only admits through active checks)."""
    if not controller().settings.kueue_admission_check:
        return
    try:
        controller().activate_check(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None


@kopf.on.event(*WORKLOADS)
def workload_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    """Kueue reserved quota for a Workload (or requeued it after a Retry): decide our checks.
    Writes nothing on Workloads without a Pending check of ours."""
    if event.get("type") == "DELETED":
        return
    c = controller()
    if not c.settings.kueue_admission_check:
        return
    wl = dict(body)
    ns = wl["metadata"].get("namespace")
    try:
        c.check_workload(wl)
    except Retry as e:
        log.info("Workload %s/%s: %s (the next event retries)", ns, wl["metadata"].get("name"), e)
    # the merge's Queued message follows its Workload (why Kueue holds the Job)
    jname = owner_job(wl)
    job = c.kube.get(JOBS, ns, jname) if jname else None
    labels = ((job or {}).get("metadata") or {}).get("labels") or {}
    if job is None or labels.get(LABEL_MANAGED_BY) != MANAGER or labels.get(LABEL_COMPONENT, "merge") != "merge":
        return
    mm_name = (job["metadata"].get("annotations") or {}).get(ANN_MERGE)
    mm = c.kube.get(MERGES, ns, mm_name) if mm_name else None
    if mm is None or not mm_name:
        return
    try:
        result = c.sync_job(mm, job)
    except Retry:
        return
    if result:
        c.kube.patch_status(MERGES, ns, mm_name, result)
        post_events(mm, mm.get("status"), result)
