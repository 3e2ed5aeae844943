"""The operator's entry point: kopf settings and every resource's handlers.

Run: ``kopf run --standalone -m mergepipe_operator.main --all-namespaces`` (the chart does; with
``replicas > 1`` it runs ``--peering=<release>`` instead, see :func:`peering_priority`).

Layout (by resource; each has pure ``decisions`` unit-tested without a cluster, a reconciler
with its I/O injected, and thin kopf ``handlers``):

- :mod:`.modelmerge`: ModelMerge (spec validation, planning in-process, the merge/analyze Jobs);
- :mod:`.snapshot`: MergedSnapshot (manifest verification);
- :mod:`.quota`: MergeQuota (the reservation ledger);
- :mod:`.search`: MergeSearch (the driver Job, results mirrored into the status);
- :mod:`.kueue`: Kueue (queue labels, Queued Jobs; the io-budget AdmissionCheck controller, its
  handlers registered when ``MERGEPIPE_KUEUE_ADMISSION_CHECK`` is true);
- :mod:`.k8s`: shared helpers (API adapter, the shared model parts, conditions, names, Kueue's
  Job label, Job templates), importing no resource; :mod:`.quantities`: the one byte grammar;
- :mod:`.controller`: the reconcilers composed (each given the services it uses);
  :mod:`.kopfglue`: the glue to kopf. This module binds each resource's handlers to its
  reconciler in the process-wide controller (so no resource imports the controller).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import kopf

from .controller import Controller, controller
from .k8s.names import FINALIZER
from .kopfglue import run
from .modelmerge import handlers as _modelmerge_handlers  # (importing registers the handlers)
from .modelmerge.planning import PlanInputError, PlanSummary, plan_merge
from .quota import handlers as _quota_handlers
from .reconcile import Retry, RetryWithStatus
from .search import handlers as _search_handlers
from .settings import Settings
from .snapshot import handlers as _snapshot_handlers

_modelmerge_handlers.merges.bind(lambda: controller().merges)
_snapshot_handlers.snapshots.bind(lambda: controller().snapshots)
_quota_handlers.quotas.bind(lambda: controller().quotas)
_search_handlers.searches.bind(lambda: controller().searches)


def serve_kueue_admission_check() -> None:
    """Register the Kueue handlers (AdmissionChecks, Workloads) and bind them to the process-wide
    controller's io-budget check; a merge Job's Workload change resyncs its ModelMerge. Done at
    import when ``MERGEPIPE_KUEUE_ADMISSION_CHECK`` is true (the chart grants the RBAC on Kueue's
    objects then)."""
    from .kueue import handlers as kueue_handlers

    kueue_handlers.checks.bind(lambda: controller().kueue)
    kueue_handlers.merge_job_changed.bind(lambda: _modelmerge_handlers.resync_merge)


if Settings.from_env().kueue_admission_check:
    serve_kueue_admission_check()

__all__ = ["Controller", "PlanInputError", "PlanSummary", "Retry", "RetryWithStatus", "controller", "plan_merge", "run"]


def peering_priority() -> int:
    """A random kopf peering priority in [1, 2**31) for this replica (chart ``replicas > 1``:
    ``kopf run --peering``). Peering is not leader election: replicas of equal priority would all
    pause, so each takes its own, and only the highest acts. Correctness does not rest on it
    either: Job names are deterministic (a second create gets 409) and quota writes are
    conditioned on the resourceVersion, so an overlap creates no second Job and charges nothing
    twice."""
    return random.SystemRandom().randrange(1, 2**31)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="mergepipe.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="mergepipe.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    if not settings.peering.standalone and settings.peering.priority == 0:
        settings.peering.priority = peering_priority()
    c = controller()
    if c.settings.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(c.settings.metrics_port, addr=c.settings.metrics_bind_address)
