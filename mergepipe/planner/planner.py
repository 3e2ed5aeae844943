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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np

from mergepipe.catalog.catalog import DEFAULT_BLOCK_BYTES, Analysis, CheckpointRecord, lora_map
from mergepipe.catalog.sketch import SKETCH_KINDS, sketch_levels, tensor_sketch_costs
from mergepipe.errors import InputError
from mergepipe.formats.safetensors import FLOAT_DTYPES, TensorInfo, n_blocks, rows_per_block
from mergepipe.methods.kernels import elementwise_merge, identity_on_zero_delta, needs_row_stats, work_floats
from mergepipe.methods.params import layer_count, layer_t
from mergepipe.methods.registry import get_method
from mergepipe.numerics import (
    N_KEYS,
    f32,
    karcher_coefficients,
    model_stock_t,
    multislerp_coefficients,
    nuslerp_coefficients,
    outlier_counts,
    outlier_window,
    sce_weights,
    slerp_coefficients,
    stream_key,
    topk_rank,
    trim_rank,
)
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
#: input dtypes whose magnitude trim (TIES) and window (breadcrumbs) rank the exact float32 |δ| (bf16 included: a
#: difference of two bf16 values is often not a bf16 value, so its key group holds distinct magnitudes; a bf16
#: group is refined only up to max(2^14, work memory / 16K) entries, else the key rule: the engine holds it whole)
EXACT_TRIM_DTYPES = ("BF16", "F16", "F32")


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
    full: np.ndarray
    cost: np.ndarray  # bytes per block (one read)
    reads: np.ndarray  # int64 per block: how many times the engine reads it (plan.block_reads)
    svalue: np.ndarray | None = None  # [block, level-1]: value a level-k sketch read keeps (None: no sketch tier)
    scost: np.ndarray | None = None  # bytes of one sign plane per block (one pass); level k reads k planes
    lora: bool = False
    lora_total: int = 0  # a LoRA module: bytes over all passes (A with every chunk read, B's rows)

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


