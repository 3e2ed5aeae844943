"""Budget- and fidelity-aware block selection.

Objective: maximize retained task-vector energy after the method's sparsification,
``Σ wᵢ² · kept_energy(i, block)`` over the selected (expert, block) pairs, subject to the expert
bytes the engine will read (coalesced with the plan's gap rule, times the reads a block needs:
a tensor's pre-passes read it again, except its first chunk, :func:`mergepipe.planner.plan.block_reads`)
being at most the budget. This is a knapsack; blocks are small and near-uniform in size,
so the greedy order by value per byte (Dantzig's bound) is within one block of optimal.

Guarantee: ``plan.io.expert_read_bytes`` is computed with :func:`mergepipe.storage.base.coalesce`
over the exact byte ranges the engine requests (per expert and tensor: the engine never coalesces
across tensors), so realized expert bytes <= planned <= budget (the engine only ever issues
subsets of these ranges, see :mod:`mergepipe.engine`). On object storage, ranges whose gap is at
most the storage's ``max_gap`` are fetched in one request and the gap bytes are paid for; a
selection is therefore *closed under the gap rule* (:func:`_gap_closure`: the blocks inside a
bridged gap are selected and merged, not read and dropped), which makes its cost exactly its
blocks' bytes and realized == planned on every storage. The plan uses the largest gap (the
storage's, halved down to one block, or 0) whose selection keeps within ``GAP_TOLERANCE`` of the
value and bytes of exact reads (:func:`_select_gap`), and records it as ``coalesce_gap``.

Blocks whose every entry falls below the trim threshold (``max|δ|`` key below it) or whose
task vector is zero carry no value and are never read, even at unlimited budget: the output is
the same either way. (With ``rescale``, a block below the threshold still changes the tensor's
L1 norm, so it keeps a tiny positive value: read last, and always at unlimited budget.)

Parameters are resolved per tensor here (layer gradients, name filters; see
:mod:`mergepipe.methods.params`) and stored in the plan per tensor and per expert. Methods whose
coefficients need whole-tensor statistics get them from the catalog: slerp from the exact
``Σθ_b²``, ``Σθ_e²``, ``Σθ_b·θ_e`` of the expert's analysis; nuslerp and model_stock from
``‖δᵢ‖²`` and the pair statistics ``⟨δᵢ,δⱼ⟩``. Row-local statistics (DELLA's per-row ranks,
model_stock ``filter_wise`` and nuslerp ``nuslerp_flatten=false`` per-row cosines) are computed by
the engine from the rows it reads; their block values here are estimates from the tensor-level
coefficient, floored so that every block with a non-zero task vector has a positive value.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES, Analysis, CheckpointRecord, lora_map
from mergepipe.catalog.sketch import R1_LEVEL, SKETCH_KINDS, level_sections, sketch_tiers, tier_costs
from mergepipe.catalog.stats import TensorStats
from mergepipe.errors import InputError
from mergepipe.formats.safetensors import FLOAT_DTYPES, TensorInfo, n_blocks, rows_per_block
from mergepipe.methods.base import MethodSpec, TensorStatsView
from mergepipe.methods.params import layer_count, layer_t
from mergepipe.methods.registry import get_method
from mergepipe.methods.sparsify import EXACT_TRIM_DTYPES  # noqa: F401 - re-exported
from mergepipe.numerics import stream_key
from mergepipe.planner.plan import (
    ExpertRef,
    InputRef,
    IOEstimate,
    LoraFactors,
    Plan,
    TensorExpert,
    TensorPlan,
    block_reads,
)
from mergepipe.request import ResolvedRequest
from mergepipe.storage.base import DEFAULT_MAX_REQUEST, coalesce

DEFAULT_WORK_BYTES = 256 * 1024 * 1024


def chunk_rows(
    info: TensorInfo, rpb: int, n_experts: int, work_bytes: int, extra_per_elem: int = 0, floats: int | None = None
) -> int:
    """Rows the engine processes at once: a multiple of ``rpb`` such that the float32 working
    set (``floats`` arrays per element, :func:`mergepipe.methods.kernels.work_floats`; default
    ``K + 3``: ``floats * rows * row_numel * 4`` bytes, plus ``extra_per_elem`` bytes per
    element) stays within ``work_bytes``; at least one block."""
    row_numel = max(1, info.numel // max(1, info.rows))
    per_row = ((n_experts + 3 if floats is None else floats) * 4 + extra_per_elem) * row_numel
    rows = max(rpb, (work_bytes // max(1, per_row)) // rpb * rpb)
    return min(rows, max(rpb, -(-info.rows // rpb) * rpb))


@dataclass
class _Cand:
    tensor: int
    expert: int
    value: np.ndarray  # per block (a LoRA module: one unit, the whole tensor)
    cost: np.ndarray  # bytes per block (one read); shared by the tensor's candidates: read-only
    reads: np.ndarray  # int64 per block: how many times the engine reads it (plan.block_reads)
    svalue: np.ndarray | None = None  # [block, j]: value a read at the policy's j-th tier keeps (None: no sketch)
    scost: np.ndarray | None = None  # [block, j]: bytes (one pass) of that read (catalog.sketch.tier_costs)
    lora: bool = False
    lora_total: int = 0  # a LoRA module: bytes over all passes (A with every chunk read, B's rows)
    te: dict = field(default_factory=dict)  # the TensorExpert's fields known before selection

    def total(self) -> np.ndarray:
        """Bytes per block over all its reads (a LoRA module: one unit)."""
        return np.array([self.lora_total], dtype=np.int64) if self.lora else self.cost * self.reads


def block_byte_ranges(info: TensorInfo, rpb: int, runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Absolute byte ranges of block runs ``[b0, b1)`` of a tensor with ``rpb`` rows per block."""
    out = []
    for b0, b1 in runs:
        r0, r1 = b0 * rpb, min(info.rows, b1 * rpb)
        if r1 > r0:
            out.append(info.row_range(r0, r1))
    return out


def _runs(idx: np.ndarray) -> list[tuple[int, int]]:
    if len(idx) == 0:
        return []
    idx = np.sort(idx)
    breaks = np.nonzero(np.diff(idx) != 1)[0]
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]]) + 1
    return list(zip(starts.tolist(), ends.tolist()))


@dataclass(frozen=True)
class PlanInputs:
    """What the catalog knows about the checkpoints of a merge.

    Attributes:
        base, experts: the registered checkpoints (experts in the request's order).
        analyses: the catalog's analysis of each expert (same order), same block size.
        gram: ``{(i, j): {tensor: ⟨δᵢ,δⱼ⟩}}`` from :meth:`Catalog.pair_dots` (model_stock, nuslerp).
        base_digests: SHA-256 of each base tensor's bytes (from the catalog); lets the engine
            copy unchanged tensors server-side and still account for their content.
        extra_files: non-tensor files of the base copied into the snapshot (``config.json``,
            ...): name -> size in bytes. The engine reads each whole (base bytes) and writes it
            (output bytes), so the plan's I/O estimate counts them.
        config_json: the base's ``config.json`` bytes, needed only when the merge writes another
            dtype (the engine then rewrites its ``torch_dtype``, which changes its size); None
            otherwise.
        sensitivity: ``{tensor: float64[n_blocks]}`` block-mean diagonal Fisher of the base on a
            calibration set (for ``SelectionOptions.value="fisher"``; see
            :mod:`mergepipe.catalog.sensitivity`).
    """

    base: CheckpointRecord
    experts: Sequence[CheckpointRecord]
    analyses: Sequence[Analysis]
    gram: dict | None = None
    base_digests: dict[str, str] | None = None
    extra_files: Mapping[str, int] = field(default_factory=dict)
    sensitivity: dict[str, np.ndarray] | None = None
    config_json: bytes | None = None


