"""The MergeSearch reconciler: start this generation's driver Job, retire earlier generations'
drivers, mirror the driver's results into the status."""

from __future__ import annotations

import logging
from typing import Any

from ..k8s.api import JOBS, Conflict
from ..k8s.conditions import get_condition, set_condition
from ..k8s.names import label_value
from ..metrics import JOBS_CREATED
from ..modelmerge.spec import format_issues
from ..reconcile import Reconciler
from .decisions import (
    ANN_SEARCH,
    LABEL_SEARCH,
    TERMINAL_SEARCH_REASONS,
    ResultsError,
    SearchReason,
    build_driver_job,
    driver_job_name,
    parse_results,
    parse_search_spec,
    planning_issues,
    results_uri,
    search_image_issue,
    search_status,
    status_changed,
)
from .model import MergeSearchSpec

log = logging.getLogger("mergepipe.operator")


class SearchReconciler(Reconciler):
    """MergeSearch reconciliation: one driver Job per generation (the candidates are ModelMerges,
    reconciled by :class:`~mergepipe_operator.modelmerge.controller.MergeReconciler`)."""

    def reconcile_search(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """One reconciliation of a MergeSearch (create/update/resume): validate, start this
        generation's driver Job (409: it exists already, carry on), delete the driver Jobs of
        earlier generations (their candidates and snapshots stay), then mirror the results.
        Returns the status fields to patch (``None``: nothing changes)."""
        meta, spec = body["metadata"], body.get("spec") or {}
        status = body.get("status") or {}
        gen = meta.get("generation")
        ready = get_condition(status.get("conditions"), "Ready")
        if (
            status.get("observedGeneration") == gen
            and ready
            and ready.get("reason") in (SearchReason.COMPLETED, *TERMINAL_SEARCH_REASONS)
        ):
            return None
        typed, issues = parse_search_spec(spec)
        if typed is not None:
            issues = planning_issues(typed, self.settings)
        refusal = search_image_issue(spec, self.settings)
        if issues or refusal:
            now = self.clock()
            return {
                "observedGeneration": gen,
                "conditions": set_condition(
                    status.get("conditions"),
                    "Ready",
                    "False",
                    SearchReason.INVALID_SPEC,
                    format_issues(issues) if issues else str(refusal),
                    gen,
                    now,
                ),
            }
        ns, name = meta["namespace"], meta["name"]
        job = build_driver_job(body, self.settings)
        jname = job["metadata"]["name"]
        for old in self.kube.list(JOBS, ns, f"{LABEL_SEARCH}={label_value(name)}"):
            if old["metadata"]["name"] != jname and (old["metadata"].get("annotations") or {}).get(ANN_SEARCH) == name:
                self.kube.delete(JOBS, ns, old["metadata"]["name"])  # an earlier generation's search stops
        try:
            self.kube.create(JOBS, ns, job)
            JOBS_CREATED.inc()
        except Conflict:
            pass  # same generation: created by an earlier attempt (or before a restart)
        return self.sync_search(body, self.kube.get(JOBS, ns, jname) or job, spec=typed)

    def sync_search(
        self, body: dict[str, Any], job: dict[str, Any] | None = None, *, spec: MergeSearchSpec | None = None
    ) -> dict[str, Any] | None:
        """Mirror the driver's results and its Job's state into the MergeSearch status; returns the
        fields to patch, or ``None`` when nothing changed (an unreadable results object is
        logged and skipped: the driver rewrites it after the next candidate; a spec that no
        longer parses is left to :meth:`reconcile_search`, which reports it). ``spec``: the
        parsed spec when the caller has it."""
        meta = body["metadata"]
        if spec is None:
            spec, issues = parse_search_spec(body.get("spec") or {})
            if spec is None:
                log.warning("MergeSearch %s/%s: %s", meta["namespace"], meta["name"], format_issues(issues))
                return None
        gen = meta.get("generation")
        jname = driver_job_name(meta["name"], gen)
        if job is None:
            job = self.kube.get(JOBS, meta["namespace"], jname)
        raw = self.store.get(results_uri(spec, gen)) if self.store else None
        try:
            results = parse_results(raw)
        except ResultsError as e:
            log.warning("MergeSearch %s/%s: %s", meta["namespace"], meta["name"], e)
            results = None
        new = search_status(body, spec, results, self.job_outcome(job, "driver Job"), jname, self.clock())
        return new if status_changed(body.get("status"), new) else None

    # deletion ---------------------------------------------------------------------------------------