def _level_runs(level: np.ndarray) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs of consecutive blocks read at one sketch level: ``([(b0, b1), ...], [k, ...])`` in
    block order, a run ending where the level changes; blocks at level 0 (no sketch) are in none."""
    idx = np.nonzero(level)[0]
    if len(idx) == 0:
        return [], []
    lv = level[idx]
    brk = np.nonzero((np.diff(idx) != 1) | (np.diff(lv) != 0))[0]
    starts = np.concatenate([[0], brk + 1])
    ends = np.concatenate([brk, [len(idx) - 1]])
    return list(zip(idx[starts].tolist(), (idx[ends] + 1).tolist())), lv[starts].tolist()


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
    """Plan a merge of ``inputs.experts`` into ``inputs.base``.

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
        InputError: no experts, parameters for another number of experts, negative budget,
            fidelity outside (0, 1], an unknown block value or fisher without sensitivity,
            missing pair statistics, an analysis that does not match the base's layout.
    """
    t0 = time.perf_counter()
    base, experts, analyses, gram = inputs.base, inputs.experts, inputs.analyses, inputs.gram
    base_digests, extra_files, sensitivity = inputs.base_digests, inputs.extra_files, inputs.sensitivity
    budget_bytes, fidelity = selection.budget_bytes, selection.fidelity
    value, calibration = selection.value, selection.calibration
    sketch = selection.sketch
    work_bytes, coalesce_gap = engine.work_bytes, engine.coalesce_gap
    method, params, seed = request.method, request.params, request.request.seed
    out_dtype = request.request.options.out_dtype
    requested_dtype, source = request.request.options.requested_dtype, request.request.options.source
    expert_names = request.names
    K = len(experts)
    # multislerp whose base is one of its inputs (a mergekit config without base_model: the first
    # model is the origin, a zero task vector): the barycentre of the raw weights, as mergekit
    raw_points = get_method(method).kind == "multislerp" and any(r.uri == base.uri for r in experts)
    if K == 0 and get_method(method).min_experts > 0:
        raise InputError("no experts given; pass at least one --expert.")
    if budget_bytes is not None and budget_bytes < 0:
        raise InputError(f"--budget {budget_bytes} is negative; give bytes like 512MiB or a percentage like 25%.")
    if fidelity is not None and not (0.0 < fidelity <= 1.0):
        raise InputError(f"--fidelity {fidelity} is outside (0, 1]; e.g. --fidelity 0.99.")
    if value not in ("energy", "fisher"):
        raise InputError(f"--value {value!r}: use 'energy' or 'fisher'.")
    if sketch not in SKETCH_KINDS:
        raise InputError(f"--sketch {sketch!r}: use one of {', '.join(SKETCH_KINDS)}.")
    # fidelity tiers only where a block can be skipped and the method is the task-arithmetic family
    levels = sketch_levels(sketch) if sketch in SKETCH_KINDS else 0
    tiers = (
        sketch != "none"
        and (budget_bytes is not None or fidelity is not None)
        and get_method(method).kind in ("gta", "linear")
    )
    if tiers:
        # (LoRA adapter experts have no sketch: their factors are read whole, already small)
        missing = [e.uri for e, a in zip(experts, analyses) if not a.sketch and getattr(e, "adapter", None) is None]
        if missing:
            raise InputError(
                f"--sketch {sketch}: the catalog has no block sketches of {missing[0]}; "
                "re-run `mergepipe analyze` (analyses since stats version 3 record them) or pass --sketch none."
            )
        coalesce_gap = 0  # exact accounting of two tiers: blocks are read exactly, never bridged
    if value == "fisher" and (sensitivity is None or not calibration):
        raise InputError(
            "--value fisher needs the base's sensitivity on a calibration set; pass --calibration FILE.jsonl."
        )
    f_floor = 0.0
    if value == "fisher":
        # blocks the calibration text never exercised (F = 0, e.g. unseen token rows) keep a
        # tiny value: read last, and always at unlimited budget (the output must not change)
        allf = (
            np.concatenate([np.asarray(v, dtype=np.float64) for v in sensitivity.values()])
            if sensitivity
            else np.zeros(1)
        )
        f_floor = 1e-6 * float(allf.mean()) if allf.size and allf.mean() > 0 else 1e-30
    spec = get_method(method)
    if len(params.experts) != K:
        raise InputError(f"{len(params.experts)} expert parameter sets for {K} experts.")
    block_bytes = analyses[0].block_bytes if analyses else DEFAULT_BLOCK_BYTES  # (passthrough: no experts)
    if spec.needs_gram and gram is None:
        raise InputError(f"{method} needs the experts' pair statistics; analyze with pairs (the pipeline does).")
    n_layers = layer_count(base.layout.tensors)
    # LoRA adapter experts: {base tensor: module} (δ = s·B·A there, 0 elsewhere)
    lmaps = [lora_map(base, e) if e.adapter is not None else None for e in experts]

    tensors: list[TensorPlan] = []
    cands: list[_Cand] = []
    infos: list[TensorInfo] = []
    for name, bt in base.layout.tensors.items():
        floating = bt.dtype in FLOAT_DTYPES and bt.numel > 0
        rpb = rows_per_block(bt, block_bytes)
        tpar = params.for_tensor(name, layer_t(name, n_layers)) if floating else None
        g = dict(tpar.globals) if tpar else {}
        eps = tpar.experts if tpar else ()
        row_stats = floating and needs_row_stats(spec, g)
        ew = elementwise_merge(spec, bt.dtype)
        cr = chunk_rows(bt, rpb, K, work_bytes, floats=work_floats(spec, K, ew))
        if (row_stats and len(bt.shape) < 2) or (floating and _whole_tensor(spec, g)):
            cr = max(rpb, -(-bt.rows // rpb) * rpb)  # a 1-D tensor is one row / whole-tensor statistics: one chunk
        weights = [float(e.get("weight", 1.0)) for e in eps]
        tp = TensorPlan(
            name=name,
            dtype=bt.dtype,
            shape=list(bt.shape),
            file=bt.file,
            start=bt.start,
            rows_per_block=rpb,
            n_blocks=n_blocks(bt, block_bytes),
            chunk_rows=cr,
            params=g,
            weight_sum=float(sum(weights)),
            out_dtype=(out_dtype if floating and out_dtype and out_dtype != bt.dtype else None),
            base_sha256=(base_digests or {}).get(name, ""),
        )
        rescale = spec.kind == "gta" and bool(g.get("rescale")) and spec.sparsify != "none"
        passes = 2 if rescale and cr < bt.rows and any(e.get("density", 1.0) < 1.0 for e in eps) else 1
        tp.passes = passes
        ti = len(tensors)
        tensors.append(tp)
        infos.append(bt)
        if not floating:
            continue
        stats = []
        for e, a in zip(experts, analyses):
            st = a.tensors.get(name)
            if st is None:
                raise InputError(f"catalog: analysis of {e.uri} lacks tensor {name!r}; re-run `mergepipe analyze`.")
            if st.rows_per_block != rpb:
                raise InputError(f"catalog: block grid of {name!r} differs from the plan's; re-run analyze.")
            stats.append(st)
        coefs = _coefficients(spec, g, tp, stats, weights, gram, name, K, raw_points)
        # bf16/float16/float32 TIES: exact top-k; the key histogram gives the threshold group and how
        # many of it to keep, the engine the float32 threshold inside it (a pre-pass when the
        # tensor spans several chunks)
        ranks = [0] * K
        windows: list[tuple[int, int, int, int] | None] = [None] * K  # breadcrumbs: (τ_lo, r_lo, τ_hi, r_hi)
        # the engine holds each refined group's float32 values for the whole tensor: a bf16 group
        # (often a sizeable share of the tensor) is refined only while it holds at most
        # max(2^14, work memory / (16 K)) entries (the K groups within a quarter of the working memory, or
        # 64 KiB each); larger ones keep the key rule (:data:`EXACT_TRIM_DTYPES`)
        group_cap = max(1 << 14, work_bytes // (16 * max(1, K))) if bt.dtype == "BF16" else None
        if spec.sparsify == "magnitude" and bt.dtype in EXACT_TRIM_DTYPES:
            for i, st in enumerate(stats):
                tau, rank, ties = trim_rank(st.hist_keys, st.hist_counts, st.numel, float(eps[i].get("density", 1.0)))
                if tau > 0 and rank < ties and (group_cap is None or ties <= group_cap):
                    ranks[i] = rank
        elif spec.sparsify == "outliers" and bt.dtype in EXACT_TRIM_DTYPES:
            for i, st in enumerate(stats):
                ks = outlier_counts(st.numel, float(eps[i].get("density", 1.0)), float(eps[i].get("gamma", 0.0)))
                if ks is None or ks[0] == ks[1]:  # keep all, or nothing (target 0)
                    continue
                lo = topk_rank(st.hist_keys, st.hist_counts, ks[0])
                hi = topk_rank(st.hist_keys, st.hist_counts, ks[1])
                if group_cap is not None and max(lo[2], hi[2]) > group_cap // 2:
                    continue
                w = (lo[0], lo[1] if 0 < lo[1] < lo[2] else 0, hi[0], hi[1] if 0 < hi[1] < hi[2] else 0)
                if w[1] or w[3]:
                    windows[i] = w
                    ranks[i] = w[1] or -1  # (-1: only the outlier bound is refined)
        if any(ranks) and cr < bt.rows:
            passes += 1
            tp.passes = passes
            tp.derived = {**tp.derived, "threshold_pass": True}
        for i, (e, st) in enumerate(zip(experts, stats)):
            ep = eps[i]
            dens = float(ep.get("density", 1.0))
            mk, xk = 0, N_KEYS
            if spec.kind in ("gta", "linear"):
                w2 = weights[i] ** 2
                if spec.sparsify == "magnitude" and dens < 1.0:
                    mk = st.min_key(dens)
                    if ranks[i]:
                        mk = trim_rank(st.hist_keys, st.hist_counts, st.numel, dens)[0]  # τ: part of its group kept
                    kept = st.kept_energy(mk)
                elif spec.sparsify == "outliers" and dens < 1.0:
                    mk, xk = outlier_window(st.hist_keys, st.hist_counts, st.numel, dens, float(ep["gamma"]))
                    win = windows[i]
                    if win is not None:  # exact ends: the cut groups are inside the key window
                        tl, rl, th, rh = win
                        mk = tl if rl else mk
                        xk = th + 1 if rh else xk
                    kept = st.kept_energy_window(mk, xk)
                elif spec.sparsify == "random" and dens < 1.0:
                    kept = st.sq_norm * (1.0 / dens if g.get("rescale") else dens)
                elif spec.sparsify == "della" and dens < 1.0:
                    kept = st.della_kept_energy(dens, float(ep["epsilon"]))
                    if g.get("rescale"):
                        kept = kept / dens**2
                else:
                    kept = st.sq_norm.copy()
                if rescale and dens < 1.0:
                    # below-threshold blocks still count in the L1 norm the rescale matches
                    kept = np.where((kept <= 0) & (st.sq_norm > 0), 1e-12 * st.sq_norm, kept)
                val = kept * w2
            else:
                c2 = coefs[i] ** 2
                if row_stats:
                    c2 = max(c2, 1e-12)  # an estimate: the engine computes the per-row coefficient
                val = st.sq_norm * c2
            if value == "fisher":
                fb = sensitivity.get(name) if sensitivity else None
                if fb is None or len(fb) != len(val):
                    raise InputError(
                        f"catalog: the sensitivity statistic lacks tensor {name!r} on this block grid; "
                        "re-run `mergepipe analyze --calibration ...`."
                    )
                val = val * (np.asarray(fb, dtype=np.float64) + f_floor)
            lf = None
            svalue = scost = None
            lmap = lmaps[i]
            if lmap is not None:
                mod = lmap.get(name)
                if mod is None:  # a tensor the adapter does not touch: δ = 0, nothing to read
                    continue
                # one unit: A for every chunk of a pass (the engine reads it with each chunk's
                # rows of B) plus B once; bytes per pass; the last pre-pass skips the first chunk
                n_chunks = -(-bt.rows // cr)
                unit = np.array([n_chunks * mod.a.nbytes + mod.b.nbytes], dtype=np.int64)
                first = mod.a.nbytes + min(cr, mod.b.rows) * mod.b.row_bytes if passes > 1 else 0
                cands.append(
                    _Cand(
                        ti,
                        i,
                        np.array([val.sum()]),
                        np.array([val.sum()]),
                        unit,
                        np.array([passes], dtype=np.int64),
                        lora=True,
                        lora_total=passes * int(unit[0]) - first,
                    )
                )
                file, start = mod.b.file, mod.b.start
                lf = LoraFactors(
                    a_start=mod.a.start,
                    a_end=mod.a.end,
                    a_dtype=mod.a.dtype,
                    b_dtype=mod.b.dtype,
                    rank=mod.rank,
                    scale=mod.scale,
                    module=mod.module,
                )
            else:
                et = e.layout.tensors[name]
                cost = (
                    np.minimum((np.arange(st.n_blocks) + 1) * rpb, et.rows) - np.arange(st.n_blocks) * rpb
                ) * et.row_bytes
                if tiers and st.has_sketch and len(bt.shape) >= 2:
                    # level k keeps the share 1 − residual_k/Σδ² of the block's energy; the method's
                    # value (trim, weights, Fisher) scales like the exact block's
                    sq = np.asarray(st.sq_norm, dtype=np.float64)[:, None]
                    res = np.asarray(st.sketch_sq, dtype=np.float64).reshape(len(val), -1)[:, :levels]
                    rho = np.where(sq > 0, 1.0 - res / np.where(sq > 0, sq, 1.0), 0.0)
                    svalue = val[:, None] * np.clip(rho, 0.0, 1.0)
                    scost = tensor_sketch_costs(et.rows, et.numel // max(1, et.rows), rpb, st.n_blocks)
                reads = np.asarray(block_reads(tp), dtype=np.int64)
                cands.append(_Cand(ti, i, val, val.copy(), cost.astype(np.int64), reads, svalue, scost))
                file, start = et.file, et.start
            tp.experts.append(
                TensorExpert(
                    expert=i,
                    file=file,
                    start=start,
                    lora=lf,
                    weight=weights[i] if weights else 1.0,
                    density=dens,
                    gamma=float(ep.get("gamma", 0.0)),
                    epsilon=float(ep.get("epsilon", 0.0)),
                    min_key=int(mk),
                    max_key=int(xk),
                    stream_key=stream_key(seed, i, name),
                    blocks=[],
                    exact_rank=max(0, ranks[i]),
                    exact_rank_hi=(windows[i] or (0, 0, 0, 0))[3],
                    bytes=0,
                    kept_energy=0.0,
                    full_energy=float(val.sum()),
                    sketch_start=int(st.sketch_start) if svalue is not None else -1,
                )
            )

    # --- selection -------------------------------------------------------------------------
    if cands:
        values = np.concatenate([c.value for c in cands])
        cost1 = np.concatenate([c.cost for c in cands]).astype(np.int64)
        costs = np.concatenate([c.total() for c in cands]).astype(np.int64)
        cand_of = np.repeat(np.arange(len(cands)), [len(c.value) for c in cands])
    else:
        values = np.zeros(0)
        cost1 = costs = cand_of = np.zeros(0, dtype=np.int64)
    offs = np.cumsum([0] + [len(c.value) for c in cands])

    def picked(sel: np.ndarray, j: int) -> np.ndarray:
        """Selected block indices of candidate ``j``."""
        return np.nonzero(sel[offs[j] : offs[j + 1]])[0]

    total_value = float(values.sum())
    level = np.zeros(len(values), dtype=np.int64)  # sketch level read per block (0: none)
    if tiers:
        svals = np.concatenate(
            [c.svalue if c.svalue is not None else np.zeros((len(c.value), levels)) for c in cands]
        ).reshape(len(values), levels)
        scosts = np.concatenate(
            [c.scost * c.reads if c.scost is not None else np.zeros(len(c.value), dtype=np.int64) for c in cands]
        ).astype(np.int64)
        if budget_bytes is not None:
            # one representation per block across experts (skip, sketch level k, or exact for all):
            # see _select_tiers_joint for why (sign election; the worst task)
            selected, level = _select_tiers_joint(
                values, costs, svals, scosts, _block_groups(cands), budget_bytes, fidelity
            )
        else:  # fidelity alone: the fewest bytes to the retained-value target, block by block
            selected, level = _select_tiers(values, costs, svals, scosts, budget_bytes, fidelity)
    else:
        selected, coalesce_gap = _select_gap(values, costs, cost1, cand_of, coalesce_gap, budget_bytes, fidelity)

    def plan_cost(sel: np.ndarray) -> int:
        """Expert bytes of a selection as the engine reads them: per expert and tensor, the
        selected block runs coalesced under the plan's gap (the engine never coalesces across
        tensors), once per pass that reads them (the last pre-pass skips the first chunk)."""
        total = 0
        for j, c in enumerate(cands):
            idx = picked(sel, j)
            if len(idx) == 0:
                continue
            if c.lora:  # A per chunk + B: exactly the ranges the engine requests (gap 0)
                total += c.lora_total
                continue
            et = experts[c.expert].layout.tensors[infos[c.tensor].name]
            for k in range(1, int(c.reads.max()) + 1):  # pass k reads the blocks read at least k times
                rng = block_byte_ranges(et, tensors[c.tensor].rows_per_block, _runs(idx[c.reads[idx] >= k]))
                total += sum(e - s for s, e in coalesce(rng, coalesce_gap, DEFAULT_MAX_REQUEST))
        return total

    sketch_read = int((scosts * level).sum()) if tiers else 0
    expert_read = plan_cost(selected) + sketch_read
    if expert_read != int(costs[selected].sum()) + sketch_read or (
        budget_bytes is not None and expert_read > budget_bytes
    ):
        raise RuntimeError(  # a defect in _select, never bad input
            f"planner: selection costs {expert_read} B coalesced vs {int(costs[selected].sum())} B by blocks "
            f"(budget {budget_bytes}); please report this."
        )

    # --- assemble --------------------------------------------------------------------------
    for j, c in enumerate(cands):
        idx = picked(selected, j)
        te = next(t for t in tensors[c.tensor].experts if t.expert == c.expert)
        te.blocks = ([(0, tensors[c.tensor].n_blocks)] if len(idx) else []) if c.lora else _runs(idx)
        te.bytes = int(c.cost[idx].sum())
        te.kept_energy = float(c.value[idx].sum())
        st_c = analyses[c.expert].tensors[infos[c.tensor].name]
        if not c.lora and len(idx):
            te.block_digests = _digests_hex(st_c.block_sha, idx, analyses[c.expert], infos[c.tensor].name)
        if tiers and c.svalue is not None and c.scost is not None:
            lv = level[offs[j] : offs[j + 1]]
            te.sketch_blocks, te.sketch_levels = _level_runs(lv)
            if te.sketch_blocks:
                sha = st_c.sketch_sha
                if sha is None:
                    _no_digests(analyses[c.expert], infos[c.tensor].name)
                te.sketch_digests = "".join(
                    sha[b0:b1, p].tobytes().hex()
                    for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels)
                    for p in range(k)
                )
            sidx = np.nonzero(lv)[0]
            te.sketch_bytes = int((c.scost[sidx] * lv[sidx]).sum())
            te.kept_energy += float(c.svalue[sidx, lv[sidx] - 1].sum())
        if not te.sketch_blocks:
            te.sketch_start = -1
    for tp, bt in zip(tensors, infos):
        tp.experts = [t for t in tp.experts if t.blocks or t.sketch_blocks]
        floating = bt.dtype in FLOAT_DTYPES and bt.numel > 0
        if not floating:
            tp.copy_base = True
        elif spec.kind == "slerp":
            tp.copy_base = tp.params["t"] == 0.0  # t = 0 is the base; otherwise slerp rescales even the base
        elif spec.kind in ("karcher", "multislerp"):
            tp.copy_base = not tp.experts and tp.derived.get("c_base", 1.0) == 1.0  # (else the base is rescaled)
        else:
            tp.copy_base = not tp.experts and identity_on_zero_delta(spec, tp.weight_sum, tp.params)
        tp.explain = _explain_tensor(tp, spec, [e for e in (expert_names or [])])
    kept_value = float(values[selected].sum())
    if tiers:
        sk = np.nonzero(level)[0]
        kept_value += float(svals[sk, level[sk] - 1].sum())
    retained = kept_value / total_value if total_value > 0 else 1.0

    plan_out_dtype = out_dtype if any(tp.out_dtype for tp in tensors) else None
    base_read, out_bytes = _side_io(tensors, infos, base, extra_files, inputs.config_json, plan_out_dtype)
    used_sketch = [any(t.expert == i and t.sketch_blocks for tp in tensors for t in tp.experts) for i in range(K)]
    names = list(expert_names) if expert_names else [e.uri.rstrip("/").rsplit("/", 1)[-1] for e in experts]
    plan = Plan(
        method=method,
        globals=dict(params.globals),
        seed=seed,
        block_bytes=block_bytes,
        coalesce_gap=coalesce_gap,
        work_bytes=work_bytes,
        base=InputRef(uri=base.uri, identity=base.identity, signature=base.signature, total_bytes=base.total_bytes),
        experts=[
            ExpertRef(
                uri=e.uri,
                identity=e.identity,
                signature=e.signature,
                total_bytes=e.total_bytes,
                name=names[i],
                params=params.experts[i],
                content_digest=_content_digest(analyses[i]),
                adapter=e.adapter.summary() if e.adapter is not None else None,
                sketch=_sketch_ref(analyses[i]) if tiers and used_sketch[i] else None,
            )
            for i, e in enumerate(experts)
        ],
        budget_bytes=budget_bytes,
        fidelity=fidelity,
        tensors=tensors,
        io=IOEstimate(
            base_read_bytes=base_read,
            expert_read_bytes=expert_read,
            output_write_bytes=out_bytes,
            sketch_read_bytes=sketch_read,
        ),
        expert_bytes_total=sum(e.layout.total_bytes for e in experts),
        retained_energy=retained,
        extra_files=sorted(extra_files),
        shard_metadata={f: sh.metadata for f, sh in base.layout.shards.items()},
        index_metadata=base.layout.index_metadata,
        out_dtype=plan_out_dtype,
        n_layers=n_layers,
        block_value={"kind": "fisher", "calibration": calibration} if value == "fisher" and calibration else None,
        sketch=sketch if tiers else None,
        requested_dtype=requested_dtype,
        source=dict(source or {}),
        created_at=time.time(),
    )
    from mergepipe import __version__

    plan.mergepipe_version = __version__
    plan.explain = _explain_plan(plan, time.perf_counter() - t0)
    return plan.seal()


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
    selected = np.zeros(n_all, dtype=bool)
    order = _greedy_order(values, costs) if order is None else order
    if budget is None and fidelity is None:
        selected[order] = True
        return _gap_closure(selected, cand_of, np.concatenate([[0], np.cumsum(cost1)]), gap)
    cum = np.concatenate([[0], np.cumsum(cost1)])
    bridges = gap > 0 and n_all > 0 and int(cost1.min(initial=gap + 1)) <= gap

    def prefix(take: np.ndarray, n: int) -> np.ndarray:
        s = np.zeros(n_all, dtype=bool)
        s[take[:n]] = True
        return _gap_closure(s, cand_of, cum, gap)

    def first_true(lo: int, hi: int, pred) -> int:
        """Smallest n in [lo, hi] with pred(n) (pred monotone false→true; hi if none)."""
        while lo < hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    take = order
    total = float(values.sum())
    if fidelity is not None and total > 0:
        target = fidelity * total * (1 - 1e-12)
        if bridges:
            n = first_true(1, len(order), lambda m: float(values[prefix(order, m)].sum()) >= target)
        else:
            cumv = np.cumsum(values[order])
            n = int(np.searchsorted(cumv, target, side="left")) + 1
        take = order[: min(n, len(order))]
    if budget is None:
        return prefix(take, len(take))
    if bridges:
        n = first_true(0, len(take), lambda m: int(costs[prefix(take, m + 1)].sum()) > budget) if len(take) else 0
    else:
        n = int(np.searchsorted(np.cumsum(costs[take]), budget, side="right"))
    selected = prefix(take, n)
    if not fill:
        return selected
    room = budget - int(costs[selected].sum())
    rest = take[n:]
    min_cost = int(costs[rest].min()) if len(rest) else 0
    for j in rest:  # fill the remainder with blocks that still fit (smaller ones, or fewer gap blocks)
        if room < min_cost or room <= 0:
            break
        if selected[j]:
            continue
        lo = hi = j
        if bridges:  # gap blocks to the nearest selected block of the same candidate on each side
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
    return selected


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
        svalues: float64 ``(n, L)`` value of each sketch level; scosts: int64 ``(n,)`` bytes of
            one sign plane (all passes; 0: the block has no sketch tier).
        budget: bytes (None: unlimited); fidelity: share of ``values.sum()`` to reach (None: off).

    Returns:
        (exact, level): bool ``(n,)`` blocks read exactly and int64 ``(n,)`` the sketch level
        read instead (0: none; never both), with ``costs[exact].sum() + (level·scosts).sum() <= budget``.

    Each block offers upgrades along the upper convex hull of its (bytes, value) points, the
    LP-greedy of the multiple-choice knapsack (Sinha & Zoltners, Oper. Res. 1979): a point below
    the segment between two others is never worth buying, so along the hull value per byte
    decreases and a global order by value per byte (ties by block, then tier) buys each block's
    upgrades in order. Upgrades are taken while they fit; one that does not fit is passed over
    and later, smaller ones may still fill the remainder. With fidelity, upgrades stop once the
    kept value reaches the target.
    """
    n, L = svalues.shape
    T = L + 2
    X = np.zeros((n, T), dtype=np.int64)
    Y = np.zeros((n, T))
    lv = np.arange(1, L + 1)
    X[:, 1 : L + 1] = scosts[:, None] * lv[None, :]
    Y[:, 1 : L + 1] = svalues
    X[:, -1], Y[:, -1] = costs, values
    ok = np.ones((n, T), dtype=bool)
    ok[:, 1 : L + 1] = (scosts[:, None] > 0) & (X[:, 1 : L + 1] < costs[:, None]) & (svalues > 0)
    ok[:, -1] = values > 0
    idx = np.broadcast_to(np.arange(T), (n, T))
    while True:  # drop points on or below the segment between their hull neighbours
        prev = np.maximum.accumulate(np.where(ok, idx, -1), axis=1)
        prev = np.concatenate([np.full((n, 1), -1), prev[:, :-1]], axis=1)
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
            break
        ok &= ~below
    prev = np.maximum.accumulate(np.where(ok, idx, -1), axis=1)
    prev = np.concatenate([np.full((n, 1), -1), prev[:, :-1]], axis=1)
    has = ok & (prev >= 0)
    has[:, 0] = False
    ib, it = np.nonzero(has)
    fr = prev[ib, it]
    dx = X[ib, it] - X[ib, fr]
    dy = Y[ib, it] - Y[ib, fr]
    eff = dy / np.maximum(dx, 1)
    order = _desc_order(eff)  # ties by (block, tier): np.nonzero lists (ib, it) in that order
    ib, it, fr, dx, dy = ib[order], it[order], fr[order], dx[order], dy[order]
    tier = np.zeros(n, dtype=np.int64)
    m = len(dx)
    if budget is not None:
        m = int(np.searchsorted(np.cumsum(dx), budget, side="right"))  # the prefix fits and keeps the order
    target = fidelity * float(values.sum()) * (1 - 1e-12) if fidelity is not None else None
    if target is not None:
        m = min(m, int(np.searchsorted(np.cumsum(dy), target, side="left")) + 1)
    np.maximum.at(tier, ib[:m], it[:m])
    if budget is not None:
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
    exact = tier == T - 1
    return exact, np.where(exact, 0, tier)


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
    gsc = np.zeros(G, dtype=np.int64)
    np.add.at(gsc, group, np.where(live, scosts, 0))
    no_sketch = np.zeros(G, dtype=np.int64)  # live members without a sketch tier
    np.add.at(no_sketch, group, (live & (scosts <= 0)).astype(np.int64))
    L = svalues.shape[1]
    gsv = np.stack(
        [np.bincount(group, weights=np.where(live, svalues[:, k], 0.0), minlength=G) for k in range(L)], axis=1
    ).reshape(G, L)
    gsc = np.where(no_sketch > 0, 0, gsc)
    gexact, glevel = _select_tiers(gv, gc, gsv, gsc, budget, fidelity)
    exact = gexact[group] & live
    level = np.where(live & (scosts > 0), glevel[group], 0)
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


