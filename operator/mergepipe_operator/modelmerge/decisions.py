"""ModelMerge decisions as pure functions (no Kubernetes client, no object storage, no clock):
the merge and analyze Jobs (:func:`job_name`, :func:`build_job`, :func:`choose_job`,
:func:`analysis_id`, :func:`build_analyze_job`), how many pods a merge runs as
(:func:`choose_parallelism`, :func:`parallelism_issue`, :func:`job_parts`, :func:`parts_status`),
the plan's status and object URI, and :func:`generation_settled` (whether a generation needs
reconciling at all)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mergepipe.methods.registry import METHODS as CORE_METHODS

from ..k8s.conditions import Reason, get_condition
from ..k8s.images import image_issue
from ..k8s.jobs import job_outcome, worker_job
from ..k8s.model import GROUP
from ..k8s.names import (
    ANN_GENERATION,
    ANN_MERGE,
    ANN_PARTS,
    ANN_PLAN_DIGEST,
    ANN_PLAN_URI,
    DIGEST_RE,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_MERGE,
    LABEL_NAME,
    LABEL_PLAN,
    MANAGER,
    dns_label,
    label_value,
)
from ..settings import Settings

#: Ready=False reasons that need a change (spec, quota or storage) rather than time.
TERMINAL_MERGE_REASONS = frozenset({Reason.INVALID_SPEC, Reason.JOB_FAILED, Reason.QUOTA_EXCEEDED})


def _retry_suffix(retry_generation: int | None) -> str:
    if retry_generation is None:
        return ""
    if isinstance(retry_generation, bool) or not isinstance(retry_generation, int) or retry_generation < 1:
        raise ValueError(f"retry generation must be a positive integer, got {retry_generation!r}")
    return f"-g{retry_generation}"


def job_name(merge_name: str, plan_digest: str, retry_generation: int | None = None) -> str:
    """Deterministic Job name: ModelMerge name + the first 10 hex of the plan digest, a DNS-1123
    label of at most 63 chars. A retry with the same plan gets the same name (409 = already there).
    ``retry_generation``: the generation that runs this plan again after an earlier generation's
    Job of it failed (:func:`choose_job`); the name gets ``-g<generation>`` so it is a new Job."""
    if not DIGEST_RE.match(plan_digest or ""):
        raise ValueError(f"plan digest must be 64 lowercase hex characters, got {plan_digest!r}")
    return dns_label(merge_name, plan_digest[:10] + _retry_suffix(retry_generation))


@dataclass(frozen=True)
class JobChoice:
    """The outcome of :func:`choose_job`.

    Attributes:
        follow: the existing Job that runs this work for the generation (``None``: create one).
        retry_generation: when creating, the generation that retries work an earlier generation's
            Job failed at (the new Job's name gets ``-g<generation>``); ``None`` for a first Job.
    """

    follow: dict[str, Any] | None
    retry_generation: int | None = None


def _job_generation(job: Mapping[str, Any]) -> int:
    try:
        return int(((job.get("metadata") or {}).get("annotations") or {}).get(ANN_GENERATION) or 0)
    except ValueError:
        return 0


def choose_job(
    jobs: Iterable[Mapping[str, Any]],
    annotation: str,
    value: str,
    generation: int | None,
    *,
    usable: frozenset[str] = frozenset({"Running", "Succeeded"}),
) -> JobChoice:
    """Which Job does ``value`` (a plan digest, or an analysis id, in the Jobs' ``annotation``)
    for ``generation`` of a ModelMerge: follow an existing Job, or create one.

    - A Job of ``value`` whose :func:`job_outcome` state is in ``usable`` (running or complete, of
      any generation) is followed: the same plan is the same work, so a spec change that plans the
      same keeps its Job (an operator restart finds it too).
    - A Job of ``value`` that ended otherwise (failed) *for this generation or a later one* is
      followed too: its failure is this generation's outcome, until the spec changes.
    - Otherwise a Job is created; when only earlier generations' Jobs of ``value`` failed, with
      ``retry_generation=generation`` so it gets a new name (:func:`job_name`): a spec change
      after ``JobFailed`` retries instead of finding the failed Job again.

    Jobs of other values and Jobs being deleted (``metadata.deletionTimestamp``) are ignored;
    among several candidates the newest generation wins (then the name, for determinism).
    """
    gen = int(generation or 0)
    mine = [
        j
        for j in jobs
        if ((j.get("metadata") or {}).get("annotations") or {}).get(annotation) == value
        and not (j.get("metadata") or {}).get("deletionTimestamp")
    ]
    mine.sort(key=lambda j: (_job_generation(j), j["metadata"].get("name", "")), reverse=True)
    for j in mine:
        if job_outcome(j).state in usable:
            return JobChoice(dict(j))
    for j in mine:
        if _job_generation(j) >= gen:
            return JobChoice(dict(j))
    return JobChoice(None, gen if mine and gen >= 1 else None)


def generation_settled(status: Mapping[str, Any] | None, generation: int | None) -> bool:
    """Has ``generation`` of a ModelMerge already gone as far as reconciling takes it?

    True when ``status.observedGeneration`` is ``generation`` and the ``Ready`` reason is one only
    the Job or a spec change moves on from: ``JobRunning`` or ``Queued`` (the Job's events take over),
    ``Committed``, ``JobFailed`` and ``InvalidSpec`` (terminal *for this generation*). Any other
    generation, in particular the next one after a failure, is reconciled again: a new plan, and a
    new Job when the old one failed (:func:`choose_job`). ``QuotaExceeded``, ``Analyzing`` and
    ``Planning`` are retried within the generation."""
    status = status or {}
    ready = get_condition(status.get("conditions"), "Ready")
    return bool(
        ready is not None
        and status.get("observedGeneration") == generation
        and ready.get("reason")
        in (Reason.COMMITTED, Reason.JOB_RUNNING, Reason.QUEUED, Reason.JOB_FAILED, Reason.INVALID_SPEC)
    )


def plan_uri(settings: Settings, namespace: str, name: str, plan_digest: str) -> str:
    """Where the operator writes the full plan (content-addressed by its digest)."""
    if not settings.plan_prefix:
        raise ValueError("the operator has no plan prefix (values: plans.prefix / MERGEPIPE_PLAN_PREFIX)")
    return f"{settings.plan_prefix.rstrip('/')}/{namespace}/{name}/{plan_digest}.json"


def plan_status(
    digest: str,
    uri: str,
    base_read_bytes: int,
    expert_read_bytes: int,
    output_write_bytes: int,
    retained_energy: float | None,
    *,
    sketch: str = "none",
    sketch_read_bytes: int = 0,
) -> dict[str, Any]:
    """A ModelMerge's ``status.plan`` (model.PlanStatus, camelCase): the plan's digest (64 hex), the
    URI of the full plan object, its estimated bytes per role, the retained task-vector
    energy fraction in [0, 1] (``None``: unknown), the fidelity tiers it was made with
    (``"none"``, ``"sign1"``..``"sign3"``, ``"sign3+r1"``) and the bytes of block sketches among its expert reads.
    Every key is present (a merge patch replaces each of them, so nothing of an earlier plan
    survives).

    Raises:
        ValueError: ``digest`` is not 64 lowercase hex characters, a byte count is negative, or
            ``sketch_read_bytes`` exceeds ``expert_read_bytes``.
    """
    if not DIGEST_RE.match(digest or ""):
        raise ValueError(f"plan digest must be 64 lowercase hex characters, got {digest!r}")
    sizes = {
        "baseReadBytes": base_read_bytes,
        "expertReadBytes": expert_read_bytes,
        "outputWriteBytes": output_write_bytes,
    }
    for k, v in sizes.items():
        if v is None or int(v) < 0:
            raise ValueError(f"plan {k} must be a byte count >= 0, got {v!r}")
    if not 0 <= int(sketch_read_bytes) <= int(expert_read_bytes):
        raise ValueError(f"plan sketchReadBytes must be in [0, expertReadBytes], got {sketch_read_bytes!r}")
    return {
        "digest": digest,
        "uri": uri,
        "estimated": {k: int(v) for k, v in sizes.items()},
        "retainedEnergy": None if retained_energy is None else float(retained_energy),
        "sketch": sketch,
        "sketchReadBytes": int(sketch_read_bytes),
    }


def status_plan_digest(status: Mapping[str, Any] | None) -> str | None:
    """The plan digest a ModelMerge status records (``status.plan.digest``), or ``None``."""
    plan = (status or {}).get("plan")
    return plan.get("digest") if isinstance(plan, Mapping) else None


#: The catalog's block size the operator plans with (the core's default; the analyze Job uses it too).
ANALYZE_BLOCK_BYTES = 128 * 1024
ANN_ANALYSIS = f"{GROUP}/analysis-id"
ANN_CALIBRATION = f"{GROUP}/calibration"


def expert_names(spec: Mapping[str, Any]) -> list[str]:
    """Names of the experts as plans, manifests and status show them: ``name``, else
    ``expert-<index>`` (0-based, as :func:`validate_merge_spec` reports them)."""
    return [(ex.get("name") or f"expert-{i}") for i, ex in enumerate(spec.get("experts") or [])]


def needs_pair_statistics(method: str | None) -> bool:
    """Methods (model_stock, nuslerp) whose plan needs the experts' pairwise task-vector dot
    products (the catalog's pair statistics, recorded by ``mergepipe analyze --pairs``)."""
    m = CORE_METHODS.get(method or "")
    return bool(m is not None and m.needs_gram)


def analysis_id(
    base_identity: str,
    expert_identities: Iterable[str],
    catalog_uri: str | None,
    method: str | None,
    calibration: str | None = None,
) -> str:
    """Content address of one analysis run: the base's and the missing experts' identity digests,
    the catalog, the block size, (for methods that need pair statistics) the method, and (when
    the Job also records the base's sensitivity) the calibration set's content digest. A changed
    checkpoint or calibration file has a new identity, so it gets a new analyze Job rather than
    the finished one."""
    key: dict[str, Any] = {
        "base": base_identity,
        "experts": sorted(set(expert_identities)),
        "catalog": (catalog_uri or "").rstrip("/"),
        "block_bytes": ANALYZE_BLOCK_BYTES,
        "pairs": method if needs_pair_statistics(method) else None,
    }
    if calibration:  # absent otherwise: analysis ids of merges without calibration are unchanged
        key["calibration"] = calibration
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def analyze_job_name(merge_name: str, analysis: str, retry_generation: int | None = None) -> str:
    """Deterministic analyze Job name: ModelMerge name + ``analyze-`` + 10 hex of the analysis id
    (+ ``-g<generation>`` for a retry after an earlier generation's analyze Job failed, as
    :func:`job_name`)."""
    if not DIGEST_RE.match(analysis or ""):
        raise ValueError(f"analysis id must be 64 lowercase hex characters, got {analysis!r}")
    return dns_label(merge_name, f"analyze-{analysis[:10]}{_retry_suffix(retry_generation)}")


def analyze_args(
    spec: Mapping[str, Any], missing_uris: Iterable[str], catalog_uri: str, calibration_uri: str | None = None
) -> list[str]:
    """Arguments of the analyze Job's ``mergepipe`` command:
    ``mergepipe analyze --base B --expert E... [--pairs] [--calibration CAL] --catalog C --json``.

    ``missing_uris`` are the experts the planner named (``MissingAnalysis.uris``: those without
    statistics and, for methods that need pair statistics, both experts of every missing pair);
    when only the base's sensitivity is missing (none named) the spec's experts are passed,
    whose cached statistics are not recomputed. For the methods that plan with pair statistics
    (model_stock, nuslerp, multislerp, karcher) ``--pairs`` also records the pair statistics of
    every two of them; pairs already in the catalog are not recomputed. With ``calibration_uri``
    the Job records the base's per-block Fisher on that calibration set
    (:mod:`mergepipe.catalog.sensitivity`; once per base and set)."""
    args = ["analyze", "--base", spec["base"]["uri"].rstrip("/")]
    uris = [u.rstrip("/") for u in missing_uris] or [
        str(ex["uri"]).rstrip("/") for ex in spec.get("experts") or [] if isinstance(ex, Mapping)
    ]
    lora = {
        str(ex["uri"]).rstrip("/")
        for ex in spec.get("experts") or []
        if isinstance(ex, Mapping) and ex.get("format") == "lora"
    }
    for uri in uris:  # (an expert declared a LoRA adapter is analyzed as one: lora:URI)
        args += ["--expert", f"lora:{uri}" if uri in lora else uri]
    if needs_pair_statistics(spec.get("method")):
        args.append("--pairs")
    if calibration_uri:
        args += ["--calibration", calibration_uri]
    return args + ["--catalog", catalog_uri, "--json"]


def parallelism_issue(spec: Mapping[str, Any], settings: Settings) -> str | None:
    """Why ``spec.parallelism`` cannot be honoured by this operator (``None``: it can): it asks
    for more pods than the chart's ``merges.parallelism.max`` allows one merge. (The CRD bounds
    it to 1..:data:`~mergepipe_operator.k8s.model.MAX_PARALLELISM`; the chart's bound is the platform
    team's, e.g. GPUs per merge, so it is checked here and reported as ``InvalidSpec``.)"""
    n = spec.get("parallelism")
    if n is None or isinstance(n, bool) or not isinstance(n, int):
        return None if n is None else f"spec.parallelism: {n!r} is not an integer"
    if n < 1:
        return f"spec.parallelism: {n} is below 1"
    if n > settings.max_parallelism:
        return (
            f"spec.parallelism: {n} pods exceed this operator's limit of {settings.max_parallelism} per merge "
            "(chart value merges.parallelism.max); lower it, or leave it unset for the automatic choice"
        )
    return None


def merge_image_issue(spec: Mapping[str, Any], settings: Settings) -> str | None:
    """Why ``spec.image`` cannot run this merge (``None``: unset, or admitted by the chart's
    ``merges.allowedImages``; :func:`~mergepipe_operator.k8s.images.image_issue`). The merge pod
    holds the namespace's S3 keys, so its image is code running with them: refused by default."""
    return image_issue(spec.get("image"), settings.allowed_images, "spec.image")


def choose_parallelism(
    requested: int | None, plan_bytes: int, shards: int, max_parallelism: int, bytes_per_part: int
) -> int:
    """How many parts (pods of an Indexed Job) a merge runs as.

    Args:
        requested: ``spec.parallelism`` (``None``: automatic).
        plan_bytes: the bytes the plan moves: base read + expert read + output write (bytes).
        shards: the plan's output shards; parts are unions of whole shards, so more parts than
            shards would leave pods with nothing to do.
        max_parallelism: the chart's ``merges.parallelism.max`` (>= 1).
        bytes_per_part: the chart's ``merges.parallelism.bytesPerPart`` (bytes, >= 1).

    Returns:
        ``requested`` when given, else ``ceil(plan_bytes / bytes_per_part)``; in both cases at
        least 1 and at most ``min(max_parallelism, shards)``. 1 means today's single-pod Job.

    Raises:
        ValueError: ``max_parallelism`` or ``bytes_per_part`` below 1.
    """
    if max_parallelism < 1 or bytes_per_part < 1:
        raise ValueError(f"max_parallelism and bytes_per_part must be >= 1, got {max_parallelism}, {bytes_per_part}")
    limit = max(1, min(max_parallelism, shards))
    want = requested if requested is not None else -(-max(0, plan_bytes) // bytes_per_part)
    return max(1, min(limit, want))


def job_parts(job: Mapping[str, Any] | None) -> int:
    """N of a merge Job: its ``mergepipe.io/parts`` annotation (1 when absent or unreadable: a
    single-pod Job, which commits by itself)."""
    ann = ((job or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return max(1, int(ann.get(ANN_PARTS) or 1))
    except (TypeError, ValueError):
        return 1


def _count_indexes(spec: str | None) -> int:
    """Number of indexes in a Job's ``completedIndexes``/``failedIndexes`` (e.g. ``"0-2,4"`` -> 4)."""
    n = 0
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        try:
            n += (int(b) - int(a) + 1) if b else 1
        except ValueError:
            continue
    return n


def parts_status(job: Mapping[str, Any] | None, total: int) -> dict[str, Any]:
    """A ModelMerge's ``status.parts`` (model.PartsStatus) from its Indexed merge Job's status:
    parts (indexes) succeeded out of ``total``, the Job's ``completedIndexes`` and
    ``failedIndexes``, and the pods that failed (each index retries on its own, up to
    ``backoffLimitPerIndex``). Every key is present (a merge patch replaces each of them)."""
    st = (job or {}).get("status") or {}
    done = st.get("completedIndexes") or None
    succeeded = _count_indexes(done) if done else int(st.get("succeeded") or 0)
    succeeded = min(total, succeeded)
    return {
        "total": total,
        "succeeded": succeeded,
        "progress": f"{succeeded}/{total}",
        "completedIndexes": done,
        "failedIndexes": st.get("failedIndexes") or None,
        "failedPods": int(st.get("failed") or 0),
    }


def _merge_job_metadata(
    name: str, generation: int | None, plan_uri: str, plan_digest: str
) -> tuple[dict[str, str], dict[str, str]]:
    """The merge Job's ``(labels, annotations)``: which merge and plan it runs (the plan digest
    in full in an annotation, its first 16 hex digits in a label for selection)."""
    labels = {
        LABEL_NAME: "mergepipe-merger",
        LABEL_COMPONENT: "merge",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_MERGE: label_value(name),
        LABEL_PLAN: plan_digest[:16],
    }
    annotations = {
        ANN_PLAN_DIGEST: plan_digest,
        ANN_PLAN_URI: plan_uri,
        ANN_MERGE: name,
        ANN_GENERATION: str(generation or 0),
    }
    return labels, annotations


def _make_indexed(job_spec: dict[str, Any], parts: int, backoff_limit: int) -> None:
    """Turn a merge Job's spec (in place) into an Indexed Job of ``parts`` pods, each index
    retried ``backoff_limit`` times on its own, the Job failing at the first index out of
    retries, and an exit 2 (bad input) failing its index at once."""
    job_spec.pop("backoffLimit", None)  # per index instead (the Job-wide default is then unbounded)
    job_spec.update(
        completionMode="Indexed",
        completions=parts,
        parallelism=parts,
        backoffLimitPerIndex=backoff_limit,
        maxFailedIndexes=0,
    )
    job_spec["podFailurePolicy"]["rules"].append(
        {"action": "FailIndex", "onExitCodes": {"containerName": "merge", "operator": "In", "values": [2]}}
    )


def build_job(
    mm: Mapping[str, Any],
    plan_uri: str,
    plan_digest: str,
    settings: Settings,
    *,
    owner: Mapping[str, Any] | None = None,
    retry_generation: int | None = None,
    parts: int = 1,
) -> dict[str, Any]:
    """The batch/v1 Job that runs ``mergepipe execute <plan-uri> --out <output-uri> --resume
    --json`` (plus ``--device cuda`` when it has GPUs): one pod executes the plan as the one part
    of its run and commits it; a pod retried after a failure (``backoffLimit``) keeps the files
    the failed one finished (:func:`mergepipe.parts.execute_resumable`).

    With ``parts`` = N > 1 it is an Indexed Job (``completionMode: Indexed``, completions =
    parallelism = N) whose pod of index i runs ``execute ... --part i/N`` (the index from the
    ``JOB_COMPLETION_INDEX`` variable the Job controller sets, expanded by the kubelet as
    ``$(JOB_COMPLETION_INDEX)``): each pod writes its part's shards and part record under the
    run's prefix, and the operator commits when every index succeeded. Each index is retried on
    its own (``backoffLimitPerIndex`` = the chart's ``backoffLimit``; a retried pod resumes: it
    keeps the files its earlier attempt finished), the Job fails as soon as one index is out of
    retries (``maxFailedIndexes: 0``: the merge cannot commit without it), and a pod that exits 2
    (the worker's "bad input" exit: retrying cannot help) fails its index at once
    (``podFailurePolicy`` ``FailIndex``). Its annotation ``mergepipe.io/parts`` holds N.

    ``mm`` is the ModelMerge object; its metadata (name, namespace, uid) gives the owner reference
    unless ``owner`` (an ownerReference dict) is passed. Per-merge overrides come from
    ``mm.spec`` (resources, s3; the image only when ``settings.allowed_images`` admits it), the
    rest from ``settings``. Security: non-root, read-only
    root filesystem with an emptyDir at /tmp, all capabilities dropped, no privilege escalation,
    seccomp RuntimeDefault, no service-account token; credentials only through ``secretKeyRef``.

    Raises:
        ValueError: ``spec.output.uri`` is missing, ``parts`` < 1, or ``spec.image`` is not
            admitted (:func:`merge_image_issue`; the reconciler refuses such a spec first).
    """
    meta = mm.get("metadata") or {}
    name = meta["name"]
    image_refusal = merge_image_issue(mm.get("spec") or {}, settings)
    if image_refusal:
        raise ValueError(image_refusal)
    out_uri = ((mm.get("spec") or {}).get("output") or {}).get("uri")
    if not out_uri:
        raise ValueError("spec.output.uri is required")
    jname = job_name(name, plan_digest, retry_generation)
    labels, annotations = _merge_job_metadata(name, meta.get("generation"), plan_uri, plan_digest)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    args = ["execute", plan_uri, "--out", out_uri]
    if parts > 1:
        annotations[ANN_PARTS] = str(parts)
        args += ["--part", f"$(JOB_COMPLETION_INDEX)/{parts}"]
    else:  # one pod runs the plan as the one part of its run and commits: a retried pod resumes
        args.append("--resume")
    job = worker_job(
        mm,
        jname,
        "merge",
        args + ["--json"],
        settings,
        gpu=True,
        labels=labels,
        annotations=annotations,
        env_extra=[{"name": "MERGEPIPE_PLAN_DIGEST", "value": plan_digest}],
        owner=owner,
        image=(mm.get("spec") or {}).get("image"),
    )
    if parts > 1:
        _make_indexed(job["spec"], parts, settings.backoff_limit)
    return job


def build_analyze_job(
    mm: Mapping[str, Any],
    missing_uris: Iterable[str],
    analysis: str,
    settings: Settings,
    *,
    owner: Mapping[str, Any] | None = None,
    retry_generation: int | None = None,
    calibration_uri: str | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that records the missing experts' statistics in the catalog
    (:func:`analyze_args`), before the operator plans. It writes the shared catalog, so it always
    runs the operator's merger image (never ``spec.image``). Same security settings,
    Secret-only credentials, CPU and memory as the merge Job. Without ``calibration_uri`` it gets
    no GPU (task-vector statistics are numpy); with one it also computes the base's Fisher
    sensitivity (backward passes of the base: torch) and gets the merge Job's GPUs, running it
    with ``--device cuda`` (CPU when the merge's GPU count is 0).
    Its name is deterministic (:func:`analyze_job_name`): a retry, a restarted operator or a
    second reconciliation finds the Job already there (409) instead of starting another."""
    if not settings.catalog_uri:
        raise ValueError("the operator has no catalog (values: catalog.uri / MERGEPIPE_CATALOG_URI)")
    meta = mm.get("metadata") or {}
    name = meta["name"]
    labels = {
        LABEL_NAME: "mergepipe-analyzer",
        LABEL_COMPONENT: "analyze",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_MERGE: label_value(name),
    }
    annotations = {
        ANN_ANALYSIS: analysis,
        ANN_MERGE: name,
        ANN_GENERATION: str(meta.get("generation") or 0),
    }
    args = analyze_args(mm.get("spec") or {}, missing_uris, settings.catalog_uri, calibration_uri)
    if calibration_uri:
        annotations[ANN_CALIBRATION] = calibration_uri
    return worker_job(
        mm,
        analyze_job_name(name, analysis, retry_generation),
        "analyze",
        args,
        settings,
        gpu=bool(calibration_uri),
        labels=labels,
        annotations=annotations,
        env_extra=[],
        owner=owner,
    )
