"""The MergeQuota ledger: admission with a reservation written under the quota's resourceVersion,
settling and releasing reservations, and the quota's status (used/hard, rolling window, Ready)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..k8s.api import QUOTAS, Conflict
from ..k8s.conditions import Reason, set_condition
from ..metrics import QUOTA_HARD, QUOTA_USED
from ..quantities import QuantityError, human_bytes
from ..reconcile import Reconciler, Retry
from .decisions import Admission, admit, close, closing, quota_status, release

#: The MergeQuota resources the quota gauges report (the ``resource`` label).
QUOTA_RESOURCES = ("expertReadBytes", "merges")


def _observe_quota(ns: str, name: str, status: dict[str, Any] | None) -> None:
    """Prometheus: a quota's used and hard amounts as written to its status (one sample per
    resource; a limit the quota does not set has no ``mergepipe_quota_hard`` sample)."""
    status = status or {}
    for res in QUOTA_RESOURCES:
        used = (status.get("used") or {}).get(res)
        if used is not None:
            QUOTA_USED.labels(ns, name, res).set(used)
        hard = (status.get("hard") or {}).get(res)
        if hard is not None:
            QUOTA_HARD.labels(ns, name, res).set(hard)
        else:
            _forget(QUOTA_HARD, ns, name, res)


def _forget(metric: Any, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


class QuotaLedger(Reconciler):
    """MergeQuota reads and conditioned writes (every status write carries the resourceVersion it
    was computed from; a lost race re-reads and tries again)."""

    def update_quota(
        self, ns: str, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None], attempts: int = 8
    ) -> bool:
        """Read-modify-write of a quota's status, conditioned on its resourceVersion."""
        for _ in range(attempts):
            q = self.kube.get(QUOTAS, ns, name)
            if q is None:
                return False
            new = change(q)
            if new is None:
                return False
            try:
                self.kube.replace_status(QUOTAS, q, new)
            except Conflict:
                continue
            _observe_quota(ns, name, new)
            return True
        raise Retry(f"MergeQuota {name}: too much contention", 5)

    def reserve(
        self,
        ns: str,
        merge: str,
        key: str,
        requested: int | None,
        now: datetime,
        *,
        clamp: bool = True,
        unclampable: str | None = None,
    ) -> tuple[Admission, list[str]]:
        """Admit under every MergeQuota of ``ns``: the final budget is the smallest any quota
        allows; a reservation for it is written to each quota with its resourceVersion. A lost
        race rolls back this attempt's reservations and starts over, so concurrent merges never
        overspend a quota. With ``clamp=False`` (a Job whose plan is already fixed: the Kueue
        AdmissionCheck) a quota that would clamp the budget refuses instead; ``unclampable``
        (why the merge cannot run under a lowered budget, e.g. a method that reads whole
        tensors) does the same and says why in the refusal."""
        for _ in range(8):
            quotas = self.kube.list(QUOTAS, ns)
            if not quotas:
                return Admission(True, requested, Reason.ADMITTED, "no MergeQuota in the namespace", {}), []
            budget, clamped, messages = requested, False, []
            for q in quotas:  # dry run: the final budget
                try:
                    a = admit(q, budget, now, key=key, merge=merge)
                except QuantityError as e:  # a broken quota blocks (fails closed)
                    return Admission(False, None, Reason.QUOTA_EXCEEDED, f"invalid MergeQuota: {e}", {}), []
                if not a.allowed:
                    return a, []
                if a.clamped and unclampable:
                    qn = q["metadata"]["name"]
                    need = "its full read" if requested is None else human_bytes(requested)
                    return Admission(
                        False,
                        None,
                        Reason.QUOTA_EXCEEDED,
                        f"MergeQuota {qn} (Clamp) would lower the budget to {human_bytes(a.budget or 0)}, "
                        f"but {unclampable}, so it cannot run under a clamped budget: it waits until the "
                        f"quota has {need} of expert reads left (or raise {qn}'s spec.hard.expertReadBytes)",
                        a.new_used,
                    ), []
                if a.clamped and not clamp:
                    return Admission(
                        False,
                        None,
                        Reason.QUOTA_EXCEEDED,
                        f"{a.message}; the planned Job needs {requested} bytes",
                        a.new_used,
                    ), []
                budget, clamped = a.budget, clamped or a.clamped
                messages.append(a.message)
            written: list[str] = []
            lost = False
            for q in quotas:
                a = admit(q, budget, now, key=key, merge=merge)
                if not a.allowed or a.budget != budget:
                    lost = True
                    break
                if a.new_status is not None:
                    try:
                        self.kube.replace_status(QUOTAS, q, a.new_status)
                    except Conflict:
                        lost = True
                        break
                    written.append(q["metadata"]["name"])
                    _observe_quota(ns, q["metadata"]["name"], a.new_status)
            if lost:
                for qn in written:
                    self.update_quota(ns, qn, lambda quota: release(quota, key, now))
                continue
            reason = Reason.CLAMPED if clamped else Reason.ADMITTED
            names = [q["metadata"]["name"] for q in quotas]
            return Admission(True, budget, reason, "; ".join(messages), {}), names
        raise Retry("MergeQuota contention; will retry", 5)

    def unreserve(
        self, ns: str, key: str, quotas: list[str], *, job_started: bool, realized: int | None = None
    ) -> None:
        """End reservation ``key`` in ``quotas`` by the one rule (:func:`~.decisions.closing`):
        released when nothing started, charged ``realized`` when known, else the reservation.

        Raises:
            ValueError: ``realized`` is not an integer >= 0 (nothing is written).
        """
        how = closing(job_started, realized)
        now = self.clock()
        for q in quotas:
            self.update_quota(ns, q, lambda quota: close(quota, key, how, now))

    def refresh_quota(self, body: dict[str, Any]) -> None:
        """Recompute used/hard, age the rolling window, set Ready (conditioned write)."""
        meta = body["metadata"]

        def change(q: dict[str, Any]) -> dict[str, Any] | None:
            now = self.clock()
            gen = q["metadata"].get("generation")
            try:
                new = quota_status(q, now)
                cond = ("True", "Active", "quota enforced")
            except QuantityError as e:
                new = dict(q.get("status") or {})
                cond = ("False", Reason.INVALID_SPEC, str(e))
            new["conditions"] = set_condition(new.get("conditions"), "Ready", *cond, gen, now)
            if new == (q.get("status") or {}):
                _observe_quota(meta["namespace"], meta["name"], new)  # unchanged: a restarted operator still reports it
                return None
            return new

        self.update_quota(meta["namespace"], meta["name"], change)

    @staticmethod
    def forget_quota(ns: str, name: str) -> None:
        """The quota is gone: drop its gauge samples."""
        for res in QUOTA_RESOURCES:
            _forget(QUOTA_USED, ns, name, res)
            _forget(QUOTA_HARD, ns, name, res)
