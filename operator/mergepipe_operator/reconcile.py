"""What every resource's reconciler shares: the outcomes a reconciliation can end with besides a
status to patch (:class:`Retry`, :class:`RetryWithStatus`, :class:`Done`), the injected I/O
(:class:`Services`: settings, the Kubernetes adapter, object storage, the clock) and the base
(:class:`Reconciler`) that holds them. Reconcilers are composed, not inherited from one another:
one that needs another's work (the merge reconciler needs the quota ledger, the io-budget check
and the snapshot verification) is given it in its constructor
(:class:`~mergepipe_operator.controller.Controller` wires them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .k8s.api import PODS, Kube
from .k8s.jobs import JobOutcome, job_outcome, pod_failure_message, with_cause
from .objectstore import ObjectStore
from .settings import Settings

log = logging.getLogger("mergepipe.operator")


class Retry(Exception):
    """Try again after ``delay`` seconds (mapped to kopf.TemporaryError by the handlers)."""

    def __init__(self, message: str, delay: float):
        super().__init__(message)
        self.delay = delay


class RetryWithStatus(Retry):
    """Retry later, but first write ``status`` (e.g. Ready=False with the reason)."""

    def __init__(self, message: str, delay: float, status: dict[str, Any]):
        super().__init__(message, delay)
        self.status = status


class Done(Exception):
    """This generation's reconciliation ends here with ``status`` (a terminal Ready=False)."""

    def __init__(self, status: dict[str, Any]):
        super().__init__()
        self.status = status


def utcnow() -> datetime:
    """The current time, timezone-aware (UTC): the reconcilers' default clock."""
    return datetime.now(timezone.utc)


@dataclass
class Services:
    """The I/O every reconciler is given (tests pass fakes).

    Attributes:
        settings: the operator's configuration.
        kube: the Kubernetes API adapter (:class:`~mergepipe_operator.k8s.api.Kube` or a fake).
        store: object storage (plans, manifests); ``None`` when none is configured.
        clock: returns the current time (timezone-aware).
    """

    settings: Settings
    kube: Kube
    store: ObjectStore | None
    clock: Callable[[], datetime] = field(default=utcnow)


class Reconciler:
    """Base of the per-resource reconcilers: their injected I/O (:class:`Services`), read through
    ``settings``, ``kube``, ``store`` and ``clock``, and the Job-outcome reading they share.

    Args:
        io: the I/O (shared by every reconciler of one controller, so a test's fake clock or
            store swapped on it is seen by all).
    """

    def __init__(self, io: Services):
        self.io = io

    @property
    def settings(self) -> Settings:
        return self.io.settings

    @property
    def kube(self) -> Kube:
        return self.io.kube

    @property
    def store(self) -> ObjectStore | None:
        return self.io.store

    def clock(self) -> datetime:
        """The current time (timezone-aware), from the injected clock."""
        return self.io.clock()

    def job_outcome(self, job: dict[str, Any] | None, what: str) -> JobOutcome:
        """:func:`~mergepipe_operator.k8s.jobs.job_outcome`; for a failed Job with its pods' cause
        (:func:`~mergepipe_operator.k8s.jobs.pod_failure_message`: the worker's one-line error),
        read from the Job's pods (label ``job-name``). Pods that cannot be listed (gone with the
        Job's TTL, or no RBAC) leave the message as the Job controller wrote it."""
        outcome = job_outcome(job, what)
        if outcome.state != "Failed" or not job:
            return outcome
        meta = job.get("metadata") or {}
        try:
            pods = self.kube.list(PODS, meta.get("namespace", ""), f"job-name={meta.get('name', '')}")
        except Exception as e:  # noqa: BLE001 - the cause is a courtesy; never fail the reconcile on it
            log.warning("cannot read the pods of Job %s/%s: %s", meta.get("namespace"), meta.get("name"), e)
            return outcome
        return with_cause(outcome, pod_failure_message(pods))
