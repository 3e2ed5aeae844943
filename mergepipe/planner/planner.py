"""Budget- and fidelity-aware block selection.

Objective: maximize retained task-vector energy after the method's sparsification,
``Σ wᵢ² · kept_energy(i, block)`` over the selected (expert, block) pairs, subject to the expert
bytes the engine will read (coalesced with the plan's gap rule, times the passes a tensor
needs) being at most the budget. This is a knapsack; blocks are small and near-uniform in size,
so the greedy order by value per byte (Dantzig's bound) is within one block of optimal.

Guarantee: ``plan.io.expert_read_bytes`` is computed with :func:`mergepipe.storage.base.coalesce`
over the exact byte ranges the engine requests, so realized expert bytes <= planned <= budget
(the engine only ever issues subsets of these ranges, see :mod:`mergepipe.engine`).

Blocks whose every entry falls below the trim threshold (``max|δ|`` key below it) or whose
task vector is zero carry no value and are never read, even at unlimited budget: the output is
the same either way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mergepipe.catalog.catalog import Analysis, CheckpointRecord
from mergepipe.errors import InputError
from mergepipe.formats.safetensors import FLOAT_DTYPES, TensorInfo, n_blocks, rows_per_block
from mergepipe.methods.kernels import identity_on_zero_delta
from mergepipe.methods.registry import get_method, resolve_params
from mergepipe.numerics import stream_key
from mergepipe.planner.plan import (
    ExpertRef,
    InputRef,
    IOEstimate,
    Plan,
    TensorExpert,
    TensorPlan,
)
from mergepipe.storage.base import DEFAULT_MAX_REQUEST, coalesce

DEFAULT_WORK_BYTES = 256 * 1024 * 1024
EXTRA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


def chunk_rows(info: TensorInfo, rpb: int, n_experts: int, work_bytes: int) -> int:
    """Rows the engine processes at once: a multiple of ``rpb`` such that the float32 working
    set (base, K task vectors, output and one temporary: ``(K + 3) * rows * row_numel * 4``
    bytes) stays within ``work_bytes``; at least one block."""
    row_numel = max(1, info.numel // max(1, info.rows))
    per_row = (n_experts + 3) * row_numel * 4
    rows = max(rpb, (work_bytes // max(1, per_row)) // rpb * rpb)
    return min(rows, max(rpb, -(-info.rows // rpb) * rpb))


@dataclass
class _Cand:
    tensor: int
    expert: int
    value: np.ndarray  # per block
    full: np.ndarray
    cost: np.ndarray  # bytes per block (one pass)
    passes: int


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
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def make_plan(
    base: CheckpointRecord,
    experts: Sequence[CheckpointRecord],
    analyses: Sequence[Analysis],
    method: str,
    global_params: dict | None = None,
    expert_params: Sequence[dict] | None = None,
    *,
    expert_names: Sequence[str] | None = None,
    budget_bytes: int | None = None,
    fidelity: float | None = None,
    seed: int = 0,
    work_bytes: int = DEFAULT_WORK_BYTES,
    coalesce_gap: int = 0,
    extra_files: Sequence[str] = (),
) -> Plan:
    """Plan a merge of ``experts`` into ``base``.

    Args:
        analyses: the catalog's analysis of each expert (same order), same block size.
        budget_bytes: expert-I/O budget in bytes (None: unlimited).
        fidelity: fraction of the full-budget retained energy to reach, in (0, 1] (None: off).
            With both, the plan stops at whichever comes first.
        work_bytes: engine working-memory target (bytes) that fixes chunking (semantic:
            it decides whether a tensor needs a second pass).
        coalesce_gap: gap (bytes) under which the storage merges ranges; the cost model.

    Raises:
        InputError: bad parameters, negative budget, fidelity outside (0, 1].
    """
    t0 = time.perf_counter()
    K = len(experts)
    if K == 0:
        raise InputError("no experts given; pass at least one --expert.")
    if budget_bytes is not None and budget_bytes < 0:
        raise InputError(f"--budget {budget_bytes} is negative; give bytes like 512MiB or a percentage like 25%.")
    if fidelity is not None and not (0.0 < fidelity <= 1.0):
        raise InputError(f"--fidelity {fidelity} is outside (0, 1]; e.g. --fidelity 0.99.")
    spec = get_method(method)
    params = resolve_params(method, dict(global_params or {}), [dict(p) for p in (expert_params or [{}] * K)])
    block_bytes = analyses[0].block_bytes
    weights = [p["weight"] for p in params.experts]
    needs_stats_pass = bool(params.globals.get("rescale")) and spec.sparsify != "none"

    tensors: list[TensorPlan] = []
    cands: list[_Cand] = []
    infos: list[TensorInfo] = []
    for name, bt in base.layout.tensors.items():
        floating = bt.dtype in FLOAT_DTYPES and bt.numel > 0
        rpb = rows_per_block(bt, block_bytes)
        cr = chunk_rows(bt, rpb, K, work_bytes)
        tp = TensorPlan(
            name=name, dtype=bt.dtype, shape=list(bt.shape), file=bt.file, start=bt.start, rows_per_block=rpb,
            n_blocks=n_blocks(bt, block_bytes), chunk_rows=cr,
        )
        passes = 2 if needs_stats_pass and cr < bt.rows and any(
            p.get("density", 1.0) < 1.0 for p in params.experts) else 1
        tp.passes = passes
        ti = len(tensors)
        tensors.append(tp)
        infos.append(bt)
        if not floating:
            continue
        for i, (e, a) in enumerate(zip(experts, analyses)):
            st = a.tensors.get(name)
            if st is None:
                raise InputError(f"catalog: analysis of {e.uri} lacks tensor {name!r}; re-run `mergepipe analyze`.")
            if st.rows_per_block != rpb:
                raise InputError(f"catalog: block grid of {name!r} differs from the plan's; re-run analyze.")
            ep = params.experts[i]
            dens = ep.get("density", 1.0)
            w2 = weights[i] ** 2
            if spec.sparsify == "magnitude" and dens < 1.0:
                mk = st.min_key(dens)
                kept = st.kept_energy(mk)
            elif spec.sparsify == "random" and dens < 1.0:
                mk = 0
                kept = st.sq_norm * (1.0 / dens if params.globals.get("rescale") else dens)
            else:
                mk = 0
                kept = st.sq_norm.copy()
            value = kept * w2
            et = e.layout.tensors[name]
            cost = (np.minimum((np.arange(st.n_blocks) + 1) * rpb, et.rows) - np.arange(st.n_blocks) * rpb) * et.row_bytes
            cands.append(_Cand(ti, i, value, value.copy(), cost.astype(np.int64), passes))
            tp.experts.append(
                TensorExpert(expert=i, file=et.file, start=et.start, min_key=int(mk), stream_key=stream_key(seed, i, name), blocks=[], bytes=0,
                             kept_energy=0.0, full_energy=float(value.sum()))
            )

    # --- selection -------------------------------------------------------------------------
    if cands:
        values = np.concatenate([c.value for c in cands])
        costs = np.concatenate([c.cost * c.passes for c in cands])
    else:
        values = costs = np.zeros(0, dtype=np.int64)
    offs = np.cumsum([0] + [len(c.value) for c in cands])

    def picked(sel: np.ndarray, j: int) -> np.ndarray:
        """Selected block indices of candidate ``j``."""
        return np.nonzero(sel[offs[j] : offs[j + 1]])[0]

    total_value = float(values.sum())
    useful = np.nonzero(values > 0)[0]
    order = useful[np.lexsort((useful, -(values[useful] / np.maximum(costs[useful], 1))))]
    selected = np.zeros(len(values), dtype=bool)
    if budget_bytes is None and fidelity is None:
        selected[order] = True
    else:
        take = order
        if fidelity is not None and total_value > 0:
            cumv = np.cumsum(values[order])
            n = int(np.searchsorted(cumv, fidelity * total_value * (1 - 1e-12), side="left")) + 1
            take = order[: min(n, len(order))]
        if budget_bytes is not None:
            cumc = np.cumsum(costs[take])
            n = int(np.searchsorted(cumc, budget_bytes, side="right"))
            chosen = list(take[:n])
            room = budget_bytes - (int(cumc[n - 1]) if n else 0)
            for j in take[n:]:  # fill the remainder with blocks that still fit (smaller ones)
                if room <= 0:
                    break
                if costs[j] <= room:
                    chosen.append(j)
                    room -= int(costs[j])
            take = np.array(chosen, dtype=np.int64)
        selected[take] = True

    def plan_cost(sel: np.ndarray) -> tuple[int, dict]:
        """Coalesced expert bytes of a selection: per expert file, ranges of all passes."""
        per_file: dict[tuple[int, str], list] = {}
        twice: dict[tuple[int, str], list] = {}
        for j, c in enumerate(cands):
            idx = picked(sel, j)
            if len(idx) == 0:
                continue
            bt = infos[c.tensor]
            et = experts[c.expert].layout.tensors[bt.name]
            rng = block_byte_ranges(et, tensors[c.tensor].rows_per_block, _runs(idx))
            per_file.setdefault((c.expert, et.file), []).extend(rng)
            if c.passes == 2:
                twice.setdefault((c.expert, et.file), []).extend(rng)
        total = 0
        for d in (per_file, twice):
            for rngs in d.values():
                total += sum(e - s for s, e in coalesce(rngs, coalesce_gap, DEFAULT_MAX_REQUEST))
        return total, per_file

    cost, _ = plan_cost(selected)
    if budget_bytes is not None and cost > budget_bytes:
        # coalescing gaps cost bytes: drop the least valuable selected blocks until it fits
        sel_order = [j for j in order if selected[j]][::-1]
        for j in sel_order:
            selected[j] = False
            cost, _ = plan_cost(selected)
            if cost <= budget_bytes:
                break

    # --- assemble --------------------------------------------------------------------------
    for j, c in enumerate(cands):
        idx = picked(selected, j)
        te = next(t for t in tensors[c.tensor].experts if t.expert == c.expert)
        te.blocks = _runs(idx)
        te.bytes = int(c.cost[idx].sum())
        te.kept_energy = float(c.value[idx].sum())
    for tp, bt in zip(tensors, infos):
        tp.experts = [t for t in tp.experts if t.blocks]
        floating = bt.dtype in FLOAT_DTYPES and bt.numel > 0
        tp.copy_base = not floating or (not tp.experts and identity_on_zero_delta(spec, weights, params.globals))
        tp.explain = _explain_tensor(tp, spec.name, params, [e for e in (expert_names or [])])
    expert_read, _ = plan_cost(selected)
    retained = float(values[selected].sum()) / total_value if total_value > 0 else 1.0

    base_read = 0
    for tp, bt in zip(tensors, infos):
        base_read += bt.nbytes * (tp.passes if tp.experts else 1)
    out_bytes = base.layout.total_bytes
    names = list(expert_names) if expert_names else [e.uri.rstrip("/").rsplit("/", 1)[-1] for e in experts]
    plan = Plan(
        method=method,
        globals=params.globals,
        seed=seed,
        block_bytes=block_bytes,
        coalesce_gap=coalesce_gap,
        work_bytes=work_bytes,
        base=InputRef(uri=base.uri, identity=base.identity, signature=base.signature, total_bytes=base.total_bytes),
        experts=[
            ExpertRef(uri=e.uri, identity=e.identity, signature=e.signature, total_bytes=e.total_bytes,
                      name=names[i], params=params.experts[i], content_digest=_content_digest(analyses[i]))
            for i, e in enumerate(experts)
        ],
        budget_bytes=budget_bytes,
        fidelity=fidelity,
        tensors=tensors,
        io=IOEstimate(base_read_bytes=base_read, expert_read_bytes=expert_read, output_write_bytes=out_bytes),
        expert_bytes_total=sum(e.layout.total_bytes for e in experts),
        retained_energy=retained,
        extra_files=sorted(extra_files),
        shard_metadata={f: sh.metadata for f, sh in base.layout.shards.items()},
        index_metadata=base.layout.index_metadata,
        created_at=time.time(),
    )
    from mergepipe import __version__

    plan.mergepipe_version = __version__
    plan.explain = _explain_plan(plan, time.perf_counter() - t0)
    return plan.seal()


def _content_digest(a: Analysis) -> str:
    import hashlib
    import json

    return hashlib.sha256(
        json.dumps({k: v.content_sha256 for k, v in a.tensors.items()}, sort_keys=True).encode()
    ).hexdigest()


def _explain_tensor(tp: TensorPlan, method: str, params, names: list[str]) -> str:
    if tp.copy_base:
        return "copied from base: no expert block selected (or the tensor is not floating point)"
    parts = []
    for te in tp.experts:
        nsel = sum(b1 - b0 for b0, b1 in te.blocks)
        frac = te.kept_energy / te.full_energy if te.full_energy > 0 else 1.0
        nm = names[te.expert] if te.expert < len(names) else f"expert {te.expert + 1}"
        thr = f", trim key>={te.min_key}" if te.min_key else ""
        parts.append(f"{nm}: {nsel}/{tp.n_blocks} blocks, {frac:.1%} of its energy{thr}")
    extra = " (L1 rescale needs a pre-pass: expert blocks read twice)" if tp.passes == 2 else ""
    return "; ".join(parts) + extra


def _explain_plan(plan: Plan, seconds: float) -> str:
    touched = sum(1 for t in plan.tensors if t.experts)
    b = "unlimited" if plan.budget_bytes is None else f"{plan.budget_bytes:,} B"
    return (
        f"{plan.method} over {len(plan.experts)} experts: reads {plan.io.expert_read_bytes:,} of "
        f"{plan.expert_bytes_total:,} expert bytes (budget {b}), retaining {plan.retained_energy:.2%} "
        f"of the weighted task-vector energy kept by {plan.method} at full budget; {touched}/"
        f"{len(plan.tensors)} tensors merged, the rest copied from the base. Planned in {seconds:.3f} s."
    )
