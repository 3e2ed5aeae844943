"""kopf handlers of ModelMerges and their merge Jobs (thin: the work is in
:class:`~mergepipe_operator.modelmerge.controller.MergeReconciler`)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from ..k8s.api import JOBS, MERGES
from ..k8s.conditions import Reason, get_condition
from ..k8s.names import ANN_MERGE, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGER
from ..kopfglue import Bound, post_events, run
from ..reconcile import Retry
from .controller import MergeReconciler

log = logging.getLogger("mergepipe.operator")

#: the ModelMerge reconciler (bound by :mod:`mergepipe_operator.main`)
merges: Bound[MergeReconciler] = Bound("ModelMerge reconciler")


@kopf.on.resume(*MERGES)
@kopf.on.create(*MERGES)
@kopf.on.update(*MERGES, field="spec")
def merge_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    run(lambda: merges().reconcile_merge(dict(body)), patch, body)


@kopf.on.delete(*MERGES)
def merge_deleted(body: kopf.Body, **_: Any) -> None:
    try:
        merges().finalize_merge(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None


def _job_running(status: kopf.Status, **_: Any) -> bool:
    ready = get_condition(status.get("conditions") if status else None, "Ready")
    return bool(ready and ready.get("reason") in (Reason.JOB_RUNNING, Reason.QUEUED))


@kopf.timer(*MERGES, interval=60, initial_delay=30, when=_job_running)
def merge_job_poll(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Safety net for missed Job events (and for Jobs removed by their TTL)."""
    c = merges()
    st = body.get("status") or {}
    job = c.kube.get(JOBS, body["metadata"]["namespace"], st.get("jobName", "")) if st.get("jobName") else None
    run(lambda: c.sync_job(dict(body), job), patch, body)


@kopf.on.event(*JOBS, labels={LABEL_MANAGED_BY: MANAGER})
def job_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    if event.get("type") == "DELETED":
        return
    if (body["metadata"].get("labels") or {}).get(LABEL_COMPONENT) in ("analyze", "search"):
        return  # the merge's handler polls its analyze Job (kopf cannot wake a delayed handler); search: below
    resync_merge(dict(body))


def resync_merge(job: dict[str, Any]) -> None:
    """Bring the ModelMerge that owns merge Job ``job`` (annotation ``ANN_MERGE``) up to date with
    it, patching its status and posting its Events; no owner (gone, replayed event): nothing. A
    :class:`Retry` is logged and left to the merge's timer. Also called when a merge Job's Kueue
    Workload changes (the Queued message names why Kueue holds it)."""
    c = merges()
    ns = job["metadata"]["namespace"]
    mm_name = (job["metadata"].get("annotations") or {}).get(ANN_MERGE)
    mm = c.kube.get(MERGES, ns, mm_name) if mm_name else None
    if mm is None or not mm_name:
        return  # owner gone (replayed event)
    try:
        result = c.sync_job(mm, job)
    except Retry as e:
        log.info("job %s/%s: %s", ns, job["metadata"]["name"], e)  # the timer retries
        return
    if result:
        c.kube.patch_status(MERGES, ns, mm_name, result)
        post_events(mm, mm.get("status"), result)
