"""The merge pipeline: register → analyze → plan → execute → commit, as library calls.

The CLI (:mod:`mergepipe.cli`) is a thin layer over these functions.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES, Analysis, Catalog, CheckpointRecord, check_compatible
from mergepipe.catalog.sensitivity import Calibration, load_calibration
from mergepipe.catalog.sketch import DEFAULT_SKETCH
from mergepipe.errors import InputError
from mergepipe.limits import short_repr
from mergepipe.methods.registry import get_method
from mergepipe.planner.plan import EXTRA_FILES, Plan
from mergepipe.planner.planner import (
    DEFAULT_WORK_BYTES,
    EngineOptions,
    PlanInputs,
    SelectionOptions,
    make_plan,
)
from mergepipe.request import MAX_BLOCK_BYTES, MAX_BYTES, MergeRequest, ResolvedRequest, Where, parse_bytes  # noqa: F401  (re-exported)
from mergepipe.result import MergeResult, build_manifest, output_storage, realized_io, versions  # noqa: F401  (re-exported)
from mergepipe.storage.base import IOCounters, Storage
from mergepipe.storage.routing import open_storage

if TYPE_CHECKING:
    from mergepipe.commit.target import CommitTarget


def parse_block_size(text: str, what: str = "--block-size") -> int:
    """The catalog block size (bytes) of ``analyze``, ``plan`` and ``merge`` (one rule for all):
    a byte quantity (see :func:`parse_bytes`) from 1 byte to 1 GiB; ``unlimited`` is refused.

    Raises:
        InputError: naming ``what`` and the accepted range.
    """
    bb = parse_bytes(text, what=what)
    if bb is None or not 1 <= bb <= MAX_BLOCK_BYTES:
        raise InputError(
            f"{what} {short_repr(text)}: must be a byte quantity from 1B to 1GiB (whole rows are "
            "grouped up to it), e.g. 128KiB."
        )
    return bb


def parse_expert(arg: str) -> tuple[str, str]:
    """``NAME=URI`` or ``URI`` -> (name, uri); the default name is the URI's last component.
    A ``lora:`` prefix (``lora:PATH``, ``NAME=lora:PATH``) stays on the URI: it marks a PEFT
    LoRA adapter (:class:`mergepipe.request.ExpertRequest` reads it)."""
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)=(.+)", arg)
    if m and not arg.startswith("s3://") and not arg.startswith("lora:"):
        return m.group(1), m.group(2).rstrip("/")
    uri = arg.rstrip("/")
    path = uri[len("lora:") :] if uri.startswith("lora:") else uri
    return path.rsplit("/", 1)[-1] or path, uri


class MissingAnalysis(InputError):
    """Planning without analysis: the catalog lacks statistics for ``uris`` (run analyze).

    Attributes:
        uris: the experts whose statistics (or pair statistics) are missing (may be empty when
            only the base's sensitivity is).
        base_identity: identity digest of the base they are relative to ("" if unknown).
        identities: identity digest of each of ``uris`` (same order; empty if unknown), so a
            caller can name the missing analysis by content, not by URI.
        calibration: the calibration set's digest when the base's sensitivity on it is missing
            (``mergepipe analyze --calibration`` records it), else ``None``.
    """

    def __init__(
        self,
        uris: Sequence[str],
        *,
        base_identity: str = "",
        identities: Sequence[str] = (),
        calibration: str | None = None,
    ) -> None:
        self.uris = list(uris)
        self.base_identity = base_identity
        self.identities = list(identities)
        self.calibration = calibration
        what = ", ".join(self.uris) if self.uris else "the base's sensitivity on the calibration set"
        super().__init__(f"the catalog has no analysis of {what}; run `mergepipe analyze` for them first.")


def register_and_analyze(
    catalog: Catalog,
    storage: Storage,
    base_uri: str,
    expert_uris: Sequence[str],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    analyze: bool = True,
    pairs: bool = False,
    calibration: str | None = None,
    device: str | None = None,
    work_bytes: int | None = None,
    force: bool = False,
) -> tuple[CheckpointRecord, list[CheckpointRecord], list[Analysis]]:
    """Register the base and experts and analyze the experts (cached; ``force``: analysed again,
    replacing the catalog's statistics and sketches; a cached analysis whose sketch blob is
    missing is analysed again too).

    With ``pairs`` the catalog also records the pair statistics (per tensor ``⟨δᵢ,δⱼ⟩``) of every
    two distinct experts, which model_stock, nuslerp, multislerp and karcher plan with (``mergepipe analyze --pairs``:
    the operator's analyze Job for those methods); cached pairs are not recomputed.

    With ``analyze=False`` nothing but shard headers (and, for checkpoints the catalog already
    knows unchanged, not even those) is read, and :class:`MissingAnalysis` names the experts
    whose statistics are missing: this is how the operator plans in-process.

    With ``calibration`` (a JSON-lines file of ``{"text": ...}``) the base's per-block Fisher
    sensitivity on it is recorded too (once; :mod:`mergepipe.catalog.sensitivity`), for plans
    with ``value="fisher"``, on torch ``device`` (default CPU).

    ``work_bytes``: the analysis' memory target (:meth:`Catalog.analyze`; None: 16 MiB row chunks).
    """
    from mergepipe.lora import split_kind

    cal = load_calibration(storage, calibration) if calibration else None
    base = catalog.register(storage, base_uri)
    experts = [catalog.register(storage, split_kind(u)[1], kind=split_kind(u)[0]) for u in expert_uris]
    if not analyze:
        missing = [e.uri for e in experts if not catalog.has_analysis(base.identity, e.identity, block_bytes)]
        if missing:
            raise MissingAnalysis(missing)
    analyses = catalog.analyze(
        storage,
        base,
        experts,
        block_bytes=block_bytes,
        progress=progress,
        pairs=pairs,
        calibration=cal,
        device=device,
        work_bytes=work_bytes,
        force=force and analyze,
        repair=analyze,
    )
    if not analyze and (lost := catalog.lost_sketches(experts, analyses)):
        raise MissingAnalysis(lost)  # an analyze (Job) re-creates the sketch blobs
    return base, experts, analyses


def build_plan(
    catalog: Catalog,
    storage: Storage,
    request: MergeRequest | ResolvedRequest,
    *,
    where: Where | None = None,
    progress: Callable[[int], None] | None = None,
    analyze: bool = True,
) -> Plan:
    """Register, analyze and plan a :class:`mergepipe.request.MergeRequest` (the one way into
    planning; the CLI, mergekit configs, the operator and the search build it). Everything that
    shapes the plan is in the request: method, parameters, budget, fidelity, seed, output dtype,
    the planning options (:class:`mergepipe.request.PlanningOptions`: block value, calibration
    set, fidelity tiers, block size) and the working memory (``request.run.work_bytes``).

    The request is validated first (:meth:`MergeRequest.resolve`, messages rendered by
    ``where``); every parameter, including layer-wise settings per tensor, is checked after
    reading the checkpoints' headers and before reading any tensor byte. An error about a
    checkpoint (missing, unreadable, of another architecture) carries ``loc``
    (``("base",)``, ``("experts", i, "uri")``) so a front end can name the field; so does one
    about the calibration set (``("planning", "calibration")``).

    With ``analyze=False`` no tensor byte is read: only shard headers (none for checkpoints the
    catalog knows unchanged) and the catalog; when the catalog lacks an expert's statistics (or,
    for methods that need them, the pair statistics of two experts, or the base's sensitivity on
    the calibration set) :class:`MissingAnalysis` names them. This is how the operator plans
    in-process (numpy only, no torch).

    Args:
        where: renders request fields in the caller's terms for messages (default: command-line
            terms).
        progress: called with the bytes analyzed so far.
        analyze: analyze what the catalog lacks (False: raise :class:`MissingAnalysis`).

    Raises:
        InputError: the request is invalid, or a checkpoint or the calibration set is missing or
            incompatible.
        MissingAnalysis: with ``analyze=False``, statistics are missing.
    """
    rr = request if isinstance(request, ResolvedRequest) else request.resolve(where)
    inputs = _plan_inputs(catalog, storage, rr, progress, analyze)
    total = sum(r.total_bytes for r in inputs.experts)
    req = rr.request
    budget_bytes = (
        parse_bytes(req.budget, total=total, what=rr.where(("budget",)), bare=False)
        if isinstance(req.budget, str)
        else req.budget
    )
    if budget_bytes is not None:
        _check_budget_buys_a_block(budget_bytes, req.budget, inputs.analyses, inputs.experts, rr.where)
    gap = storage.gap_for([e.uri for e in req.experts])
    return _plan_under_deadline(rr, lambda b: _plan_at(catalog, rr, inputs, gap, b), budget_bytes, total)


@dataclass(frozen=True)
class _Inputs:
    """What :func:`build_plan` gathered before planning: the registered checkpoints, the
    catalog's statistics, the base's extra files and the calibration set with its sensitivity."""

    base: CheckpointRecord
    experts: list[CheckpointRecord]
    analyses: list[Analysis]
    gram: dict[tuple[int, int], dict[str, float]] | None
    sensitivity: dict[str, Any] | None
    calibration: Calibration | None
    extra_files: dict[str, int]
    config_json: bytes | None


def _register_checked(
    catalog: Catalog, storage: Storage, rr: ResolvedRequest
) -> tuple[CheckpointRecord, list[CheckpointRecord]]:
    """Register the request's base and experts and check, from their headers only, that every
    parameter names existing tensors and every expert matches the base.

    Raises:
        InputError: with ``loc`` ``("base",)`` or ``("experts", i, "uri")``.
    """
    from mergepipe.formats.safetensors import FLOAT_DTYPES

    req = rr.request
    try:
        base = catalog.register(storage, req.base)
    except InputError as e:
        raise rr.at(("base",), e) from None
    recs = []
    for i, ex in enumerate(req.experts):
        try:
            recs.append(catalog.register(storage, ex.uri, kind=ex.kind))
        except InputError as e:
            raise rr.at(("experts", i, "uri"), e) from None
    rr.params.check_tensors([n for n, t in base.layout.tensors.items() if t.dtype in FLOAT_DTYPES and t.numel > 0])
    for i, r in enumerate(recs):
        try:
            check_compatible(base, [r])  # headers only, both directions, before any tensor byte is read
        except InputError as e:
            raise rr.at(("experts", i, "uri"), e) from None
    return base, recs


def _plan_inputs(
    catalog: Catalog,
    storage: Storage,
    rr: ResolvedRequest,
    progress: Callable[[int], None] | None,
    analyze: bool,
) -> _Inputs:
    """Load the calibration set, register and check the checkpoints, read the base's extra
    files' sizes, then analyze what the catalog lacks (with ``analyze=False``: raise
    :class:`MissingAnalysis` instead) and find the base's sensitivity on the calibration set.
    Nothing of a tensor is read before every header check passed.

    Raises:
        InputError: the calibration set (``loc`` ``("planning", "calibration")``) or a
            checkpoint is missing or incompatible.
        MissingAnalysis: with ``analyze=False``, statistics are missing.
    """
    req = rr.request
    block_bytes = req.planning.block_bytes or DEFAULT_BLOCK_BYTES
    try:
        cal = load_calibration(storage, req.planning.calibration) if req.planning.calibration else None
    except InputError as e:
        raise rr.at(("planning", "calibration"), e) from None
    spec = get_method(req.method)
    base, recs = _register_checked(catalog, storage, rr)
    extra = _extra_files(storage, base.uri)  # size-capped, before any tensor byte is read
    config_json = None  # the output dtype rewrites config.json: the plan sizes the rewritten file
    if req.options.out_dtype and "config.json" in extra:
        config_json = storage.read_object(storage.join(base.uri, "config.json"), "other")
    if not analyze:
        _require_analysis(catalog, base, recs, block_bytes, spec.needs_gram)
    analyses = catalog.analyze(storage, base, recs, block_bytes=block_bytes, progress=progress, pairs=spec.needs_gram)
    gram = catalog.pair_dots(base, recs, analyses) if spec.needs_gram else None
    sens = None
    if cal is not None:
        sens = catalog.find_sensitivity(base.identity, cal.digest, block_bytes)
        if sens is None:
            if not analyze:
                raise MissingAnalysis([], base_identity=base.identity, calibration=cal.digest)
            sens = catalog.sensitivity(storage, base, cal, block_bytes)
    return _Inputs(base, recs, analyses, gram, sens, cal, extra, config_json)


def _plan_at(catalog: Catalog, rr: ResolvedRequest, inputs: _Inputs, gap: int, budget: int | None) -> Plan:
    """:func:`make_plan` of the request over the gathered inputs under ``budget`` bytes (None:
    unlimited), reading with the storage's coalescing ``gap``."""
    req = rr.request
    planning = req.planning
    cal = inputs.calibration
    fisher = cal is not None and planning.block_value == "fisher"
    return make_plan(
        rr,
        PlanInputs(
            inputs.base,
            inputs.experts,
            inputs.analyses,
            gram=inputs.gram,
            base_digests=catalog.tensor_digests(inputs.base.identity),
            extra_files=inputs.extra_files,
            sensitivity=inputs.sensitivity if fisher else None,
            config_json=inputs.config_json,
        ),
        SelectionOptions(
            budget_bytes=budget,
            fidelity=req.fidelity,
            value=planning.block_value,
            calibration=cal.digest if (cal is not None and fisher) else None,
            sketch=planning.sketch if planning.sketch is not None else DEFAULT_SKETCH,
        ),
        EngineOptions(work_bytes=req.run.work_bytes or DEFAULT_WORK_BYTES, coalesce_gap=gap),
    )


