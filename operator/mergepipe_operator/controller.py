"""The operator's controller: the per-resource reconcilers composed over one set of injected I/O,
and the process-wide instance :mod:`mergepipe_operator.main` binds the kopf handlers to (the glue
to kopf is :mod:`mergepipe_operator.kopfglue`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from typing import Any

from .k8s.api import Kube
from .kueue.controller import IOBudgetCheck
from .modelmerge.committing import commit_parts
from .modelmerge.controller import MergeReconciler
from .modelmerge.planning import PlanSummary, plan_merge
from .objectstore import ObjectStore
from .quota.controller import QuotaLedger
from .reconcile import Services, utcnow
from .search.controller import SearchReconciler
from .settings import Settings
from .snapshot.controller import SnapshotVerifier


class Controller:
    """The operator's reconcilers of all four resources (ModelMerge, MergedSnapshot, MergeQuota,
    MergeSearch) and the Kueue io-budget check, composed over one set of injected I/O (tests pass
    fakes): the composition root. Each reconciler is given the services it uses in its
    constructor; none inherits from another.

    Args:
        settings: the operator's configuration.
        kube: the Kubernetes API adapter (:class:`~mergepipe_operator.k8s.api.Kube` or a fake).
        store: object storage for plans and manifests (``None``: none configured).
        planner: plans a merge; default :func:`~mergepipe_operator.modelmerge.planning.plan_merge`
            over :meth:`core_storage`.
        committer: commits a partitioned merge's parts; default
            :func:`~mergepipe_operator.modelmerge.committing.commit_parts` over :meth:`core_storage`.
        clock: the current time (timezone-aware).

    Attributes:
        io: the shared I/O (:class:`~mergepipe_operator.reconcile.Services`).
        quotas: :class:`~mergepipe_operator.quota.controller.QuotaLedger` (MergeQuotas).
        snapshots: :class:`~mergepipe_operator.snapshot.controller.SnapshotVerifier` (MergedSnapshots).
        kueue: :class:`~mergepipe_operator.kueue.controller.IOBudgetCheck` (Workloads, AdmissionChecks).
        merges: :class:`~mergepipe_operator.modelmerge.controller.MergeReconciler` (ModelMerges).
        searches: :class:`~mergepipe_operator.search.controller.SearchReconciler` (MergeSearches).
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
        self.io = Services(settings, kube, store, clock)
        self._core_storage: Any = None
        self.quotas = QuotaLedger(self.io)
        self.snapshots = SnapshotVerifier(self.io)
        self.kueue = IOBudgetCheck(self.io, self.quotas)
        self.merges = MergeReconciler(
            self.io,
            ledger=self.quotas,
            kueue=self.kueue,
            verifier=self.snapshots,
            planner=planner or (lambda spec, catalog: plan_merge(spec, catalog, storage=self.core_storage())),
            committer=committer
            or (lambda plan_uri, out_uri, n: commit_parts(self.core_storage(), plan_uri, out_uri, n)),
        )
        self.searches = SearchReconciler(self.io)

    @property
    def settings(self) -> Settings:
        return self.io.settings

    @property
    def kube(self) -> Kube:
        return self.io.kube

    @property
    def store(self) -> ObjectStore | None:
        return self.io.store

    def core_storage(self) -> Any:
        """The core's storage that planning reads shard headers and catalog objects through: the
        object store's own (one S3 client and connection pool for everything), else one created
        once with the configured endpoint."""
        shared = getattr(self.io.store, "storage", None)
        if shared is not None:
            return shared
        if self._core_storage is None:
            self._core_storage = ObjectStore(endpoint=self.io.settings.s3_endpoint).storage
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