def _coefficients(
    spec, g: dict, tp: TensorPlan, stats: list, weights: list[float], gram, name: str, K: int, raw: bool = False
) -> list[float]:
    """Per-expert coefficient of the task vector in the output (interpolating methods), and
    ``tp.derived`` filled with what the engine needs. From whole-tensor catalog statistics.
    ``raw``: multislerp over the inputs' raw weights θᵢ = base + δᵢ (mergekit without
    ``base_model``; the base is one of the inputs), not over the task vectors."""
    if spec.kind == "slerp":
        st = stats[0]
        ca, cb = slerp_coefficients(float(g["t"]), st.base_sq, st.expert_sq, st.base_dot_expert)
        tp.derived = {"c_base": ca, "c_expert": cb}
        return [cb]
    if spec.kind == "nuslerp":
        total = weights[0] + weights[1]
        t = 0.5 if abs(total) < 1e-6 else weights[1] / total
        a, b, s = nuslerp_coefficients(t, stats[0].delta_sq, stats[1].delta_sq, float(gram[(0, 1)][name]))
        tp.derived = {"t": t}
        if g.get("nuslerp_flatten", True):
            tp.derived.update({"a": a, "b": b, "s": s})
        return [a / s, b / s]
    if spec.kind == "model_stock":
        t = float(model_stock_t(K, [st.delta_sq for st in stats], {k: float(v[name]) for k, v in gram.items()}))
        tp.derived = {} if g.get("filter_wise") else {"t": t}
        return [t / K] * K
    if spec.kind in ("multislerp", "karcher"):
        dd = np.zeros((K, K))
        for i in range(K):
            dd[i, i] = stats[i].delta_sq
            for j in range(i + 1, K):
                dd[i, j] = dd[j, i] = float(gram[(i, j)][name])
        if spec.kind == "multislerp" and not raw:
            try:
                cs = multislerp_coefficients(weights, dd, bool(g["normalize_weights"]), float(g["eps"]))
            except ValueError as e:
                raise InputError(f"multislerp: tensor {name!r}: {e}; change the weights.") from None
            tp.derived = {"c_base": 1.0, **{f"c{i}": c for i, c in enumerate(cs)}}
            return cs
        # karcher (and multislerp without a base) over the points θᵢ = base + δᵢ:
        # ⟨θᵢ,θⱼ⟩ = ⟨b,θᵢ⟩ + ⟨b,θⱼ⟩ − ‖b‖² + ⟨δᵢ,δⱼ⟩; the result Σ cᵢθᵢ = (Σ cᵢ)·base + Σ cᵢδᵢ
        bb = stats[0].base_sq
        bx = np.array([st.base_dot_expert for st in stats])
        gt = dd + bx[:, None] + bx[None, :] - bb
        for i in range(K):
            gt[i, i] = stats[i].expert_sq
        if spec.kind == "multislerp":
            try:
                cs = multislerp_coefficients(weights, gt, bool(g["normalize_weights"]), float(g["eps"]))
            except ValueError as e:
                raise InputError(f"multislerp: tensor {name!r}: {e}; change the weights.") from None
            tp.derived = {
                "c_base": f32(math.fsum(float(np.float32(c)) for c in cs)),
                **{f"c{i}": c for i, c in enumerate(cs)},
            }
            return cs
        cs = karcher_coefficients(gt, int(g["max_iter"]), float(g["tol"]))
        tp.derived = {
            "c_base": f32(math.fsum(float(np.float32(c)) for c in cs)),
            **{f"c{i}": c for i, c in enumerate(cs)},
        }
        return cs
    if spec.kind == "sce" and not _whole_tensor(spec, g):
        ws = sce_weights([st.delta_sq for st in stats], stats[0].numel)
        tp.derived = {f"w{i}": w for i, w in enumerate(ws)}
        return ws
    return [1.0] * K


