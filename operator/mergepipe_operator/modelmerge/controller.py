"""The ModelMerge reconciler: validate the spec -> (fidelity mode: plan to get the estimate) ->
admit under every MergeQuota of the namespace (reservation written with the quota's
resourceVersion *before* any Job exists) -> plan with the admitted budget -> write the plan to
object storage -> create the Job (deterministic name; 409 = already created; an Indexed Job of N
pods for a partitioned merge) -> follow the Job -> on success (for an Indexed Job: commit its
parts in-process, :mod:`.committing`) verify the committed manifest, create the MergedSnapshot,
charge the quotas with the realized bytes -> Ready=True (Committed). One pass per generation,
idempotent under kopf's retries.

When the catalog lacks an expert's statistics, an analyze Job (``mergepipe analyze ...
--catalog <catalog>``) records them first and the merge waits in ``Analyzing``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..k8s.api import JOBS, PODS, QUOTAS, SNAPSHOTS, Conflict
from ..k8s.conditions import Reason, get_condition, set_condition
from ..k8s.jobs import JobOutcome, job_ever_started
from ..k8s.model import API_VERSION
from ..k8s.names import (
    ANN_GENERATION,
    ANN_PLAN_DIGEST,
    ANN_PLAN_URI,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_MERGE,
    MANAGER,
    label_value,
)
from ..k8s.queueing import job_suspended, queued_message
from ..kueue.controller import IOBudgetCheck
from ..metrics import (
    ADMISSIONS,
    ANALYZE_JOBS_CREATED,
    COMMITTED,
    JOBS_CREATED,
    MERGE_SECONDS,
    REALIZED_BYTES,
)
from ..objectstore import manifest_uri
from ..quantities import QuantityError, human_bytes
from ..quota.controller import QuotaLedger
from ..quota.decisions import Admission, Closing, admission_key, admit, close, closing, keys_of
from ..reconcile import Done, Reconciler, Retry, RetryWithStatus, Services
from ..snapshot.controller import SnapshotVerifier
from ..snapshot.decisions import (
    manifest_facts,
    manifest_hash,
    snapshot_name,
    snapshot_ready,
)
from .decisions import (
    ANN_ANALYSIS,
    analyze_job_name,
    build_analyze_job,
    build_job,
    choose_job,
    choose_parallelism,
    generation_settled,
    job_parts,
    merge_image_issue,
    parallelism_issue,
    parts_status,
    plan_status,
    plan_uri,
    status_plan_digest,
)
from .planning import PlanInputError, PlanSummary
from .spec import budget_refusal_text, format_issues, parse_merge_spec, requested_budget

log = logging.getLogger("mergepipe.operator")


def _is_merge_job(job: dict[str, Any]) -> bool:
    """A ModelMerge's merge Job (label component ``merge``, or none: Jobs of older operators), not
    its analyze Job."""
    return (job["metadata"].get("labels") or {}).get(LABEL_COMPONENT, "merge") == "merge"


def _job_output(job: dict[str, Any]) -> str | None:
    """The output URI a merge Job writes (its container's ``--out`` argument), or ``None``."""
    for c in ((job.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []:
        args = list(c.get("args") or [])
        if "--out" in args and args.index("--out") + 1 < len(args):
            return str(args[args.index("--out") + 1])
    return None


def _pods_of(job: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods of this very Job: a pod of an earlier, deleted Job of the same name (same
    ``job-name`` label, e.g. still terminating) is owned by another uid and is left out."""
    uid = (job.get("metadata") or {}).get("uid")
    if not uid:
        return pods
    return [
        p
        for p in pods
        if not (p.get("metadata") or {}).get("ownerReferences")
        or any(r.get("uid") == uid for r in p["metadata"]["ownerReferences"])
    ]


def _count_commit(facts: Any, raw: bytes) -> None:
    """Prometheus: one more committed merge, its realized bytes per role and its wall time."""
    COMMITTED.inc()
    for role, n in facts.realized.items():
        if n:
            REALIZED_BYTES.labels(role).inc(n)
    try:
        wall = float(json.loads(raw)["time"]["wall_s"])
    except (KeyError, TypeError, ValueError):
        return
    MERGE_SECONDS.observe(wall)


def _parts_message(job: dict[str, Any] | None, parts: dict[str, Any]) -> str:
    """The Ready message of a running Indexed merge Job: parts done / total, pods running, failed
    attempts (each retried on its own index)."""
    st = (job or {}).get("status") or {}
    name = (job or {}).get("metadata", {}).get("name", "")
    msg = f"merge Job {name}: {parts['progress']} parts done, {int(st.get('active') or 0)} pod(s) running"
    if parts.get("failedPods"):
        msg += f", {parts['failedPods']} failed attempt(s) retried per index"
    return msg


def _missing_statistics(plan: PlanSummary) -> str:
    """What the catalog lacks for ``plan``, in words: the missing experts and/or the base's
    sensitivity on the calibration set."""
    return " and ".join(
        ([f"{len(plan.missing_experts)} expert(s) ({', '.join(plan.missing_experts)})"] if plan.missing_experts else [])
        + ([f"the base's sensitivity on {plan.calibration_uri}"] if plan.missing_sensitivity else [])
    )


def _analysis_failure(jname: str, outcome: JobOutcome, what: str, catalog_uri: str | None) -> str:
    """The JobFailed message of a finished analyze Job that did not give the statistics: it
    failed, or it completed but the catalog still lacks ``what``."""
    if outcome.state == "Failed":
        msg = f"analyze Job {jname} failed ({outcome.reason}): {outcome.message}"
    else:
        msg = (
            f"analyze Job {jname} completed, but the catalog {catalog_uri} still has no "
            f"statistics for {what}; check that the Job and the operator use the same catalog and S3 endpoint"
        )
    return msg + "; fix the cause, then change the spec (or delete and re-create the ModelMerge) to retry"


@dataclass
class _Pass:
    """One reconciliation of one ModelMerge generation: what its steps read (the body, its old
    status, the generation, the pass's time) and the status they build (``out``; ``conds``, the
    conditions so far)."""

    body: dict[str, Any]
    status: dict[str, Any]
    gen: Any
    now: datetime
    out: dict[str, Any]
    conds: list[Any]

    @property
    def ns(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def condition(self, kind: str, status: str, reason: str, message: str) -> None:
        """Set condition ``kind`` in ``conds`` (at this generation and time)."""
        self.conds = set_condition(self.conds, kind, status, reason, message, self.gen, self.now)

    def ready(self, ready_status: str, reason: str, message: str) -> list[Any]:
        """``conds`` with the Ready condition set (``conds`` itself unchanged)."""
        return set_condition(self.conds, "Ready", ready_status, reason, message, self.gen, self.now)

    def finish(self, ready_status: str, reason: str, message: str, **extra: Any) -> dict[str, Any]:
        """The status to patch: ``out`` with ``extra`` and the Ready condition set."""
        self.out.update(extra)
        self.out["conditions"] = self.ready(ready_status, reason, message)
        return self.out


@dataclass
class _Admitted:
    """A pass's admission: its reservation ``key``, the quotas' verdict, the MergeQuotas holding the
    reservation, the Kueue AdmissionCheck reserving instead (``None``: none) and the budget admitted
    (bytes; ``None``: unbounded)."""

    key: str
    adm: Admission
    quotas: list[str]
    check: str | None
    budget: int | None


class MergeReconciler(Reconciler):
    """ModelMerge reconciliation, composed with the services it uses.

    Args:
        io: the injected I/O.
        ledger: the MergeQuota ledger (admission reserves in it, every run's end settles it).
        kueue: the Kueue io-budget AdmissionCheck (whether a LocalQueue's Jobs are admitted by
            it rather than by the operator before the Job exists; a queued Job's Workload).
        verifier: the MergedSnapshot verification (a finished Job's manifest and outputs).
        planner: ``(spec with the admitted budget in bytes, catalog URI) -> PlanSummary``
            (:func:`~mergepipe_operator.modelmerge.planning.plan_merge` in production).
        committer: ``(plan URI, output URI, N) -> manifest hash``: commits the N parts of an
            Indexed merge Job (:func:`~mergepipe_operator.modelmerge.committing.commit_parts`
            in production).
    """

    def __init__(
        self,
        io: Services,
        *,
        ledger: QuotaLedger,
        kueue: IOBudgetCheck,
        verifier: SnapshotVerifier,
        planner: Callable[[dict[str, Any], str | None], PlanSummary],
        committer: Callable[[str, str, int], str],
    ):
        super().__init__(io)
        self.ledger = ledger
        self.kueue = kueue
        self.verifier = verifier
        self.planner = planner
        self.committer = committer

    def reconcile_merge(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """One reconciliation of a ModelMerge; returns the status fields to patch (``None``: no
        change). Raises :class:`Retry` when it must come back later; a :class:`RetryWithStatus`
        carries the status to write first (e.g. Ready=False, QuotaExceeded)."""
        try:
            return self._reconcile_merge(body)
        except Done as e:
            # this generation ends here (inputs the planner refused, a failed analysis): like an
            # invalid spec, it retires the previous generation's run, settling its reservation
            meta = body["metadata"]
            self._retire(meta["namespace"], meta["name"], body.get("status") or {}, e.status, self.clock())
            return e.status

    def _reconcile_merge(self, body: dict[str, Any]) -> dict[str, Any] | None:
        meta, spec = body["metadata"], body.get("spec") or {}
        status = body.get("status") or {}
        gen = meta.get("generation")
        ready = get_condition(status.get("conditions"), "Ready")
        if generation_settled(status, gen):
            return None  # this generation already went as far as reconcile takes it
        out: dict[str, Any] = {
            "observedGeneration": gen,
            "expertCount": len(spec.get("experts") or []),
            "method": spec.get("method"),
        }
        p = _Pass(body, status, gen, self.clock(), out, status.get("conditions") or [])
        typed, issues = parse_merge_spec(spec)  # parsed once; the spec field of each problem named
        refusal = parallelism_issue(spec, self.settings) or merge_image_issue(spec, self.settings)
        if typed is None or refusal:
            # the previous generation's run is retired as on any spec change
            self._retire(p.ns, p.name, status, out, p.now)
            return p.finish("False", Reason.INVALID_SPEC, format_issues(issues) if issues else str(refusal))

        key = admission_key(meta["uid"], gen)
        requested = requested_budget(typed, self.settings)
        # Planning is in-process and cheap: plan first, so the quota is charged with what the
        # plan will read (<= the budget), not with the whole budget.
        first = self._plan(body, requested, out, p.conds, gen, p.now)
        p.condition(
            "Analyzed", "True", "Analyzed", f"the catalog has statistics for all {len(typed.experts)} expert(s)"
        )
        if ready and ready.get("reason") == Reason.COMMITTED and status_plan_digest(status) == first.digest:
            # the new generation plans to the same digest: its snapshot is already committed
            return p.finish("True", Reason.COMMITTED, f"plan unchanged; {ready.get('message', '')}".strip())
        check = self.kueue.io_budget_check(p.ns, typed.queue_name or self.settings.queue_name)
        adm, quotas = self._admit(p, spec, key, first, requested, check)
        budget = adm.budget if adm.clamped else requested
        try:
            plan = (
                first
                if budget is None or first.expert_read_bytes <= budget
                else self._plan(body, budget, out, p.conds, gen, p.now)
            )
        except (RetryWithStatus, Done):
            self.ledger.unreserve(p.ns, key, quotas, job_started=False)
            raise
        return self._run_plan(p, typed.output.uri, typed.parallelism, plan, _Admitted(key, adm, quotas, check, budget))

    def _admit(
        self, p: _Pass, spec: dict[str, Any], key: str, first: PlanSummary, requested: int | None, check: str | None
    ) -> tuple[Admission, list[str]]:
        """Admit ``first`` (the plan under the requested budget) under the namespace's MergeQuotas
        (a reservation of its expert bytes under ``key``), or defer to Kueue AdmissionCheck
        ``check``; sets the QuotaAdmitted condition. Returns the admission and the quotas holding
        the reservation. Raises :class:`RetryWithStatus` (QuotaExceeded) when refused."""
        quotas: list[str]
        if check:  # Kueue's AdmissionCheck reserves the plan when Kueue admits the Job
            adm, quotas = (
                Admission(
                    True,
                    requested,
                    Reason.ADMITTED,
                    f"MergeQuotas are checked by Kueue AdmissionCheck {check} when Kueue admits the merge Job",
                    {},
                ),
                [],
            )
        else:
            adm, quotas = self.ledger.reserve(
                p.ns, p.name, key, first.expert_read_bytes, p.now, unclampable=budget_refusal_text(spec)
            )
            ADMISSIONS.labels(adm.reason).inc()
        if not adm.allowed:
            p.condition("QuotaAdmitted", "False", Reason.QUOTA_EXCEEDED, adm.message)
            status_out = p.finish("False", Reason.QUOTA_EXCEEDED, adm.message)
            raise RetryWithStatus(adm.message, self.settings.quota_retry_seconds, status_out)
        if check:
            p.condition("QuotaAdmitted", "Unknown", "AdmissionCheck", adm.message)
        else:
            reason = adm.reason if adm.reason != Reason.ALREADY_ADMITTED else Reason.ADMITTED
            p.condition("QuotaAdmitted", "True", reason, adm.message)
        return adm, quotas

    def _run_plan(
        self, p: _Pass, out_uri: str, parallelism: int | None, plan: PlanSummary, a: _Admitted
    ) -> dict[str, Any]:
        """Run the admitted ``plan`` into ``out_uri``: refuse an output holding another plan's
        snapshot, write the plan to object storage, follow this plan's merge Job or create it,
        retire the previous generation's run; returns the status to patch."""
        if self.store is None:
            raise RuntimeError("the operator has no object store configured")
        other = self._committed_plan(out_uri)
        if other is not None and other != plan.digest:
            # snapshots are immutable: the worker would refuse this output (and fail the Job)
            self.ledger.unreserve(p.ns, a.key, a.quotas, job_started=False)
            self._retire(p.ns, p.name, p.status, p.out, p.now)
            return p.finish(
                "False",
                Reason.INVALID_SPEC,
                f"spec.output.uri: {out_uri} already holds a committed snapshot of another plan "
                f"({other[:12]}); snapshots are immutable, choose a new output.uri",
            )
        uri = plan_uri(self.settings, p.ns, p.name, plan.digest)
        self.store.put(uri, plan.plan_json)
        plan_summary = plan_status(
            plan.digest,
            uri,
            plan.base_read_bytes,
            plan.expert_read_bytes,
            plan.output_write_bytes,
            plan.retained_energy,
            sketch=plan.sketch,
            sketch_read_bytes=plan.sketch_read_bytes,
        )
        merge_jobs = [j for j in self.kube.list(JOBS, p.ns, f"{LABEL_MERGE}={label_value(p.name)}") if _is_merge_job(j)]
        choice = choose_job(merge_jobs, ANN_PLAN_DIGEST, plan.digest, p.gen)
        if other == plan.digest and choice.follow is None:
            # the output already holds this plan's committed snapshot and no Job of it exists: an
            # earlier generation committed it (and was charged); nothing is read again
            self.ledger.unreserve(p.ns, a.key, a.quotas, job_started=False)
            self._retire(p.ns, p.name, p.status, p.out, p.now)
            return p.finish(
                "True",
                Reason.COMMITTED,
                f"{out_uri} already holds the committed snapshot of plan {plan.digest[:12]}; nothing to run",
                plan=plan_summary,
            )
        job = choice.follow
        if job is None:
            job = self._create_merge_job(p, parallelism, plan, uri, choice.retry_generation)
        return self._record_run(p, plan, plan_summary, job, choice.follow is not None, a)

    def _create_merge_job(
        self, p: _Pass, parallelism: int | None, plan: PlanSummary, uri: str, retry_generation: Any
    ) -> dict[str, Any]:
        """Create the merge Job of ``plan`` (its plan written at ``uri``), an Indexed Job when the
        plan is worth splitting; returns it as stored (Kueue's webhook may have suspended it), or
        as built when an earlier attempt created it (409: same name = same merge, plan, attempt)."""
        parts = choose_parallelism(
            parallelism,
            plan.base_read_bytes + plan.expert_read_bytes + plan.output_write_bytes,
            plan.shards,
            self.settings.max_parallelism,
            self.settings.bytes_per_part,
        )
        job = build_job(p.body, uri, plan.digest, self.settings, retry_generation=retry_generation, parts=parts)
        try:
            job = self.kube.create(JOBS, p.ns, job) or job  # as stored: Kueue's webhook may have suspended it
            JOBS_CREATED.inc()
        except Conflict:
            pass  # same name = same merge, plan and attempt: created by an earlier attempt
        return job

    def _record_run(
        self,
        p: _Pass,
        plan: PlanSummary,
        plan_summary: dict[str, Any],
        job: dict[str, Any],
        followed: bool,
        a: _Admitted,
    ) -> dict[str, Any]:
        """The status of a pass that runs ``job`` (``followed``: it existed, same plan): the
        previous generation's run superseded, the plan, Job and admission recorded, the Planned
        condition, and Ready=False with JobRunning (or Queued while Kueue holds the Job)."""
        status, key = p.status, a.key
        parts = job_parts(job)  # a followed Job keeps the N it was created with
        old_adm = status.get("admission") or {}
        if a.check and followed and old_adm.get("admissionCheck") and status_plan_digest(status) == plan.digest:
            key = old_adm.get("key") or key  # the same (admitted) Job carries on: its reservation stays
        carried_started = followed and (
            bool(old_adm.get("started") and status.get("jobName") == job["metadata"]["name"])
            or job_ever_started(job, [])
        )
        self._supersede(p.ns, p.name, status, plan.digest, key, p.now)
        p.out.update(
            budget=human_bytes(a.budget) if a.budget is not None else "unbounded",
            budgetBytes=a.budget,
            plan=plan_summary,
            realized=None,
            expertRead=None,
            snapshot=None,
            jobName=job["metadata"]["name"],
            parts=parts_status(job, parts) if parts > 1 else None,
            admission={
                "key": key,
                "budgetBytes": a.budget,
                "clamped": a.adm.clamped,
                "quotas": a.quotas,
                **({"admissionCheck": a.check} if a.check else {}),
                # the same Job carries on: what it already read stays known to have started
                **({"started": True} if carried_started else {}),
            },
        )
        p.condition(
            "Planned",
            "True",
            "Planned",
            f"plan {plan.digest[:12]}: {human_bytes(plan.expert_read_bytes)} expert reads"
            + (
                f" ({human_bytes(plan.sketch_read_bytes)} of them block sketches, {plan.sketch})"
                if plan.sketch_read_bytes
                else ""
            ),
        )
        verb = "carries on (same plan)" if followed else "created"
        if parts > 1:
            verb += f" as an Indexed Job of {parts} parts"
        if job_suspended(job):  # Kueue holds it until it admits it
            return p.finish("False", Reason.QUEUED, f"merge Job {verb}; " + queued_message("merge Job", job))
        return p.finish("False", Reason.JOB_RUNNING, f"merge Job {job['metadata']['name']} {verb}")

    def _committed_plan(self, out_uri: str) -> str | None:
        """Plan digest of the snapshot already committed at ``out_uri`` ("" if unreadable)."""
        raw = self.store.get(manifest_uri(out_uri)) if self.store else None
        if raw is None:
            return None
        try:
            return str(json.loads(raw).get("plan_digest") or "")
        except (ValueError, AttributeError):
            return ""

    def _plan(
        self, body: dict[str, Any], budget: int | None, out: dict[str, Any], conds: list, gen: Any, now: datetime
    ) -> PlanSummary:
        """Plan under ``budget``; when the catalog lacks statistics, see to the analyze Job
        (:meth:`_await_analysis`). Raises :class:`RetryWithStatus` (come back later) or
        :class:`Done` (Ready=False for good: invalid inputs, failed analysis)."""
        spec = body.get("spec") or {}
        planned_spec = copy.deepcopy(spec)
        planned_spec.pop("budget", None)
        if budget is not None:
            planned_spec["budget"] = budget
        if not (planned_spec.get("calibration") or {}).get("uri") and self.settings.calibration_uri:
            planned_spec["calibration"] = {"uri": self.settings.calibration_uri}  # the operator's default
        if planned_spec.get("sketch") is None:  # the namespace's, else the operator's default tiers
            ns = body["metadata"].get("namespace")
            default = self.settings.sketch_by_namespace.get(ns) or self.settings.sketch
            if default:
                planned_spec["sketch"] = default
        plan = self._call_planner(body, planned_spec, out, conds, gen, now)
        if plan.needs_analysis and self._await_analysis(body, plan, out, conds, gen, now, final=False):
            # the analyze Job completed, possibly after the planner read the catalog: plan again
            plan = self._call_planner(body, planned_spec, out, conds, gen, now)
            if plan.needs_analysis:
                self._await_analysis(body, plan, out, conds, gen, now, final=True)
        if budget is not None and plan.expert_read_bytes > budget:
            raise RuntimeError(f"planner broke the budget: {plan.expert_read_bytes} > {budget}")
        return plan

    def _call_planner(
        self,
        body: dict[str, Any],
        planned_spec: dict[str, Any],
        out: dict[str, Any],
        conds: list,
        gen: Any,
        now: datetime,
    ) -> PlanSummary:
        """``self.planner`` with its errors mapped to statuses (see :meth:`_plan`)."""
        try:
            return self.planner(planned_spec, self.settings.catalog_uri)
        except NotImplementedError as e:
            out["conditions"] = set_condition(
                conds, "Ready", "False", Reason.PLANNING, f"cannot plan yet: {e}", gen, now
            )
            raise RetryWithStatus(str(e), 300, out) from None
        except PlanInputError as e:
            msg = f"{e.field}: the planner refused the inputs: {e}"
            out["conditions"] = set_condition(conds, "Ready", "False", Reason.INVALID_SPEC, msg, gen, now)
            raise Done(out) from None
        except Exception as e:  # object storage unreachable, throttled, ...: transient
            msg = f"cannot plan yet ({type(e).__name__}): {e}"
            log.warning("%s/%s: %s", body["metadata"].get("namespace"), body["metadata"].get("name"), msg)
            out["conditions"] = set_condition(conds, "Ready", "False", Reason.PLANNING, msg, gen, now)
            raise RetryWithStatus(msg, 30, out) from None

    def _await_analysis(
        self,
        body: dict[str, Any],
        plan: PlanSummary,
        out: dict[str, Any],
        conds: list,
        gen: Any,
        now: datetime,
        *,
        final: bool,
    ) -> bool:
        """The catalog lacks statistics for ``plan.missing_experts``: create the analyze Job
        (deterministic name: a retry or a restarted operator finds it), then come back every
        ``analyze_poll_seconds`` until it finished. Returns ``True`` when the Job has completed
        and ``final`` is false (the caller plans again: the Job may have written the statistics
        after the planner read the catalog). Otherwise raises: :class:`RetryWithStatus`
        (Analyzing, or QuotaExceeded when the namespace's quota could not admit any merge, so no
        expert bytes are read for a merge that cannot run) or :class:`Done` (JobFailed; with
        ``final``, a completed Job whose statistics are still missing)."""
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        if not plan.analysis_id:
            raise RuntimeError("the planner reported missing statistics without an analysis id")
        what = _missing_statistics(plan)
        analyze_jobs = self.kube.list(JOBS, ns, f"{LABEL_MERGE}={label_value(name)},{LABEL_COMPONENT}=analyze")
        # a complete analyze Job whose statistics are still missing is as good as failed
        choice = choose_job(analyze_jobs, ANN_ANALYSIS, plan.analysis_id, gen, usable=frozenset({"Running"}))
        job = choice.follow
        jname = job["metadata"]["name"] if job else analyze_job_name(name, plan.analysis_id, choice.retry_generation)
        if job is None:
            refusal = self._quota_precheck(ns, admission_key(meta["uid"], gen), now)
            if refusal:
                c = set_condition(conds, "QuotaAdmitted", "False", Reason.QUOTA_EXCEEDED, refusal, gen, now)
                out["conditions"] = set_condition(c, "Ready", "False", Reason.QUOTA_EXCEEDED, refusal, gen, now)
                raise RetryWithStatus(refusal, self.settings.quota_retry_seconds, out)
            try:
                job = self.kube.create(
                    JOBS,
                    ns,
                    build_analyze_job(
                        body,
                        plan.missing_experts,
                        plan.analysis_id,
                        self.settings,
                        retry_generation=choice.retry_generation,
                        calibration_uri=plan.calibration_uri,
                    ),
                )
                ANALYZE_JOBS_CREATED.inc()
                log.info("%s/%s: analyze Job %s created for %s", ns, name, jname, what)
            except Conflict:  # created by an earlier attempt
                job = self.kube.get(JOBS, ns, jname)
        outcome = (
            self.job_outcome(job, "analyze Job") if job is not None else JobOutcome("Running", Reason.JOB_RUNNING, "")
        )
        if outcome.state == "Succeeded" and not final:
            return True
        if outcome.state != "Running":
            msg = _analysis_failure(jname, outcome, what, self.settings.catalog_uri)
            c = set_condition(conds, "Analyzed", "False", Reason.JOB_FAILED, msg, gen, now)
            out["conditions"] = set_condition(c, "Ready", "False", Reason.JOB_FAILED, msg, gen, now)
            raise Done(out)
        msg = f"analyze Job {jname} is recording the catalog statistics of {what}"
        reason = Reason.ANALYZING
        if outcome.reason == Reason.QUEUED:  # Kueue holds it: say so (and where)
            msg, reason = outcome.message, Reason.QUEUED
        c = set_condition(conds, "Analyzed", "False", Reason.ANALYZING, msg, gen, now)
        out["conditions"] = set_condition(c, "Ready", "False", reason, msg, gen, now)
        raise RetryWithStatus(msg, self.settings.analyze_poll_seconds, out)

    def _quota_precheck(self, ns: str, key: str, now: datetime) -> str | None:
        """Why no MergeQuota of ``ns`` could admit any merge now (no merge left in the window, or
        no expert byte left under Reject or Clamp), or ``None``. Nothing is written: the real
        admission, with the plan's bytes, comes after planning."""
        for q in self.kube.list(QUOTAS, ns):
            try:
                a = admit(q, 1, now, key=key)
            except QuantityError as e:
                return f"invalid MergeQuota: {e}"
            if not a.allowed:
                return f"{a.message} (not analyzing the experts of a merge that cannot be admitted)"
        return None

    def admission_quotas(self, ns: str, adm: dict[str, Any]) -> list[str]:
        """The MergeQuotas that may hold a merge's reservation: the ones its admission named; with
        a Kueue AdmissionCheck (which reserved when Kueue admitted the Job) every MergeQuota of the
        namespace (settling or releasing a key a quota does not hold changes nothing)."""
        if adm.get("admissionCheck"):
            return [q["metadata"]["name"] for q in self.kube.list(QUOTAS, ns)]
        return list(adm.get("quotas") or [])

    def _supersede(self, ns: str, name: str, old: dict[str, Any], digest: str, key: str, now: datetime) -> None:
        """Retire the previous generation's run: delete Jobs of other plans, then end its
        reservation by the ledger's one rule (:func:`~..quota.decisions.closing`): released when
        the same Job carries on (same plan digest: the new reservation covers it) or when its Job
        never started (no container of it ever ran: nothing was read, e.g. a pod that was
        pending, unschedulable or suspended; :func:`job_ever_started`, checked before the Job is
        deleted, or ``status.admission.started``); charged the spent expert bytes of its manifest
        when it committed meanwhile; else charged its reservation (it may have read up to its
        plan). A Job that cannot be found is charged (it may have run)."""
        old_job_name = old.get("jobName")
        adm = old.get("admission") or {}
        old_started = bool(adm.get("started"))
        old_found = False
        old_out: str | None = None
        for job in self.kube.list(JOBS, ns, f"{LABEL_MERGE}={label_value(name)}"):
            if not _is_merge_job(job):
                continue  # analyze Jobs are not superseded: their statistics serve any plan
            if (job["metadata"].get("annotations") or {}).get(ANN_PLAN_DIGEST) != digest:
                if job["metadata"]["name"] == old_job_name:
                    old_found = True
                    old_started = old_started or self._job_started(ns, job)
                    old_out = _job_output(job)
                self.kube.delete(JOBS, ns, job["metadata"]["name"])
        ready = get_condition(old.get("conditions"), "Ready") or {}
        if not adm.get("key") or adm["key"] == key or ready.get("reason") == Reason.COMMITTED:
            return
        old_digest = status_plan_digest(old)
        if old_digest == digest:
            how = closing(False, None)  # the same Job carries on under the new reservation
        else:
            known = self._known_read(old_out, old_digest)
            how = closing(old_started or not old_found, known)
        for q in self.admission_quotas(ns, adm):
            self.ledger.update_quota(ns, q, lambda quota: close(quota, adm["key"], how, now))

    def _known_read(self, out_uri: str | None, plan_digest: str | None) -> int | None:
        """Expert bytes a run of ``plan_digest`` read, from the manifest committed at ``out_uri``
        (all attempts; :attr:`ManifestFacts.spent_expert_bytes`, validated by
        :func:`manifest_facts`); ``None`` when there is none, it is of another plan, or it does
        not validate (the run is then charged its reservation)."""
        if not out_uri or not plan_digest or self.store is None:
            return None
        try:
            raw = self.store.get(manifest_uri(out_uri))
            if raw is None:
                return None
            facts = manifest_facts(json.loads(raw))
        except Exception as e:  # noqa: BLE001 - unreadable or invalid: unknown, charge the reservation
            log.warning("manifest at %s not usable for the ledger: %s", out_uri, e)
            return None
        return facts.spent_expert_bytes if facts.plan_digest == plan_digest else None

    def _retire(self, ns: str, name: str, old: dict[str, Any], out: dict[str, Any], now: datetime) -> None:
        """The new generation runs nothing (invalid spec, output taken): stop the previous
        generation's merge Jobs and settle its reservation as :meth:`_supersede` does (released
        if its Job never started, else charged), then clear ``admission``/``jobName`` in ``out``
        so that nothing settles it twice. A committed generation keeps its charge and snapshot."""
        if not (old.get("admission") or old.get("jobName")):
            return
        self._supersede(ns, name, old, "", "", now)
        out.update(admission=None, jobName=None)

    def _job_started(self, ns: str, job: dict[str, Any]) -> bool:
        """Did any container of ``job`` ever run? (Its pods, label ``job-name``; pods that cannot
        be read count as started: charging is the safe side.)"""
        try:
            pods = self.kube.list(PODS, ns, f"job-name={job['metadata']['name']}")
        except Exception as e:  # noqa: BLE001 - decide conservatively
            log.warning("cannot read the pods of Job %s/%s: %s", ns, job["metadata"]["name"], e)
            return True
        return job_ever_started(job, _pods_of(job, pods))

    # quotas -----------------------------------------------------------------------------------------

    def sync_job(self, mm: dict[str, Any], job: dict[str, Any] | None) -> dict[str, Any] | None:
        """Fold the merge Job's state into the ModelMerge; returns status fields to patch."""
        status = mm.get("status") or {}
        gen = mm["metadata"].get("generation")
        ready = get_condition(status.get("conditions"), "Ready")
        digest = status_plan_digest(status)
        if not ready or ready.get("reason") not in (Reason.JOB_RUNNING, Reason.QUEUED) or not digest:
            return None
        if job is not None and (
            (job["metadata"].get("annotations") or {}).get(ANN_PLAN_DIGEST) != digest
            or (status.get("jobName") and job["metadata"].get("name") != status["jobName"])
        ):
            return None  # a Job of an earlier plan, or an earlier (failed) run of this plan
        p = _Pass(mm, status, gen, self.clock(), {}, status.get("conditions") or [])
        adm = status.get("admission") or {}
        outcome = self.job_outcome(job, "merge Job")
        out_uri = (mm.get("spec") or {}).get("output", {}).get("uri")
        n = job_parts(job) if job is not None else int((status.get("parts") or {}).get("total") or 1)
        parts = parts_status(job, n) if n > 1 and job is not None else status.get("parts")
        if outcome.state == "Running":
            started_now = (
                job is not None and not adm.get("started") and adm.get("key") and job_ever_started(job, [])
            )  # (the Job's own counts: ready/failed/succeeded pods; no pod listing per event)
            # remembered: Kueue may evict it (pods gone) and its reads stay charged
            seen = {"admission": {**adm, "started": True}} if started_now else {}
            return self._running_status(p, job, outcome, ready, n, parts, seen)
        raw = self.store.get(manifest_uri(out_uri)) if out_uri and self.store else None
        extra: dict[str, Any] = {"parts": parts} if n > 1 and parts else {}
        if outcome.state == "Failed" and raw is None:
            # a Job that failed before any container ran (deadline while pending, image pull) read nothing
            ran = bool(adm.get("started")) or job is None or self._job_started(p.ns, job)
            self.ledger.unreserve(p.ns, adm.get("key", ""), self.admission_quotas(p.ns, adm), job_started=ran)
            return {"conditions": p.ready("False", Reason.JOB_FAILED, outcome.message), **extra}
        if outcome.state == "Succeeded" and raw is None and n > 1 and out_uri:
            # every index succeeded: commit the parts here, with the core's `mergepipe commit` code
            failure = self._commit_parts(mm, job, out_uri, n)
            if failure is not None:
                self.ledger.unreserve(p.ns, adm.get("key", ""), self.admission_quotas(p.ns, adm), job_started=True)
                return {"conditions": p.ready("False", Reason.JOB_FAILED, failure), **extra}
            raw = self.store.get(manifest_uri(out_uri)) if self.store else None
        # Succeeded (or the Job is gone but a manifest is there): verify what was committed
        return self._verified_commit(p, digest, out_uri, raw, outcome.reason, extra)

    def _running_status(
        self,
        p: _Pass,
        job: dict[str, Any] | None,
        outcome: JobOutcome,
        ready: dict[str, Any],
        n: int,
        parts: dict[str, Any] | None,
        seen: dict[str, Any],
    ) -> dict[str, Any] | None:
        """The status of a merge whose Job runs or is queued (``n`` parts, their ``parts`` status;
        ``seen``: the admission marked started, when the Job just started): Ready=False with
        JobRunning (parts done) or Queued (where Kueue holds it), QuotaAdmitted=True once Kueue's
        AdmissionCheck admitted the Job; ``seen`` or ``None`` when nothing else changed."""
        adm = p.status.get("admission") or {}
        message = outcome.message
        if outcome.reason == Reason.QUEUED and job is not None and self.settings.kueue_admission_check:
            message = queued_message("merge Job", job, self.kueue.workload_of(p.ns, job))
        reason = Reason.QUEUED if outcome.reason == Reason.QUEUED else Reason.JOB_RUNNING
        if n > 1 and reason == Reason.JOB_RUNNING and parts:
            message = _parts_message(job, parts)
        if ready.get("message") == message and ready.get("reason") == reason and p.status.get("parts") == parts:
            return seen or None
        new = p.ready("False", reason, message)
        admitted = get_condition(p.conds, "QuotaAdmitted") or {}
        if reason == Reason.JOB_RUNNING and adm.get("admissionCheck") and admitted.get("status") != "True":
            new = set_condition(
                new,
                "QuotaAdmitted",
                "True",
                Reason.ADMITTED,
                f"reserved by Kueue AdmissionCheck {adm['admissionCheck']}; Kueue admitted the Job",
                p.gen,
                p.now,
            )
        return {"conditions": new, **({"parts": parts} if n > 1 else {}), **seen}

    def _verified_commit(
        self,
        p: _Pass,
        digest: str,
        out_uri: str | None,
        raw: bytes | None,
        job_reason: str,
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        """Verify the manifest ``raw`` committed at ``out_uri`` (of plan ``digest``) and its
        outputs; on success create the MergedSnapshot, charge the quotas the expert bytes spent and
        set Ready=True (Committed), else end the reservation (charged: the Job ran) and set
        Ready=False (JobFailed). Raises
        :class:`Retry` while the manifest is missing (the Job ended ``job_reason``)."""
        adm = p.status.get("admission") or {}
        sizes = self.verifier.output_sizes(out_uri, raw)
        ok, reason, message = snapshot_ready(raw, digest, None, object_sizes=sizes)
        if not ok:
            if reason == Reason.MANIFEST_MISSING:
                raise Retry(f"Job {job_reason}; waiting for the committed manifest", 30)
            self.ledger.unreserve(p.ns, adm.get("key", ""), self.admission_quotas(p.ns, adm), job_started=True)
            return {
                "conditions": p.ready("False", Reason.JOB_FAILED, f"snapshot verification failed ({reason}): {message}")
            }
        assert raw is not None  # snapshot_ready found the manifest
        mhash = manifest_hash(raw)
        facts = manifest_facts(json.loads(raw))
        snap = snapshot_name(p.name, mhash)
        self._create_snapshot(p, snap, out_uri, mhash, digest, facts, raw)
        rx = facts.realized.get("expertReadBytes")
        # quotas are charged what was read: after a resumed retry, the earlier attempts' reads too
        spent = facts.spent_expert_bytes
        self.ledger.unreserve(
            p.ns, adm.get("key", ""), self.admission_quotas(p.ns, adm), job_started=True, realized=spent
        )
        return {
            **extra,
            "realized": facts.realized,
            "expertRead": human_bytes(rx),
            "snapshot": snap,
            "conditions": p.ready("True", Reason.COMMITTED, f"snapshot {snap}: {message}"),
        }

    def _create_snapshot(
        self, p: _Pass, snap: str, out_uri: str | None, mhash: str, digest: str, facts: Any, raw: bytes
    ) -> None:
        """Create MergedSnapshot ``snap`` of the manifest (hash ``mhash``) at ``out_uri`` and count
        the commit in the metrics, once (a replayed reconcile gets a 409 and counts nothing)."""
        try:
            self.kube.create(
                SNAPSHOTS,
                p.ns,
                {
                    "apiVersion": API_VERSION,
                    "kind": "MergedSnapshot",
                    "metadata": {
                        "name": snap,
                        "namespace": p.ns,
                        "labels": {LABEL_MERGE: label_value(p.name), LABEL_MANAGED_BY: MANAGER},
                    },
                    "spec": {
                        "uri": out_uri,
                        "manifestHash": mhash,
                        "planDigest": digest,
                        "source": {"name": p.name, "uid": p.body["metadata"]["uid"], "generation": p.gen},
                    },
                },
            )
            _count_commit(facts, raw)  # once: a replayed reconcile gets the 409 below
        except Conflict:
            pass

    def _commit_parts(self, mm: dict[str, Any], job: dict[str, Any] | None, out_uri: str, n: int) -> str | None:
        """Commit the N parts of a succeeded Indexed merge Job (``self.committer``, the core's
        ``mergepipe commit``). Returns ``None`` when committed (by this call or an earlier one),
        else why it was refused (a missing or mismatched part record; the condition message).
        Raises :class:`Retry` when object storage failed (transient)."""
        from mergepipe.errors import MergepipeError

        plan_uri = ((job or {}).get("metadata", {}).get("annotations") or {}).get(ANN_PLAN_URI) or (
            (mm.get("status") or {}).get("plan") or {}
        ).get("uri")
        jname = (job or {}).get("metadata", {}).get("name", "")
        if not plan_uri:
            return f"merge Job {jname} completed, but the plan it executed is not recorded; change the spec to retry"
        try:
            mh = self.committer(plan_uri, out_uri, n)
        except MergepipeError as e:  # CommitConflict, InputError: the parts cannot be committed as they are
            return (
                f"merge Job {jname} completed all {n} parts, but the commit refused them: {e}; "
                "change the spec (or delete and re-create the ModelMerge) to run the merge again"
            )
        except Exception as e:  # object storage unreachable, throttled, ...: transient
            raise Retry(f"commit of the {n} parts of merge Job {jname} failed ({type(e).__name__}): {e}", 30) from None
        meta = mm["metadata"]
        log.info("%s/%s: committed the %d parts of %s: manifest %s", meta["namespace"], meta["name"], n, jname, mh[:12])
        return None

    def finalize_merge(self, body: dict[str, Any]) -> None:
        """Delete the merge's Jobs (a running merge stops) and end its reservation by the
        ledger's one rule (:func:`~..quota.decisions.closing`): charged the manifest's spent bytes
        when its run committed, charged the reservation when its own Job (``status.jobName``; the
        Jobs of earlier generations were settled when superseded) ever started, was seen started
        (``status.admission.started``) or is gone (it may have run), released when it never
        started (pending, unschedulable, suspended: nothing was read; checked before the Jobs are
        deleted, as in :meth:`_supersede`). Reservations of this merge that its status does not
        name (the operator stopped between writing one and the status) are ended by the same
        rule, from the Job of their generation."""
        meta, status = body["metadata"], body.get("status") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        jobs = self.kube.list(JOBS, ns, f"{LABEL_MERGE}={label_value(name)}")
        merge_jobs = [j for j in jobs if _is_merge_job(j)]
        by_gen: dict[str, list[dict[str, Any]]] = {}
        for j in merge_jobs:
            by_gen.setdefault((j["metadata"].get("annotations") or {}).get(ANN_GENERATION, ""), []).append(j)
        started_of = {
            gen: any(self._job_started(ns, j) for j in js) for gen, js in by_gen.items()
        }  # before the Jobs are deleted
        job_name = status.get("jobName")
        own = [j for j in merge_jobs if j["metadata"]["name"] == job_name]
        adm = status.get("admission") or {}
        started = bool(adm.get("started")) or any(self._job_started(ns, j) for j in own) or bool(job_name and not own)
        out_job = _job_output(own[0]) if own else None
        for job in jobs:
            self.kube.delete(JOBS, ns, job["metadata"]["name"])
        ready = get_condition(status.get("conditions"), "Ready") or {}
        now = self.clock()
        if adm.get("key") and ready.get("reason") != Reason.COMMITTED:
            known = self._known_read(
                out_job or ((body.get("spec") or {}).get("output") or {}).get("uri"), status_plan_digest(status)
            )
            how = closing(started, known)
            for q in self.admission_quotas(ns, adm):
                self.ledger.update_quota(ns, q, lambda quota: close(quota, adm["key"], how, now))
        for quota_obj in self.kube.list(QUOTAS, ns):  # reservations the status never named
            for k in keys_of(quota_obj, uid):
                if k == adm.get("key"):
                    continue
                stray = closing(started_of.get(k.rsplit(".", 1)[-1], False), None)

                def end(quota: dict[str, Any], k: str = k, stray: Closing = stray) -> dict[str, Any] | None:
                    return close(quota, k, stray, now)

                self.ledger.update_quota(ns, quota_obj["metadata"]["name"], end)