def _plan_under_deadline(
    rr: ResolvedRequest, plan_at: Callable[[int | None], Plan], budget_bytes: int | None, total: int
) -> Plan:
    """``plan_at(budget_bytes)``, or with ``planning.deadline`` the plan of the largest budget
    (at most ``budget_bytes`` and ``total``) whose predicted time fits
    (:func:`mergepipe.planner.cost.budget_for_deadline`); with this machine's throughput known,
    the plan's ``predicted_seconds`` are filled in.

    Raises:
        InputError: a bad deadline (``loc`` ``("planning", "deadline")``) or a broken throughput
            cache when a deadline needs it.
    """
    from mergepipe.planner.cost import budget_for_deadline, load_throughput, parse_duration, predict_seconds

    deadline = rr.request.planning.deadline
    try:
        tp = load_throughput()
    except InputError as e:
        if deadline is None:
            tp = None  # a broken cache does not stop planning by bytes; calibrate reports it
        else:
            raise e from None
    if deadline is not None:
        if tp is None:
            tp = _first_calibration()
        hi = total if budget_bytes is None else min(budget_bytes, total)
        try:
            plan = budget_for_deadline(
                lambda b: plan_at(budget_bytes if b is None else min(b, hi)),
                hi,
                parse_duration(deadline, what=rr.where(("planning", "deadline"))),
                tp,
            )
        except InputError as e:
            raise rr.at(("planning", "deadline"), e) from None
    else:
        plan = plan_at(budget_bytes)
    if tp is not None:
        plan = plan.model_copy(update={"predicted_seconds": predict_seconds(plan, tp)})
    return plan