@dataclass(frozen=True)
class SelectionOptions:
    """Which expert blocks to read.

    Attributes:
        budget_bytes: expert-I/O budget in bytes (None: unlimited); the request's budget with a
            percentage resolved against the experts' total size.
        fidelity: fraction of the full-budget retained value to reach, in (0, 1] (None: off).
            With both, the plan stops at whichever comes first.
        value: the block value the selection maximises per byte: ``"energy"`` (``w²`` times the
            task-vector energy the method keeps in the block) or ``"fisher"`` (that energy times
            the block's mean diagonal Fisher of the base, ``PlanInputs.sensitivity``). With
            ``fisher``, ``retained_energy`` and ``fidelity`` are shares of the Fisher-weighted energy.
        calibration: the calibration set's digest, recorded in the plan (part of its digest).
        sketch: fidelity tiers per block: ``"none"`` (read a block exactly or skip it) or
            ``"signK"`` (K = 1..3: a block may also be merged from the first k <= K sign planes
            of its sketch recorded by the catalog, :mod:`mergepipe.catalog.sketch`, whose bytes
            count against the budget like expert bytes). Used only under a budget or fidelity,
            for the task-arithmetic family (``linear``/``gta`` methods) and tensors the catalog
            sketched. With tiers under a budget, the same block of a tensor gets the same tier
            in every expert (:func:`_select_tiers_joint`); with a fidelity target alone, tiers
            are chosen block by block (the fewest bytes to the target).
    """

    budget_bytes: int | None = None
    fidelity: float | None = None
    value: str = "energy"
    calibration: str | None = None
    sketch: str = "none"

    def __post_init__(self) -> None:
        """Refuse options no validated request produces (a caller's bug, not a user's input: a
        user's budget, fidelity, block value and tiers are refused with their field path by
        :meth:`mergepipe.request.MergeRequest.resolve` before planning).

        Raises:
            ValueError: a negative budget, a fidelity outside (0, 1], an unknown block value or
                fidelity tier.
        """
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"SelectionOptions.budget_bytes {self.budget_bytes} is negative")
        if self.fidelity is not None and not 0.0 < self.fidelity <= 1.0:
            raise ValueError(f"SelectionOptions.fidelity {self.fidelity} is outside (0, 1]")
        if self.value not in ("energy", "fisher"):
            raise ValueError(f"SelectionOptions.value {self.value!r} is not 'energy' or 'fisher'")
        if self.sketch not in SKETCH_KINDS:
            raise ValueError(f"SelectionOptions.sketch {self.sketch!r} is not one of {', '.join(SKETCH_KINDS)}")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine will read, which the plan's cost model and chunking follow.

    Attributes:
        work_bytes: engine working-memory target (bytes) that fixes chunking (semantic: it
            decides whether a tensor needs a second pass).
        coalesce_gap: gap (bytes) under which the storage merges ranges (its ``max_gap``); the
            plan records the gap it chose, at most this (see the module docstring).
    """

    work_bytes: int = DEFAULT_WORK_BYTES
    coalesce_gap: int = 0


def make_plan(
    request: ResolvedRequest,
    inputs: PlanInputs,
    selection: SelectionOptions = SelectionOptions(),
    engine: EngineOptions = EngineOptions(),
) -> Plan:
    """Plan a merge of ``inputs.experts`` into ``inputs.base``: candidates (per tensor and
    expert, the method's block values, :func:`_tensor_candidates`) -> selection (the knapsack
    under the budget or fidelity, :func:`_select_blocks`) -> assembly (the selected blocks into
    the tensor plans, :func:`_assemble`, and the sealed :class:`Plan`, :func:`_plan_record`).
    The method's behaviour comes from its object (:class:`mergepipe.methods.base.MethodSpec`).

    Args:
        request: the validated merge request (method, expert names, parameters resolved per
            expert, seed, output dtype and what is recorded: :class:`mergepipe.request.ResolvedRequest`).
            ``request.options.out_dtype`` is recorded per tensor (and in the plan) only where it
            differs from the base's dtype, so a merge asking for the dtype it already has plans
            (and digests) like one that does not ask; ``requested_dtype`` and ``source`` are
            recorded in the plan, not part of its digest.
        inputs: the checkpoints and the catalog's statistics (:class:`PlanInputs`).
        selection: budget, fidelity and block value (:class:`SelectionOptions`).
        engine: working memory and coalescing gap (:class:`EngineOptions`).

    Raises:
        InputError: fidelity tiers asked of experts the catalog has no sketches of (``loc``
            ``("planning", "sketch")``), parameters for another number of experts, missing pair
            statistics, an analysis that does not match the base's layout.
        ValueError: ``fisher`` without sensitivity (see :meth:`BlockValueRule.of`). The
            request-level refusals (budget, fidelity, block value, tiers, number of experts)
            happen before, in :meth:`mergepipe.request.MergeRequest.resolve`, with field paths;
            :class:`SelectionOptions` refuses values no validated request produces.
    """
    t0 = time.perf_counter()
    pc = _planning(request, inputs, selection, engine)
    tensors: list[TensorPlan] = []
    cands: list[_Cand] = []
    infos: list[TensorInfo] = []
    for name, bt in inputs.base.layout.tensors.items():
        tp, eps = _tensor_plan(pc, name, bt)
        tensors.append(tp)
        infos.append(bt)
        if bt.dtype in FLOAT_DTYPES and bt.numel > 0:
            cands.extend(_tensor_candidates(pc, len(tensors) - 1, tp, bt, eps))
    sel = _select_blocks(pc, cands, tensors, infos, selection)
    _assemble(pc, cands, tensors, infos, sel)
    return _plan_record(pc, tensors, infos, sel, selection, t0)


@dataclass(frozen=True)
class _Planning:
    """What every step of :func:`make_plan` reads: the method object, the inputs and the
    options, checked (:func:`_planning`)."""

    spec: MethodSpec
    request: ResolvedRequest
    inputs: PlanInputs
    value: BlockValueRule
    work_bytes: int
    coalesce_gap: int
    tiers: bool
    levels: int  # tiers the policy offers (columns of svals/scosts)
    tier_levels: np.ndarray  # int64 (levels,): the sketch level of each column (catalog.sketch.sketch_tiers)
    block_bytes: int
    n_layers: int
    lmaps: list
    base_is_input: bool

    @property
    def experts(self) -> Sequence[CheckpointRecord]:
        return self.inputs.experts

    @property
    def analyses(self) -> Sequence[Analysis]:
        return self.inputs.analyses

    @property
    def K(self) -> int:
        return len(self.inputs.experts)


def _planning(
    request: ResolvedRequest, inputs: PlanInputs, selection: SelectionOptions, engine: EngineOptions
) -> _Planning:
    """Check the options against the method and the inputs; the shared state of the plan.

    Raises:
        InputError: as :func:`make_plan`.
    """
    spec = get_method(request.method)
    experts, analyses, K = inputs.experts, inputs.analyses, len(inputs.experts)
    budget_bytes, fidelity, sketch = selection.budget_bytes, selection.fidelity, selection.sketch
    value = BlockValueRule.of(selection, inputs.sensitivity)
    # fidelity tiers only where a block can be skipped and the method is the task-arithmetic family
    tiers = sketch != "none" and (budget_bytes is not None or fidelity is not None) and spec.sketch_tiers
    coalesce_gap = engine.coalesce_gap
    if tiers:
        # (LoRA adapter experts have no sketch: their factors are read whole, already small)
        missing = [e.uri for e, a in zip(experts, analyses) if not a.sketch and getattr(e, "adapter", None) is None]
        if missing:
            loc = ("planning", "sketch")
            problem = (
                f"{sketch}: the catalog has no block sketches of {missing[0]}; re-run `mergepipe analyze` "
                f"(analyses since stats version 3 record them) or ask for {request.where(loc)} none."
            )
            raise InputError(f"{request.where(loc)} {problem}", loc=loc, problem=problem)
        coalesce_gap = 0  # exact accounting of two tiers: blocks are read exactly, never bridged
    if len(request.params.experts) != K:
        raise InputError(f"{len(request.params.experts)} expert parameter sets for {K} experts.")
    if spec.needs_gram and inputs.gram is None:
        raise InputError(
            f"{request.method} needs the experts' pair statistics; analyze with pairs (the pipeline does)."
        )
    base = inputs.base
    return _Planning(
        spec=spec,
        request=request,
        inputs=inputs,
        value=value,
        work_bytes=engine.work_bytes,
        coalesce_gap=coalesce_gap,
        tiers=tiers,
        levels=len(sketch_tiers(sketch)),
        tier_levels=np.asarray(sketch_tiers(sketch), dtype=np.int64),
        block_bytes=analyses[0].block_bytes if analyses else DEFAULT_BLOCK_BYTES,  # (passthrough: no experts)
        n_layers=layer_count(base.layout.tensors),
        # LoRA adapter experts: {base tensor: module} (δ = s·B·A there, 0 elsewhere)
        lmaps=[lora_map(base, e) if e.adapter is not None else None for e in experts],
        # a mergekit config without base_model: the base is one of the inputs (multislerp's raw points)
        base_is_input=any(r.uri == base.uri for r in experts),
    )


def _tensor_plan(pc: _Planning, name: str, bt: TensorInfo) -> tuple[TensorPlan, Sequence[Mapping[str, Any]]]:
    """The tensor's plan before selection (resolved parameters, chunking and passes; no
    experts yet) and its resolved per-expert parameters (empty for a tensor that is not
    floating point)."""
    spec, K = pc.spec, pc.K
    floating = bt.dtype in FLOAT_DTYPES and bt.numel > 0
    rpb = rows_per_block(bt, pc.block_bytes)
    tpar = pc.request.params.for_tensor(name, layer_t(name, pc.n_layers)) if floating else None
    g = dict(tpar.globals) if tpar else {}
    eps = tpar.experts if tpar else ()
    ew = spec.elementwise(bt.dtype)
    cr = chunk_rows(bt, rpb, K, pc.work_bytes, floats=spec.work_floats(K, ew))
    if (floating and spec.row_stats(g) and len(bt.shape) < 2) or (floating and spec.whole_tensor(g)):
        cr = max(rpb, -(-bt.rows // rpb) * rpb)  # a 1-D tensor is one row / whole-tensor statistics: one chunk
    weights = [float(e.get("weight", 1.0)) for e in eps]
    out_dtype = pc.request.request.options.out_dtype
    tp = TensorPlan(
        name=name,
        dtype=bt.dtype,
        shape=list(bt.shape),
        file=bt.file,
        start=bt.start,
        rows_per_block=rpb,
        n_blocks=n_blocks(bt, pc.block_bytes),
        chunk_rows=cr,
        params=g,
        weight_sum=float(sum(weights)),
        out_dtype=(out_dtype if floating and out_dtype and out_dtype != bt.dtype else None),
        base_sha256=(pc.inputs.base_digests or {}).get(name, ""),
    )
    # an L1 rescale of a tensor larger than one chunk needs a pre-pass over it
    tp.passes = 2 if spec.rescales(g) and cr < bt.rows and any(e.get("density", 1.0) < 1.0 for e in eps) else 1
    return tp, eps


def _tensor_stats(pc: _Planning, name: str, rpb: int) -> list:
    """The catalog's statistics of tensor ``name`` for every expert.

    Raises:
        InputError: an analysis lacks the tensor or has another block grid."""
    stats = []
    for e, a in zip(pc.experts, pc.analyses):
        st = a.tensors.get(name)
        if st is None:
            raise InputError(f"catalog: analysis of {e.uri} lacks tensor {name!r}; re-run `mergepipe analyze`.")
        if st.rows_per_block != rpb:
            raise InputError(f"catalog: block grid of {name!r} differs from the plan's; re-run analyze.")
        stats.append(st)
    return stats


def _tensor_candidates(
    pc: _Planning, ti: int, tp: TensorPlan, bt: TensorInfo, eps: Sequence[Mapping[str, Any]]
) -> list[_Cand]:
    """The candidates of one floating tensor (one per expert with a task vector there), with
    the method's coefficients and exact-threshold refinements recorded in ``tp``; each carries
    the fields of its :class:`TensorExpert` (made by :func:`_assemble` once the selection is
    known). What every expert of the tensor shares — the reads per block, the bytes per block of
    experts with the base's layout, the sketch tiers' bytes — is computed once, and the sketch
    tiers' values of all the tensor's experts in one array operation (:func:`_tier_values`)."""
    spec, K = pc.spec, pc.K
    weights = [float(e.get("weight", 1.0)) for e in eps]
    ts = TensorStatsView(
        tp.name, tp.params, _tensor_stats(pc, tp.name, tp.rows_per_block), weights, pc.inputs.gram, pc.base_is_input
    )
    coefs, tp.derived = spec.coefficients(ts)
    # exact top-k (TIES) / window (breadcrumbs) on bf16/float16/float32: the key histogram gives the
    # threshold group and how many of it to keep, the engine the float32 threshold inside it (a
    # pre-pass when the tensor spans several chunks). The engine counts each refined group's float32
    # bit patterns (a 65,537-bin histogram per expert, mergepipe.numerics.exact_shrink_hist): exact
    # at any group size in bounded memory, so no group is capped
    ranks, windows = spec.exact_bounds(ts, eps, bt.dtype, None)
    if any(ranks) and tp.chunk_rows < bt.rows:
        tp.passes += 1
        tp.derived = {**tp.derived, "threshold_pass": True}
    row_stats = spec.row_stats(tp.params)
    shared = _TensorShared(np.asarray(block_reads(tp), dtype=np.int64))
    bvs = []
    for i in range(K):
        bv = spec.block_value(ts, i, eps[i], coefs[i], row_stats, (ranks[i], windows[i]))
        bvs.append((bv, pc.value.apply(bv.value, tp.name)))
    sketched = [
        i for i in range(K) if pc.tiers and pc.lmaps[i] is None and ts.stats[i].has_sketch and len(bt.shape) >= 2
    ]
    svalues = dict(zip(sketched, _tier_values(pc, [ts.stats[i] for i in sketched], [bvs[i][1] for i in sketched])))
    out = []
    seed = pc.request.request.seed
    for i in range(K):
        bv, val = bvs[i]
        sv = svalues.get(i)
        c = _expert_candidate(pc, ti, tp, bt, i, ts.stats[i], val, sv, shared)
        if c is None:
            continue
        cand, file, start, lf = c
        out.append(cand)
        ep = eps[i]
        cand.te = dict(
            expert=i,
            file=file,
            start=start,
            weight=weights[i] if weights else 1.0,
            density=float(ep.get("density", 1.0)),
            gamma=float(ep.get("gamma", 0.0)),
            epsilon=float(ep.get("epsilon", 0.0)),
            min_key=int(bv.min_key),
            max_key=int(bv.max_key),
            stream_key=stream_key(seed, i, tp.name),
            exact_rank=max(0, ranks[i]),
            exact_rank_hi=(windows[i] or (0, 0, 0, 0))[3],
            full_energy=float(val.sum()),
            lora=lf,
        )
    return out


@dataclass
class _TensorShared:
    """What the candidates of one tensor share (:func:`_tensor_candidates`): the reads per
    block, and per expert layout ``(rows, row_bytes)`` the bytes per block and the sketch
    tiers' bytes (the same for every expert stored like the base)."""

    reads: np.ndarray
    costs: dict = field(default_factory=dict)
    scosts: dict = field(default_factory=dict)


