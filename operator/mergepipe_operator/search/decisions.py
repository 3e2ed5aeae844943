"""Pure decisions of the MergeSearch reconciler (issue 7 item 5): validation, the driver Job, and
the status mirrored from the search's results.

Design. A MergeSearch runs as one *driver* Job per generation, ``<name>-search-g<generation>``
(deterministic: a second reconciliation or a restarted operator gets 409 and carries on). The
driver runs ``mergepipe search`` (the merger image: botorch proposes on CPU) with its state under
``<spec.output.uri>/g<generation>/`` in object storage, so a restarted driver pod resumes the
search from its state. Its workers are Kubernetes objects, not threads: each candidate is a child
``ModelMerge`` ``<name>-c<NNNN>`` (ownerReference to the MergeSearch, labels naming the search and
the candidate) whose layer-wise parameters are the candidate's point, so quota admission and
charging, planning, the merge Job and the MergedSnapshot all come from the ModelMerge path;
then an evaluation Job ``<name>-e<NNNN>`` (:func:`eval_job_template`: the search's resources,
GPUs included) runs ``mergepipe search-eval`` with the evaluator command on the committed
snapshot URI and writes the metrics under the state prefix for the driver. The driver rewrites
``results.json`` (the core's :func:`mergepipe.search.runner.results`, without the trace) under
the state prefix after every finished candidate; the operator mirrors it into the status. The
operator never computes the hypervolume itself: that needs torch, which the operator image lacks.

Everything here is a pure function of its arguments (unit-tested without a cluster).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from mergepipe.methods.registry import METHODS as CORE_METHODS

from ..k8s.conditions import Reason, set_condition
from ..k8s.images import image_issue
from ..k8s.jobs import JobOutcome, owner_reference, worker_job
from ..k8s.model import GROUP
from ..k8s.names import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGER,
    dns_label,
    label_value,
)
from ..modelmerge.request import spec_settings
from ..modelmerge.spec import Issue, _pydantic_issues, validate_merge_spec
from ..settings import Settings
from ..snapshot.decisions import snapshot_name
from .model import MergeSearchSpec, ObjectiveSpec

LABEL_SEARCH = f"{GROUP}/merge-search"
LABEL_CANDIDATE = f"{GROUP}/search-candidate"
ANN_SEARCH = f"{GROUP}/merge-search"
ANN_GENERATION = f"{GROUP}/generation"
RESULTS_NAME = "results.json"
#: activeDeadlineSeconds of a driver Job (7 days; at least the merge Jobs' deadline).
DRIVER_DEADLINE_SECONDS = 7 * 86400
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
STATE_NAME = "state.json"
#: the MergeSearch fields every candidate ModelMerge gets as they are (checked as a ModelMerge's)
MERGE_FIELDS = ("base", "experts", "method", "parameters", "budget", "sketch", "blockValue", "calibration", "output")


class SearchReason:
    """Reasons of a MergeSearch's ``Ready`` condition."""

    SEARCHING = "Searching"
    #: the driver Job exists but Kueue holds it suspended until it admits it
    QUEUED = Reason.QUEUED
    COMPLETED = "Completed"
    FAILED = Reason.SEARCH_FAILED
    INVALID_SPEC = "InvalidSpec"


#: Ready=False reasons that only a spec change ends.
TERMINAL_SEARCH_REASONS = frozenset({SearchReason.FAILED, SearchReason.INVALID_SPEC})


# --- validation ---------------------------------------------------------------------------------


