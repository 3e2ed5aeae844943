"""kopf handlers: thin wrappers around :class:`Controller`, whose decisions live in
:mod:`mergepipe_operator.decisions`.

Run: ``kopf run --standalone -m mergepipe_operator.main --all-namespaces`` (the chart does).

Flow of a ModelMerge (one pass per generation, idempotent under kopf's retries):
validate the spec -> (fidelity mode: plan to get the estimate) -> admit under every MergeQuota of
the namespace (reservation written with the quota's resourceVersion *before* any Job exists) ->
plan with the admitted budget -> write the plan to object storage -> create the Job (deterministic
name; 409 = already created) -> watch the Job -> on success verify the committed manifest, create
the MergedSnapshot, charge the quotas with the realized bytes -> Ready=True (Committed).

Planning is in-process (:func:`plan_merge`: ``mergepipe.pipeline.build_plan`` over the catalog's
index objects, numpy only). When the catalog lacks an expert's statistics, an analyze Job
(``mergepipe analyze ... --catalog <catalog>``) records them first and the merge waits in
``Analyzing``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kopf

from . import decisions as d
from . import search_decisions as sd
from .crd import API_VERSION
from .kube import JOBS, MERGES, QUOTAS, SEARCHES, SNAPSHOTS, Conflict, Kube
from .objectstore import ObjectStore, join, manifest_uri
from .settings import Settings

log = logging.getLogger("mergepipe.operator")

try:
    import prometheus_client as _prom

    ADMISSIONS = _prom.Counter("mergepipe_admissions_total", "Quota admissions of merges", ["result"])
    JOBS_CREATED = _prom.Counter("mergepipe_jobs_created_total", "Merge Jobs created")
    ANALYZE_JOBS_CREATED = _prom.Counter("mergepipe_analyze_jobs_created_total", "Analyze Jobs created")
    VERIFICATIONS = _prom.Counter("mergepipe_snapshot_verifications_total", "Snapshot verifications", ["reason"])
    COMMITTED = _prom.Counter("mergepipe_merges_committed_total", "Merges committed and verified (MergedSnapshot created)")
    REALIZED_BYTES = _prom.Counter("mergepipe_realized_bytes_total",
                                   "Bytes moved by committed merges, per role, from their manifests", ["role"])
    MERGE_SECONDS = _prom.Histogram("mergepipe_merge_duration_seconds", "Wall time of committed merges (manifest)",
                                    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200))
    QUOTA_USED = _prom.Gauge("mergepipe_quota_used", "MergeQuota use in its current window (status.used)",
                             ["namespace", "quota", "resource"])
    QUOTA_HARD = _prom.Gauge("mergepipe_quota_hard", "MergeQuota limits (status.hard; unset limits have no sample)",
                             ["namespace", "quota", "resource"])
except ImportError:  # pragma: no cover - metrics are optional
    _prom = None

    class _Noop:
        def labels(self, *a: Any, **k: Any) -> "_Noop":
            return self

        def inc(self, *a: Any) -> None:
            pass

        def observe(self, *a: Any) -> None:
            pass

        def set(self, *a: Any) -> None:
            pass

        def remove(self, *a: Any) -> None:
            pass

    ADMISSIONS = JOBS_CREATED = ANALYZE_JOBS_CREATED = VERIFICATIONS = _Noop()  # type: ignore[assignment]
    COMMITTED = REALIZED_BYTES = MERGE_SECONDS = QUOTA_USED = QUOTA_HARD = _Noop()  # type: ignore[assignment]

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


# --- the planner: mergepipe.pipeline.build_plan, in-process ---------------------------------------


@dataclass(frozen=True)
class PlanSummary:
    """What the operator needs from planning a merge.

    Attributes:
        digest: plan digest (64 hex); empty when planning could not finish.
        plan_json: the full plan (canonical JSON bytes) for the worker; the operator writes it to
            ``decisions.plan_uri(...)``.
        base_read_bytes, expert_read_bytes, output_write_bytes: the plan's I/O estimate.
        budget_bytes: the budget the plan was made under (``None``: unbounded).
        retained_energy: fraction of the task-vector energy the plan retains (``status.plan.retainedEnergy``).
        missing_experts: URIs the catalog has no statistics for (an analyze Job must run first).
        analysis_id: content address of that missing analysis (``decisions.analysis_id``).
    """

    digest: str = ""
    plan_json: bytes = b""
    base_read_bytes: int = 0
    expert_read_bytes: int = 0
    output_write_bytes: int = 0
    budget_bytes: int | None = None
    retained_energy: float | None = None
    missing_experts: tuple[str, ...] = field(default_factory=tuple)
    analysis_id: str = ""


class PlanInputError(Exception):
    """The core refused the merge's inputs (a checkpoint that is missing, unreadable or
    incompatible with the base; a parameter that fits no tensor): ``field`` is the spec field it
    names, the message the core's explanation with the fix."""

    def __init__(self, message: str, field: str = "spec"):
        super().__init__(message)
        self.field = field