def _first_calibration():
    """Measure and cache this machine's throughput on first use of a deadline (a few seconds)."""
    from mergepipe.planner.cost import calibrate, save_throughput

    tp = calibrate()
    save_throughput(tp)
    return tp


def _extra_files(storage: Storage, base_uri: str) -> dict[str, int]:
    """The non-weight files of the base (:data:`EXTRA_FILES`) present, name -> size in bytes
    (the plan counts them as base reads and output writes), each refused when larger than its cap
    (:data:`mergepipe.limits.MAX_CONFIG_JSON_BYTES` for JSON configs,
    :data:`mergepipe.limits.MAX_EXTRA_FILE_BYTES` for tokenizer files): they are read whole."""
    from mergepipe.limits import MAX_CONFIG_JSON_BYTES, MAX_EXTRA_FILE_BYTES, check_size
    from mergepipe.storage.base import NotFoundError

    out: dict[str, int] = {}
    for f in EXTRA_FILES:
        uri = storage.join(base_uri, f)
        try:
            size = storage.stat(uri).size
        except NotFoundError:
            continue
        cap = MAX_CONFIG_JSON_BYTES if f.endswith("config.json") else MAX_EXTRA_FILE_BYTES
        check_size(size, cap, uri, f)
        out[f] = int(size)
    return out