def _tier_values(pc: _Planning, stats: Sequence[TensorStats], vals: Sequence[np.ndarray]) -> list[np.ndarray]:
    """float64 ``[n_blocks, levels]`` per expert: the value a read at each of the policy's tiers
    keeps, for the sketched experts of one tensor (``stats`` and block values ``vals``, same
    order; the same block grid), computed for all of them at once. Level ``k`` keeps the share
    ``1 − residual_k/Σδ²`` of the block's energy; the method's value (trim, weights, Fisher)
    scales like the exact block's."""
    if not stats:
        return []
    nb = len(vals[0])
    if any(len(v) != nb for v in vals):  # (one grid per tensor; never stack unequal ones)
        return [v for st, v in zip(stats, vals) for v in _tier_values(pc, [st], [v])]
    sq = np.stack([np.asarray(st.sq_norm, dtype=np.float64) for st in stats])[:, :, None]
    res = np.stack([np.asarray(st.sketch_sq, dtype=np.float64).reshape(nb, -1) for st in stats])[
        :, :, pc.tier_levels - 1
    ]
    rho = np.where(sq > 0, 1.0 - res / np.where(sq > 0, sq, 1.0), 0.0)
    return list(np.stack(vals)[:, :, None] * np.clip(rho, 0.0, 1.0))