def _field_of(message: str, spec: dict[str, Any]) -> str:
    """The spec field whose URI a core error message names (the longest match), else ``spec``."""
    best, where = "", "spec"
    cands = [("spec.base.uri", (spec.get("base") or {}).get("uri"))]
    cands += [(f"spec.experts[{i}].uri", ex.get("uri")) for i, ex in enumerate(spec.get("experts") or [])]
    for path, uri in cands:
        u = (uri or "").rstrip("/")
        if u and u in message and len(u) > len(best):
            best, where = u, path
    return where


def plan_merge(spec: dict[str, Any], catalog_uri: str | None, *, storage: Any = None) -> PlanSummary:
    """Plan a merge in-process from the catalog's index objects (numpy, no torch).

    ``spec`` is the ModelMerge spec with ``budget`` replaced by the admitted budget in bytes (or
    absent for an unbounded/fidelity-driven plan). Calls
    ``mergepipe.pipeline.build_plan(ObjectCatalog(storage, catalog_uri), storage, ...,
    analyze=False)``: only shard headers and catalog objects are read, never a tensor.

    Returns:
        the plan, or (``missing_experts``, ``analysis_id``) when the catalog lacks statistics.

    Raises:
        PlanInputError: the core refused the inputs (names the field and the fix).
        mergepipe.storage.base.StorageError: object storage failed (transient: retry).
    """
    from mergepipe.catalog.objectstore import ObjectCatalog
    from mergepipe.errors import InputError
    from mergepipe.pipeline import MissingAnalysis, build_plan
    from mergepipe.storage.base import IOCounters, open_storage

    if not catalog_uri:
        raise PlanInputError("the operator has no catalog; set values catalog.uri (MERGEPIPE_CATALOG_URI)")
    storage = storage if storage is not None else open_storage(None, IOCounters())
    budget = spec.get("budget")
    if budget is not None and not isinstance(budget, int):
        budget = d.parse_quantity(budget, field="spec.budget")
    try:
        plan = build_plan(
            ObjectCatalog(storage, catalog_uri), storage, spec["base"]["uri"].rstrip("/"),
            d.merge_experts(spec), spec["method"], d.merge_params(spec),
            budget=budget, fidelity=spec.get("fidelity"), seed=int(spec.get("seed") or 0),
            block_bytes=d.ANALYZE_BLOCK_BYTES, analyze=False,
        )
    except MissingAnalysis as e:
        return PlanSummary(
            missing_experts=tuple(e.uris),
            analysis_id=d.analysis_id(e.base_identity, e.identities, catalog_uri, spec.get("method")),
        )
    except InputError as e:
        raise PlanInputError(str(e), _field_of(str(e), spec)) from None
    fid = plan.retained_energy
    return PlanSummary(
        digest=plan.digest,
        plan_json=plan.to_json().encode(),
        base_read_bytes=int(plan.io.base_read_bytes),
        expert_read_bytes=int(plan.io.expert_read_bytes),
        output_write_bytes=int(plan.io.output_write_bytes),
        budget_bytes=plan.budget_bytes,
        retained_energy=None if fid is None or fid != fid else min(1.0, max(0.0, float(fid))),
    )


# --- controller -------------------------------------------------------------------------------------


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