def _require_analysis(
    catalog: Catalog, base: CheckpointRecord, recs: Sequence[CheckpointRecord], block_bytes: int, pairs: bool
) -> None:
    """Raise :class:`MissingAnalysis` unless every expert (and, with ``pairs``, every two distinct
    experts) has its statistics in the catalog."""
    missing: list[CheckpointRecord] = []

    def add(r: CheckpointRecord) -> None:
        if all(m.identity != r.identity for m in missing):
            missing.append(r)

    for r in recs:
        if not catalog.has_analysis(base.identity, r.identity, block_bytes):
            add(r)
    if pairs:
        for i, a in enumerate(recs):
            for b in recs[i + 1 :]:
                if (
                    a.identity != b.identity
                    and catalog._find_pair(base.identity, *sorted((a.identity, b.identity))) is None
                ):
                    add(a)
                    add(b)
    if missing:
        raise MissingAnalysis(
            [r.uri for r in missing], base_identity=base.identity, identities=[r.identity for r in missing]
        )


def execute_and_commit(
    plan: Plan,
    storage: Storage,
    out: str,
    *,
    device: str = "cpu",
    progress: Callable[[int], None] | None = None,
    prefetch_bytes: int | None = None,
    out_storage: Storage | None = None,
    target: CommitTarget | None = None,
    resume: bool = False,
    unsafe_single_writer: bool = False,
    lineage: dict | None = None,
) -> MergeResult:
    """Execute ``plan`` in this process and publish the snapshot at ``out`` atomically: the
    plan as the one part of a run, committed like any partitioned run
    (:func:`mergepipe.parts.execute_single`; the target decides how: a run folder beside a local
    ``out`` renamed onto it under ``out``'s lock, or a run prefix and a conditional manifest
    create on object storage, :mod:`mergepipe.commit.target`).

    Args:
        out_storage: storage for ``out`` (default: ``target``'s, else derived from ``out``,
            sharing ``storage``'s byte counters).
        target: the commit target of ``out`` (default:
            :func:`mergepipe.commit.target.commit_target` of ``out_storage``; e.g. a
            ``PrefixTarget`` over local storage runs the object-store protocol on a folder).
        resume: keep what an interrupted run of this plan finished (``--resume``).
        lineage: extra top-level manifest keys recording where the merge came from, e.g.
            ``{"search": {"search_id", "candidate", "point", ...}}`` (``mergepipe search``).

    Raises:
        InputError: output path unusable or holding another snapshot; inputs changed; the store
            ignores conditional writes (unless ``unsafe_single_writer``).
        CommitConflict: another writer holds a local ``out``, or committed a different
            snapshot at ``out`` meanwhile.
    """
    from mergepipe.commit.target import commit_target
    from mergepipe.parts import execute_single

    if target is None:
        target = commit_target(out_storage or output_storage(plan, storage, out), out)
    return execute_single(
        plan,
        storage,
        out,
        target=target,
        resume=resume,
        device=device,
        progress=progress,
        prefetch_bytes=prefetch_bytes,
        unsafe_single_writer=unsafe_single_writer,
        lineage=lineage,
    )


