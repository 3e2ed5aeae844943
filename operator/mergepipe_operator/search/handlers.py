"""kopf handlers of MergeSearches and their driver Jobs (thin: the work is in
:class:`~mergepipe_operator.search.controller.SearchReconciler`)."""

from __future__ import annotations

import os
from typing import Any

import kopf

from ..k8s.api import JOBS, SEARCHES
from ..k8s.conditions import get_condition
from ..k8s.names import LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGER
from ..kopfglue import Bound, post_events, run
from ..settings import Settings
from .controller import SearchReconciler
from .decisions import ANN_SEARCH, SearchReason, job_generation

#: the MergeSearch reconciler (bound by :mod:`mergepipe_operator.main`)
searches: Bound[SearchReconciler] = Bound("MergeSearch reconciler")


@kopf.on.resume(*SEARCHES)
@kopf.on.create(*SEARCHES)
@kopf.on.update(*SEARCHES, field="spec")
def search_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    run(lambda: searches().reconcile_search(dict(body)), patch, body)


def _searching(status: kopf.Status, **_: Any) -> bool:
    ready = get_condition(status.get("conditions") if status else None, "Ready")
    return bool(ready and ready.get("reason") in (SearchReason.SEARCHING, SearchReason.QUEUED))


#: Seconds between reads of a running search's results (MERGEPIPE_SEARCH_POLL_SECONDS, read when
#: the operator starts; kopf fixes a timer's interval when the handler is registered).
SEARCH_POLL_SECONDS = float(os.environ.get("MERGEPIPE_SEARCH_POLL_SECONDS") or Settings.search_poll_seconds)


@kopf.timer(*SEARCHES, interval=SEARCH_POLL_SECONDS, initial_delay=SEARCH_POLL_SECONDS, when=_searching)
def search_poll(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Mirror the running search's results (the driver rewrites them after every candidate)."""
    run(lambda: searches().sync_search(dict(body)), patch, body)


@kopf.on.event(*JOBS, labels={LABEL_MANAGED_BY: MANAGER, LABEL_COMPONENT: "search"})
def search_job_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    """The driver Job changed (started, completed, failed): mirror at once."""
    if event.get("type") == "DELETED":
        return
    c = searches()
    ns = body["metadata"]["namespace"]
    name = (body["metadata"].get("annotations") or {}).get(ANN_SEARCH)
    ms = c.kube.get(SEARCHES, ns, name) if name else None
    gen = (ms or {}).get("metadata", {}).get("generation")
    if (
        ms is None
        or not name
        or job_generation(body) != gen
        or (ms.get("status") or {}).get("observedGeneration") != gen
    ):
        return  # owner gone, an earlier generation's driver, or the search handler has not written its status yet
    result = c.sync_search(ms, dict(body))
    if result:
        c.kube.patch_status(SEARCHES, ns, name, result)
        post_events(ms, ms.get("status"), result)