def _expert_candidate(
    pc: _Planning,
    ti: int,
    tp: TensorPlan,
    bt: TensorInfo,
    i: int,
    st: TensorStats,
    val: np.ndarray,
    svalue: np.ndarray | None,
    shared: _TensorShared,
) -> tuple[_Cand, str, int, LoraFactors | None] | None:
    """Expert ``i``'s candidate on tensor ``ti`` with block values ``val`` (and ``svalue``, the
    values of its sketch tiers, None: no tiers): its bytes per block and reads (a LoRA module:
    one unit of its factors; a sketched tensor: the sign-plane tiers), and where its data is
    (file, start, LoRA factors). None: a LoRA expert that does not touch the tensor (δ = 0,
    nothing to read)."""
    lmap = pc.lmaps[i]
    passes, cr = tp.passes, tp.chunk_rows
    if lmap is not None:
        mod = lmap.get(tp.name)
        if mod is None:
            return None
        # one unit: A for every chunk of a pass (the engine reads it with each chunk's
        # rows of B) plus B once; bytes per pass; the last pre-pass skips the first chunk
        n_chunks = -(-bt.rows // cr)
        unit = np.array([n_chunks * mod.a.nbytes + mod.b.nbytes], dtype=np.int64)
        first = mod.a.nbytes + min(cr, mod.b.rows) * mod.b.row_bytes if passes > 1 else 0
        cand = _Cand(
            ti,
            i,
            np.array([val.sum()]),
            unit,
            np.array([passes], dtype=np.int64),
            lora=True,
            lora_total=passes * int(unit[0]) - first,
        )
        lf = LoraFactors(
            a_start=mod.a.start,
            a_end=mod.a.end,
            a_dtype=mod.a.dtype,
            b_dtype=mod.b.dtype,
            rank=mod.rank,
            scale=mod.scale,
            module=mod.module,
        )
        return cand, mod.b.file, mod.b.start, lf
    rpb = tp.rows_per_block
    et = pc.experts[i].layout.tensors[tp.name]
    key = (et.rows, et.row_bytes, et.numel, st.n_blocks)
    cost = shared.costs.get(key)
    if cost is None:
        nb = st.n_blocks
        cost = (np.minimum((np.arange(nb) + 1) * rpb, et.rows) - np.arange(nb) * rpb) * et.row_bytes
        cost = shared.costs[key] = cost.astype(np.int64)
    scost = None
    if svalue is not None:
        scost = shared.scosts.get(key)
        if scost is None:
            tc = tier_costs(et.rows, et.numel // max(1, et.rows), rpb, st.n_blocks)
            scost = shared.scosts[key] = tc[:, pc.tier_levels - 1]
    return _Cand(ti, i, val, cost, shared.reads, svalue, scost), et.file, et.start, None


@dataclass
class _Selection:
    """The outcome of :func:`_select_blocks` over the flattened candidate blocks."""

    values: np.ndarray  # float64 per block
    offs: np.ndarray  # candidate j's blocks are [offs[j], offs[j+1])
    selected: np.ndarray  # bool per block: read exactly
    level: np.ndarray  # int64 per block: sketch level read (0: none)
    svals: np.ndarray | None  # float64 [block, tier column] (tiers only)
    scosts: np.ndarray | None  # int64 [block, tier column] bytes over all passes (tiers only)
    coalesce_gap: int
    expert_read: int
    sketch_read: int

    def picked(self, j: int) -> np.ndarray:
        """Selected block indices of candidate ``j``."""
        return np.nonzero(self.selected[self.offs[j] : self.offs[j + 1]])[0]


def _select_blocks(
    pc: _Planning,
    cands: Sequence[_Cand],
    tensors: Sequence[TensorPlan],
    infos: Sequence[TensorInfo],
    selection: SelectionOptions,
) -> _Selection:
    """The knapsack over every candidate block: exact reads (closed under the plan's gap,
    :func:`_select_gap`) or, with fidelity tiers, sketch levels (:func:`_select_tiers_joint`
    under a budget, :func:`_select_tiers` for a fidelity target alone); the read bytes checked
    against the coalesced byte ranges the engine will request.

    Raises:
        RuntimeError: the selection's coalesced cost differs from its block cost or exceeds
            the budget (a defect, never bad input)."""
    budget_bytes, fidelity = selection.budget_bytes, selection.fidelity
    if cands:
        values = np.concatenate([c.value for c in cands])
        cost1 = np.concatenate([c.cost for c in cands]).astype(np.int64)
        costs = np.concatenate([c.total() for c in cands]).astype(np.int64)
        cand_of = np.repeat(np.arange(len(cands)), [len(c.value) for c in cands])
    else:
        values = np.zeros(0)
        cost1 = costs = cand_of = np.zeros(0, dtype=np.int64)
    offs = np.cumsum([0] + [len(c.value) for c in cands])
    level = np.zeros(len(values), dtype=np.int64)  # tier read per block: column + 1 of svals/scosts (0: none)
    svals = scosts = None
    gap = pc.coalesce_gap
    if pc.tiers:
        L = pc.levels
        svals = np.concatenate(
            [c.svalue if c.svalue is not None else np.zeros((len(c.value), L)) for c in cands]
        ).reshape(len(values), L)
        scosts = (
            np.concatenate(
                [
                    c.scost * c.reads[:, None] if c.scost is not None else np.zeros((len(c.value), L), np.int64)
                    for c in cands
                ]
            )
            .astype(np.int64)
            .reshape(len(values), L)
        )
        if budget_bytes is not None:
            # one representation per block across experts (skip, sketch level k, or exact for all):
            # see _select_tiers_joint for why (sign election; the worst task)
            selected, level = _select_tiers_joint(
                values, costs, svals, scosts, _block_groups(cands), budget_bytes, fidelity
            )
        else:  # fidelity alone: the fewest bytes to the retained-value target, block by block
            selected, level = _select_tiers(values, costs, svals, scosts, budget_bytes, fidelity)
    else:
        selected, gap = _select_gap(values, costs, cost1, cand_of, gap, budget_bytes, fidelity)
    sel = _Selection(values, offs, selected, level, svals, scosts, gap, 0, 0)
    sel.sketch_read = (
        int(np.take_along_axis(scosts, np.maximum(level, 1)[:, None] - 1, 1)[level > 0].sum())
        if scosts is not None
        else 0
    )
    sel.expert_read = _plan_cost(pc, cands, tensors, infos, sel) + sel.sketch_read
    if sel.expert_read != int(costs[selected].sum()) + sel.sketch_read or (
        budget_bytes is not None and sel.expert_read > budget_bytes
    ):
        raise RuntimeError(  # a defect in _select, never bad input
            f"planner: selection costs {sel.expert_read} B coalesced vs {int(costs[selected].sum())} B by blocks "
            f"(budget {budget_bytes}); please report this."
        )
    return sel


def _plan_cost(
    pc: _Planning, cands: Sequence[_Cand], tensors: Sequence[TensorPlan], infos: Sequence[TensorInfo], sel: _Selection
) -> int:
    """Expert bytes of a selection as the engine reads them: per expert and tensor, the
    selected block runs coalesced under the plan's gap (the engine never coalesces across
    tensors), once per pass that reads them (the last pre-pass skips the first chunk)."""
    total = 0
    for j, c in enumerate(cands):
        idx = sel.picked(j)
        if len(idx) == 0:
            continue
        if c.lora:  # A per chunk + B: exactly the ranges the engine requests (gap 0)
            total += c.lora_total
            continue
        et = pc.experts[c.expert].layout.tensors[infos[c.tensor].name]
        for k in range(1, int(c.reads.max()) + 1):  # pass k reads the blocks read at least k times
            rng = block_byte_ranges(et, tensors[c.tensor].rows_per_block, _runs(idx[c.reads[idx] >= k]))
            total += sum(e - s for s, e in coalesce(rng, sel.coalesce_gap, DEFAULT_MAX_REQUEST))
    return total


def _assemble(
    pc: _Planning, cands: Sequence[_Cand], tensors: list[TensorPlan], infos: Sequence[TensorInfo], sel: _Selection
) -> None:
    """Record the selection in the tensor plans: each expert's block runs, bytes, kept value
    and content digests (sketch levels and their digests with tiers); drop experts with no
    block; decide which tensors are copied from the base and explain each. The runs of every
    candidate and the sketch digests are found in one pass over the flattened selection
    (:func:`_flat_runs`, :func:`_sketch_digests`)."""
    runs = _cand_runs(_flat_runs(sel.selected, sel.offs), sel.offs)
    lruns, sdig = None, {}
    if pc.tiers and sel.level.any():
        has = np.zeros(len(sel.level), dtype=bool)  # (only a candidate with tiers has a level)
        for j, c in enumerate(cands):
            has[sel.offs[j] : sel.offs[j + 1]] = c.svalue is not None and c.scost is not None
        lvk = np.where((sel.level > 0) & has, pc.tier_levels[np.maximum(sel.level, 1) - 1], 0)
        flat = _flat_runs(lvk, sel.offs)
        lruns, sdig = _cand_runs(flat, sel.offs), _sketch_digests(pc, cands, infos, flat, sel.offs)
    chosen: list[list[TensorExpert]] = [[] for _ in tensors]
    for j, c in enumerate(cands):
        sb: list[tuple[int, int]] = []
        sl: list[int] = []
        if lruns is not None:
            sb, sl = lruns[j]
        if not runs[j][0] and not sb:
            continue  # nothing of this expert is read: no TensorExpert
        idx = sel.picked(j)
        name = infos[c.tensor].name
        st_c = pc.analyses[c.expert].tensors[name]
        kept = float(c.value[idx].sum())
        sk: dict[str, Any] = {"sketch_start": -1, "sketch_bytes": 0, "sketch_digests": ""}
        if sb:
            sk = _assemble_sketch(c, st_c, sel.level[sel.offs[j] : sel.offs[j + 1]], sdig[j])
            kept += sk.pop("kept")
        # every field given: model_construct fills no default (pydantic inspects default factories slowly)
        te = TensorExpert.model_construct(
            **c.te,
            blocks=([(0, tensors[c.tensor].n_blocks)] if len(idx) else []) if c.lora else runs[j][0],
            bytes=int(c.cost[idx].sum()),
            kept_energy=kept,
            block_digests=(
                _digests_hex(st_c.block_sha, idx, pc.analyses[c.expert], name) if not c.lora and len(idx) else ""
            ),
            sketch_blocks=sb,
            sketch_levels=sl,
            **sk,
        )
        chosen[c.tensor].append(te)
    names = list(pc.request.names or [])
    for tp, bt, tes in zip(tensors, infos, chosen):
        tp.experts = tes
        tp.copy_base = not (bt.dtype in FLOAT_DTYPES and bt.numel > 0) or pc.spec.copies_base(tp)
        tp.explain = _explain_tensor(tp, pc.spec, names)


def _flat_runs(x: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The runs of consecutive blocks with the same non-zero value of the flattened ``x`` (bool:
    the selected blocks; int: a sketch level per block, 0 none) that do not cross a candidate
    (candidate ``j``'s blocks are ``[offs[j], offs[j+1])``), in block order: int64 arrays of
    (first block, end block, value, candidate), block indices global."""
    n = len(x)
    v = np.asarray(x).astype(np.int64)
    first = np.zeros(n, dtype=bool)
    first[offs[:-1][offs[:-1] < n]] = True  # a candidate's first block starts a run
    last = np.zeros(n, dtype=bool)
    last[offs[1:][offs[1:] > 0] - 1] = True  # its last block ends one
    on = v != 0
    chg = np.ones(n, dtype=bool)
    chg[1:] = v[1:] != v[:-1]
    starts = np.flatnonzero(on & (chg | first))
    end_chg = np.ones(n, dtype=bool)
    end_chg[:-1] = v[:-1] != v[1:]
    ends = np.flatnonzero(on & (end_chg | last)) + 1
    return starts, ends, v[starts], np.searchsorted(offs, starts, side="right") - 1


def _cand_runs(
    runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], offs: np.ndarray
) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """Per candidate ``j``, its runs of :func:`_flat_runs`: ``([(b0, b1), ...], [value, ...])`` in
    block order, block indices local to the candidate (what :func:`_runs` gives of one
    candidate's selected blocks; with levels, a run also ends where the level changes)."""
    starts, ends, vals, cand = runs
    J = len(offs) - 1
    base = offs[cand]
    pairs = list(zip((starts - base).tolist(), (ends - base).tolist()))
    v_l = vals.tolist()
    bounds = np.searchsorted(cand, np.arange(J + 1), side="left").tolist()
    return [(pairs[a:b], v_l[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


#: sections of the sketch a read at each level takes (row ``k``; :func:`level_sections`), padded
#: with -1, and how many
_LEVEL_SECTIONS = np.array(
    [[-1, -1, -1]] + [list(level_sections(k)) + [-1] * (3 - len(level_sections(k))) for k in range(1, R1_LEVEL + 1)],
    dtype=np.int64,
)
_LEVEL_NSECT = (_LEVEL_SECTIONS >= 0).sum(axis=1)


def _sketch_digests(
    pc: _Planning,
    cands: Sequence[_Cand],
    infos: Sequence[TensorInfo],
    runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    offs: np.ndarray,
) -> dict[int, str]:
    """Per candidate with sketch runs (:func:`_flat_runs` of the sketch levels), the hex of the
    recorded digests of the sketch bytes it reads, in the plan's order: per run, per section of
    its level (:func:`level_sections`), per block. Gathered for every candidate at once.

    Raises:
        InputError: an analysis without sketch digests for a tensor read from its sketch."""
    s, e, k, cand = runs
    if len(s) == 0:
        return {}
    js = np.unique(cand).tolist()
    shas = []
    for j in js:
        c = cands[j]
        sha = pc.analyses[c.expert].tensors[infos[c.tensor].name].sketch_sha
        if sha is None:
            _no_digests(pc.analyses[c.expert], infos[c.tensor].name)
        shas.append(sha.reshape(-1, *sha.shape[-2:]))
    # row of each candidate's first block in the concatenation of their digest tables
    first_row = np.zeros(len(offs) - 1, dtype=np.int64)
    first_row[js] = np.cumsum([0] + [len(x) for x in shas[:-1]])
    ns = _LEVEL_NSECT[k]
    seg_run = np.repeat(np.arange(len(k)), ns)  # one segment per (run, section), in order
    seg_q = np.arange(len(seg_run)) - np.repeat(np.cumsum(ns) - ns, ns)
    seg_sec = _LEVEL_SECTIONS[k[seg_run], seg_q]
    seg_len = (e - s)[seg_run]
    seg_row = (s - offs[cand] + first_row[cand])[seg_run]
    within = np.arange(int(seg_len.sum())) - np.repeat(np.cumsum(seg_len) - seg_len, seg_len)
    rows = np.repeat(seg_row, seg_len) + within
    hexall = np.concatenate(shas)[rows, np.repeat(seg_sec, seg_len)].tobytes().hex()
    w = 2 * shas[0].shape[-1]  # hex characters per digest
    per = np.bincount(cand, weights=(e - s) * ns, minlength=len(offs) - 1).astype(np.int64)
    at = np.concatenate([[0], np.cumsum(per)]) * w
    return {j: hexall[at[j] : at[j + 1]] for j in js}


def _assemble_sketch(c: _Cand, st: TensorStats, lv: np.ndarray, digests: str) -> dict[str, Any]:
    """The :class:`TensorExpert` fields of the sketch tiers ``lv`` (per block of candidate ``c``:
    column + 1 of its ``svalue``/``scost``, 0: none; some non-zero) with their digests
    (:func:`_sketch_digests`): start, bytes, digests, and ``kept``, the value they keep."""
    assert c.svalue is not None and c.scost is not None
    sidx = np.nonzero(lv)[0]
    return {
        "sketch_start": int(st.sketch_start),
        "sketch_bytes": int(c.scost[sidx, lv[sidx] - 1].sum()),
        "sketch_digests": digests,
        "kept": float(c.svalue[sidx, lv[sidx] - 1].sum()),
    }


def _plan_record(
    pc: _Planning,
    tensors: list[TensorPlan],
    infos: Sequence[TensorInfo],
    sel: _Selection,
    selection: SelectionOptions,
    t0: float,
) -> Plan:
    """The sealed :class:`Plan` of the assembled tensors: inputs, retained value, I/O estimate."""
    inputs, request, K = pc.inputs, pc.request, pc.K
    base, experts, analyses = inputs.base, inputs.experts, inputs.analyses
    options = request.request.options
    kept_value = float(sel.values[sel.selected].sum())
    if sel.svals is not None:
        sk = np.nonzero(sel.level)[0]
        kept_value += float(sel.svals[sk, sel.level[sk] - 1].sum())
    total_value = float(sel.values.sum())
    retained = kept_value / total_value if total_value > 0 else 1.0
    plan_out_dtype = options.out_dtype if any(tp.out_dtype for tp in tensors) else None
    base_read, out_bytes = _side_io(tensors, infos, base, inputs.extra_files, inputs.config_json, plan_out_dtype)
    used_sketch = [any(t.expert == i and t.sketch_blocks for tp in tensors for t in tp.experts) for i in range(K)]
    names = list(request.names) if request.names else [e.uri.rstrip("/").rsplit("/", 1)[-1] for e in experts]
    plan = Plan(
        method=request.method,
        globals=dict(request.params.globals),
        seed=request.request.seed,
        block_bytes=pc.block_bytes,
        coalesce_gap=sel.coalesce_gap,
        work_bytes=pc.work_bytes,
        base=InputRef(uri=base.uri, identity=base.identity, signature=base.signature, total_bytes=base.total_bytes),
        experts=[
            ExpertRef(
                uri=e.uri,
                identity=e.identity,
                signature=e.signature,
                total_bytes=e.total_bytes,
                name=names[i],
                params=request.params.experts[i],
                content_digest=_content_digest(analyses[i]),
                adapter=e.adapter.summary() if e.adapter is not None else None,
                sketch=_sketch_ref(analyses[i]) if pc.tiers and used_sketch[i] else None,
            )
            for i, e in enumerate(experts)
        ],
        budget_bytes=selection.budget_bytes,
        fidelity=selection.fidelity,
        tensors=tensors,
        io=IOEstimate(
            base_read_bytes=base_read,
            expert_read_bytes=sel.expert_read,
            output_write_bytes=out_bytes,
            sketch_read_bytes=sel.sketch_read,
        ),
        expert_bytes_total=sum(e.layout.total_bytes for e in experts),
        retained_energy=retained,
        extra_files=sorted(inputs.extra_files),
        shard_metadata={f: sh.metadata for f, sh in base.layout.shards.items()},
        index_metadata=base.layout.index_metadata,
        out_dtype=plan_out_dtype,
        n_layers=pc.n_layers,
        block_value=pc.value.record(),
        sketch=selection.sketch if pc.tiers else None,
        requested_dtype=options.requested_dtype,
        source=dict(options.source or {}),
        created_at=time.time(),
    )
    from mergepipe import __version__

    plan.mergepipe_version = __version__
    plan.explain = _explain_plan(plan, time.perf_counter() - t0)
    return plan.seal()


@dataclass(frozen=True)
class BlockValueRule:
    """The block value the selection maximises per byte, and the calibration it depends on:
    the one place the planner applies ``SelectionOptions.value``.

    ``energy``: the method's value as is (:meth:`MethodSpec.block_value`). ``fisher``: that
    value times the block's mean diagonal Fisher of the base on the calibration set
    (``PlanInputs.sensitivity``), plus a floor of 1e-6 of the mean Fisher so blocks the
    calibration text never exercised (F = 0, e.g. unseen token rows) are read last, and always
    at unlimited budget (the output must not change).
    """

    kind: str = "energy"
    calibration: str | None = None
    sensitivity: Mapping[str, np.ndarray] | None = None
    floor: float = 0.0

    @classmethod
    def of(cls, selection: SelectionOptions, sensitivity: Mapping[str, np.ndarray] | None) -> BlockValueRule:
        """The rule of ``selection``.

        Raises:
            ValueError: ``fisher`` without sensitivity or calibration (a caller's bug:
                :func:`mergepipe.pipeline.build_plan` measures or loads the sensitivity of the
                calibration set the request names, and the request refuses ``fisher`` without one)."""
        value, calibration = selection.value, selection.calibration
        if value == "energy":
            return cls("energy", calibration)
        if sensitivity is None or not calibration:
            raise ValueError("the fisher block value needs the base's sensitivity and the calibration set's digest")
        allf = (
            np.concatenate([np.asarray(v, dtype=np.float64) for v in sensitivity.values()])
            if sensitivity
            else np.zeros(1)
        )
        floor = 1e-6 * float(allf.mean()) if allf.size and allf.mean() > 0 else 1e-30
        return cls("fisher", calibration, sensitivity, floor)

    def apply(self, value: np.ndarray, tensor: str) -> np.ndarray:
        """float64 ``[n_blocks]`` block values of ``tensor`` under this rule.

        Raises:
            InputError: ``fisher`` and the sensitivity lacks the tensor on this block grid."""
        if self.kind != "fisher":
            return value
        fb = self.sensitivity.get(tensor) if self.sensitivity else None
        if fb is None or len(fb) != len(value):
            raise InputError(
                f"catalog: the sensitivity statistic lacks tensor {tensor!r} on this block grid; "
                "re-run `mergepipe analyze --calibration ...`."
            )
        return value * (np.asarray(fb, dtype=np.float64) + self.floor)

    def record(self) -> dict | None:
        """What the plan records (part of its digest): None for ``energy``."""
        return {"kind": "fisher", "calibration": self.calibration} if self.kind == "fisher" else None


def _side_io(
    tensors: Sequence[TensorPlan],
    infos: Sequence[TensorInfo],
    base: CheckpointRecord,
    extra_files: Mapping[str, int],
    config_json: bytes | None,
    out_dtype: str | None,
) -> tuple[int, int]:
    """Base bytes read and output bytes written by the engine for ``tensors`` (the plan's, after
    selection), exactly as it moves them (on storage without server-side copy):

    - base: each tensor's bytes once per pass of a merged tensor (a pre-pass reads the base rows
      too, except the first chunk's in the last pre-pass: :func:`block_reads`), once for a
      copied one; plus every extra file (config, tokenizer) read whole;
    - output: per shard its header (:func:`~mergepipe.engine.worklist.shard_header`'s bytes:
      the base's tensor order and metadata, each tensor's output dtype) and data; the index
      when the output needs one (:func:`mergepipe.formats.safetensors.index_json`); the extra
      files, ``config.json`` rewritten for ``out_dtype`` when the merge changes the dtype.

    Shard headers are not base reads: the catalog read them when it registered the base."""
    from mergepipe.formats.safetensors import DTYPES, build_header, config_with_dtype, index_json, needs_index_file

    base_read = 0
    for tp, bt in zip(tensors, infos):
        base_read += bt.nbytes
        if tp.experts and tp.passes > 1:  # pre-passes; the last one skips the first chunk
            base_read += (tp.passes - 1) * bt.nbytes - min(tp.chunk_rows, bt.rows) * bt.row_bytes
    base_read += sum(int(v) for v in extra_files.values())
    files: dict[str, list[TensorPlan]] = {}
    for tp in tensors:
        files.setdefault(tp.file, []).append(tp)
    data = {tp.name: int(np.prod(tp.shape, dtype=np.int64)) * DTYPES[tp.out_dtype or tp.dtype][0] for tp in tensors}
    out = sum(data.values())
    for f, tps in files.items():
        meta = base.layout.shards[f].metadata if f in base.layout.shards else {}
        out += len(build_header([(t.name, t.out_dtype or t.dtype, tuple(t.shape)) for t in tps], meta))
    if needs_index_file(set(files), base.layout.index_metadata):
        out += len(index_json({tp.name: tp.file for tp in tensors}, sum(data.values())))
    for f, size in extra_files.items():
        if f == "config.json" and out_dtype and config_json is not None:
            out += len(config_with_dtype(config_json, out_dtype))
        else:
            out += int(size)
    return base_read, out


def _gap_closure(sel: np.ndarray, cand_of: np.ndarray, cum: np.ndarray, gap: int) -> np.ndarray:
    """``sel`` plus every unselected block lying in a gap the storage bridges: between two
    selected blocks ``a < b`` of the same candidate (expert, tensor) whose gap
    ``cum[b] − cum[a+1]`` bytes is at most ``gap`` (:func:`mergepipe.storage.base.coalesce` reads
    those bytes anyway, so the plan takes and uses the blocks in them). Idempotent; monotone
    (a superset's closure contains the closure). ``cum`` is the exclusive prefix sum of one-pass
    block bytes over the flattened blocks (a candidate's blocks are contiguous in its file)."""
    if gap <= 0:  # a gap is at least one whole block of bytes
        return sel
    idx = np.flatnonzero(sel)
    if len(idx) < 2:
        return sel
    a, b = idx[:-1], idx[1:]
    br = (cand_of[a] == cand_of[b]) & (b - a > 1) & (cum[b] - cum[a + 1] <= gap)
    if not br.any():
        return sel
    d = np.zeros(len(sel) + 1, dtype=np.int64)
    d[a[br] + 1] += 1  # the bridged gaps [a+1, b) are disjoint: no index repeats within one side
    d[b[br]] -= 1
    return sel | (np.cumsum(d[:-1]) > 0)


def _desc_order(key: np.ndarray) -> np.ndarray:
    """int64 indices ordering the float64 ``key`` descending, ties by index ascending: the same
    permutation as ``np.lexsort((np.arange(len(key)), -key))`` (a total order, so it does not depend
    on the sort algorithm). numpy's default argsort (vectorised, not stable) sorts first, then each
    run of equal keys is put back in index order; on a million keys this is several times faster
    than a stable sort, which the planner otherwise spends most of its selection time in."""
    neg = -key
    order = np.argsort(neg)
    s = neg[order]
    tie = s[1:] == s[:-1]
    if tie.any():
        at = np.zeros(len(order), dtype=bool)
        at[1:] |= tie
        at[:-1] |= tie
        sub = np.nonzero(at)[0]  # the tied runs, contiguous in ``order``, in key order
        order[sub] = order[sub][np.lexsort((order[sub], s[sub]))]
    return order


def _greedy_order(values: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Indices of the blocks with a positive value, by value per byte (descending; ties by index)."""
    useful = np.nonzero(values > 0)[0]
    return useful[_desc_order(values[useful] / np.maximum(costs[useful], 1))]


def _select(
    values: np.ndarray,
    costs: np.ndarray,
    cost1: np.ndarray,
    cand_of: np.ndarray,
    gap: int,
    budget: int | None,
    fidelity: float | None,
    fill: bool = True,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """Greedy knapsack over flattened (expert, tensor, block) candidates.

    Args:
        values: float64 ``(n,)`` block values (retained energy); costs: int64 ``(n,)`` bytes of a
            block over all its passes; cost1: int64 ``(n,)`` bytes of one pass; cand_of: int
            ``(n,)`` candidate (expert, tensor) of each block, blocks of one candidate
            contiguous and in file order; gap: the storage's coalescing gap (bytes);
            budget: expert-read bytes (None: unlimited); fidelity: share of the total value to
            reach (None: off); fill: fill the budget's remainder after the greedy prefix;
            order: :func:`_greedy_order` of ``values``/``costs`` when already computed.

    Returns:
        bool ``(n,)``: the selection, closed under the gap rule (:func:`_gap_closure`), so its
        coalesced read cost is exactly ``costs[sel].sum()`` (<= ``budget``) whatever reads the
        engine groups the runs into, and no bridged byte is read without being merged.

    Blocks are taken in order of value per byte (ties by position); under a budget the longest
    prefix of that order whose closure fits is taken, then later blocks that still fit (with the
    gap blocks their taking bridges) fill the remainder. With ``gap = 0`` (local storage) closure
    is the identity and this is the plain greedy of Dantzig's bound.
    """
    n_all = len(values)
    order = _greedy_order(values, costs) if order is None else order
    cum = np.concatenate([[0], np.cumsum(cost1)])
    if budget is None and fidelity is None:
        selected = np.zeros(n_all, dtype=bool)
        selected[order] = True
        return _gap_closure(selected, cand_of, cum, gap)
    bridges = gap > 0 and n_all > 0 and int(cost1.min(initial=gap + 1)) <= gap

    def prefix(take: np.ndarray, n: int) -> np.ndarray:
        """The first ``n`` blocks of ``take``, closed under the gap rule."""
        s = np.zeros(n_all, dtype=bool)
        s[take[:n]] = True
        return _gap_closure(s, cand_of, cum, gap)

    take = order
    if fidelity is not None:
        take = _fidelity_prefix(values, order, fidelity, prefix if bridges else None)
    if budget is None:
        return prefix(take, len(take))
    if bridges:
        n = _first_true(0, len(take), lambda m: int(costs[prefix(take, m + 1)].sum()) > budget) if len(take) else 0
    else:
        n = int(np.searchsorted(np.cumsum(costs[take]), budget, side="right"))
    selected = prefix(take, n)
    if fill:
        _fill_remainder(selected, take[n:], costs, cand_of, cum, gap if bridges else 0, budget)
    return selected


def _first_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """Smallest n in [lo, hi] with pred(n) (pred monotone false→true; hi if none): bisection."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fidelity_prefix(
    values: np.ndarray,
    order: np.ndarray,
    fidelity: float,
    prefix: Callable[[np.ndarray, int], np.ndarray] | None,
) -> np.ndarray:
    """The shortest prefix of ``order`` whose selection keeps ``fidelity`` of the total value
    (all of ``order`` when the total is 0). ``prefix``: the gap-closed selection of a prefix when
    the storage bridges gaps (the value then counts the bridged blocks), else None."""
    total = float(values.sum())
    if not total > 0:
        return order
    target = fidelity * total * (1 - 1e-12)
    if prefix is not None:
        n = _first_true(1, len(order), lambda m: float(values[prefix(order, m)].sum()) >= target)
    else:
        cumv = np.cumsum(values[order])
        n = int(np.searchsorted(cumv, target, side="left")) + 1
    return order[: min(n, len(order))]


def _fill_remainder(
    selected: np.ndarray,
    rest: np.ndarray,
    costs: np.ndarray,
    cand_of: np.ndarray,
    cum: np.ndarray,
    gap: int,
    budget: int,
) -> None:
    """Fill ``budget``'s remainder in place with the blocks of ``rest`` (in order) that still
    fit, each with the gap blocks (``gap`` > 0: the storage bridges gaps) its taking bridges to
    the nearest selected block of its candidate on each side."""
    n_all = len(selected)
    room = budget - int(costs[selected].sum())
    min_cost = int(costs[rest].min()) if len(rest) else 0
    for j in rest:  # fill the remainder with blocks that still fit (smaller ones, or fewer gap blocks)
        if room < min_cost or room <= 0:
            break
        if selected[j]:
            continue
        lo = hi = j
        if gap > 0:  # gap blocks to the nearest selected block of the same candidate on each side
            k = j - 1
            while k >= 0 and cand_of[k] == cand_of[j]:
                if selected[k]:  # the gap [k+1, j) is within the rule (checked below)
                    lo = k + 1
                    break
                if cum[j] - cum[k] > gap:  # block k joins the gap, which is now too long
                    break
                k -= 1
            k = j + 1
            while k < n_all and cand_of[k] == cand_of[j]:
                if selected[k]:
                    hi = k - 1
                    break
                if cum[k + 1] - cum[j + 1] > gap:
                    break
                k += 1
        inc = int(costs[lo : hi + 1].sum())
        if inc <= room:
            selected[lo : hi + 1] = True
            room -= inc


#: A plan reads with the storage's coalescing gap (fewer, larger requests) only when closing
#: gaps costs at most this share of the value (or adds at most this share of bytes) compared with
#: exact reads (gap 0); otherwise with a smaller gap, down to 0.
GAP_TOLERANCE = 0.01


def _select_gap(
    values: np.ndarray,
    costs: np.ndarray,
    cost1: np.ndarray,
    cand_of: np.ndarray,
    gap: int,
    budget: int | None,
    fidelity: float | None,
) -> tuple[np.ndarray, int]:
    """:func:`_select` with the largest coalescing gap among ``gap, gap/2, gap/4, …`` (down to
    one block) and 0 whose selection keeps at least ``1 − GAP_TOLERANCE`` of the value of the
    exact-read selection (gap 0) and reads at most ``1 + GAP_TOLERANCE`` times its bytes.

    Bridging a gap buys the blocks in it: worth it where they are nearly as valuable as the
    blocks the budget would buy instead (smooth task vectors), not where value is scattered
    block by block. Returns (selection, gap in bytes the plan records and the engine reads with).
    """
    order = _greedy_order(values, costs)
    sel0 = _select(values, costs, cost1, cand_of, 0, budget, fidelity, order=order)
    if gap <= 0 or len(values) == 0:
        return sel0, 0
    v0, b0 = float(values[sel0].sum()), int(costs[sel0].sum())
    inner = np.zeros(len(cost1), dtype=bool)  # a bridged gap holds blocks strictly inside a candidate
    inner[1:-1] = (cand_of[:-2] == cand_of[1:-1]) & (cand_of[1:-1] == cand_of[2:])
    smallest = int(cost1[inner].min(initial=gap + 1))  # a smaller gap bridges nothing: it is gap 0
    g = gap
    while g >= smallest:
        # judged without the final fill (a few blocks at most; the costly part to evaluate)
        sel = _select(values, costs, cost1, cand_of, g, budget, fidelity, fill=False, order=order)
        if float(values[sel].sum()) >= (1 - GAP_TOLERANCE) * v0 and int(costs[sel].sum()) <= (1 + GAP_TOLERANCE) * b0:
            return _select(values, costs, cost1, cand_of, g, budget, fidelity, order=order), g
        g //= 2
    return sel0, 0


def _select_tiers(
    values: np.ndarray,
    costs: np.ndarray,
    svalues: np.ndarray,
    scosts: np.ndarray,
    budget: int | None,
    fidelity: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy multiple-choice knapsack over the fidelity tiers of each block: skip (0 bytes,
    value 0), sketch level ``k = 1..L`` (``k·scosts`` bytes, ``svalues[:, k−1]``) and exact
    (``costs`` bytes, ``values``).

    Args:
        values, costs: float64/int64 ``(n,)`` exact value and bytes (all passes) of each block.
        svalues: float64 ``(n, L)`` value of each sketch tier; scosts: int64 ``(n, L)`` bytes of
            each tier (all passes), or ``(n,)`` bytes of one sign plane with tier ``k`` reading
            ``k`` planes (0: the block has no sketch tier). Tiers need not be in byte order: each
            block's are sorted by bytes for the hull.
        budget: bytes (None: unlimited); fidelity: share of ``values.sum()`` to reach (None: off).

    Returns:
        (exact, level): bool ``(n,)`` blocks read exactly and int64 ``(n,)`` the sketch tier
        (column + 1 of ``svalues``) read instead (0: none; never both), within ``budget`` bytes.

    Each block offers upgrades along the upper convex hull of its (bytes, value) points, the
    LP-greedy of the multiple-choice knapsack (Sinha & Zoltners, Oper. Res. 1979): a point below
    the segment between two others is never worth buying, so along the hull value per byte
    decreases and a global order by value per byte (ties by block, then tier) buys each block's
    upgrades in order. Upgrades are taken while they fit; one that does not fit is passed over
    and later, smaller ones may still fill the remainder. With fidelity, upgrades stop once the
    kept value reaches the target.
    """
    n, L = svalues.shape
    X, Y, ok, perm = _tier_points(values, costs, svalues, scosts)
    ok = _upper_hull(X, Y, ok)
    ib, it, fr, dx, dy = _hull_upgrades(X, Y, ok)
    target = fidelity * float(values.sum()) * (1 - 1e-12) if fidelity is not None else None
    tier = _buy_upgrades(n, ib, it, fr, dx, dy, budget, target)
    exact = tier == L + 1
    sk = (tier > 0) & ~exact
    level = np.zeros(n, dtype=np.int64)
    level[sk] = perm[sk, tier[sk] - 1] + 1  # back to the caller's tier columns
    return exact, level


def _tier_points(
    values: np.ndarray, costs: np.ndarray, svalues: np.ndarray, scosts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each block's tiers as (bytes, value) points, in increasing bytes: column 0 skip, columns
    ``1..L`` the sketch tiers sorted by bytes, column ``L+1`` exact (arguments as
    :func:`_select_tiers`).

    Returns:
        (X, Y, ok, perm): int64 ``(n, L+2)`` bytes, float64 ``(n, L+2)`` values, bool ``(n, L+2)``
        the points worth considering (a sketch tier with bytes, cheaper than exact and of some
        value; exact with some value; skip always), and int ``(n, L)`` each block's sort of its
        sketch tiers by bytes (sorted column -> caller's column).
    """
    n, L = svalues.shape
    T = L + 2
    sc = _tier_cost_matrix(scosts, L)
    # the hull walks each block's tiers in increasing bytes: sort the sketch tiers per block
    perm = np.argsort(sc, axis=1, kind="stable")
    sc = np.take_along_axis(sc, perm, 1)
    svalues = np.take_along_axis(svalues, perm, 1)
    X = np.zeros((n, T), dtype=np.int64)
    Y = np.zeros((n, T))
    X[:, 1 : L + 1] = sc
    Y[:, 1 : L + 1] = svalues
    X[:, -1], Y[:, -1] = costs, values
    ok = np.ones((n, T), dtype=bool)
    ok[:, 1 : L + 1] = (sc > 0) & (X[:, 1 : L + 1] < costs[:, None]) & (svalues > 0)
    ok[:, -1] = values > 0
    return X, Y, ok, perm


def _prev_point(ok: np.ndarray) -> np.ndarray:
    """int ``(n, T)``: for each column, the nearest column to its left that is ``ok`` (-1: none)."""
    n, T = ok.shape
    idx = np.broadcast_to(np.arange(T), (n, T))
    prev = np.maximum.accumulate(np.where(ok, idx, -1), axis=1)
    return np.concatenate([np.full((n, 1), -1), prev[:, :-1]], axis=1)


def _upper_hull(X: np.ndarray, Y: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """``ok`` without the points on or below the segment between their neighbours: each block's
    remaining points are the upper convex hull of its (bytes, value) points (columns in
    increasing bytes; column 0, skip, always stays)."""
    n, T = ok.shape
    idx = np.broadcast_to(np.arange(T), (n, T))
    while True:  # drop points on or below the segment between their hull neighbours
        prev = _prev_point(ok)
        nxt = np.minimum.accumulate(np.where(ok, idx, T)[:, ::-1], axis=1)[:, ::-1]
        nxt = np.concatenate([nxt[:, 1:], np.full((n, 1), T)], axis=1)
        inner = ok & (prev >= 0) & (nxt < T)
        inner[:, 0] = False
        pi, ni = np.clip(prev, 0, T - 1), np.clip(nxt, 0, T - 1)
        xp, yp = np.take_along_axis(X, pi, 1), np.take_along_axis(Y, pi, 1)
        xn, yn = np.take_along_axis(X, ni, 1), np.take_along_axis(Y, ni, 1)
        # j is below the chord p–n: (y_j − y_p)(x_n − x_p) <= (y_n − y_p)(x_j − x_p)
        below = inner & ((Y - yp) * (xn - xp) <= (yn - yp) * (X - xp))
        if not below.any():
            return ok
        ok = ok & ~below


def _hull_upgrades(
    X: np.ndarray, Y: np.ndarray, ok: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The upgrades along each block's hull (from one hull point to the next), in order of value
    per byte (descending; ties by block, then tier).

    Returns:
        (ib, it, fr, dx, dy): the block, the tier bought, the tier it upgrades from, the added
        bytes (int64) and the added value (float64) of each upgrade.
    """
    prev = _prev_point(ok)
    has = ok & (prev >= 0)
    has[:, 0] = False
    ib, it = np.nonzero(has)
    fr = prev[ib, it]
    dx = X[ib, it] - X[ib, fr]
    dy = Y[ib, it] - Y[ib, fr]
    eff = dy / np.maximum(dx, 1)
    order = _desc_order(eff)  # ties by (block, tier): np.nonzero lists (ib, it) in that order
    return ib[order], it[order], fr[order], dx[order], dy[order]


def _buy_upgrades(
    n: int,
    ib: np.ndarray,
    it: np.ndarray,
    fr: np.ndarray,
    dx: np.ndarray,
    dy: np.ndarray,
    budget: int | None,
    target: float | None,
) -> np.ndarray:
    """int64 ``(n,)`` the tier each block ends at, buying the upgrades (as
    :func:`_hull_upgrades` returns them) in order: the longest prefix within ``budget`` bytes
    and, with a ``target`` value, no longer than it takes to reach it; then, under a budget,
    later upgrades that still fit (each from the tier its block is at) until the target is
    reached."""
    tier = np.zeros(n, dtype=np.int64)
    m = len(dx)
    if budget is not None:
        m = int(np.searchsorted(np.cumsum(dx), budget, side="right"))  # the prefix fits and keeps the order
    if target is not None:
        m = min(m, int(np.searchsorted(np.cumsum(dy), target, side="left")) + 1)
    np.maximum.at(tier, ib[:m], it[:m])
    if budget is None:
        return tier
    room = budget - int(dx[:m].sum())
    kept = float(dy[:m].sum())
    rest_min = int(dx[m:].min()) if m < len(dx) else 0
    for k in range(m, len(dx)):  # fill the remainder with upgrades that still fit
        if room < rest_min or (target is not None and kept >= target):
            break
        b = ib[k]
        if tier[b] != fr[k] or dx[k] > room:
            continue
        tier[b] = it[k]
        room -= int(dx[k])
        kept += float(dy[k])
    return tier


def _tier_cost_matrix(scosts: np.ndarray, L: int) -> np.ndarray:
    """int64 ``(n, L)`` bytes of each sketch tier: ``scosts`` as given when 2-D, else the bytes of
    one sign plane per block, level ``k`` reading ``k`` planes."""
    sc = np.asarray(scosts, dtype=np.int64)
    if sc.ndim == 2:
        return sc.reshape(-1, L)
    return sc[:, None] * np.arange(1, L + 1, dtype=np.int64)[None, :]


def _digests_hex(sha: np.ndarray | None, idx: np.ndarray, a: Analysis, tensor: str) -> str:
    """Hex of the recorded content digests of blocks ``idx`` (``TensorStats.block_sha``)."""
    if sha is None:
        _no_digests(a, tensor)
    return sha[idx].tobytes().hex()


def _no_digests(a: Analysis, tensor: str) -> NoReturn:
    raise InputError(
        f"catalog: the analysis of expert {a.expert_identity[:12]} has no block content digests for tensor "
        f"{tensor[:200]!r} (an older or damaged analysis); re-run `mergepipe analyze --force` for it and re-plan."
    )


def _block_groups(cands: Sequence[_Cand]) -> np.ndarray:
    """int64 ``(n,)``: for each candidate block (the concatenation of ``cands``' blocks), the id
    of its (tensor, block index) across experts; a LoRA unit is a group of its own."""
    stride = max((len(c.value) for c in cands), default=0) + 1
    keys = [
        np.full(1, -1 - j, dtype=np.int64) if c.lora else c.tensor * stride + np.arange(len(c.value), dtype=np.int64)
        for j, c in enumerate(cands)
    ]
    return np.unique(np.concatenate(keys), return_inverse=True)[1].reshape(-1) if keys else np.zeros(0, np.int64)


def _select_tiers_joint(
    values: np.ndarray,
    costs: np.ndarray,
    svalues: np.ndarray,
    scosts: np.ndarray,
    group: np.ndarray,
    budget: int | None,
    fidelity: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_select_tiers` with one tier per *group* of blocks: the same block of a tensor in
    every expert is skipped, read at the same sketch level, or read exactly, together.

    Why (measured on the zoo's development seeds 0-2, docs/QUALITY.md "Monotone in budget"):

    * a sign-electing method (TIES, DARE-TIES, breadcrumbs-TIES) elects each entry's sign from
      the sum of all experts' trimmed task vectors and averages the agreeing ones. When one
      expert's block is exact (trimmed: half its entries zero, the rest large) and another's is
      a sign-plane sketch (dense, every entry ``±`` a row scale), the election and the disjoint
      mean mix two representations: the sketch's dense entries vote and dilute the exact
      expert's where the full merge has the sketched expert's entry trimmed away. Independent
      per-expert tiers made ties at 50% worse than at 25% (zoo seed 2: worst-task NG 0.178 vs
      0.198); joint tiers give 0.205 vs 0.202;
    * value per byte ranks an expert with large task vectors first, so per-expert tiers spend a
      small budget on the experts with the most energy and starve the others, whose tasks are
      then the worst ones. Joint tiers give every expert the same blocks: the mean worst-task
      normalised gain at 10% rose from 0.32 to 0.35 (task_arithmetic), 0.26 to 0.30 (ties) and
      0.33 to 0.35 (dare_ties) over seeds 0-2.

    The cost: a group's bytes are K blocks', so the last few percent of a budget may stay unused
    (50% of the zoo read 48.7-49.9%).

    Args:
        values, costs, svalues, scosts, budget, fidelity: as :func:`_select_tiers`, per block.
        group: int64 ``(n,)`` group id per block, ``0..G-1`` (:func:`_block_groups`).

    Returns:
        (exact, level) per block as :func:`_select_tiers`. A member of a group whose value is 0
        (nothing the method keeps, e.g. every entry below the trim threshold) is never read; a
        group offers a sketch level only when each of its other members has a sketch.
    """
    n = len(values)
    if n == 0:
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64)
    G = int(group.max()) + 1
    live = values > 0
    gv = np.bincount(group, weights=np.where(live, values, 0.0), minlength=G)
    gc = np.zeros(G, dtype=np.int64)
    np.add.at(gc, group, np.where(live, costs, 0))
    L = svalues.shape[1]
    sc = _tier_cost_matrix(scosts, L)
    gsc = np.zeros((G, L), dtype=np.int64)
    np.add.at(gsc, group, np.where(live[:, None], sc, 0))
    no_sketch = np.zeros(G, dtype=np.int64)  # live members without a sketch tier
    has = (sc > 0).all(axis=1) if L else np.zeros(n, dtype=bool)
    np.add.at(no_sketch, group, (live & ~has).astype(np.int64))
    gsv = np.stack(
        [np.bincount(group, weights=np.where(live, svalues[:, k], 0.0), minlength=G) for k in range(L)], axis=1
    ).reshape(G, L)
    gsc = np.where(no_sketch[:, None] > 0, 0, gsc)
    gexact, glevel = _select_tiers(gv, gc, gsv, gsc, budget, fidelity)
    exact = gexact[group] & live
    level = np.where(live & has, glevel[group], 0)
    return exact, level


def _sketch_ref(a: Analysis) -> dict | None:
    """What a plan records of an expert's sketch blob (its location, kind and content digest)."""
    return {k: a.sketch[k] for k in ("kind", "planes", "uri", "sha256", "bytes")} if a.sketch else None


def _content_digest(a: Analysis) -> str:
    import hashlib
    import json

    return hashlib.sha256(
        json.dumps({k: v.content_sha256 for k, v in a.tensors.items()}, sort_keys=True).encode()
    ).hexdigest()


def _explain_tensor(tp: TensorPlan, spec: MethodSpec, names: list[str]) -> str:
    """One line on how tensor ``tp`` is merged: the method's head (its coefficients), then per
    expert its blocks, sketch levels, share of energy and threshold, then the pre-passes."""
    if tp.copy_base:
        why = spec.explain_copy(tp) if tp.dtype in FLOAT_DTYPES else None
        return why or "copied from base: no expert block selected (or the tensor is not floating point)"
    parts = [_explain_expert(tp, te, spec, names) for te in tp.experts]
    head = spec.explain_head(tp)
    if not parts:
        return head + "no expert block selected"
    extra = (
        f" ({tp.passes - 1} pre-pass(es) over the tensor: L1 rescale or exact threshold; expert blocks read"
        f" {tp.passes}x, {tp.passes - 1}x in the first chunk)"
        if tp.passes > 1
        else ""
    )
    return head + "; ".join(parts) + extra


def _explain_expert(tp: TensorPlan, te: TensorExpert, spec: MethodSpec, names: list[str]) -> str:
    nsel = sum(b1 - b0 for b0, b1 in te.blocks)
    frac = te.kept_energy / te.full_energy if te.full_energy > 0 else 1.0
    nm = names[te.expert] if te.expert < len(names) else f"expert {te.expert + 1}"
    pv, thr = spec.explain_expert(te)
    lo = ""
    if te.lora is not None:
        lo = f", LoRA {te.lora.module} r={te.lora.rank} scale={te.lora.scale:g}: reads A and B ({te.bytes:,} B)"
    sk = ""
    if te.sketch_blocks:
        by: dict[int, int] = {}
        for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels):
            by[k] = by.get(k, 0) + b1 - b0
        sk = " + sketched " + ", ".join(
            f"{n} at " + ("rank 1 + 1 plane" if k == R1_LEVEL else f"{k} plane{'s' if k > 1 else ''}")
            for k, n in sorted(by.items())
        )
    return f"{nm}{pv}: {nsel}/{tp.n_blocks} blocks{sk}, {frac:.1%} of its energy{thr}{lo}"


def _explain_plan(plan: Plan, seconds: float) -> str:
    touched = sum(1 for t in plan.tensors if t.experts)
    b = "unlimited" if plan.budget_bytes is None else f"{plan.budget_bytes:,} B"
    dt = ""
    if plan.requested_dtype:
        dt = (
            f" Arithmetic in float32 (the config's dtype {plan.requested_dtype} is recorded; mergepipe always "
            "computes in float32)."
        )
    if plan.out_dtype:
        dt += f" Floating outputs written as {plan.out_dtype}."
    sk = ""
    if plan.sketch:
        nb = sum(b1 - b0 for t in plan.tensors for te in t.experts for b0, b1 in te.sketch_blocks)
        sk = (
            f" Fidelity tiers ({plan.sketch}): {nb} blocks merged from their sketches (sign planes; rank-1 factors + a plane), "
            f"{plan.io.sketch_read_bytes:,} of the bytes read (charged to the budget like expert bytes)."
        )
    dist = ""
    if plan.retained_energy < 1.0 - 1e-9:  # (a full selection can sum to 1 - 1 ulp)
        dist = (
            f" Estimated distance to the full-budget merge: √(1 − E) = "
            f"{math.sqrt(max(0.0, 1.0 - plan.retained_energy)):.1%} of its task vector's norm (exact for one "
            "expert under a linear method; cross terms between experts' task vectors and TIES's "
            "normalization change it: measured 1.0-1.3x this on the demo zoo, see docs/QUALITY.md)."
        )
    lora = [e for e in plan.experts if e.adapter is not None]
    if lora:
        dt += (
            f" LoRA adapter experts ({', '.join(e.name for e in lora)}): task vector s·B·A on their adapted "
            f"modules, 0 elsewhere; only their factors are read ({sum(e.total_bytes for e in lora):,} adapter bytes)."
        )
    return (
        f"{plan.method} over {len(plan.experts)} experts: reads {plan.io.expert_read_bytes:,} of "
        f"{plan.expert_bytes_total:,} expert bytes (budget {b}), retaining {plan.retained_energy:.2%} "
        f"of the weighted task-vector energy kept by {plan.method} at full budget; {touched}/"
        f"{len(plan.tensors)} tensors merged, the rest copied from the base. Planned in {seconds:.3f} s."
        + sk
        + dist
        + dt
        + _explain_slices(plan)
    )


def _explain_slices(plan: Plan) -> str:
    """Where a mergekit ``slices`` merge's bytes went (:func:`mergepipe.slices.explain_stacks`)."""
    from mergepipe.slices import explain_stacks

    return explain_stacks(plan)
