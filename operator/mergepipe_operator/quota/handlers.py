"""kopf handlers of MergeQuotas."""

from __future__ import annotations

from typing import Any

import kopf

from ..k8s.api import QUOTAS
from ..kopfglue import Bound
from ..reconcile import Retry
from .controller import QuotaLedger

#: the MergeQuota ledger (bound by :mod:`mergepipe_operator.main`)
quotas: Bound[QuotaLedger] = Bound("MergeQuota ledger")


@kopf.on.resume(*QUOTAS)
@kopf.on.create(*QUOTAS)
@kopf.on.update(*QUOTAS, field="spec")
@kopf.timer(*QUOTAS, interval=300, initial_delay=60)
def quota_changed(body: kopf.Body, **_: Any) -> None:
    try:
        quotas().refresh_quota(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None


@kopf.on.delete(*QUOTAS, optional=True)
def quota_deleted(body: kopf.Body, **_: Any) -> None:
    """No finalizer (optional): when seen, drop the deleted quota's gauge samples."""
    QuotaLedger.forget_quota(body["metadata"]["namespace"], body["metadata"]["name"])
