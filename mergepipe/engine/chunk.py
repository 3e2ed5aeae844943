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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from mergepipe.engine.reader import ChunkInputs, ExpertRun, LoraBytes
from mergepipe.engine.sketchkernel import SketchRun
from mergepipe.engine.worklist import WorkItem
from mergepipe.formats.safetensors import DTYPES
from mergepipe.methods.kernels import (
    ExpertTensorParams,
    combine,
    elementwise_merge,
    l1_row_sums,
    l1_rows,
    magnitude_shrink_lambda,
    rescale_factor,
    row_numel_of,
    sparsify,
)
from mergepipe.numerics import GROUP_BINS, decode, exact_shrink_hist, key_group_bits
from mergepipe.planner.plan import LoraFactors, Plan, TensorExpert, TensorPlan

if TYPE_CHECKING:
    import torch

    from mergepipe.engine.reader import Buffer
    from mergepipe.methods.base import MethodSpec

#: a run of the tiled path: ``(elem0, elem1, values, is_delta)`` (see :func:`_merge_chunk_tiled`)
Run = tuple[int, int, "torch.Tensor | SketchRun", bool]
#: the int64 bit histogram of a threshold key group: ``hist_of(slot, key)``
HistOf = Callable[[int, int], np.ndarray]
#: :attr:`L1Sums.groups`
Groups = dict[tuple[Any, ...], Any]
#: :attr:`L1Sums.all` / :attr:`L1Sums.kept`
L1Map = dict[tuple[str, int], list[float]]


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[name][1])


def _encode(t: torch.Tensor, dtype: str) -> bytes:
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


def _elementwise(tp: TensorPlan, spec: MethodSpec) -> bool:
    """The merge of this tensor runs tile by tile (:func:`mergepipe.methods.kernels.elementwise_merge`)."""
    return elementwise_merge(spec, tp.dtype)


def _lora_delta(lf: LoraFactors, buf: LoraBytes, rows: int) -> np.ndarray:
    """float32 numpy ``δ = scale·B·A`` (flat) of ``rows`` rows of a LoRA expert from its
    :class:`~mergepipe.engine.reader.LoraBytes` (the catalog's arithmetic, bit for bit)."""
    from mergepipe.lora import delta_from_bytes

    return delta_from_bytes(lf.a_dtype, buf.a, lf.b_dtype, buf.b, lf.rank, lf.scale).reshape(-1)


def _raw_tensor(raw: Buffer, dtype: str) -> torch.Tensor:
    """Zero-copy torch view of little-endian safetensors bytes (BF16, F16, F32)."""
    import torch

    with warnings.catch_warnings():  # read-only buffers: the view is only read
        warnings.simplefilter("ignore")
        return torch.frombuffer(raw, dtype=_torch_dtype(dtype))