def validate_search_spec(spec: Mapping[str, Any]) -> list[Issue]:
    """Problems in a MergeSearch spec, as ``(field path, message)``; empty when valid.

    The schema checks (pydantic model = the CRD's schema and CEL rules), then what every candidate
    merge would be refused for (the ModelMerge checks of :func:`decisions.validate_merge_spec` on
    base, experts, method, fixed parameters, budget, sketch, block value, calibration set and
    output: :data:`MERGE_FIELDS`), then the varied parameters:
    each must be a parameter of the method, a global one cannot be varied per expert, and it
    cannot also be fixed in the same scope.
    """
    if not isinstance(spec, Mapping):
        return [("spec", "spec must be an object.")]
    out: list[Issue] = []
    try:
        MergeSearchSpec.model_validate(dict(spec))
    except ValidationError as err:
        out.extend((p, m.replace("modelmerge.spec", "mergesearch.spec")) for p, m in _pydantic_issues(err))
    merge_like = {k: spec[k] for k in MERGE_FIELDS if k in spec}
    merge_like.setdefault("method", "task_arithmetic")
    out.extend(validate_merge_spec(merge_like))  # same paths; duplicates of the schema issues are dropped below
    method = merge_like["method"]
    core = CORE_METHODS.get(method)
    table = {p.name: p for p in core.params} if core is not None else {}
    experts = [e for e in spec.get("experts") or [] if isinstance(e, Mapping)]
    names = {e.get("name") for e in experts if e.get("name")}
    for i, v in enumerate(spec.get("vary") or []):
        if not isinstance(v, Mapping):
            continue
        path, name, expert = f"spec.vary[{i}]", v.get("name"), v.get("expert")
        p = table.get(name) if isinstance(name, str) else None
        if p is None:
            out.append(
                (f"{path}.name", f"method {method} takes no parameter {name!r}; allowed: {', '.join(table) or 'none'}.")
            )
            continue
        if p.kind == "bool":
            out.append((f"{path}.name", f"{name} is a boolean; only numeric parameters vary per layer block."))
            continue
        if expert is not None and p.scope == "global":
            out.append((f"{path}.expert", f"{name} is a global parameter of {method}; vary it without expert."))
        if expert is not None and expert not in names:
            out.append((f"{path}.expert", f"{expert!r} is not the name of an expert in spec.experts."))
        if p.scope == "global" and name in (spec.get("parameters") or {}):
            out.append((f"{path}.name", f"{name} is also fixed in spec.parameters; drop one of them."))
        for j, e in enumerate(experts):
            if p.scope != "global" and (expert is None or e.get("name") == expert):
                if name in (e.get("parameters") or {}) or (name == "weight" and e.get("weight") is not None):
                    out.append(
                        (f"spec.experts[{j}].parameters.{name}", f"{name} is varied by {path}; do not fix it here.")
                    )
    if not ((spec.get("evaluator") or {}).get("command")):
        out.append(
            (
                "spec.evaluator.command",
                "a MergeSearch needs an evaluator command: it runs in an evaluation "
                "Job per candidate with {checkpoint} = the candidate's snapshot URI (s3://...) and prints a JSON "
                "object of metrics (the built-in zoo evaluator reads local folders only).",
            )
        )
    return list(dict.fromkeys(out))  # without repeats, in order


def parse_search_spec(spec: Mapping[str, Any]) -> tuple[MergeSearchSpec | None, list[Issue]]:
    """A MergeSearch spec parsed once into its typed model, with its problems
    (:func:`validate_search_spec`): ``(model, [])`` when valid, ``(None, issues)`` otherwise
    (the reconciler reports them as ``Ready=False``, reason ``InvalidSpec``)."""
    issues = validate_search_spec(spec)
    if issues:
        return None, issues
    return MergeSearchSpec.model_validate(dict(spec)), []


def calibration_uri(spec: MergeSearchSpec, settings: Settings) -> str | None:
    """The calibration set of every candidate merge: ``spec.calibration.uri``, else the
    operator's default (chart value ``merges.calibration.uri``), as a ModelMerge gets it."""
    return spec.calibration.uri if spec.calibration is not None else settings.calibration_uri


def planning_issues(spec: MergeSearchSpec, settings: Settings) -> list[Issue]:
    """What the operator's settings make impossible for every candidate merge: ``blockValue
    fisher`` without a calibration set (neither ``spec.calibration.uri`` nor the operator's
    default), which each candidate's planning would refuse."""
    if spec.block_value == "fisher" and not calibration_uri(spec, settings):
        return [
            (
                "spec.blockValue",
                "fisher needs a calibration set: set spec.calibration.uri (or the operator's "
                "merges.calibration.uri), or use blockValue energy.",
            )
        ]
    return []


# --- names, locations, the driver Job -----------------------------------------------------------


def state_prefix(spec: MergeSearchSpec, generation: int | None) -> str:
    """Where generation ``generation`` of the search keeps its state, results and candidates'
    snapshots: ``<spec.output.uri>/g<generation>`` (a spec change starts a new search beside the
    old one; snapshots are immutable)."""
    return f"{spec.output.uri.rstrip('/')}/g{int(generation or 0)}"


def results_uri(spec: MergeSearchSpec, generation: int | None) -> str:
    """The results object the driver rewrites after every finished candidate."""
    return f"{state_prefix(spec, generation)}/{RESULTS_NAME}"