class _Done(Exception):
    """This generation's reconciliation ends here with ``status`` (a terminal Ready=False)."""

    def __init__(self, status: dict[str, Any]):
        super().__init__()
        self.status = status


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Controller:
    """The operator's reconciliation, with its I/O injected (tests pass fakes)."""

    def __init__(
        self,
        settings: Settings,
        kube: Kube,
        store: ObjectStore | None,
        planner: Callable[[dict[str, Any], str | None], PlanSummary] | None = None,
        clock: Callable[[], datetime] = _now,
    ):
        self.settings = settings
        self.kube = kube
        self.store = store
        self.planner = planner or (lambda spec, catalog: plan_merge(spec, catalog, storage=self.core_storage()))
        self.clock = clock
        self._core_storage: Any = None

    def core_storage(self) -> Any:
        """The core's storage (reads shard headers and catalog objects while planning), created
        once: it holds the S3 client and its connection pool."""
        if self._core_storage is None:
            from mergepipe.storage.base import IOCounters, open_storage

            self._core_storage = open_storage(None, IOCounters(), endpoint_url=self.settings.s3_endpoint or None)
        return self._core_storage

    # ModelMerge ---------------------------------------------------------------------------------

    def reconcile_merge(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """One reconciliation of a ModelMerge; returns the status fields to patch (``None``: no
        change). Raises :class:`Retry` when it must come back later; a :class:`RetryWithStatus`
        carries the status to write first (e.g. Ready=False, QuotaExceeded)."""
        try:
            return self._reconcile_merge(body)
        except _Done as e:
            return e.status

    def _reconcile_merge(self, body: dict[str, Any]) -> dict[str, Any] | None:
        meta, spec = body["metadata"], body.get("spec") or {}
        status = body.get("status") or {}
        gen = meta.get("generation")
        ready = d.get_condition(status.get("conditions"), "Ready")
        if d.generation_settled(status, gen):
            return None  # this generation already went as far as reconcile takes it
        now = self.clock()
        conds = status.get("conditions") or []
        out: dict[str, Any] = {"observedGeneration": gen, "expertCount": len(spec.get("experts") or []), "method": spec.get("method")}

        def finish(ready_status: str, reason: str, message: str, **extra: Any) -> dict[str, Any]:
            out.update(extra)
            out["conditions"] = d.set_condition(conds, "Ready", ready_status, reason, message, gen, now)
            return out

        issues = d.validate_merge_spec(spec)
        if issues:
            return finish("False", d.Reason.INVALID_SPEC, d.format_issues(issues))

        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        key = d.admission_key(uid, gen)
        requested = d.requested_budget(spec, self.settings)
        # Planning is in-process and cheap: plan first, so the quota is charged with what the
        # plan will read (<= the budget), not with the whole budget.
        first = self._plan(body, requested, out, conds, gen, now)
        conds = d.set_condition(conds, "Analyzed", "True", "Analyzed",
                                f"the catalog has statistics for all {len(spec['experts'])} expert(s)", gen, now)
        if ready and ready.get("reason") == d.Reason.COMMITTED and d.status_plan_digest(status) == first.digest:
            # the new generation plans to the same digest: its snapshot is already committed
            return finish("True", d.Reason.COMMITTED, f"plan unchanged; {ready.get('message', '')}".strip())
        adm, quotas = self.reserve(ns, name, key, first.expert_read_bytes, now)
        ADMISSIONS.labels(adm.reason).inc()
        if not adm.allowed:
            conds = d.set_condition(conds, "QuotaAdmitted", "False", d.Reason.QUOTA_EXCEEDED, adm.message, gen, now)
            status_out = finish("False", d.Reason.QUOTA_EXCEEDED, adm.message)
            raise RetryWithStatus(adm.message, self.settings.quota_retry_seconds, status_out)
        conds = d.set_condition(conds, "QuotaAdmitted", "True", adm.reason if adm.reason != d.Reason.ALREADY_ADMITTED else d.Reason.ADMITTED, adm.message, gen, now)
        budget = adm.budget if adm.clamped else requested
        try:
            plan = first if budget is None or first.expert_read_bytes <= budget else self._plan(body, budget, out, conds, gen, now)
        except (RetryWithStatus, _Done):
            self.unreserve(ns, key, quotas, job_started=False)
            raise
        if self.store is None:
            raise RuntimeError("the operator has no object store configured")
        out_uri = spec["output"]["uri"]
        other = self._committed_plan(out_uri)
        if other is not None and other != plan.digest:
            # snapshots are immutable: the worker would refuse this output (and fail the Job)
            self.unreserve(ns, key, quotas, job_started=False)
            return finish("False", d.Reason.INVALID_SPEC,
                          f"spec.output.uri: {out_uri} already holds a committed snapshot of another plan "
                          f"({other[:12]}); snapshots are immutable, choose a new output.uri")
        uri = d.plan_uri(self.settings, ns, name, plan.digest)
        self.store.put(uri, plan.plan_json)
        merge_jobs = [j for j in self.kube.list(JOBS, ns, f"{d.LABEL_MERGE}={d.label_value(name)}")
                      if (j["metadata"].get("labels") or {}).get(d.LABEL_COMPONENT, "merge") == "merge"]
        choice = d.choose_job(merge_jobs, d.ANN_PLAN_DIGEST, plan.digest, gen)
        job = choice.follow
        if job is None:
            job = d.build_job(body, uri, plan.digest, self.settings, retry_generation=choice.retry_generation)
            try:
                self.kube.create(JOBS, ns, job)
                JOBS_CREATED.inc()
            except Conflict:
                pass  # same name = same merge, plan and attempt: created by an earlier attempt
        self._supersede(ns, name, status, plan.digest, key, now)
        out.update(
            budget=d.human_bytes(budget) if budget is not None else "unbounded",
            budgetBytes=budget,
            plan=d.plan_status(plan.digest, uri, plan.base_read_bytes, plan.expert_read_bytes,
                               plan.output_write_bytes, plan.retained_energy),
            realized=None,
            expertRead=None,
            snapshot=None,
            jobName=job["metadata"]["name"],
            admission={"key": key, "budgetBytes": budget, "clamped": adm.clamped, "quotas": quotas},
        )
        conds = d.set_condition(conds, "Planned", "True", "Planned", f"plan {plan.digest[:12]}: {d.human_bytes(plan.expert_read_bytes)} expert reads", gen, now)
        verb = "created" if choice.follow is None else "carries on (same plan)"
        return finish("False", d.Reason.JOB_RUNNING, f"merge Job {job['metadata']['name']} {verb}")

    def _committed_plan(self, out_uri: str) -> str | None:
        """Plan digest of the snapshot already committed at ``out_uri`` ("" if unreadable)."""
        raw = self.store.get(manifest_uri(out_uri)) if self.store else None
        if raw is None:
            return None
        try:
            return str(json.loads(raw).get("plan_digest") or "")
        except (ValueError, AttributeError):
            return ""

    def _plan(self, body: dict[str, Any], budget: int | None, out: dict[str, Any], conds: list, gen: Any, now: datetime) -> PlanSummary:
        """Plan under ``budget``; when the catalog lacks statistics, see to the analyze Job
        (:meth:`_await_analysis`). Raises :class:`RetryWithStatus` (come back later) or
        :class:`_Done` (Ready=False for good: invalid inputs, failed analysis)."""
        spec = body.get("spec") or {}
        planned_spec = copy.deepcopy(spec)
        planned_spec.pop("budget", None)
        if budget is not None:
            planned_spec["budget"] = budget
        plan = self._call_planner(body, planned_spec, out, conds, gen, now)
        if plan.missing_experts and self._await_analysis(body, plan, out, conds, gen, now, final=False):
            # the analyze Job completed, possibly after the planner read the catalog: plan again
            plan = self._call_planner(body, planned_spec, out, conds, gen, now)
            if plan.missing_experts:
                self._await_analysis(body, plan, out, conds, gen, now, final=True)
        if budget is not None and plan.expert_read_bytes > budget:
            raise RuntimeError(f"planner broke the budget: {plan.expert_read_bytes} > {budget}")
        return plan

    def _call_planner(self, body: dict[str, Any], planned_spec: dict[str, Any], out: dict[str, Any], conds: list, gen: Any,
                      now: datetime) -> PlanSummary:
        """``self.planner`` with its errors mapped to statuses (see :meth:`_plan`)."""
        try:
            return self.planner(planned_spec, self.settings.catalog_uri)
        except NotImplementedError as e:
            out["conditions"] = d.set_condition(conds, "Ready", "False", d.Reason.PLANNING, f"cannot plan yet: {e}", gen, now)
            raise RetryWithStatus(str(e), 300, out) from None
        except PlanInputError as e:
            msg = f"{e.field}: the planner refused the inputs: {e}"
            out["conditions"] = d.set_condition(conds, "Ready", "False", d.Reason.INVALID_SPEC, msg, gen, now)
            raise _Done(out) from None
        except Exception as e:  # object storage unreachable, throttled, ...: transient
            msg = f"cannot plan yet ({type(e).__name__}): {e}"
            log.warning("%s/%s: %s", body["metadata"].get("namespace"), body["metadata"].get("name"), msg)
            out["conditions"] = d.set_condition(conds, "Ready", "False", d.Reason.PLANNING, msg, gen, now)
            raise RetryWithStatus(msg, 30, out) from None

    def _await_analysis(self, body: dict[str, Any], plan: PlanSummary, out: dict[str, Any], conds: list, gen: Any,
                        now: datetime, *, final: bool) -> bool:
        """The catalog lacks statistics for ``plan.missing_experts``: create the analyze Job
        (deterministic name: a retry or a restarted operator finds it), then come back every
        ``analyze_poll_seconds`` until it finished. Returns ``True`` when the Job has completed
        and ``final`` is false (the caller plans again: the Job may have written the statistics
        after the planner read the catalog). Otherwise raises: :class:`RetryWithStatus`
        (Analyzing, or QuotaExceeded when the namespace's quota could not admit any merge, so no
        expert bytes are read for a merge that cannot run) or :class:`_Done` (JobFailed; with
        ``final``, a completed Job whose statistics are still missing)."""
        meta, spec = body["metadata"], body.get("spec") or {}
        ns, name = meta["namespace"], meta["name"]
        if not plan.analysis_id:
            raise RuntimeError("the planner reported missing statistics without an analysis id")
        what = f"{len(plan.missing_experts)} expert(s) ({', '.join(plan.missing_experts)})"
        analyze_jobs = self.kube.list(JOBS, ns, f"{d.LABEL_MERGE}={d.label_value(name)},{d.LABEL_COMPONENT}=analyze")
        # a complete analyze Job whose statistics are still missing is as good as failed
        choice = d.choose_job(analyze_jobs, d.ANN_ANALYSIS, plan.analysis_id, gen, usable=frozenset({"Running"}))
        job = choice.follow
        jname = job["metadata"]["name"] if job else d.analyze_job_name(name, plan.analysis_id, choice.retry_generation)
        if job is None:
            refusal = self._quota_precheck(ns, d.admission_key(meta["uid"], gen), now)
            if refusal:
                c = d.set_condition(conds, "QuotaAdmitted", "False", d.Reason.QUOTA_EXCEEDED, refusal, gen, now)
                out["conditions"] = d.set_condition(c, "Ready", "False", d.Reason.QUOTA_EXCEEDED, refusal, gen, now)
                raise RetryWithStatus(refusal, self.settings.quota_retry_seconds, out)
            try:
                job = self.kube.create(JOBS, ns, d.build_analyze_job(body, plan.missing_experts, plan.analysis_id, self.settings,
                                                                     retry_generation=choice.retry_generation))
                ANALYZE_JOBS_CREATED.inc()
                log.info("%s/%s: analyze Job %s created for %s", ns, name, jname, what)
            except Conflict:  # created by an earlier attempt
                job = self.kube.get(JOBS, ns, jname)
        outcome = d.job_outcome(job) if job is not None else d.JobOutcome("Running", d.Reason.JOB_RUNNING, "")
        if outcome.state == "Succeeded" and not final:
            return True
        if outcome.state != "Running":
            if outcome.state == "Failed":
                msg = f"analyze Job {jname} failed ({outcome.reason}): {outcome.message}"
            else:
                msg = (f"analyze Job {jname} completed, but the catalog {self.settings.catalog_uri} still has no "
                       f"statistics for {what}; check that the Job and the operator use the same catalog and S3 endpoint")
            msg += "; fix the cause, then change the spec (or delete and re-create the ModelMerge) to retry"
            c = d.set_condition(conds, "Analyzed", "False", d.Reason.JOB_FAILED, msg, gen, now)
            out["conditions"] = d.set_condition(c, "Ready", "False", d.Reason.JOB_FAILED, msg, gen, now)
            raise _Done(out)
        msg = f"analyze Job {jname} is recording the catalog statistics of {what}"
        c = d.set_condition(conds, "Analyzed", "False", d.Reason.ANALYZING, msg, gen, now)
        out["conditions"] = d.set_condition(c, "Ready", "False", d.Reason.ANALYZING, msg, gen, now)
        raise RetryWithStatus(msg, self.settings.analyze_poll_seconds, out)

    def _quota_precheck(self, ns: str, key: str, now: datetime) -> str | None:
        """Why no MergeQuota of ``ns`` could admit any merge now (no merge left in the window, or
        no expert byte left under Reject or Clamp), or ``None``. Nothing is written: the real
        admission, with the plan's bytes, comes after planning."""
        for q in self.kube.list(QUOTAS, ns):
            try:
                a = d.admit(q, 1, now, key=key)
            except d.QuantityError as e:
                return f"invalid MergeQuota: {e}"
            if not a.allowed:
                return f"{a.message} (not analyzing the experts of a merge that cannot be admitted)"
        return None

    def _supersede(self, ns: str, name: str, old: dict[str, Any], digest: str, key: str, now: datetime) -> None:
        """Retire the previous generation's run: delete Jobs of other plans; its reservation is
        released when the same Job carries on (same plan digest: the new reservation covers it),
        else charged (it may have read, and how much is unknown without a manifest)."""
        for job in self.kube.list(JOBS, ns, f"{d.LABEL_MERGE}={d.label_value(name)}"):
            if (job["metadata"].get("labels") or {}).get(d.LABEL_COMPONENT, "merge") != "merge":
                continue  # analyze Jobs are not superseded: their statistics serve any plan
            if (job["metadata"].get("annotations") or {}).get(d.ANN_PLAN_DIGEST) != digest:
                self.kube.delete(JOBS, ns, job["metadata"]["name"])
        adm = old.get("admission") or {}
        ready = d.get_condition(old.get("conditions"), "Ready") or {}
        if not adm.get("key") or adm["key"] == key or ready.get("reason") == d.Reason.COMMITTED:
            return
        same_job = d.status_plan_digest(old) == digest
        for q in adm.get("quotas") or []:
            if same_job:
                self.update_quota(ns, q, lambda quota: d.release(quota, adm["key"], now))
            else:
                self.update_quota(ns, q, lambda quota: d.settle(quota, adm["key"], None, now))

    # quotas -----------------------------------------------------------------------------------------

    def update_quota(self, ns: str, name: str, change: Callable[[dict[str, Any]], dict[str, Any] | None], attempts: int = 8) -> bool:
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

    def reserve(self, ns: str, merge: str, key: str, requested: int | None, now: datetime) -> tuple[d.Admission, list[str]]:
        """Admit under every MergeQuota of ``ns``: the final budget is the smallest any quota
        allows; a reservation for it is written to each quota with its resourceVersion. A lost
        race rolls back this attempt's reservations and starts over, so concurrent merges never
        overspend a quota."""
        for _ in range(8):
            quotas = self.kube.list(QUOTAS, ns)
            if not quotas:
                return d.Admission(True, requested, d.Reason.ADMITTED, "no MergeQuota in the namespace", {}), []
            budget, clamped, messages = requested, False, []
            for q in quotas:  # dry run: the final budget
                try:
                    a = d.admit(q, budget, now, key=key, merge=merge)
                except d.QuantityError as e:  # a broken quota blocks (fails closed)
                    return d.Admission(False, None, d.Reason.QUOTA_EXCEEDED, f"invalid MergeQuota: {e}", {}), []
                if not a.allowed:
                    return a, []
                budget, clamped = a.budget, clamped or a.clamped
                messages.append(a.message)
            written: list[str] = []
            lost = False
            for q in quotas:
                a = d.admit(q, budget, now, key=key, merge=merge)
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
                    self.update_quota(ns, qn, lambda quota: d.release(quota, key, now))
                continue
            reason = d.Reason.CLAMPED if clamped else d.Reason.ADMITTED
            names = [q["metadata"]["name"] for q in quotas]
            return d.Admission(True, budget, reason, "; ".join(messages), {}), names
        raise Retry("MergeQuota contention; will retry", 5)

    def unreserve(self, ns: str, key: str, quotas: list[str], *, job_started: bool, realized: int | None = None) -> None:
        now = self.clock()
        for q in quotas:
            if job_started:
                self.update_quota(ns, q, lambda quota: d.settle(quota, key, realized, now))
            else:
                self.update_quota(ns, q, lambda quota: d.release(quota, key, now))

    def refresh_quota(self, body: dict[str, Any]) -> None:
        """Recompute used/hard, age the rolling window, set Ready (conditioned write)."""
        meta = body["metadata"]

        def change(q: dict[str, Any]) -> dict[str, Any] | None:
            now = self.clock()
            gen = q["metadata"].get("generation")
            try:
                new = d.quota_status(q, now)
                cond = ("True", "Active", "quota enforced")
            except d.QuantityError as e:
                new = dict(q.get("status") or {})
                cond = ("False", d.Reason.INVALID_SPEC, str(e))
            new["conditions"] = d.set_condition(new.get("conditions"), "Ready", *cond, gen, now)
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

    # Job watching -----------------------------------------------------------------------------------

    def sync_job(self, mm: dict[str, Any], job: dict[str, Any] | None) -> dict[str, Any] | None:
        """Fold the merge Job's state into the ModelMerge; returns status fields to patch."""
        status = mm.get("status") or {}
        gen = mm["metadata"].get("generation")
        ready = d.get_condition(status.get("conditions"), "Ready")
        digest = d.status_plan_digest(status)
        if not ready or ready.get("reason") != d.Reason.JOB_RUNNING or not digest:
            return None
        if job is not None and (
            (job["metadata"].get("annotations") or {}).get(d.ANN_PLAN_DIGEST) != digest
            or (status.get("jobName") and job["metadata"].get("name") != status["jobName"])
        ):
            return None  # a Job of an earlier plan, or an earlier (failed) run of this plan
        now = self.clock()
        conds = status.get("conditions") or []
        ns, name = mm["metadata"]["namespace"], mm["metadata"]["name"]
        adm = status.get("admission") or {}
        outcome = d.job_outcome(job)
        out_uri = (mm.get("spec") or {}).get("output", {}).get("uri")
        if outcome.state == "Running":
            if ready.get("message") == outcome.message:
                return None
            return {"conditions": d.set_condition(conds, "Ready", "False", d.Reason.JOB_RUNNING, outcome.message, gen, now)}
        raw = self.store.get(manifest_uri(out_uri)) if out_uri and self.store else None
        if outcome.state == "Failed" and raw is None:
            self.unreserve(ns, adm.get("key", ""), adm.get("quotas") or [], job_started=True)
            return {"conditions": d.set_condition(conds, "Ready", "False", d.Reason.JOB_FAILED, outcome.message, gen, now)}
        # Succeeded (or the Job is gone but a manifest is there): verify what was committed
        sizes = self._output_sizes(out_uri, raw)
        ok, reason, message = d.snapshot_ready(raw, digest, None, object_sizes=sizes)
        if not ok:
            if reason == d.Reason.MANIFEST_MISSING:
                raise Retry(f"Job {outcome.reason}; waiting for the committed manifest", 30)
            self.unreserve(ns, adm.get("key", ""), adm.get("quotas") or [], job_started=True)
            return {"conditions": d.set_condition(conds, "Ready", "False", d.Reason.JOB_FAILED, f"snapshot verification failed ({reason}): {message}", gen, now)}
        mhash = d.manifest_hash(raw)
        facts = d.manifest_facts(json.loads(raw))
        snap = d.snapshot_name(name, mhash)
        try:
            self.kube.create(SNAPSHOTS, ns, {
                "apiVersion": API_VERSION,
                "kind": "MergedSnapshot",
                "metadata": {"name": snap, "namespace": ns, "labels": {d.LABEL_MERGE: d.label_value(name), d.LABEL_MANAGED_BY: d.MANAGER}},
                "spec": {
                    "uri": out_uri,
                    "manifestHash": mhash,
                    "planDigest": digest,
                    "source": {"name": name, "uid": mm["metadata"]["uid"], "generation": gen},
                },
            })
            _count_commit(facts, raw)  # once: a replayed reconcile gets the 409 below
        except Conflict:
            pass
        rx = facts.realized.get("expertReadBytes")
        self.unreserve(ns, adm.get("key", ""), adm.get("quotas") or [], job_started=True, realized=rx)
        return {
            "realized": facts.realized,
            "expertRead": d.human_bytes(rx),
            "snapshot": snap,
            "conditions": d.set_condition(conds, "Ready", "True", d.Reason.COMMITTED, f"snapshot {snap}: {message}", gen, now),
        }

    def _output_sizes(self, prefix: str | None, raw: bytes | None) -> dict[str, int | None] | None:
        """HEAD every output listed in the manifest: ``{path relative to prefix: size or None}``."""
        if raw is None or prefix is None or self.store is None:
            return None
        try:
            facts = d.manifest_facts(json.loads(raw))
        except ValueError:
            return None
        paths = [d.output_path(facts, name) for name in facts.outputs]
        return {p: self.store.head_size(join(prefix, p)) for p in paths}

    # MergedSnapshot ---------------------------------------------------------------------------------

    def verify_snapshot(self, body: dict[str, Any]) -> dict[str, Any] | None:
        spec, status = body.get("spec") or {}, body.get("status") or {}
        gen = body["metadata"].get("generation")
        ready = d.get_condition(status.get("conditions"), "Ready")
        if ready and ready.get("status") == "True" and status.get("observedGeneration") == gen:
            return None
        now = self.clock()
        raw = self.store.get(manifest_uri(spec["uri"])) if self.store else None
        ok, reason, message = d.snapshot_ready(
            raw, spec.get("planDigest"), spec.get("manifestHash"), object_sizes=self._output_sizes(spec["uri"], raw)
        )
        VERIFICATIONS.labels(reason).inc()
        out: dict[str, Any] = {"observedGeneration": gen}
        if ok:
            facts = d.manifest_facts(json.loads(raw))
            out.update(
                verifiedTime=d.rfc3339(now),
                planDigest=facts.plan_digest,
                sizes={"totalBytes": facts.total_bytes, "files": len(facts.outputs)},
                totalSize=d.human_bytes(facts.total_bytes),
                estimated=facts.estimated,
                realized=facts.realized,
                expertRead=d.human_bytes(facts.realized.get("expertReadBytes")),
            )
        out["conditions"] = d.set_condition(status.get("conditions"), "Ready", ok, reason, message, gen, now)
        if reason == d.Reason.MANIFEST_MISSING:
            raise RetryWithStatus(message, 60, out)
        return out

    # MergeSearch ------------------------------------------------------------------------------------

    def reconcile_search(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """One reconciliation of a MergeSearch (create/update/resume): validate, start this
        generation's driver Job (409: it exists already, carry on), delete the driver Jobs of
        earlier generations (their candidates and snapshots stay), then mirror the results.
        Returns the status fields to patch (``None``: nothing changes)."""
        meta, spec = body["metadata"], body.get("spec") or {}
        status = body.get("status") or {}
        gen = meta.get("generation")
        ready = d.get_condition(status.get("conditions"), "Ready")
        if status.get("observedGeneration") == gen and ready and ready.get("reason") in (
                sd.SearchReason.COMPLETED, *sd.TERMINAL_SEARCH_REASONS):
            return None
        issues = sd.validate_search_spec(spec)
        if issues:
            now = self.clock()
            return {"observedGeneration": gen, "conditions": d.set_condition(
                status.get("conditions"), "Ready", "False", sd.SearchReason.INVALID_SPEC, d.format_issues(issues), gen, now)}
        ns, name = meta["namespace"], meta["name"]
        job = sd.build_driver_job(body, self.settings)
        jname = job["metadata"]["name"]
        for old in self.kube.list(JOBS, ns, f"{sd.LABEL_SEARCH}={d.label_value(name)}"):
            if old["metadata"]["name"] != jname and (old["metadata"].get("annotations") or {}).get(sd.ANN_SEARCH) == name:
                self.kube.delete(JOBS, ns, old["metadata"]["name"])  # an earlier generation's search stops
        try:
            self.kube.create(JOBS, ns, job)
            JOBS_CREATED.inc()
        except Conflict:
            pass  # same generation: created by an earlier attempt (or before a restart)
        return self.sync_search(body, self.kube.get(JOBS, ns, jname) or job)

    def sync_search(self, body: dict[str, Any], job: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Mirror the driver's results and its Job's state into the MergeSearch status; returns the
        fields to patch, or ``None`` when nothing changed (an unreadable results object is
        logged and skipped: the driver rewrites it after the next candidate)."""
        meta, spec = body["metadata"], body.get("spec") or {}
        gen = meta.get("generation")
        jname = sd.driver_job_name(meta["name"], gen)
        if job is None:
            job = self.kube.get(JOBS, meta["namespace"], jname)
        raw = self.store.get(sd.results_uri(spec, gen)) if self.store else None
        try:
            results = sd.parse_results(raw)
        except sd.ResultsError as e:
            log.warning("MergeSearch %s/%s: %s", meta["namespace"], meta["name"], e)
            results = None
        new = sd.search_status(body, results, d.job_outcome(job, "driver Job"), jname, self.clock())
        return new if sd.status_changed(body.get("status"), new) else None

    # deletion ---------------------------------------------------------------------------------------

    def finalize_merge(self, body: dict[str, Any]) -> None:
        """Delete the merge's Jobs (a running merge stops) and settle its reservation."""
        meta, status = body["metadata"], body.get("status") or {}
        ns, name = meta["namespace"], meta["name"]
        jobs = self.kube.list(JOBS, ns, f"{d.LABEL_MERGE}={d.label_value(name)}")
        for job in jobs:
            self.kube.delete(JOBS, ns, job["metadata"]["name"])
        adm = status.get("admission") or {}
        ready = d.get_condition(status.get("conditions"), "Ready") or {}
        if adm.get("key") and ready.get("reason") != d.Reason.COMMITTED:
            self.unreserve(ns, adm["key"], adm.get("quotas") or [], job_started=bool(jobs or status.get("jobName")))


# --- kopf wiring ----------------------------------------------------------------------------------

_controller: Controller | None = None


def controller() -> Controller:
    global _controller
    if _controller is None:
        settings = Settings.from_env()
        if settings.s3_region:  # the core's S3 client takes the region from the environment
            os.environ.setdefault("AWS_REGION", settings.s3_region)
            os.environ.setdefault("AWS_DEFAULT_REGION", settings.s3_region)
        Kube.load_config()
        _controller = Controller(settings, Kube(), ObjectStore(settings.s3_endpoint, settings.s3_region))
    return _controller


def post_events(obj: Any, old_status: dict[str, Any] | None, new_status: dict[str, Any] | None) -> None:
    """Post a Kubernetes Event on ``obj`` for each condition transition between the two statuses
    (:func:`decisions.transition_events`), through kopf's event poster (never blocks)."""
    if not new_status or "conditions" not in new_status:
        return
    for ev in d.transition_events((old_status or {}).get("conditions"), new_status["conditions"]):
        kopf.event(obj, type=ev.type, reason=ev.reason, message=ev.message)


def _run(fn: Callable[[], dict[str, Any] | None], patch: kopf.Patch, body: kopf.Body) -> None:
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


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = d.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="mergepipe.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="mergepipe.io", key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    c = controller()
    if c.settings.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(c.settings.metrics_port)


@kopf.on.resume(*MERGES)
@kopf.on.create(*MERGES)
@kopf.on.update(*MERGES, field="spec")
def merge_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    _run(lambda: controller().reconcile_merge(dict(body)), patch, body)


@kopf.on.delete(*MERGES)
def merge_deleted(body: kopf.Body, **_: Any) -> None:
    try:
        controller().finalize_merge(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None


def _job_running(status: dict[str, Any], **_: Any) -> bool:
    ready = d.get_condition((status or {}).get("conditions"), "Ready")
    return bool(ready and ready.get("reason") == d.Reason.JOB_RUNNING)


@kopf.timer(*MERGES, interval=60, initial_delay=30, when=_job_running)
def merge_job_poll(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Safety net for missed Job events (and for Jobs removed by their TTL)."""
    c = controller()
    st = body.get("status") or {}
    job = c.kube.get(JOBS, body["metadata"]["namespace"], st.get("jobName", "")) if st.get("jobName") else None
    _run(lambda: c.sync_job(dict(body), job), patch, body)


@kopf.on.event(*JOBS, labels={d.LABEL_MANAGED_BY: d.MANAGER})
def job_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    if event.get("type") == "DELETED":
        return
    if (body["metadata"].get("labels") or {}).get(d.LABEL_COMPONENT) in ("analyze", "search"):
        return  # the merge's handler polls its analyze Job (kopf cannot wake a delayed handler); search: below
    c = controller()
    ns = body["metadata"]["namespace"]
    mm_name = (body["metadata"].get("annotations") or {}).get(d.ANN_MERGE)
    mm = c.kube.get(MERGES, ns, mm_name) if mm_name else None
    if mm is None:
        return  # owner gone (replayed event)
    try:
        result = c.sync_job(mm, dict(body))
    except Retry as e:
        log.info("job %s/%s: %s", ns, body["metadata"]["name"], e)  # the timer retries
        return
    if result:
        c.kube.patch_status(MERGES, ns, mm_name, result)
        post_events(mm, mm.get("status"), result)


@kopf.on.resume(*SNAPSHOTS)
@kopf.on.create(*SNAPSHOTS)
@kopf.on.update(*SNAPSHOTS, field="spec")
def snapshot_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    _run(lambda: controller().verify_snapshot(dict(body)), patch, body)


@kopf.on.resume(*SEARCHES)
@kopf.on.create(*SEARCHES)
@kopf.on.update(*SEARCHES, field="spec")
def search_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    _run(lambda: controller().reconcile_search(dict(body)), patch, body)


def _searching(status: dict[str, Any], **_: Any) -> bool:
    ready = d.get_condition((status or {}).get("conditions"), "Ready")
    return bool(ready and ready.get("reason") == sd.SearchReason.SEARCHING)


#: Seconds between reads of a running search's results (MERGEPIPE_SEARCH_POLL_SECONDS, read when
#: the operator starts; kopf fixes a timer's interval when the handler is registered).
SEARCH_POLL_SECONDS = float(os.environ.get("MERGEPIPE_SEARCH_POLL_SECONDS") or Settings.search_poll_seconds)


@kopf.timer(*SEARCHES, interval=SEARCH_POLL_SECONDS, initial_delay=SEARCH_POLL_SECONDS, when=_searching)
def search_poll(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """Mirror the running search's results (the driver rewrites them after every candidate)."""
    _run(lambda: controller().sync_search(dict(body)), patch, body)


@kopf.on.event(*JOBS, labels={d.LABEL_MANAGED_BY: d.MANAGER, d.LABEL_COMPONENT: "search"})
def search_job_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    """The driver Job changed (started, completed, failed): mirror at once."""
    if event.get("type") == "DELETED":
        return
    c = controller()
    ns = body["metadata"]["namespace"]
    name = (body["metadata"].get("annotations") or {}).get(sd.ANN_SEARCH)
    ms = c.kube.get(SEARCHES, ns, name) if name else None
    gen = (ms or {}).get("metadata", {}).get("generation")
    if ms is None or sd.job_generation(body) != gen or (ms.get("status") or {}).get("observedGeneration") != gen:
        return  # owner gone, an earlier generation's driver, or the search handler has not written its status yet
    result = c.sync_search(ms, dict(body))
    if result:
        c.kube.patch_status(SEARCHES, ns, name, result)
        post_events(ms, ms.get("status"), result)


@kopf.on.resume(*QUOTAS)
@kopf.on.create(*QUOTAS)
@kopf.on.update(*QUOTAS, field="spec")
@kopf.timer(*QUOTAS, interval=300, initial_delay=60)
def quota_changed(body: kopf.Body, **_: Any) -> None:
    try:
        controller().refresh_quota(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None


@kopf.on.delete(*QUOTAS, optional=True)
def quota_deleted(body: kopf.Body, **_: Any) -> None:
    """No finalizer (optional): when seen, drop the deleted quota's gauge samples."""
    Controller.forget_quota(body["metadata"]["namespace"], body["metadata"]["name"])
