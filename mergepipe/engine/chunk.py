"""The engine's merge arithmetic for one work item: a row chunk in, its output bytes out.

Inputs are the raw little-endian bytes of the base's rows and of each expert's selected rows
(:class:`mergepipe.engine.reader.ChunkInputs`); rows an expert did not select count as equal
to the base (a zero task vector). The arithmetic is float32 on a torch ``device``; the result
is encoded in the tensor's output dtype (round to nearest even). Elementwise methods run tile
by tile (:func:`_merge_chunk_tiled`), the others on the whole chunk. Every parameter used is
the plan's per-tensor value (``tp.params``, the ``TensorExpert`` fields, ``tp.derived``); the
kernels and their sources are in :mod:`mergepipe.methods.kernels`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from mergepipe.engine.reader import ChunkInputs
from mergepipe.engine.sketchkernel import SketchRun
from mergepipe.engine.worklist import WorkItem
from mergepipe.formats.safetensors import DTYPES
from mergepipe.methods.kernels import (
    ExpertTensorParams,
    combine,
    elementwise_merge,
    l1_row_sums,
    l1_rows,
    magnitude_key_torch,
    rescale_factor,
    row_numel_of,
    sparsify,
)
from mergepipe.numerics import decode, exact_shrink
from mergepipe.planner.plan import Plan


def _torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name][1])


def _encode(t, dtype: str) -> bytes:
    """float32 torch tensor -> little-endian bytes of ``dtype`` (round to nearest even)."""
    import torch

    out = t.to(_torch_dtype(dtype)).contiguous().cpu()
    return out.view(torch.uint8).numpy().tobytes()


#: elements per tile of the tiled elementwise path: the float32 temporaries of one tile (~K + 6
#: arrays of 256 KiB) stay in the CPU caches, and each torch call is still long enough that its
#: dispatch overhead (~µs) is small next to its work. Measured on the 2-core Xeon (CPU time per
#: element of a TIES chunk, docs/BENCHMARKS.md): 64Ki elements beat 32Ki, 128Ki and 256Ki at K = 2
#: and 8 (K = 8: 27, 24, 34, 36 ns).
TILE_ELEMS = 1 << 16


def _elementwise(tp, spec) -> bool:
    """The merge of this tensor runs tile by tile (:func:`mergepipe.methods.kernels.elementwise_merge`)."""
    return elementwise_merge(spec, tp.dtype)


def _lora_delta(te, buf, rows: int):
    """float32 numpy ``δ = scale·B·A`` (flat) of ``rows`` rows of a LoRA expert from its
    :class:`~mergepipe.engine.reader.LoraBytes` (the catalog's arithmetic, bit for bit)."""
    from mergepipe.lora import delta_from_bytes

    lf = te.lora
    return delta_from_bytes(lf.a_dtype, buf.a, lf.b_dtype, buf.b, lf.rank, lf.scale).reshape(-1)


def _raw_tensor(raw, dtype: str):
    """Zero-copy torch view of little-endian safetensors bytes (BF16, F16, F32)."""
    import torch

    with warnings.catch_warnings():  # read-only buffers: the view is only read
        warnings.simplefilter("ignore")
        return torch.frombuffer(raw, dtype=_torch_dtype(dtype))


def _group_values(d, tau: int):
    """float32 numpy ``|δ|`` of the entries of ``d`` (float32 torch) whose magnitude key is ``tau``."""
    a = d.abs()
    return a[magnitude_key_torch(d) == tau].cpu().numpy()


def _concat(parts):
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def _bounds(te):
    """The threshold key groups of ``te`` to refine: ``(slot, key, rank)`` for the lower end
    (TIES's threshold, breadcrumbs' window start; slot 0) and breadcrumbs' outlier bound (slot 1)."""
    out = []
    if te.exact_rank:
        out.append((0, te.min_key, te.exact_rank))
    if te.exact_rank_hi:
        out.append((1, te.max_key - 1, te.exact_rank_hi))
    return out


def _shrinks(values_of, te) -> tuple[float | None, float | None]:
    """(shrink, shrink_hi) of ``te`` from ``values_of(slot, key)`` (float32 ``|δ|`` of a key group)."""
    lo = hi = None
    for slot, key, rank in _bounds(te):
        if slot == 0:
            lo = exact_shrink(values_of(slot, key), rank)
        else:
            hi = exact_shrink(values_of(slot, key), rank, all_below=True)
    return lo, hi


def _shrinks_from(groups, tp, te):
    """The exact thresholds of ``te`` in ``tp`` from the values its ``threshold`` pre-pass gathered."""
    return _shrinks(lambda slot, key: _concat(groups.get((tp.name, te.expert, slot), [])), te)


def _expert_params(tp, te, groups, values_of) -> ExpertTensorParams:
    """The sparsification parameters of expert ``te`` (a ``TensorExpert`` of tensor ``tp``) for
    one chunk: the plan's weight, density and key range, plus the exact-threshold shrinks when
    ``te`` has threshold key groups (:func:`_bounds`) -- from the values the tensor's
    ``threshold`` pre-pass gathered in ``groups`` (``tp.derived["threshold_pass"]``), otherwise
    from ``values_of(slot, key)`` over this chunk, which is then the whole tensor."""
    shrink = shrink_hi = None
    if _bounds(te):
        shrink, shrink_hi = (
            _shrinks_from(groups, tp, te) if tp.derived.get("threshold_pass") else _shrinks(values_of, te)
        )
    return ExpertTensorParams(
        weight=te.weight,
        density=te.density,
        min_key=te.min_key,
        stream_key=te.stream_key,
        max_key=te.max_key,
        epsilon=te.epsilon,
        shrink=shrink,
        shrink_hi=shrink_hi,
    )


def _tile_delta(runs, b, s: int, e: int):
    """float32 task vector of one expert over the chunk's elements ``[s, e)`` (zeros where it
    has no run); ``b`` is the base's ``[s, e)`` in float32. Runs are ``(elem0, elem1, values,
    is_delta)`` (see :func:`_merge_chunk_tiled`); a sketched run's ``values`` is its
    :class:`~mergepipe.engine.sketchkernel.SketchRun`, decoded here for the tile's rows only."""
    import torch

    d = None
    for a, z, x, dl in runs:
        lo, hi = max(a, s), min(z, e)
        if hi <= lo:
            continue
        if isinstance(x, SketchRun):
            piece = x.delta(lo - a, hi - a, b[lo - s : hi - s])
            if lo == s and hi == e:
                return piece
            if d is None:
                d = torch.zeros_like(b)
            d[lo - s : hi - s] = piece
            continue
        if lo == s and hi == e:
            # widened exactly to float32, then subtracted (a LoRA run: δ itself, copied since
            # sparsify may write into it)
            return x[lo - a : hi - a].clone() if dl else torch.sub(x[lo - a : hi - a], b)
        if d is None:
            d = torch.zeros_like(b)
        d[lo - s : hi - s] = x[lo - a : hi - a] if dl else torch.sub(x[lo - a : hi - a], b[lo - s : hi - s])
    return d if d is not None else torch.zeros_like(b)


def _tiled_l1_rows(eparts, which, base_t, n: int, row_numel: int, offset: int, spec, shape):
    """Per expert index in ``which``: the float64 L1 sums of each row of its task vector over
    the chunk and of what its sparsifier keeps (:func:`mergepipe.methods.kernels.l1_row_sums`),
    computed a few whole rows at a time (about ``TILE_ELEMS`` elements), so the rescale needs no
    float32 copy of the chunk."""
    step = max(1, TILE_ELEMS // row_numel) * row_numel
    out: dict[int, tuple[list[float], list[float]]] = {i: ([], []) for i in which}
    for s in range(0, n, step):
        e = min(n, s + step)
        b = base_t[s:e].float()
        for i in which:
            ep, runs = eparts[i]
            d = _tile_delta(runs, b, s, e)
            out[i][0].extend(l1_row_sums(d, row_numel))
            out[i][1].extend(l1_row_sums(sparsify(d, spec, ep, offset + s, shape), row_numel))
    return out


def _merge_chunk_tiled(it, base_raw, exp, plan, spec, dev, groups=None, l1_all=None, l1_kept=None):
    """Elementwise merge of one row chunk, ``TILE_ELEMS`` elements at a time (see
    :func:`_elementwise`). Inputs stay in their storage dtype until a tile is widened to
    float32, so the chunk holds its raw bytes, the output and one tile's temporaries instead of
    K + 1 float32 copies of the chunk. Same arithmetic per element as :func:`_merge_chunk`
    (every operation is elementwise), hence the same bytes. With an L1 rescale, a first sweep
    over the chunk (whole rows at a time) gathers its row sums — added to the tensor's pre-pass
    sums for a ``stats`` item (which returns None there) or a ``fused`` one — and the factor
    (from the whole tensor's sums, or this chunk's when it is the whole tensor) scales each
    tile's kept entries as :func:`_merge_chunk` scales the chunk's. Returns the output bytes (a
    ``memoryview`` of the encoded tensor)."""
    import torch

    tp = it.tp
    n = memoryview(base_raw).nbytes // DTYPES[tp.dtype][0]
    row_numel = row_numel_of(tp.shape)
    offset = it.r0 * row_numel
    base_t = _raw_tensor(base_raw, tp.dtype).to(dev)
    eparts = []  # per expert: (params, [(elem0, elem1, raw view)])
    for te, parts in zip(tp.experts, exp):
        # (elem0, elem1, values, is_delta): a LoRA run holds its task vector itself (float32)
        runs = [
            (
                (a - it.r0) * row_numel,
                (z - it.r0) * row_numel,
                torch.from_numpy(_lora_delta(te, buf, z - a)).to(dev)
                if te.lora is not None
                else buf
                if isinstance(buf, SketchRun)
                else _raw_tensor(buf, tp.dtype).to(dev),
                te.lora is not None,
            )
            for (a, z), buf in parts
            if z > a
        ]

        def values_of(slot, key, runs=runs):
            """This chunk's threshold key group values, a tile at a time."""
            vals = []
            for a, z, x, dl in runs:
                for s in range(a, z, TILE_ELEMS):
                    e = min(z, s + TILE_ELEMS)
                    if isinstance(x, SketchRun):
                        dd = x.delta(s - a, e - a, base_t[s:e].float())
                    else:
                        dd = x[s - a : e - a] if dl else torch.sub(x[s - a : e - a], base_t[s:e].float())
                    vals.append(_group_values(dd, key))
            return _concat(vals)

        if _bounds(te) and tp.derived.get("threshold_pass") and it.fused == "threshold":
            for slot, key, _rank in _bounds(te):  # the pre-pass skipped this chunk: add its group values
                groups.setdefault((tp.name, te.expert, slot), []).append(values_of(slot, key))
        eparts.append((_expert_params(tp, te, groups, values_of), runs))
    factors = _tiled_factors(it, eparts, base_t, spec, l1_all, l1_kept)
    if it.kind == "stats":
        return None
    out = torch.empty(n, dtype=_torch_dtype(tp.out_dtype or tp.dtype), device=dev)
    ws = [ep.weight for ep, _ in eparts]
    for s in range(0, n, TILE_ELEMS):
        e = min(n, s + TILE_ELEMS)
        b = base_t[s:e].float()  # (F32: a read-only view; nothing below writes into the base)
        deltas = []
        for (ep, runs), f in zip(eparts, factors):
            kept = sparsify(_tile_delta(runs, b, s, e), spec, ep, offset + s, tp.shape)
            deltas.append(kept * f if f != 1.0 else kept)
        out[s:e].copy_(combine(b, deltas, ws, spec, tp.params, weight_sum=tp.weight_sum, consume=True))
    return memoryview(out.cpu().view(torch.uint8).numpy()) if n else b""


def _tiled_factors(it, eparts, base_t, spec, l1_all, l1_kept) -> list[float]:
    """The L1 rescale factor of each expert of a tiled chunk (1.0 without a rescale): its row
    sums gathered a few rows at a time (added to the tensor's pre-pass sums for a ``stats`` item
    or a ``fused`` one), the factor from the whole tensor's sums when the tensor has an L1
    pre-pass, else from this chunk's (then the whole tensor)."""
    tp = it.tp
    row_numel = row_numel_of(tp.shape)
    n = base_t.numel()
    factors = [1.0] * len(eparts)
    rescale = spec.rescales(tp.params)
    which = [i for i, (ep, _) in enumerate(eparts) if rescale and ep.density < 1.0]
    if not which:
        return factors
    sums = _tiled_l1_rows(eparts, which, base_t, n, row_numel, it.r0 * row_numel, spec, tp.shape)
    two_pass = tp.passes - (1 if tp.derived.get("threshold_pass") else 0) == 2  # an L1 pre-pass
    for i in which:
        key = (tp.name, tp.experts[i].expert)
        if it.kind == "stats" or it.fused == "stats":  # (fused: the pre-pass skipped this chunk)
            l1_all.setdefault(key, []).extend(sums[i][0])
            l1_kept.setdefault(key, []).extend(sums[i][1])
        if two_pass:
            factors[i] = rescale_factor(math.fsum(l1_all[key]), math.fsum(l1_kept[key]))
        else:  # the whole tensor is this chunk
            factors[i] = rescale_factor(math.fsum(sums[i][0]), math.fsum(sums[i][1]))
    return factors


@dataclass
class L1Sums:
    """Per (tensor, expert index): L1 norms of each row of the task vector (``all``) and of
    what sparsification kept (``kept``), gathered by a two-pass tensor's ``stats`` items (and its
    first ``merge`` item, :attr:`WorkItem.fused`) for the rescale factor of its ``merge`` items
    (DARE/DELLA rescale over the whole tensor)."""

    all: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    kept: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    #: per (tensor, expert index, slot): float32 ``|δ|`` of a threshold key group (exact float16/
    #: float32 TIES and breadcrumbs; slot 1: breadcrumbs' outlier bound), gathered by
    #: ``threshold`` pre-pass items (and the first ``merge`` item when that pre-pass is the last)
    groups: dict[tuple[str, int], list] = field(default_factory=dict)


def merge_chunk(it: WorkItem, inputs: ChunkInputs, plan: Plan, spec, dev, l1: L1Sums):
    """Merge one work item (kinds ``merge``, ``stats``, ``threshold`` or ``convert``).

    Args:
        it: the item (rows ``[it.r0, it.r1)`` of ``it.tp``).
        inputs: its fetched bytes.
        spec: the plan's :class:`~mergepipe.methods.registry.MethodSpec`.
        dev: the torch device of the arithmetic.
        l1: the L1 sums of two-pass tensors (filled by ``stats`` items, read by ``merge`` items).

    Returns:
        The output bytes of the rows (``bytes`` or a ``memoryview``) in ``tp.out_dtype or
        tp.dtype``; None for ``stats`` and ``threshold`` items.
    """
    return _merge_chunk(it, inputs.base, inputs.experts, plan, spec, dev, l1.all, l1.kept, l1.groups)


def _merge_chunk(it, base_raw, exp, plan, spec, dev, l1_all, l1_kept, groups=None):
    """Merge one row chunk; for ``stats`` items only accumulate L1 sums and return None. Uses
    only the plan's per-tensor parameters (``tp.params``, ``TensorExpert`` fields, ``tp.derived``)."""
    import torch

    tp = it.tp
    if it.kind in ("merge", "stats") and _elementwise(tp, spec) and len(base_raw):
        return _merge_chunk_tiled(it, base_raw, exp, plan, spec, dev, groups, l1_all, l1_kept)
    b = torch.from_numpy(decode(base_raw, tp.dtype)).to(dev)
    if b.dtype != torch.float32:
        b = b.float()
    out_dtype = tp.out_dtype or tp.dtype
    if it.kind == "convert":
        return _encode(b, out_dtype)
    present = _chunk_deltas(it, b, exp, dev, spec.needs_expert_values)
    if not spec.combines_task_vectors:
        return _encode(spec.merge_chunk(b, present, tp, len(plan.experts)), out_dtype)
    out = _task_vector_chunk(it, b, present, spec, l1_all, l1_kept, groups)
    return None if out is None else _encode(out, out_dtype)


def _chunk_deltas(it, b, exp, dev, keep_values: bool) -> dict:
    """expert index -> ``(TensorExpert, δ, θ)`` of the chunk: float32 task vector (zeros on
    unread rows) and, with ``keep_values``, the expert's values (the base on unread rows)."""
    import torch

    tp = it.tp
    row_numel = row_numel_of(tp.shape)
    present = {}
    for te, parts in zip(tp.experts, exp):
        d = torch.zeros_like(b)
        xf = b.clone() if keep_values else None
        for (a, z), buf in parts:
            sl = slice((a - it.r0) * row_numel, (z - it.r0) * row_numel)
            if te.lora is not None:  # δ = s·B·A from the factors; θ_e = θ_b + δ
                d[sl] = torch.from_numpy(_lora_delta(te, buf, z - a)).to(dev)
                if xf is not None:
                    xf[sl] = b[sl] + d[sl]
                continue
            if isinstance(buf, SketchRun):  # base + δ̂_k (float32), as the numpy decoder gave it
                x = buf.values(0, (z - a) * row_numel, b[sl])
            else:
                x = torch.from_numpy(decode(buf, tp.dtype)).to(dev).float()
            d[sl] = x - b[sl]
            if xf is not None:
                xf[sl] = x
        present[te.expert] = (te, d, xf)
    return present


def _task_vector_chunk(it, b, present: dict, spec, l1_all, l1_kept, groups):
    """The task-arithmetic family's chunk (whole-chunk path): threshold groups for a
    ``threshold`` item, then per expert sparsify -> L1 rescale (with the tensor's pre-pass sums
    when it has one) -> :func:`~mergepipe.methods.kernels.combine`. float32 output, or None for
    ``stats`` and ``threshold`` items."""
    tp = it.tp
    row_numel = row_numel_of(tp.shape)
    offset = it.r0 * row_numel
    if it.kind == "threshold" or it.fused == "threshold":  # (fused: the pre-pass skipped this chunk)
        for te, d, _ in present.values():
            for slot, key, _rank in _bounds(te):
                groups.setdefault((tp.name, te.expert, slot), []).append(_group_values(d, key))
        if it.kind == "threshold":
            return None
    rescale = spec.rescales(tp.params)
    deltas, ws = [], []
    for te, d, _ in present.values():
        ep = _expert_params(tp, te, groups, lambda slot, key, d=d: _group_values(d, key))
        kept = sparsify(d, spec, ep, offset, tp.shape)
        key = (tp.name, te.expert)
        if rescale and ep.density < 1.0:
            if it.kind == "stats" or it.fused == "stats":  # (fused: the pre-pass skipped this chunk)
                l1_all.setdefault(key, []).extend(l1_row_sums(d, row_numel))
                l1_kept.setdefault(key, []).extend(l1_row_sums(kept, row_numel))
                if it.kind == "stats":
                    continue
            if tp.passes - (1 if tp.derived.get("threshold_pass") else 0) == 2:  # an L1 pre-pass
                f = rescale_factor(math.fsum(l1_all[key]), math.fsum(l1_kept[key]))
            else:
                f = rescale_factor(l1_rows(d, row_numel), l1_rows(kept, row_numel))
            if f != 1.0:
                kept = kept * f
        deltas.append(kept)
        ws.append(ep.weight)
    if it.kind == "stats":
        return None
    return combine(b, deltas, ws, spec, tp.params, weight_sum=tp.weight_sum)
