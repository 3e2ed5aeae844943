"""The operator's controller: the per-resource reconcilers combined over one set of injected I/O,
the process-wide instance the kopf handlers use, and the glue from a reconciler's outcome to
kopf (status patch, Events, retries)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from datetime import datetime
from typing import Any

import kopf

from .k8s.api import Kube
from .k8s.conditions import transition_events
from .modelmerge.committing import commit_parts
from .modelmerge.controller import MergeReconciler
from .modelmerge.planning import PlanSummary, plan_merge
from .objectstore import ObjectStore
from .reconcile import Retry, RetryWithStatus, utcnow
from .search.controller import SearchReconciler
from .settings import Settings


class Controller(MergeReconciler, SearchReconciler):
    """The operator's reconciliation of all four resources (ModelMerge, MergedSnapshot,
    MergeQuota, MergeSearch), with its I/O injected (tests pass fakes).

    Args:
        settings: the operator's configuration.
        kube: the Kubernetes API adapter (:class:`~mergepipe_operator.k8s.api.Kube` or a fake).
        store: object storage for plans and manifests (``None``: none configured).
        planner: plans a merge; default :func:`~mergepipe_operator.modelmerge.planning.plan_merge`
            over :meth:`core_storage`.
        committer: commits a partitioned merge's parts; default
            :func:`~mergepipe_operator.modelmerge.committing.commit_parts` over :meth:`core_storage`.
        clock: the current time (timezone-aware).
    """

    def __init__(
        self,
        settings: Settings,
        kube: Kube,
        store: ObjectStore | None,
        planner: Callable[[dict[str, Any], str | None], PlanSummary] | None = None,
        clock: Callable[[], datetime] = utcnow,
        committer: Callable[[str, str, int], str] | None = None,
    ):
        self.settings = settings
        self.kube = kube
        self.store = store
        self.planner = planner or (lambda spec, catalog: plan_merge(spec, catalog, storage=self.core_storage()))
        self.committer = committer or (
            lambda plan_uri, out_uri, n: commit_parts(self.core_storage(), plan_uri, out_uri, n)
        )
        self.clock = clock
        self._core_storage: Any = None

    def core_storage(self) -> Any:
        """The core's storage that planning reads shard headers and catalog objects through: the
        object store's own (one S3 client and connection pool for everything), else one created
        once with the configured endpoint."""
        shared = getattr(self.store, "storage", None)
        if shared is not None:
            return shared
        if self._core_storage is None:
            self._core_storage = ObjectStore(endpoint=self.settings.s3_endpoint).storage
        return self._core_storage


_controller: Controller | None = None


def controller() -> Controller:
    """The process-wide controller, created on first use from the environment
    (:meth:`Settings.from_env`, in-cluster or kubeconfig credentials)."""
    global _controller
    if _controller is None:
        settings = Settings.from_env()
        if settings.s3_region:  # the core's S3 client takes the region from the environment
            os.environ.setdefault("AWS_REGION", settings.s3_region)
            os.environ.setdefault("AWS_DEFAULT_REGION", settings.s3_region)
        Kube.load_config()
        _controller = Controller(settings, Kube(), ObjectStore(endpoint=settings.s3_endpoint))
    return _controller


def post_events(obj: Any, old_status: dict[str, Any] | None, new_status: dict[str, Any] | None) -> None:
    """Post a Kubernetes Event on ``obj`` for each condition transition between the two statuses
    (:func:`~mergepipe_operator.k8s.conditions.transition_events`), through kopf's event poster
    (never blocks)."""
    if not new_status or "conditions" not in new_status:
        return
    for ev in transition_events((old_status or {}).get("conditions"), new_status["conditions"]):
        kopf.event(obj, type=ev.type, reason=ev.reason, message=ev.message)


def run(fn: Callable[[], dict[str, Any] | None], patch: kopf.Patch, body: kopf.Body) -> None:
    """Run one reconciliation for a kopf handler: patch the status it returns (and post its
    Events); :class:`RetryWithStatus` patches first, then both retries become
    ``kopf.TemporaryError`` with their delay."""
    old = copy.deepcopy(dict(body.get("status") or {}))
    try:
        result = fn()
    except RetryWithStatus as e:
        patch.status.update(e.status)
        post_events(body, old, e.status)
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    if result:
        patch.status.update(result)
        post_events(body, old, result)