class _GroupHist:
    """Accumulates the exact-threshold histogram of one key group (:func:`mergepipe.numerics.
    exact_shrink_hist`) from float32 task-vector tiles: each tile's ``|δ|`` bit patterns, offset
    by the group's first pattern and clamped to one bin below and one above the group, are
    counted with ``torch.bincount`` (on the tile's device) into a running ``GROUP_BINS + 2``
    histogram whose two end bins (entries outside the group) are dropped. A select of the
    entries in the group would cost a boolean mask and a gather per tile; the clamp keeps
    every pass a plain elementwise one."""

    def __init__(self, tau: int) -> None:
        self.lo, n = key_group_bits(tau)
        self.hist = np.zeros(n, dtype=np.int64)
        self._acc: torch.Tensor | None = None

    def add_dense(self, d: torch.Tensor) -> None:
        """Count the entries of ``d`` (float32 torch, any device) whose ``|δ|`` is in the group."""
        import torch

        n = len(self.hist)
        # |δ| bits − lo: no int32 overflow (|δ| clears the sign bit, lo >= 0); clamped to [-1, n]
        off = d.abs().view(torch.int32).sub_(self.lo).clamp_(-1, n).add_(1).to(torch.int64)
        counts = torch.bincount(off, minlength=n + 2)
        self._acc = counts if self._acc is None else self._acc.add_(counts)

    def add_run(self, run: SketchRun, dev: torch.device) -> None:
        """Count a sketched run's entries: a sign-plane run from its rows' value tables (no
        decode); a rank-1 run (its entries are not a table's) decoded and counted by the fused
        CPU kernel (:func:`mergepipe.methods.kernels_cpu.rank1_hist`) on a CPU device, else
        decoded a tile of rows at a time."""
        if run.factors is None:
            run.add_group_hist(self.hist, self.lo, dev)
            return
        from mergepipe.methods import kernels_cpu

        if dev.type == "cpu" and kernels_cpu.available():  # decoded and counted in one pass, nothing written
            codes, table, u, v = run.host_arrays(dev, None, 1.0)
            assert u is not None and v is not None
            kernels_cpu.rank1_hist(self.hist, codes, table, u, v, run.rows_per_block, run.rows, run.row_numel, self.lo)
            return
        step = max(1, TILE_ELEMS // run.row_numel)
        for r0 in range(0, run.rows, step):
            self.add_dense(run.delta_rows(r0, min(run.rows, r0 + step), dev).view(-1))

    def done(self) -> np.ndarray:
        """The int64 histogram (bin ``i``: bit pattern ``lo + i``)."""
        if self._acc is not None:
            self.hist += self._acc[1:-1].cpu().numpy()
            self._acc = None
        return self.hist


def _dense_group_hist(d: torch.Tensor, tau: int) -> np.ndarray:
    """int64 bit histogram of the entries of ``d`` (float32 torch) whose magnitude key is ``tau``."""
    g = _GroupHist(tau)
    g.add_dense(d)
    return g.done()


def _dense_hist_of(d: torch.Tensor) -> HistOf:
    """``hist_of(slot, key)`` over the whole-chunk task vector ``d`` (:func:`_dense_group_hist`)."""
    return lambda slot, key: _dense_group_hist(d, key)


def _bounds(te: TensorExpert) -> list[tuple[int, int, int]]:
    """The threshold key groups of ``te`` to refine: ``(slot, key, rank)`` for the lower end
    (TIES's threshold, breadcrumbs' window start; slot 0) and breadcrumbs' outlier bound (slot 1).
    (A key outside ``[1, 0x7F7F]`` has no bounded group: the key rule applies there.)"""
    out: list[tuple[int, int, int]] = []
    if te.exact_rank and 1 <= te.min_key < 0x7F80:
        out.append((0, te.min_key, te.exact_rank))
    if te.exact_rank_hi and 1 <= te.max_key - 1 < 0x7F80:
        out.append((1, te.max_key - 1, te.exact_rank_hi))
    return out


def _shrinks(hist_of: HistOf, te: TensorExpert) -> tuple[float | None, float | None]:
    """(shrink, shrink_hi) of ``te`` from ``hist_of(slot, key)`` (the int64 bit histogram of the
    key group's ``|δ|``, :func:`mergepipe.numerics.exact_shrink_hist`)."""
    lo = hi = None
    for slot, key, rank in _bounds(te):
        bits = key_group_bits(key)[0]
        if slot == 0:
            lo = exact_shrink_hist(hist_of(slot, key), bits, rank)
        else:
            hi = exact_shrink_hist(hist_of(slot, key), bits, rank, all_below=True)
    return lo, hi


def _shrinks_from(groups: Groups, tp: TensorPlan, te: TensorExpert) -> tuple[float | None, float | None]:
    """The exact thresholds of ``te`` in ``tp`` from the histograms its ``threshold`` pre-pass
    gathered; computed once per tensor (cached in ``groups`` under ``(name, expert, "shrinks")``,
    the histograms then dropped)."""
    key = (tp.name, te.expert, "shrinks")
    got = groups.get(key)
    if got is None:
        got = groups[key] = _shrinks(
            lambda slot, k: groups.get((tp.name, te.expert, slot), np.zeros(GROUP_BINS, dtype=np.int64)), te
        )
        for slot, _k, _r in _bounds(te):
            groups.pop((tp.name, te.expert, slot), None)
    return got


def _add_group(groups: Groups, tp: TensorPlan, te: TensorExpert, slot: int, hist: np.ndarray) -> None:
    key = (tp.name, te.expert, slot)
    if key in groups:
        groups[key] += hist
    else:
        groups[key] = hist


def _trim_lambda(spec: MethodSpec, ep: ExpertTensorParams) -> float | None:
    """The ``λ`` of the magnitude trim ``hardshrink(δ, λ)`` that :func:`sparsify` applies to this
    expert's task vector, or None when it applies something else (or nothing)."""
    if spec.sparsify != "magnitude" or ep.density >= 1.0:
        return None
    if ep.shrink is not None:
        return ep.shrink
    return magnitude_shrink_lambda(ep.min_key) if ep.min_key > 0 else None


def _expert_params(tp: TensorPlan, te: TensorExpert, groups: Groups, hist_of: HistOf) -> ExpertTensorParams:
    """The sparsification parameters of expert ``te`` (a ``TensorExpert`` of tensor ``tp``) for
    one chunk: the plan's weight, density and key range, plus the exact-threshold shrinks when
    ``te`` has threshold key groups (:func:`_bounds`) -- from the histograms the tensor's
    ``threshold`` pre-pass gathered in ``groups`` (``tp.derived["threshold_pass"]``), otherwise
    from ``hist_of(slot, key)`` over this chunk, which is then the whole tensor."""
    shrink = shrink_hi = None
    if _bounds(te):
        shrink, shrink_hi = _shrinks_from(groups, tp, te) if tp.derived.get("threshold_pass") else _shrinks(hist_of, te)
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


def _tile_delta_or_zero(
    runs: list[Run], b: torch.Tensor, s: int, e: int, shrink: float | None = None
) -> tuple[torch.Tensor | None, bool]:
    """:func:`_tile_delta`, or ``(None, True)`` when the expert's task vector over ``[s, e)`` is
    known to be exactly zero without computing it: no run overlaps the tile, or every run that
    does is a sign-plane sketch whose overlapping rows' trimmed value tables are all zero
    (:meth:`~mergepipe.engine.sketchkernel.SketchRun.zero_rows`). The merge then leaves the
    expert out of the tile: a zero task vector adds nothing to a task-arithmetic combine (see
    :func:`_merge_chunk_tiled`)."""
    if _tile_zero(runs, s, e, b.device, shrink):
        return None, True
    return _tile_delta(runs, b, s, e, shrink)


def _tile_zero(runs: list[Run], s: int, e: int, dev: torch.device, shrink: float | None) -> bool:
    """The expert's (trimmed) task vector over ``[s, e)`` is known to be exactly zero without
    computing it (see :func:`_tile_delta_or_zero`)."""
    for a, z, x, _dl in runs:
        lo, hi = max(a, s), min(z, e)
        if hi <= lo:
            continue
        if not isinstance(x, SketchRun):
            return False
        rn = x.row_numel
        if not x.zero_rows((lo - a) // rn, -(-(hi - a) // rn), dev, shrink):
            return False
    return True


def _tile_delta(
    runs: list[Run], b: torch.Tensor, s: int, e: int, shrink: float | None = None
) -> tuple[torch.Tensor, bool]:
    """float32 task vector of one expert over the chunk's elements ``[s, e)`` (zeros where it
    has no run); ``b`` is the base's ``[s, e)`` in float32. Runs are ``(elem0, elem1, values,
    is_delta)`` (see :func:`_merge_chunk_tiled`); a sketched run's ``values`` is its
    :class:`~mergepipe.engine.sketchkernel.SketchRun`, decoded here for the tile's rows only.

    Returns ``(δ, trimmed)``: with ``shrink`` (the ``λ`` of the expert's magnitude trim), the
    sketched pieces come trimmed from their value tables, and ``trimmed`` says the whole tile
    did (no exact run in it), so the caller skips the trim (``hardshrink`` is idempotent:
    trimming again would give the same values)."""
    import torch

    d = None
    trimmed = shrink is not None
    for a, z, x, dl in runs:
        lo, hi = max(a, s), min(z, e)
        if hi <= lo:
            continue
        if isinstance(x, SketchRun):
            piece = x.delta(lo - a, hi - a, b[lo - s : hi - s], shrink)
            if lo == s and hi == e:
                return piece, trimmed
            if d is None:
                d = torch.zeros_like(b)
            d[lo - s : hi - s] = piece
            continue
        trimmed = False
        if lo == s and hi == e:
            # widened exactly to float32, then subtracted (a LoRA run: δ itself, copied since
            # sparsify may write into it)
            return (x[lo - a : hi - a].clone() if dl else torch.sub(x[lo - a : hi - a], b)), False
        if d is None:
            d = torch.zeros_like(b)
        d[lo - s : hi - s] = x[lo - a : hi - a] if dl else torch.sub(x[lo - a : hi - a], b[lo - s : hi - s])
    return (d if d is not None else torch.zeros_like(b)), trimmed


def _tiled_l1_rows(
    eparts: list[tuple[ExpertTensorParams, list[Run]]],
    which: list[int],
    base_t: torch.Tensor,
    n: int,
    row_numel: int,
    offset: int,
    spec: MethodSpec,
    shape: list[int],
) -> dict[int, tuple[list[float], list[float]]]:
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
            d, _ = _tile_delta(runs, b, s, e)
            out[i][0].extend(l1_row_sums(d, row_numel))
            out[i][1].extend(l1_row_sums(sparsify(d, spec, ep, offset + s, shape), row_numel))
    return out


def _merge_chunk_tiled(
    it: WorkItem,
    base_raw: Buffer,
    exp: list[list[ExpertRun]],
    plan: Plan,
    spec: MethodSpec,
    dev: torch.device,
    groups: Groups,
    l1_all: L1Map,
    l1_kept: L1Map,
) -> memoryview | bytes | None:
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
    tp = it.tp
    row_numel = row_numel_of(tp.shape)
    base_t = _raw_tensor(base_raw, tp.dtype).to(dev)
    eparts = []  # per expert: (params, [(elem0, elem1, values, is_delta)])
    for te, parts in zip(tp.experts, exp):
        runs = _expert_runs(it, te, parts, row_numel, dev)
        hist_of = _chunk_hist_of(runs, base_t, dev)
        if it.kind == "threshold" or (tp.derived.get("threshold_pass") and it.fused == "threshold"):
            for slot, key, _rank in _bounds(te):  # (fused: the pre-pass skipped this chunk: add its groups)
                _add_group(groups, tp, te, slot, hist_of(slot, key))
            if it.kind == "threshold":
                continue
        eparts.append((_expert_params(tp, te, groups, hist_of), runs))
    if it.kind == "threshold":
        return None
    factors = _tiled_factors(it, eparts, base_t, spec, l1_all, l1_kept)
    if it.kind == "stats":
        return None
    return _tiled_output(it, eparts, factors, base_t, spec, dev)


def _expert_runs(
    it: WorkItem, te: TensorExpert, parts: list[ExpertRun], row_numel: int, dev: torch.device
) -> list[Run]:
    """One expert's runs in a chunk as ``(elem0, elem1, values, is_delta)``, elements relative to
    the chunk's first: a LoRA run holds its float32 task vector (``is_delta``), a sketched run its
    :class:`~mergepipe.engine.sketchkernel.SketchRun`, an exact run its raw values in the
    tensor's dtype on ``dev`` (a view of the fetched bytes on CPU: no copy)."""
    import torch

    dtype = it.tp.dtype
    return [
        (
            (a - it.r0) * row_numel,
            (z - it.r0) * row_numel,
            torch.from_numpy(_lora_delta(te.lora, cast(LoraBytes, buf), z - a)).to(dev)
            if te.lora is not None
            else buf
            if isinstance(buf, SketchRun)
            else _raw_tensor(cast("Buffer", buf), dtype).to(dev),
            te.lora is not None,
        )
        for (a, z), buf in parts
        if z > a
    ]


def _chunk_hist_of(runs: list[Run], base_t: torch.Tensor, dev: torch.device) -> HistOf:
    """``hist_of(slot, key)`` of one expert's runs in a chunk: the chunk's bit histogram of a
    threshold key group, a tile at a time (a sketched run from its value tables, without
    decoding)."""
    import torch

    def hist_of(slot: int, key: int) -> np.ndarray:
        g = _GroupHist(key)
        for a, z, x, dl in runs:
            if isinstance(x, SketchRun):
                g.add_run(x, dev)
                continue
            for s in range(a, z, TILE_ELEMS):
                e = min(z, s + TILE_ELEMS)
                g.add_dense(x[s - a : e - a] if dl else torch.sub(x[s - a : e - a], base_t[s:e].float()))
        return g.done()

    return hist_of


def _tiled_output(
    it: WorkItem,
    eparts: list[tuple[ExpertTensorParams, list[Run]]],
    factors: list[float],
    base_t: torch.Tensor,
    spec: MethodSpec,
    dev: torch.device,
) -> memoryview | bytes:
    """The merged chunk, ``TILE_ELEMS`` elements at a time: each expert's tile of task vector
    (trimmed or sparsified, times its rescale factor), combined with the base's tile into the
    output tensor in the output dtype. Returns a ``memoryview`` of its bytes (``b""`` when
    empty)."""
    import torch

    tp = it.tp
    n = base_t.numel()
    offset = it.r0 * row_numel_of(tp.shape)
    out = torch.empty(n, dtype=_torch_dtype(tp.out_dtype or tp.dtype), device=dev)
    trims = [_trim_lambda(spec, ep) for ep, _ in eparts]
    droppable = spec.zero_delta_droppable(tp.params)
    kc = _fused_kernels(spec, dev)
    if kc is not None:
        _fused_output(kc, out, eparts, factors, trims, base_t, spec, tp, offset, droppable)
        return out.view(torch.uint8).numpy().data if n else b""
    for s in range(0, n, TILE_ELEMS):
        e = min(n, s + TILE_ELEMS)
        b = base_t[s:e].float()  # (F32: a read-only view; nothing below writes into the base)
        # an expert whose task vector is exactly zero on the tile is left out of it: its terms in
        # the sign election, the sum and the divisor are zeros, which change no value of the
        # merge (a zero added to a sum leaves it, up to the sign of a zero result, and a zero
        # merged delta takes the base bit for bit: kernels._sum_consensus_arith)
        deltas, ws = [], []
        for (ep, runs), f, lam in zip(eparts, factors, trims):
            d, trimmed = _tile_delta_or_zero(runs, b, s, e, lam) if droppable else _tile_delta(runs, b, s, e, lam)
            if d is None:
                continue
            kept = d if trimmed else sparsify(d, spec, ep, offset + s, tp.shape)
            deltas.append(kept * f if f != 1.0 else kept)
            ws.append(ep.weight)
        out[s:e].copy_(combine(b, deltas, ws, spec, tp.params, weight_sum=tp.weight_sum, consume=True))
    return out.cpu().view(torch.uint8).numpy().data if n else b""


def _fused_kernels(spec: MethodSpec, dev: torch.device) -> Any:
    """The fused CPU kernels (:mod:`mergepipe.methods.kernels_cpu`) when they merge this tensor's
    tiles: a method combining with :func:`~mergepipe.methods.kernels.task_arithmetic_combine` (TIES-style
    ``consensus: sum`` or none; not ``linear``, which has its own) on a CPU device, the
    kernels compiled (and ``MERGEPIPE_KERNELS`` not ``torch``); else None (the torch path, the
    one a CUDA device runs)."""
    from mergepipe.methods import kernels_cpu
    from mergepipe.methods.gta import TaskArithmeticMethod

    if (
        dev.type != "cpu"
        or type(spec).combine is not TaskArithmeticMethod.combine  # (linear: its own combine)
        or spec.consensus not in ("sum", None)
    ):
        return None
    return kernels_cpu if kernels_cpu.available() else None


def _fused_output(
    kc: Any,
    out: torch.Tensor,
    eparts: list[tuple[ExpertTensorParams, list[Run]]],
    factors: list[float],
    trims: list[float | None],
    base_t: torch.Tensor,
    spec: MethodSpec,
    tp: TensorPlan,
    offset: int,
    droppable: bool,
) -> None:
    """:func:`_tiled_output`'s tiles with the fused CPU kernels: per tile, each expert's trimmed
    and scaled task vector is written into one preallocated float32 ``(K, TILE_ELEMS)`` buffer
    (:func:`_fill_fused`: a sketched piece straight from its codes and value table, an exact one
    widened, subtracted and trimmed), then one call of ``combine_sum`` / ``combine_plain``
    (:mod:`mergepipe.methods.kernels_cpu`) elects the signs and takes the mean over the buffer.
    The same float32 operations in the same order as the torch path, hence the same bytes; a
    tile the kernels do not take (a non-finite election sum, a non-positive weight under
    ``normalize``) is combined by the torch path from the same buffer. ``kc``: the kernels
    module :func:`_fused_kernels` returned; ``out``: the chunk's output tensor (the output
    dtype, CPU)."""
    import torch

    n = base_t.numel()
    dbuf = torch.empty((max(1, len(eparts)), min(n, TILE_ELEMS)), dtype=torch.float32)
    dn = dbuf.numpy()
    obuf = torch.empty(dbuf.shape[1], dtype=torch.float32)
    normalize = bool(tp.params.get("normalize", False))
    lam = float(tp.params.get("lambda", 1.0))
    wsum = tp.weight_sum
    for s in range(0, n, TILE_ELEMS):
        e = min(n, s + TILE_ELEMS)
        b = base_t[s:e].float()
        ws: list[float] = []
        for (ep, runs), f, trim in zip(eparts, factors, trims):
            if droppable and _tile_zero(runs, s, e, b.device, trim):
                continue
            _fill_fused(kc, dbuf[len(ws), : e - s], runs, b, s, e, trim, f, ep, spec, offset, tp.shape)
            ws.append(ep.weight)
        if not ws:  # (the torch combine returns the base)
            out[s:e].copy_(b)
            continue
        on, bn, m = obuf.numpy()[: e - s], b.numpy(), len(ws)
        if spec.consensus == "sum":
            ok = (not normalize or all(np.float32(w) > 0 for w in ws)) and kc.combine_sum(
                on, bn, dn, m, e - s, ws, normalize, lam
            )
        else:
            total = sum(ws) if wsum is None else wsum
            kc.combine_plain(
                on, bn, dn, m, e - s, ws, (total if abs(total) >= 1e-8 else 1.0) if normalize else None, lam
            )
            ok = True
        if ok:
            out[s:e].copy_(obuf[: e - s])
        else:
            deltas = [dbuf[i, : e - s] for i in range(m)]
            out[s:e].copy_(combine(b, deltas, ws, spec, tp.params, weight_sum=wsum, consume=True))


def _fill_fused(
    kc: Any,
    dt: torch.Tensor,
    runs: list[Run],
    b: torch.Tensor,
    s: int,
    e: int,
    trim: float | None,
    f: float,
    ep: ExpertTensorParams,
    spec: MethodSpec,
    offset: int,
    shape: list[int],
) -> None:
    """Write one expert's task vector over the chunk's elements ``[s, e)``, sparsified and times
    its rescale factor ``f``, into ``dt`` (float32 ``(e − s,)``, CPU, contiguous): the value
    :func:`_tiled_output` appends to its ``deltas``. With a magnitude trim (``trim``, the ``λ`` of
    ``hardshrink``) or no sparsification, piece by piece (the trim and the factor are
    elementwise): a sign-plane run from its trimmed, scaled value table (``gather_rows``), a
    rank-1 run decoded, trimmed and scaled in one pass (``rank1_rows``), an exact bf16 run
    widened, subtracted, trimmed and scaled in one pass (``exact_bf16``), a float16/float32 or
    LoRA run widened/subtracted by torch into ``dt`` and trimmed in place (``trim_scale``); entries no run
    covers are zeros. Other sparsifiers (DARE's random drop, breadcrumbs' window) run the torch
    path on the assembled tile."""
    import torch

    if trim is None and ep.density < 1.0 and spec.sparsify != "none":
        d, _ = _tile_delta(runs, b, s, e)
        kept = sparsify(d, spec, ep, offset + s, shape)
        if f != 1.0:
            torch.mul(kept, f, out=dt)
        else:
            dt.copy_(kept)
        return
    dn = dt.numpy()
    pieces = [(a, max(a, s), min(z, e), x, dl) for a, z, x, dl in runs if min(z, e) > max(a, s)]
    if sum(hi - lo for _a, lo, hi, _x, _dl in pieces) < e - s:
        dn.fill(0.0)
    for a, lo, hi, x, dl in pieces:
        seg = dn[lo - s : hi - s]
        if isinstance(x, SketchRun):
            codes, table, u, v = x.host_arrays(b.device, trim, f)
            if u is None:
                kc.gather_rows(seg, codes, table, lo - a, hi - a, x.row_numel)
            else:
                kc.rank1_rows(seg, codes, table, u, v, x.rows_per_block, lo - a, hi - a, x.row_numel, trim, f)
            continue
        if not dl and x.dtype == torch.bfloat16:  # widened, subtracted, trimmed, scaled in one pass
            kc.exact_bf16(seg, x[lo - a : hi - a].view(torch.int16).numpy(), b.numpy()[lo - s : hi - s], trim, f)
            continue
        if dl:
            dt[lo - s : hi - s].copy_(x[lo - a : hi - a])
        else:
            torch.sub(x[lo - a : hi - a], b[lo - s : hi - s], out=dt[lo - s : hi - s])
        if trim is not None or f != 1.0:
            kc.trim_scale(seg, trim, f)


def _tiled_factors(
    it: WorkItem,
    eparts: list[tuple[ExpertTensorParams, list[Run]]],
    base_t: torch.Tensor,
    spec: MethodSpec,
    l1_all: L1Map,
    l1_kept: L1Map,
) -> list[float]:
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

    all: L1Map = field(default_factory=dict)
    kept: L1Map = field(default_factory=dict)
    #: per (tensor, expert index, slot): the int64 bit histogram of ``|δ|`` in a threshold key group
    #: (exact bf16/float16/float32 TIES and breadcrumbs; slot 1: breadcrumbs' outlier bound,
    #: :func:`mergepipe.numerics.exact_shrink_hist`), gathered by ``threshold`` pre-pass items (and
    #: the first ``merge`` item when that pre-pass is the last); then, under ``(tensor, expert
    #: index, "shrinks")``, the thresholds computed from them (the histograms are dropped)
    groups: Groups = field(default_factory=dict)


def merge_chunk(
    it: WorkItem, inputs: ChunkInputs, plan: Plan, spec: MethodSpec, dev: torch.device, l1: L1Sums
) -> bytes | memoryview | None:
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
    exp = cast("list[list[ExpertRun]]", inputs.experts)  # (None only for copies, which are not merged)
    out = _merge_chunk(it, inputs.base, exp, plan, spec, dev, l1.all, l1.kept, l1.groups)
    if it.ends_tensor and l1.groups:  # the tensor's thresholds are spent
        for key in [k for k in l1.groups if k[0] == it.tp.name]:
            del l1.groups[key]
    return out


def _merge_chunk(
    it: WorkItem,
    base_raw: Buffer,
    exp: list[list[ExpertRun]],
    plan: Plan,
    spec: MethodSpec,
    dev: torch.device,
    l1_all: L1Map,
    l1_kept: L1Map,
    groups: Groups,
) -> bytes | memoryview | None:
    """Merge one row chunk; for ``stats`` items only accumulate L1 sums and return None. Uses
    only the plan's per-tensor parameters (``tp.params``, ``TensorExpert`` fields, ``tp.derived``)."""
    import torch

    tp = it.tp
    if it.kind in ("merge", "stats", "threshold") and _elementwise(tp, spec) and len(base_raw):
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


def _chunk_deltas(
    it: WorkItem, b: torch.Tensor, exp: list[list[ExpertRun]], dev: torch.device, keep_values: bool
) -> dict[int, tuple[TensorExpert, torch.Tensor, torch.Tensor | None]]:
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
                d[sl] = torch.from_numpy(_lora_delta(te.lora, cast(LoraBytes, buf), z - a)).to(dev)
                if xf is not None:
                    xf[sl] = b[sl] + d[sl]
                continue
            if isinstance(buf, SketchRun):  # δ̂_k (float32); the expert's values b + δ̂_k
                d[sl] = buf.delta(0, (z - a) * row_numel, b[sl])
                if xf is not None:
                    xf[sl] = b[sl] + d[sl]
                continue
            x = torch.from_numpy(decode(cast("Buffer", buf), tp.dtype)).to(dev).float()
            d[sl] = x - b[sl]
            if xf is not None:
                xf[sl] = x
        present[te.expert] = (te, d, xf)
    return present


def _task_vector_chunk(
    it: WorkItem,
    b: torch.Tensor,
    present: dict[int, tuple[TensorExpert, torch.Tensor, torch.Tensor | None]],
    spec: MethodSpec,
    l1_all: L1Map,
    l1_kept: L1Map,
    groups: Groups,
) -> torch.Tensor | None:
    """The task-arithmetic family's chunk (whole-chunk path): threshold groups for a
    ``threshold`` item, then per expert sparsify -> L1 rescale (with the tensor's pre-pass sums
    when it has one) -> :func:`~mergepipe.methods.kernels.combine`. float32 output, or None for
    ``stats`` and ``threshold`` items."""
    tp = it.tp
    row_numel = row_numel_of(tp.shape)
    offset = it.r0 * row_numel
    if it.kind == "threshold" or it.fused == "threshold":  # (fused: the pre-pass skipped this chunk)
        for te, d, _ in present.values():
            for slot, gkey, _rank in _bounds(te):
                _add_group(groups, tp, te, slot, _dense_group_hist(d, gkey))
        if it.kind == "threshold":
            return None
    rescale = spec.rescales(tp.params)
    deltas, ws = [], []
    for te, d, _ in present.values():
        ep = _expert_params(tp, te, groups, _dense_hist_of(d))
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