def _check_budget_buys_a_block(budget_bytes: int, given, analyses, recs, where) -> None:
    """Refuse a budget smaller than the cheapest block of every expert: it buys nothing, and the
    "merge" would commit the base under a new name (issue 24: ``--budget 25`` read 0 bytes and
    exited 0). The cheapest block is the smallest exact block (``block_numel`` times the
    tensor's element size; 1 byte per entry for a LoRA adapter's tensors, a lower bound) of any
    expert tensor with a non-zero task vector.

    Raises:
        InputError: naming the budget field and the smallest budget that buys a block.
    """
    from mergepipe.formats.safetensors import DTYPES

    cheapest = None
    for rec, an in zip(recs, analyses, strict=True):
        for name, st in an.tensors.items():
            info = rec.layout.tensors.get(name) if rec.adapter is None else None
            size = DTYPES[info.dtype][0] if info is not None and info.dtype in DTYPES else 1
            bn = st.block_numel[st.sq_norm > 0] if len(st.block_numel) == len(st.sq_norm) else st.block_numel
            if len(bn):
                c = int(bn.min()) * size
                cheapest = c if cheapest is None else min(cheapest, c)
    if cheapest is not None and budget_bytes < cheapest:
        loc = ("budget",)
        problem = (
            f"{short_repr(given)} ({budget_bytes} bytes) buys no block of any expert (the smallest costs "
            f"{cheapest} bytes); give at least {cheapest}B, a percentage like 10%, or unlimited."
        )
        raise InputError(f"{where(loc)}: {problem}", loc=loc, problem=problem)


