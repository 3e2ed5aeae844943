"""The io-budget AdmissionCheck controller (``controllerName: mergepipe.io/io-budget``): Kueue
asks, per Workload that reserved quota in a ClusterQueue listing such a check, whether the Job may
start; for a merge Job the answer is the namespace's MergeQuota ledger (the reservation the
operator otherwise makes before creating the Job). See :mod:`.decisions`."""

from __future__ import annotations

import logging
from typing import Any

from ..k8s.api import JOBS, MERGES, QUOTAS, Conflict
from ..k8s.names import ANN_MERGE, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGER
from ..quota.controller import QuotaLedger
from ..quota.decisions import admission_key, quota_limits
from ..reconcile import Reconciler, Retry, Services
from .decisions import (
    ADMISSION_CHECKS,
    CLUSTER_QUEUES,
    LOCAL_QUEUES,
    WORKLOADS,
    CheckState,
    active_condition,
    cluster_queue_checks,
    is_ours,
    owner_job,
    pending_checks,
    with_check_state,
)

log = logging.getLogger("mergepipe.operator")


class IOBudgetCheck(Reconciler):
    """Kueue integration: which LocalQueues route through an io-budget check, the check's
    ``Active`` condition, and each Workload's check state.

    Args:
        io: the injected I/O.
        ledger: the MergeQuota ledger a Workload's check reserves in.
    """

    def __init__(self, io: Services, ledger: QuotaLedger):
        super().__init__(io)
        self.ledger = ledger

    def io_budget_check(self, ns: str, queue: str | None) -> str | None:
        """The io-budget AdmissionCheck that Kueue applies to Jobs of LocalQueue ``queue`` in
        ``ns`` (LocalQueue -> ClusterQueue -> its admission checks -> ``controllerName``), or
        ``None``: no queue, Kueue not installed, or no such check (the operator admits under the
        MergeQuotas itself, before creating the Job)."""
        if not queue:
            return None
        try:
            lq = self.kube.get(LOCAL_QUEUES, ns, queue)
            cq_name = ((lq or {}).get("spec") or {}).get("clusterQueue")
            cq = self.kube.get_cluster(CLUSTER_QUEUES, cq_name) if cq_name else None
            for name in cluster_queue_checks(cq):
                if is_ours(self.kube.get_cluster(ADMISSION_CHECKS, name)):
                    return name
        except Exception as e:  # noqa: BLE001 - no Kueue CRDs (404) or no RBAC for them: not in play
            log.debug("Kueue lookup for LocalQueue %s/%s: %s", ns, queue, e)
        return None

    def workload_of(self, ns: str, job: dict[str, Any]) -> dict[str, Any] | None:
        """The Kueue Workload of a Job (owned by it), or ``None`` (none yet, or not readable)."""
        try:
            for wl in self.kube.list(WORKLOADS, ns):
                if owner_job(wl) == job["metadata"]["name"]:
                    return wl
        except Exception as e:  # noqa: BLE001 - no Kueue CRDs or RBAC: the message goes without it
            log.debug("Workloads of %s/%s: %s", ns, job["metadata"]["name"], e)
        return None

    def activate_check(self, check: dict[str, Any]) -> None:
        """Mark one of our AdmissionChecks ``Active=True`` (Kueue keeps ClusterQueues using an
        inactive check inactive)."""
        if not is_ours(check):
            return
        conds = active_condition(check, self.clock())
        if conds is None:
            return
        try:
            self.kube.replace_cluster_status(ADMISSION_CHECKS, check, dict(check.get("status") or {}, conditions=conds))
        except Conflict:
            raise Retry(f"AdmissionCheck {check['metadata']['name']} changed meanwhile", 1) from None

    def check_workload(self, workload: dict[str, Any]) -> bool:
        """Decide our pending checks of one Workload; returns whether its status was written.

        A merge Job's Workload: reserve the plan's expert bytes (``status.plan.estimated``) in
        every MergeQuota of the namespace under the merge's admission key, as the operator's own
        admission would, but without clamping (the Job's plan is fixed by now): covered ->
        ``Ready``; not now -> ``Retry`` after ``merges.quotaRetrySeconds``; never (the plan
        exceeds a Reject or Clamp quota's hard limit) -> ``Rejected``. Any other Workload -> ``Ready``
        (it reads no expert bytes). The write is conditioned on the Workload's resourceVersion."""
        meta = workload["metadata"]
        ns = meta["namespace"]
        ours = {c["metadata"]["name"] for c in self.kube.list_cluster(ADMISSION_CHECKS) if is_ours(c)}
        names = pending_checks(workload, ours)
        if not names:
            return False
        state, message, requeue = self._decide(ns, workload)
        now = self.clock()
        checks = workload
        for name in names:
            checks = {"status": {"admissionChecks": with_check_state(checks, name, state, message, now, requeue)}}
        status = dict(workload.get("status") or {}, admissionChecks=checks["status"]["admissionChecks"])
        try:
            self.kube.replace_status(WORKLOADS, workload, status)
        except Conflict:
            raise Retry(f"Workload {ns}/{meta['name']} changed meanwhile", 1) from None
        log.info("Workload %s/%s: %s %s: %s", ns, meta["name"], ", ".join(names), state, message)
        return True

    def _decide(self, ns: str, workload: dict[str, Any]) -> tuple[CheckState, str, int | None]:
        jname = owner_job(workload)
        job = self.kube.get(JOBS, ns, jname) if jname else None
        labels = ((job or {}).get("metadata") or {}).get("labels") or {}
        if job is None or labels.get(LABEL_MANAGED_BY) != MANAGER or labels.get(LABEL_COMPONENT, "merge") != "merge":
            what = f"Job {jname}" if jname else "this workload"
            return "Ready", f"{what} is not a mergepipe merge: no expert reads to budget", None
        mm_name = (job["metadata"].get("annotations") or {}).get(ANN_MERGE)
        mm = self.kube.get(MERGES, ns, mm_name) if mm_name else None
        status = (mm or {}).get("status") or {}
        if mm is None or not mm_name:
            return (
                "Retry",
                f"ModelMerge {mm_name} does not (yet) name Job {jname} with a plan",
                self.settings.quota_retry_seconds,
            )
        plan = status.get("plan") or {}
        need = (plan.get("estimated") or {}).get("expertReadBytes")
        if mm is None or status.get("jobName") != jname or need is None:
            return (
                "Retry",
                f"ModelMerge {mm_name} does not (yet) name Job {jname} with a plan",
                self.settings.quota_retry_seconds,
            )
        key = (status.get("admission") or {}).get("key") or admission_key(
            mm["metadata"]["uid"], status.get("observedGeneration")
        )
        adm, quotas = self.ledger.reserve(ns, mm_name, key, int(need), self.clock(), clamp=False)
        if adm.allowed:
            return "Ready", f"plan {str(plan.get('digest', ''))[:12]}: {adm.message}", None
        for q in self.kube.list(QUOTAS, ns):
            try:
                hard = quota_limits(q).expert_read_bytes
            except Exception:  # noqa: BLE001 - a broken quota: Retry (its owner may fix it)
                continue
            if hard is not None and int(need) > hard:
                return (
                    "Rejected",
                    f"the plan reads {need} expert bytes, more than MergeQuota "
                    f"{q['metadata']['name']} ever allows ({hard}); lower the budget",
                    None,
                )
        return "Retry", adm.message, self.settings.quota_retry_seconds