def driver_job_name(search_name: str, generation: int | None) -> str:
    """``<name>-search-g<generation>`` (a DNS label; long names are shortened with a hash)."""
    return dns_label(search_name, f"search-g{int(generation or 0)}")


def candidate_merge_name(search_name: str, candidate: int) -> str:
    """Name of the child ModelMerge of candidate ``candidate``: ``<name>-c<NNNN>``."""
    if candidate < 0:
        raise ValueError(f"candidate must be >= 0, got {candidate}")
    return dns_label(search_name, f"c{candidate:04d}")


def _objective_arg(o: ObjectiveSpec) -> str:
    return o.metric + ("@max" if o.sense == "max" else "")


def _json_arg(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"), allow_nan=False)


def _param_args(spec: MergeSearchSpec) -> list[str]:
    """The spec's fixed settings as the driver's ``--param`` command-line arguments (the driver is a
    ``mergepipe search`` process; its command line parses them back into settings):
    ``NAME=VALUE`` for ``spec.parameters``, ``POSITION:NAME=VALUE`` (1-based) per expert (its
    ``parameters``, plus ``weight`` from the shorthand ``weight``). Values are JSON. Positions,
    not names, address experts: a DNS-label name may be all digits, which the command line reads
    as a position."""
    glob, per = spec_settings(spec.model_dump(by_alias=True, exclude_none=True))
    out = [f"{k}={_json_arg(v)}" for k, v in glob.items()]
    for i, own in enumerate(per, start=1):
        out += [f"{i}:{k}={_json_arg(v)}" for k, v in own.items()]
    return out


def _planning_args(spec: MergeSearchSpec, settings: Settings) -> list[str]:
    """The candidates' planning options as ``mergepipe search`` options: ``--budget`` in bytes
    with a unit (the operator's byte grammar read it; the core's ``--budget`` grammar has no bare
    numbers and no Pi/Ei), ``--sketch``, ``--value`` (``spec.blockValue``) and ``--calibration``
    (:func:`calibration_uri`: the spec's, else the operator's default, as a ModelMerge gets it).
    Unset options stay unset: the candidates' ModelMerge defaults apply."""
    args: list[str] = []
    if spec.budget_bytes is not None:
        args += ["--budget", f"{spec.budget_bytes}B"]
    if spec.sketch is not None:
        args += ["--sketch", str(spec.sketch)]
    if spec.block_value is not None:
        args += ["--value", spec.block_value]
    cal = calibration_uri(spec, settings)
    if cal and spec.block_value != "energy":
        args += ["--calibration", cal]
    return args


def driver_args(meta: Mapping[str, Any], spec: MergeSearchSpec, settings: Settings) -> list[str]:
    """The driver's ``mergepipe`` arguments: the spec as ``mergepipe search`` options (fixed
    parameters in the core's ``--param`` syntax, varied ones as ``--vary [EXPERT:]NAME=MIN:MAX``,
    the planning options of :func:`_planning_args`) plus the Kubernetes worker backend
    (``--worker-backend kubernetes``: candidates are child ModelMerges in the search's namespace,
    owned by the search whose uid is given) and ``--resume-existing`` (a restarted pod continues
    the state it finds). ``meta``: the MergeSearch's metadata (name, namespace, uid, generation)."""
    names = [e.name or f"expert-{i}" for i, e in enumerate(spec.experts)]
    args = ["search", "--out", state_prefix(spec, meta.get("generation")) + "/"]
    args += ["--base", spec.base.uri.rstrip("/")]
    for n, e in zip(names, spec.experts):
        args += ["--expert", f"{n}={e.uri.rstrip('/')}"]
    args += ["--method", spec.method]
    for p in _param_args(spec):
        args += ["--param", p]
    for v in spec.vary:
        args += ["--vary", f"{v.expert + ':' if v.expert else ''}{v.name}={v.min!r}:{v.max!r}"]
    args += ["--layer-blocks", str(spec.layer_blocks)]
    for o in spec.objectives:
        args += ["--objective", _objective_arg(o)]
    ev = spec.evaluator
    if ev is not None and ev.command:
        args += ["--eval-command", ev.command]
    if ev is not None and ev.timeout_seconds:
        args += ["--eval-timeout", str(ev.timeout_seconds)]
    if ev is not None and ev.zoo_batches:
        args += ["--eval-batches", str(ev.zoo_batches)]
    args += ["--evaluations", str(spec.evaluations), "--initial", str(spec.initial)]
    args += ["--workers", str(spec.workers), "--strategy", spec.strategy, "--seed", str(spec.seed)]
    if not spec.prior:
        args.append("--no-prior")
    if spec.ref_point:
        args += ["--ref-point", ",".join(repr(float(x)) for x in spec.ref_point)]
    args += _planning_args(spec, settings)
    if settings.catalog_uri:
        args += ["--catalog", settings.catalog_uri]
    args += ["--worker-backend", "kubernetes", "--namespace", meta["namespace"]]
    args += ["--search-name", meta["name"], "--search-uid", meta["uid"], "--resume-existing", "--json"]
    return args


def build_driver_job(ms: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """The batch/v1 Job of the search driver of ``ms``'s generation.

    It always runs the operator's merger image (``settings.merger_image``), never
    ``spec.image``: the pod holds the search driver's ServiceAccount token and the S3 keys, so
    no tenant-chosen code may run in it (``spec.image`` only reaches the candidates' merge Jobs
    and the evaluation Jobs, where :func:`search_image_issue` admitted it). Same security
    settings (non-root, read-only root filesystem, no capabilities, seccomp RuntimeDefault) and
    Secret-only S3 credentials as the merge Job; no GPU (the candidates' merge
    Jobs get them) and the driver's resources from the settings (``search_driver_cpu``/``_memory``;
    ``spec.resources`` are the candidates'). Unlike the merge Job it runs as
    ``settings.search_service_account`` with its token mounted: it creates ModelMerges and the
    evaluation Jobs (:func:`eval_job_template`, passed as ``MERGEPIPE_EVAL_JOB_TEMPLATE``) in its
    namespace and reads MergedSnapshots (the chart's Role allows exactly that); no user code runs
    in its pod. Owned by the MergeSearch (deleted with it).

    Raises:
        ValueError: ``ms`` lacks metadata.name/uid/namespace, or its spec is not a valid
            MergeSearch spec (pydantic's ValidationError; the reconciler refuses such specs first).
    """
    meta = ms.get("metadata") or {}
    if not meta.get("namespace"):
        raise ValueError("the MergeSearch needs metadata.namespace")
    typed = MergeSearchSpec.model_validate(dict(ms.get("spec") or {}))
    name, gen = meta["name"], meta.get("generation")
    driver = {
        "metadata": meta,
        "spec": {
            **{k: v for k, v in (ms.get("spec") or {}).items() if k != "image"},
            "resources": {"cpu": settings.search_driver_cpu, "memory": settings.search_driver_memory},
        },
    }
    labels = {
        LABEL_NAME: "mergepipe-search-driver",
        LABEL_COMPONENT: "search",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_SEARCH: label_value(name),
    }
    annotations = {ANN_SEARCH: name, ANN_GENERATION: str(int(gen or 0))}
    spec = ms.get("spec") or {}
    template = {k: spec[k] for k in ("resources", "image", "s3", "queueName") if spec.get(k) is not None}
    env = [
        {"name": "MERGEPIPE_CANDIDATE_TEMPLATE", "value": json.dumps(template, sort_keys=True, separators=(",", ":"))},
        {
            "name": "MERGEPIPE_EVAL_JOB_TEMPLATE",
            "value": json.dumps(eval_job_template(ms, settings), sort_keys=True, separators=(",", ":")),
        },
        {"name": "MERGEPIPE_SEARCH_POLL_SECONDS", "value": str(settings.search_poll_seconds)},
    ]
    job = worker_job(
        driver,
        driver_job_name(name, gen),
        "search",
        driver_args(meta, typed, settings),
        settings,
        gpu=False,
        labels=labels,
        annotations=annotations,
        env_extra=env,
        owner=owner_reference(ms),
        image=settings.merger_image,
    )
    pod = job["spec"]["template"]["spec"]
    pod["serviceAccountName"] = settings.search_service_account
    pod["automountServiceAccountToken"] = True
    # the driver resumes from its state: a pod restart is not a failure of the search, and a search
    # of many candidates outlives a merge's deadline
    job["spec"]["backoffLimit"] = max(settings.backoff_limit, 6)
    job["spec"]["activeDeadlineSeconds"] = max(settings.active_deadline_seconds, DRIVER_DEADLINE_SECONDS)
    return job


def eval_job_template(ms: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """The evaluation Job template the driver fills per candidate (name ``<name>-e<NNNN>``, args
    ``mergepipe search-eval ...``; :class:`mergepipe_kube.search.KubernetesJobEvaluator`): the
    merge Job's image, security settings and Secret-only credentials, the search's
    ``spec.resources`` (GPUs as the candidates' merge Jobs get them), no ServiceAccount token
    (the user's command runs here), owned by the MergeSearch. Its image is ``spec.image`` when
    the chart's ``merges.allowedImages`` admits it, else the operator's merger image. Its S3 keys
    are ``settings.eval_s3_secret_name``'s when the chart names one (keys scoped to reading the
    candidates' snapshots and writing the metrics: the tenant's command runs with them), else the
    merge Jobs' (``spec.s3.credentialsSecretRef`` or the chart's Secret).

    Raises:
        ValueError: ``spec.image`` is not admitted (:func:`search_image_issue`; the reconciler
            refuses such a spec before building any Job).
    """
    meta = ms.get("metadata") or {}
    refusal = search_image_issue(ms.get("spec") or {}, settings)
    if refusal:
        raise ValueError(refusal)
    name = meta["name"]
    labels = {
        LABEL_NAME: "mergepipe-search-evaluator",
        LABEL_COMPONENT: "evaluate",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_SEARCH: label_value(name),
    }
    annotations = {ANN_SEARCH: name, ANN_GENERATION: str(int(meta.get("generation") or 0))}
    if settings.eval_s3_secret_name:
        spec = dict(ms.get("spec") or {})
        s3 = dict(spec.get("s3") or {})
        s3["credentialsSecretRef"] = {
            "name": settings.eval_s3_secret_name,
            "accessKeyIdKey": settings.s3_access_key_id_key,
            "secretAccessKeyKey": settings.s3_secret_access_key_key,
        }
        spec["s3"] = s3
        ms = {**ms, "spec": spec}
    return worker_job(
        ms,
        dns_label(name, "e0000"),
        "evaluate",
        [],
        settings,
        gpu=True,
        labels=labels,
        annotations=annotations,
        env_extra=[],
        owner=owner_reference(ms),
        image=(ms.get("spec") or {}).get("image"),
    )


def search_image_issue(spec: Mapping[str, Any], settings: Settings) -> str | None:
    """Why a MergeSearch's ``spec.image`` cannot run (``None``: unset or admitted by the chart's
    ``merges.allowedImages``). It would be the image of the candidates' merge Jobs and of the
    evaluation Jobs (both hold the namespace's S3 keys); the driver never runs it."""
    return image_issue(spec.get("image"), settings.allowed_images, "spec.image")


def job_generation(job: Mapping[str, Any]) -> int | None:
    """The MergeSearch generation a driver Job belongs to (its annotation), else ``None``."""
    value = (job.get("metadata", {}).get("annotations") or {}).get(ANN_GENERATION)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# --- status ------------------------------------------------------------------------------------


class ResultsError(ValueError):
    """The results object is not what the driver writes (names the problem)."""


def parse_results(raw: bytes | str | None) -> dict[str, Any] | None:
    """The driver's results document, or ``None`` when there is none yet.

    Raises:
        ResultsError: not a JSON object with ``search_id``, ``objectives``, ``evaluations``,
            ``failed`` and ``pareto``.
    """
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ResultsError(f"results are not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ResultsError("results are not a JSON object")
    missing = [k for k in ("search_id", "objectives", "evaluations", "failed", "pareto") if k not in doc]
    if missing:
        raise ResultsError(f"results lack {', '.join(missing)}")
    return doc


def _user_value(objective: str, v: float) -> float:
    """A minimised objective value back in the metric's own units (negated for ``NAME@max``)."""
    return -float(v) if objective.endswith("@max") else float(v)


def _finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _pareto_points(search: str, results: Mapping[str, Any], objs: list[str]) -> list[dict[str, Any]]:
    """The driver's Pareto points in status form, by candidate number: user-unit objective
    values, the MergedSnapshot name when the manifest hash is a sha256, the snapshot URI."""
    pareto = []
    for p in sorted(results["pareto"], key=lambda p: int(p["id"])):
        point: dict[str, Any] = {
            "candidate": int(p["id"]),
            "objectives": {
                o.split("@")[0]: _user_value(o, p["objectives"][o]) for o in objs if o in (p.get("objectives") or {})
            },
        }
        if _SHA256.match(str(p.get("manifest_hash") or "")):
            point["snapshot"] = snapshot_name(candidate_merge_name(search, int(p["id"])), p["manifest_hash"])
        if p.get("snapshot"):
            point["uri"] = str(p["snapshot"])
        pareto.append(point)
    return pareto


def _results_fields(search: str, results: Mapping[str, Any], total: int, max_pareto: int) -> tuple[dict[str, Any], str]:
    """The status fields the driver's results fill (counts, hypervolume, refPoint, Pareto set)
    and the one-line progress summary."""
    objs = list(results["objectives"])
    done, failed = int(results["evaluations"]), int(results["failed"])
    pareto = _pareto_points(search, results, objs)
    hv = (results.get("hypervolume") or [{}])[-1].get("hv")
    ref = results.get("ref_point")
    fields: dict[str, Any] = dict(
        searchID=str(results["search_id"]),
        evaluations=done + failed,
        failed=failed,
        running=int(results.get("running") or 0),
        hypervolume=None if (hv_f := _finite(hv)) is None else max(0.0, hv_f),
        refPoint=[_user_value(o, r) for o, r in zip(objs, ref)] if ref else [],
        paretoSize=len(pareto),
        pareto=pareto[:max_pareto],
    )
    summary = f"{done + failed}/{total} candidates evaluated ({failed} failed), Pareto set of {len(pareto)}"
    if fields["hypervolume"] is not None:
        summary += f", hypervolume {fields['hypervolume']:.6g}"
    return fields, summary


def _ready(outcome: JobOutcome, has_results: bool, job_name: str, summary: str, uri: str) -> tuple[str, str, str]:
    """The Ready condition ``(status, reason, message)`` from the driver Job's outcome."""
    if outcome.state == "Running" and outcome.reason == Reason.QUEUED:
        return ("False", SearchReason.QUEUED, outcome.message)
    if outcome.state == "Running":
        return ("False", SearchReason.SEARCHING, f"driver Job {job_name}: {summary}")
    if outcome.state == "Succeeded" and has_results:
        return ("True", SearchReason.COMPLETED, summary)
    if outcome.state == "Succeeded":
        return ("False", SearchReason.FAILED, f"driver Job {job_name} completed but wrote no results at {uri}")
    return (
        "False",
        SearchReason.FAILED,
        f"driver Job {job_name} failed ({outcome.reason}): {outcome.message}; {summary}",
    )


def search_status(
    ms: Mapping[str, Any],
    spec: MergeSearchSpec,
    results: Mapping[str, Any] | None,
    outcome: JobOutcome,
    job_name: str,
    now: datetime,
    *,
    max_pareto: int = 64,
) -> dict[str, Any]:
    """The status of MergeSearch ``ms`` (its metadata and current status; ``spec``: its parsed
    spec) from its driver Job's outcome and the driver's results.

    Counts: ``evaluations`` = candidates finished (done + failed), ``failed``, ``running``
    (``results.running`` when the driver reports it). ``hypervolume`` is the last point of the
    driver's hypervolume curve (minimised objectives, against ``refPoint``); ``refPoint`` and the
    Pareto points' objective values are in the metrics' own units (``@max`` objectives negated
    back). Each Pareto point links its MergedSnapshot by name: the child ModelMerge
    ``candidate_merge_name(search, id)`` commits ``snapshot_name(merge, manifest_hash)``. At most
    ``max_pareto`` points are listed (lowest candidate numbers); ``paretoSize`` counts all.

    Ready: ``Searching`` (False) while the driver runs; ``Completed`` (True) when it succeeded
    and its results are there; ``Failed`` (False) when it failed, or succeeded without results.
    """
    meta = ms["metadata"]
    gen = meta.get("generation")
    status = ms.get("status") or {}
    out: dict[str, Any] = {
        "observedGeneration": gen,
        "stateURI": f"{state_prefix(spec, gen)}/{STATE_NAME}",
        "driverJob": job_name,
    }
    total = spec.evaluations
    summary = f"0/{total} candidates evaluated"
    if results is not None:
        fields, summary = _results_fields(meta["name"], results, total, max_pareto)
        out.update(fields)
    ready = _ready(outcome, results is not None, job_name, summary, results_uri(spec, gen))
    out["conditions"] = set_condition(status.get("conditions"), "Ready", *ready, gen, now)
    return out


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether patching ``new`` would change ``old`` (conditions compared without their times)."""
    old = old or {}

    def strip(conds: Any) -> list:
        return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conds or []]

    for k, v in new.items():
        if k == "conditions":
            if strip(v) != strip(old.get("conditions")):
                return True
        elif old.get(k) != v:
            return True
    return False
