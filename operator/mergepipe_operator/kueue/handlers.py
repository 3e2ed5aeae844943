"""kopf handlers of the io-budget AdmissionCheck controller (registered by
:mod:`mergepipe_operator.main` only when ``MERGEPIPE_KUEUE_ADMISSION_CHECK`` is true: the chart's
``kueue.admissionCheck.enabled``, which also grants the RBAC on Kueue's objects)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf

from ..k8s.api import JOBS
from ..k8s.names import LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGER
from ..kopfglue import Bound
from ..reconcile import Retry
from .controller import IOBudgetCheck
from .decisions import ADMISSION_CHECKS, WORKLOADS, owner_job

log = logging.getLogger("mergepipe.operator")

#: the io-budget AdmissionCheck controller (bound by :mod:`mergepipe_operator.main`)
checks: Bound[IOBudgetCheck] = Bound("Kueue io-budget check")
#: what to call with a merge Job whose Workload changed (bound by :mod:`mergepipe_operator.main`
#: to the ModelMerge handlers' resync: the merge's Queued message follows its Workload)
merge_job_changed: Bound[Callable[[dict[str, Any]], None]] = Bound("ModelMerge resync")


@kopf.on.resume(*ADMISSION_CHECKS)
@kopf.on.create(*ADMISSION_CHECKS)
@kopf.on.update(*ADMISSION_CHECKS)
def admission_check_changed(body: kopf.Body, **_: Any) -> None:
    """Our AdmissionChecks are Active (Kueue only admits through active checks)."""
    if not checks().settings.kueue_admission_check:
        return
    try:
        checks().activate_check(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None


@kopf.on.event(*WORKLOADS)
def workload_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    """Kueue reserved quota for a Workload (or requeued it after a Retry): decide our checks.
    Writes nothing on Workloads without a Pending check of ours."""
    if event.get("type") == "DELETED":
        return
    c = checks()
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
    merge_job_changed()(job)