def _whole_tensor(spec, g: dict) -> bool:
    """The engine merges this tensor in one chunk: its statistics are whole-tensor functions of
    the expert values that the catalog does not keep (arcee_fusion's importance quantiles,
    ramplus_tl's overlap counts, sce's variance top-k with select_topk < 1)."""
    return spec.kind in ("arcee_fusion", "ramplus_tl") or (
        spec.kind == "sce" and float(g.get("select_topk", 1.0)) < 1.0
    )


def _explain_tensor(tp: TensorPlan, spec, names: list[str]) -> str:
    if tp.copy_base:
        if spec.kind == "slerp" and tp.params.get("t") == 0.0 and tp.dtype in FLOAT_DTYPES:
            return "copied from base: slerp t=0"
        return "copied from base: no expert block selected (or the tensor is not floating point)"
    parts = []
    for te in tp.experts:
        nsel = sum(b1 - b0 for b0, b1 in te.blocks)
        frac = te.kept_energy / te.full_energy if te.full_energy > 0 else 1.0
        nm = names[te.expert] if te.expert < len(names) else f"expert {te.expert + 1}"
        thr = ""
        if spec.sparsify == "magnitude" and te.min_key:
            thr = f", trim key>={te.min_key}"
        elif spec.sparsify == "outliers" and te.density < 1.0:
            thr = f", keep keys in [{te.min_key}, {te.max_key})"
        pv = ""
        if spec.has_weights and spec.kind != "nuslerp":
            pv = f" (weight {te.weight:g}" + (f", density {te.density:g}" if spec.uses_density else "") + ")"
        lo = ""
        if te.lora is not None:
            lo = f", LoRA {te.lora.module} r={te.lora.rank} scale={te.lora.scale:g}: reads A and B ({te.bytes:,} B)"
        sk = ""
        if te.sketch_blocks:
            by: dict[int, int] = {}
            for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels):
                by[k] = by.get(k, 0) + b1 - b0
            sk = " + sketched " + ", ".join(f"{n} at {k} plane{'s' if k > 1 else ''}" for k, n in sorted(by.items()))
        parts.append(f"{nm}{pv}: {nsel}/{tp.n_blocks} blocks{sk}, {frac:.1%} of its energy{thr}{lo}")
    head = ""
    d = tp.derived
    if spec.kind == "slerp":
        head = (
            f"slerp t={tp.params['t']:g}: {d['c_base']:.6g}·base + {d['c_expert']:.6g}·expert (coefficients "
            "from the catalog's whole-tensor norms and dot product); "
        )
    elif spec.kind == "model_stock":
        head = (
            "model_stock filter_wise: per-row ratio computed by the engine from the rows it reads (unread rows "
            "count as δ = 0); "
            if tp.params.get("filter_wise")
            else f"model_stock t={d['t']:.6g} from the catalog's pairwise cosines; "
        )
    elif spec.kind == "nuslerp":
        head = (
            f"nuslerp t={d['t']:.6g}: coefficients from the catalog's norms and ⟨δ₀,δ₁⟩; "
            if "a" in d
            else f"nuslerp t={d['t']:.6g}: per-row coefficients computed by the engine from the rows it reads; "
        )
    elif spec.kind in ("multislerp", "karcher"):
        cs = ", ".join(
            f"{d[k]:.6g}" for k in sorted(d, key=lambda k: (len(k), k)) if k.startswith("c") and k != "c_base"
        )
        head = (
            f"{spec.kind}: base·{d.get('c_base', 1.0):.6g} + Σ cᵢδᵢ, c = [{cs}] from the catalog's norms and pair "
            "statistics; "
        )
    elif spec.kind == "sce" and d:
        head = f"sce: weights [{', '.join(f'{d[k]:.6g}' for k in sorted(d))}] from the catalog's ‖δᵢ‖²; "
    elif spec.budget == "whole" or spec.kind == "sce":
        head = f"{spec.kind}: whole-tensor statistics computed by the engine over the whole tensor (one chunk); "
    elif spec.sparsify == "della":
        head = "della: per-row magnitude ranks computed by the engine from the rows it reads; "
    if not parts:
        return head + "no expert block selected"
    extra = (
        f" ({tp.passes - 1} pre-pass(es) over the tensor: L1 rescale or exact threshold; expert blocks read"
        f" {tp.passes}x, {tp.passes - 1}x in the first chunk)"
        if tp.passes > 1
        else ""
    )
    return head + "; ".join(parts) + extra


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
            f" Fidelity tiers ({plan.sketch}): {nb} blocks merged from their sign-plane sketches, "
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
