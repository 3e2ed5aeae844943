"""kopf handlers: thin wrappers around :class:`Controller`, whose decisions live in
:mod:`mergepipe_operator.decisions`.

Run: ``kopf run --standalone -m mergepipe_operator.main --all-namespaces`` (the chart does).

Flow of a ModelMerge (one pass per generation, idempotent under kopf's retries):
validate the spec -> (fidelity mode: plan to get the estimate) -> admit under every MergeQuota of
the namespace (reservation written with the quota's resourceVersion *before* any Job exists) ->
plan with the admitted budget -> write the plan to object storage -> create the Job (deterministic
name; 409 = already created) -> watch the Job -> on success verify the committed manifest, create
the MergedSnapshot, charge the quotas with the realized bytes -> Ready=True (Committed).

The one piece that needs the core library is :func:`plan_merge`.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kopf

from . import decisions as d
from .crd import API_VERSION
from .kube import JOBS, MERGES, QUOTAS, SNAPSHOTS, Conflict, Kube
from .objectstore import ObjectStore, join, manifest_uri
from .settings import Settings

log = logging.getLogger("mergepipe.operator")

try:
    import prometheus_client as _prom

    ADMISSIONS = _prom.Counter("mergepipe_admissions_total", "Quota admissions of merges", ["result"])
    JOBS_CREATED = _prom.Counter("mergepipe_jobs_created_total", "Merge Jobs created")
    VERIFICATIONS = _prom.Counter("mergepipe_snapshot_verifications_total", "Snapshot verifications", ["reason"])
except ImportError:  # pragma: no cover - metrics are optional
    _prom = None

    class _Noop:
        def labels(self, *a: Any, **k: Any) -> "_Noop":
            return self

        def inc(self, *a: Any) -> None:
            pass

    ADMISSIONS = JOBS_CREATED = VERIFICATIONS = _Noop()  # type: ignore[assignment]

# --- the planner (to be wired to mergepipe.planner) -------------------------------------------------


@dataclass(frozen=True)
class PlanSummary:
    """What the operator needs from planning a merge.

    Attributes:
        digest: plan digest (64 hex); empty when planning could not finish.
        plan_json: the full plan (canonical JSON bytes) for the worker; the operator writes it to
            ``decisions.plan_uri(...)``.
        base_read_bytes, expert_read_bytes, output_write_bytes: the plan's I/O estimate.
        budget_bytes: the budget the plan was made under (``None``: unbounded).
        estimated_fidelity: retained task-vector energy fraction of the plan.
        missing_experts: URIs the catalog has no statistics for (an analyze Job must run first).
    """

    digest: str = ""
    plan_json: bytes = b""
    base_read_bytes: int = 0
    expert_read_bytes: int = 0
    output_write_bytes: int = 0
    budget_bytes: int | None = None
    estimated_fidelity: float | None = None
    missing_experts: tuple[str, ...] = field(default_factory=tuple)


def plan_merge(spec: dict[str, Any], catalog_uri: str | None) -> PlanSummary:
    """Plan a merge in-process from the catalog's index objects (numpy, no torch).

    ``spec`` is the ModelMerge spec with ``budget`` replaced by the admitted budget in bytes (or
    absent for an unbounded/fidelity-driven plan).
    """
    raise NotImplementedError("planner integration pending")


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
        self.planner = planner or (lambda spec, catalog: plan_merge(spec, catalog))
        self.clock = clock

    # ModelMerge ---------------------------------------------------------------------------------

    def reconcile_merge(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """One reconciliation of a ModelMerge; returns the status fields to patch (``None``: no
        change). Raises :class:`Retry` when it must come back later; a :class:`RetryWithStatus`
        carries the status to write first (e.g. Ready=False, QuotaExceeded)."""
        meta, spec = body["metadata"], body.get("spec") or {}
        status = body.get("status") or {}
        gen = meta.get("generation")
        ready = d.get_condition(status.get("conditions"), "Ready")
        if status.get("observedGeneration") == gen and ready and ready.get("reason") in (
            d.Reason.COMMITTED, d.Reason.JOB_RUNNING, d.Reason.JOB_FAILED, d.Reason.INVALID_SPEC,
        ):
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
        first = self._plan(spec, requested, out, conds, gen, now)
        if ready and ready.get("reason") == d.Reason.COMMITTED and status.get("planDigest") == first.digest:
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
            plan = first if budget is None or first.expert_read_bytes <= budget else self._plan(spec, budget, out, conds, gen, now)
        except RetryWithStatus:
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
        job = d.build_job(body, uri, plan.digest, self.settings)
        try:
            self.kube.create(JOBS, ns, job)
            JOBS_CREATED.inc()
        except Conflict:
            pass  # same name = same merge and plan: created by an earlier attempt
        self._supersede(ns, name, status, plan.digest, key, now)
        out.update(
            budget=d.human_bytes(budget) if budget is not None else "unbounded",
            budgetBytes=budget,
            planDigest=plan.digest,
            planURI=uri,
            estimatedFidelity=plan.estimated_fidelity,
            estimated={
                "baseReadBytes": plan.base_read_bytes,
                "expertReadBytes": plan.expert_read_bytes,
                "outputWriteBytes": plan.output_write_bytes,
            },
            realized=None,
            expertRead=None,
            snapshot=None,
            jobName=job["metadata"]["name"],
            admission={"key": key, "budgetBytes": budget, "clamped": adm.clamped, "quotas": quotas},
        )
        conds = d.set_condition(conds, "Planned", "True", "Planned", f"plan {plan.digest[:12]}: {d.human_bytes(plan.expert_read_bytes)} expert reads", gen, now)
        return finish("False", d.Reason.JOB_RUNNING, f"merge Job {job['metadata']['name']} created")

    def _committed_plan(self, out_uri: str) -> str | None:
        """Plan digest of the snapshot already committed at ``out_uri`` ("" if unreadable)."""
        raw = self.store.get(manifest_uri(out_uri)) if self.store else None
        if raw is None:
            return None
        try:
            return str(json.loads(raw).get("plan_digest") or "")
        except (ValueError, AttributeError):
            return ""

    def _plan(self, spec: dict[str, Any], budget: int | None, out: dict[str, Any], conds: list, gen: Any, now: datetime) -> PlanSummary:
        planned_spec = copy.deepcopy(spec)
        planned_spec.pop("budget", None)
        if budget is not None:
            planned_spec["budget"] = budget
        try:
            plan = self.planner(planned_spec, self.settings.catalog_uri)
        except NotImplementedError as e:
            out["conditions"] = d.set_condition(conds, "Ready", "False", d.Reason.PLANNING, f"cannot plan yet: {e}", gen, now)
            raise RetryWithStatus(str(e), 300, out) from None
        if plan.missing_experts:
            msg = "the catalog has no statistics for " + ", ".join(plan.missing_experts) + "; analysis pending"
            out["conditions"] = d.set_condition(conds, "Ready", "False", d.Reason.ANALYZING, msg, gen, now)
            raise RetryWithStatus(msg, 30, out)
        if budget is not None and plan.expert_read_bytes > budget:
            raise RuntimeError(f"planner broke the budget: {plan.expert_read_bytes} > {budget}")
        return plan

    def _supersede(self, ns: str, name: str, old: dict[str, Any], digest: str, key: str, now: datetime) -> None:
        """Retire the previous generation's run: delete Jobs of other plans; its reservation is
        released when the same Job carries on (same plan digest: the new reservation covers it),
        else charged (it may have read, and how much is unknown without a manifest)."""
        for job in self.kube.list(JOBS, ns, f"{d.LABEL_MERGE}={d.label_value(name)}"):
            if (job["metadata"].get("annotations") or {}).get(d.ANN_PLAN_DIGEST) != digest:
                self.kube.delete(JOBS, ns, job["metadata"]["name"])
        adm = old.get("admission") or {}
        ready = d.get_condition(old.get("conditions"), "Ready") or {}
        if not adm.get("key") or adm["key"] == key or ready.get("reason") == d.Reason.COMMITTED:
            return
        same_job = old.get("planDigest") == digest
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
                return True
            except Conflict:
                continue
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
            return None if new == (q.get("status") or {}) else new

        self.update_quota(meta["namespace"], meta["name"], change)

    # Job watching -----------------------------------------------------------------------------------

    def sync_job(self, mm: dict[str, Any], job: dict[str, Any] | None) -> dict[str, Any] | None:
        """Fold the merge Job's state into the ModelMerge; returns status fields to patch."""
        status = mm.get("status") or {}
        gen = mm["metadata"].get("generation")
        ready = d.get_condition(status.get("conditions"), "Ready")
        if not ready or ready.get("reason") != d.Reason.JOB_RUNNING or not status.get("planDigest"):
            return None
        if job is not None and (job["metadata"].get("annotations") or {}).get(d.ANN_PLAN_DIGEST) != status["planDigest"]:
            return None  # a Job of an earlier plan
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
        ok, reason, message = d.snapshot_ready(raw, status["planDigest"], None, object_sizes=sizes)
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
                    "planDigest": status["planDigest"],
                    "source": {"name": name, "uid": mm["metadata"]["uid"], "generation": gen},
                },
            })
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
        Kube.load_config()
        _controller = Controller(settings, Kube(), ObjectStore(settings.s3_endpoint, settings.s3_region))
    return _controller


def _run(fn: Callable[[], dict[str, Any] | None], patch: kopf.Patch) -> None:
    try:
        result = fn()
    except RetryWithStatus as e:
        patch.status.update(e.status)
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
    if result:
        patch.status.update(result)


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
    _run(lambda: controller().reconcile_merge(dict(body)), patch)


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
    _run(lambda: c.sync_job(dict(body), job), patch)


@kopf.on.event(*JOBS, labels={d.LABEL_MANAGED_BY: d.MANAGER})
def job_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    if event.get("type") == "DELETED":
        return
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


@kopf.on.resume(*SNAPSHOTS)
@kopf.on.create(*SNAPSHOTS)
@kopf.on.update(*SNAPSHOTS, field="spec")
def snapshot_changed(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    _run(lambda: controller().verify_snapshot(dict(body)), patch)


@kopf.on.resume(*QUOTAS)
@kopf.on.create(*QUOTAS)
@kopf.on.update(*QUOTAS, field="spec")
@kopf.timer(*QUOTAS, interval=300, initial_delay=60)
def quota_changed(body: kopf.Body, **_: Any) -> None:
    try:
        controller().refresh_quota(dict(body))
    except Retry as e:
        raise kopf.TemporaryError(str(e), delay=e.delay) from None