def merge_request(
    request: MergeRequest,
    *,
    where: Where | None = None,
    catalog: Catalog | None = None,
    storage: Storage | None = None,
    prefetch_bytes: int | None = None,
    progress: Callable[[str, int, int | None], None] | None = None,
) -> MergeResult:
    """register → analyze → plan → execute → commit in one call (what ``mergepipe merge`` runs),
    committing at ``request.output``. How it runs is the request's too
    (:class:`mergepipe.request.RunOptions`): ``run.workers`` parts in parallel processes
    (:func:`mergepipe.parts.run_workers`; a rerun resumes), else in this process as the one part
    of a run (:func:`execute_and_commit`; with ``run.resume`` a rerun after a crash keeps what
    the interrupted attempt finished, else it merges every file again); on ``run.device``.

    Args:
        where: renders request fields in the caller's terms for messages (see :func:`build_plan`).
        catalog, storage: default the local catalog and the storage of ``request.base``.
        prefetch_bytes: bytes the engine reads ahead (default the plan's working memory).
        progress: ``progress(stage, advance_bytes, total_bytes_or_None)``.

    Raises:
        InputError: no ``request.output``, an invalid request, or an unusable output path.
    """
    from mergepipe.commit.manifest import probe_lock
    from mergepipe.commit.target import FolderTarget, commit_target

    out = request.output
    if not out:
        raise InputError("the merge request has no output; give --out DIR (or an s3:// prefix).", loc=("output",))
    t0 = time.perf_counter()
    storage = storage or open_storage(request.base, IOCounters())
    catalog = catalog or Catalog()
    rr = request.resolve(where)  # before touching the output
    # fail fast, before reading any input and creating anything: a bad --out, or a live writer owning it
    target = commit_target(storage, out)
    if (
        isinstance(target, FolderTarget)
        and target.committed(None, [request.base, *(e.uri for e in request.experts)]) is None
    ):
        probe_lock(out)
    cb = (lambda n: progress("analyze", n, None)) if progress else None
    plan = build_plan(catalog, storage, rr, progress=cb)
    workers, resume, device = request.run.workers, request.run.resume, request.run.device
    t_an = time.perf_counter() - t0
    if progress and not workers:  # (part processes report no progress to this one)
        progress("merge", 0, plan.io.output_write_bytes)
    if workers:
        from mergepipe.parts import run_workers

        res = run_workers(plan, storage, out, workers, device=device)
    else:
        res = execute_and_commit(
            plan,
            storage,
            out,
            device=device,
            prefetch_bytes=prefetch_bytes,
            resume=bool(resume),
            progress=(lambda n: progress("merge", n, None)) if progress else None,
        )
    res.analyze_s = t_an
    res.total_s = time.perf_counter() - t0
    return res


def merge(
    base_uri: str,
    experts: Sequence[tuple[str, str]],
    method: str,
    out: str,
    params: Sequence[str] = (),
    *,
    budget: str | int | None = None,
    fidelity: float | None = None,
    seed: int = 0,
    out_dtype: str | None = None,
    **kw,
) -> MergeResult:
    """:func:`merge_request` with command-line style inputs: ``experts`` as ``(name, uri)``
    pairs, ``params`` in the ``--param`` grammar (``["density=0.5", "math:weight=0.3"]``,
    :func:`mergepipe.request.parse_param_args`) and ``out_dtype`` the safetensors dtype of the
    floating outputs; ``kw`` are planning and run options (:func:`with_options`: ``value``,
    ``calibration``, ``sketch``, ``block_bytes``, ``work_bytes``, ``workers``, ``resume``,
    ``device``) and :func:`merge_request`'s own arguments."""
    from mergepipe.request import RequestOptions, request_from_args

    req = request_from_args(
        base_uri,
        experts,
        method,
        params,
        budget=budget,
        fidelity=fidelity,
        seed=seed,
        output=str(out),
        options=RequestOptions(out_dtype=out_dtype),
    )
    req, kw = with_options(req, **kw)
    return merge_request(req, **kw)


_PLANNING_KEYS = ("value", "calibration", "sketch", "block_bytes")
_RUN_KEYS = ("work_bytes", "workers", "resume", "device")


def with_options(request: MergeRequest, **kw: Any) -> tuple[MergeRequest, dict[str, Any]]:
    """``request`` with the planning options (``value``, ``calibration``, ``sketch``,
    ``block_bytes``: :class:`mergepipe.request.PlanningOptions`) and run options (``work_bytes``,
    ``workers``, ``resume``, ``device``: :class:`mergepipe.request.RunOptions`) among ``kw`` set
    (those given as None keep the request's), and the other keyword arguments: how the
    command-line style helpers (:func:`merge`, :func:`mergepipe.config.merge_from_config`) fill a
    request from keyword arguments.

    Raises:
        pydantic.ValidationError: a value of the wrong type.
    """
    plan_kw = {k: kw.pop(k) for k in _PLANNING_KEYS if k in kw}
    run_kw = {k: kw.pop(k) for k in _RUN_KEYS if k in kw}
    plan_kw = {k: v for k, v in plan_kw.items() if v is not None}
    run_kw = {k: v for k, v in run_kw.items() if v is not None}
    if plan_kw:
        request = request.with_planning(**plan_kw)
    if run_kw:
        request = request.with_run(**run_kw)
    return request, kw
