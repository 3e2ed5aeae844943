"""Block-wise merge kernels (torch, any device) for the methods of :mod:`.registry`.

All arithmetic is elementwise in float32 with a fixed order of operations (experts are summed
one by one in plan order), so the result of an element does not depend on how a tensor is cut
into chunks or blocks, nor on the device: block-wise execution is bit-identical to a dense
whole-tensor merge (``tests/unit/test_methods.py`` checks this against the dense reference in
``testkit/dense_reference.py``).

Unread expert blocks enter as ``δ = 0`` (the expert is assumed equal to the base there): they
are pruned by every sparsifier and take no part in the sign election or the divisor.

Statistics that are not elementwise are computed so that they are still independent of
chunking and device: per-tensor sums are exactly rounded (``math.fsum``) sums of per-row float64
sums, and row-local statistics (DELLA's ranks, per-row cosines) are computed on the CPU with
numpy from whole rows (a chunk always holds whole rows, and a 1-D tensor, which mergekit
treats as one row, is one chunk).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe.methods.base import MethodSpec
from mergepipe.methods.sparsify import (  # noqa: F401 - re-exported (the kernels' vocabulary)
    SPARSIFIERS,
    ExpertTensorParams,
    magnitude_key_torch,
    magnitude_shrink_lambda,
    row_numel_of,
)
from mergepipe.numerics import (
    model_stock_t,
    nuslerp_coefficients_rows,
    segment_dots,
)

if TYPE_CHECKING:
    import torch

#: safetensors dtypes the tiled elementwise path reads in place (others are decoded per chunk)
TILE_DTYPES = ("BF16", "F16", "F32")


def sparsify(
    delta: torch.Tensor, spec: MethodSpec, ep: ExpertTensorParams, offset: int, shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Apply the method's sparsifier (:mod:`mergepipe.methods.sparsify`) to a chunk of one
    expert's task vector.

    Args:
        delta: float32 tensor ``(n,)``: flat elements ``[offset, offset + n)`` of the tensor;
            whole rows.
        offset: flat index of the chunk's first element (for the random streams).
        shape: the tensor's shape (DELLA ranks along mergekit's rank axis within rows).

    Returns:
        ``δ ⊙ mask`` (float32, same device), not yet rescaled; ``delta`` itself at density 1.
    """
    if ep.density >= 1.0:
        return delta
    return SPARSIFIERS[spec.sparsify].apply(delta, ep, offset, shape)


def elementwise_merge(spec: MethodSpec, dtype: str) -> bool:
    """True when the engine merges a tensor tile by tile: every operation is elementwise given
    the plan's parameters (no row statistics) and the inputs can be viewed in place (``dtype``
    in :data:`TILE_DTYPES`). An L1 rescale is elementwise once its factor is known: the engine
    gathers the row sums in a first sweep over the chunk's raw inputs, a few rows at a time
    (or over the tensor's chunks in a pre-pass), then scales each tile.
    """
    return spec.elementwise(dtype)


def work_floats(spec: MethodSpec, n_experts: int, elementwise: bool) -> int:
    """float32 arrays per tensor element the engine holds while merging one chunk (its working
    set is ``work_floats · 4 · elements``; inputs in flight are bounded separately by the
    prefetch bytes). Measured with ``bench/work_floats.py`` (peak RSS of one 16M-element chunk,
    K = 2 and 4, minus the raw inputs and output; 2026-11-22):

    * tiled elementwise path (:func:`elementwise_merge`): a tile's temporaries are constant and
      the chunk holds only its output, so any count would do; ``K + 3`` keeps chunks small
      enough that two are in flight within the prefetch bytes (measured total incl. inputs:
      ``0.5·K + 2``);
    * model_stock, slerp, nuslerp (whole-chunk float32, row statistics): ``K + 7``
      (measured ``K + 6.3``); the same count for mergekit 0.1.5's newer methods (multislerp,
      karcher, sce, nearswap, ram, ramplus_tl, arcee_fusion: whole-chunk float32; not measured
      separately);
    * whole-chunk task-vector methods (DELLA; an L1 rescale on inputs the tiles cannot view in
      place): ``2·K + 11`` (measured ``2·K + 10.3`` with an L1 rescale, before it was tiled).
    """
    return spec.work_floats(n_experts, elementwise)


def filter_width(shape: Sequence[int]) -> int:
    """Length of the vectors mergekit's per-row statistics run over: the last dimension; a 1-D
    tensor is one vector."""
    return int(shape[-1]) if len(shape) > 1 else int(shape[0]) if shape else 1


def needs_row_stats(spec: MethodSpec, params: dict) -> bool:
    """The method computes row-local statistics in the engine (so a 1-D tensor must be one chunk)."""
    return spec.row_stats(params)


def l1_row_sums(x: torch.Tensor, row_numel: int) -> list[float]:
    """float64 ``Σ|x|`` of each row of a flat chunk (``row_numel`` elements per row)."""
    import torch

    if x.numel() == 0:
        return []
    return x.reshape(-1, row_numel).abs().sum(dim=1, dtype=torch.float64).cpu().tolist()


def l1_rows(x: torch.Tensor, row_numel: int) -> float:
    """``Σ|x|`` as the exactly rounded sum (``math.fsum``) of float64 row sums, so the value does
    not depend on how rows are grouped into chunks."""
    return math.fsum(l1_row_sums(x, row_numel))


RESCALE_EPS = 1e-7
"""mergekit 0.1.5 ``sparsify.rescaled_masked_tensor``'s ``eps``: no rescale when either L1 norm
is below it."""


def rescale_factor(l1_all: float, l1_kept: float) -> float:
    """mergekit's L1 rescale: ``‖δ‖₁ / ‖mask ⊙ δ‖₁``, or 1 when either norm is below
    :data:`RESCALE_EPS` (``sparsify.rescaled_masked_tensor``)."""
    if l1_all < RESCALE_EPS or l1_kept < RESCALE_EPS:
        return 1.0
    return l1_all / l1_kept


def combine(
    base: torch.Tensor,
    deltas: list[torch.Tensor],
    weights: list[float],
    spec: MethodSpec,
    globals_: dict,
    weight_sum: float | None = None,
    consume: bool = False,
) -> torch.Tensor:
    """Combine sparsified (and rescaled) task vectors with the base: the method's combination
    (:func:`linear_combine` for ``linear``, :func:`task_arithmetic_combine` for the other
    task-arithmetic methods, with the method's ``consensus``).

    Args:
        base: float32 ``(n,)``.
        deltas: K float32 ``(n,)`` tensors, already sparsified/rescaled, in plan order.
        weights: K weights.
        globals_: resolved global parameters (``normalize``, ``lambda``).
        weight_sum: sum of the weights of *all* experts of the merge (experts with no block
            in this chunk count as ``δ = 0``); defaults to ``sum(weights)``.
        consume: the caller hands ``deltas`` over: they may be overwritten (saves temporaries).

    Returns:
        float32 ``(n,)`` merged values.
    """
    return spec.combine(base, deltas, weights, globals_, weight_sum, consume)


def linear_combine(
    base: torch.Tensor,
    deltas: list[torch.Tensor],
    weights: list[float],
    globals_: Mapping[str, Any],
    weight_sum: float | None = None,
) -> torch.Tensor:
    """mergekit 0.1.5 ``linear``: ``Σwᵢθᵢ / Σwᵢ`` written as ``base + Σwᵢδᵢ / Σwᵢ`` (``normalize``;
    the divisor is 1 where ``|Σwᵢ| < 1e-8``), else ``base·Σwᵢ + Σwᵢδᵢ``. float32 ``(n,)``."""
    normalize = bool(globals_.get("normalize", False))
    acc = None
    for d, w in zip(deltas, weights):
        t = d * w
        acc = t if acc is None else acc + t
    wsum = sum(weights) if weight_sum is None else weight_sum
    if normalize:
        den = wsum if abs(wsum) >= 1e-8 else 1.0
        return _add(base, acc / den) if acc is not None else base
    return base * wsum + (acc if acc is not None else 0.0)


def task_arithmetic_combine(
    base: torch.Tensor,
    deltas: list[torch.Tensor],
    weights: list[float],
    globals_: Mapping[str, Any],
    consensus: str | None,
    weight_sum: float | None = None,
    consume: bool = False,
) -> torch.Tensor:
    """mergekit 0.1.5 ``GeneralizedTaskArithmeticMerge``: weighted task vectors; with
    ``consensus="sum"``, the elected sign is ``sign(Σ wᵢδᵢ)`` with 0 counted as +, and only
    entries agreeing with it (zeros never agree) are summed and counted in the divisor; the
    divisor is replaced by 1 where it is exactly 0 (without consensus: where the weight sum is
    below 1e-8 in magnitude), as mergekit does; times ``lambda``, added to the base.
    Arguments as :func:`combine`; float32 ``(n,)``."""
    import torch

    normalize = bool(globals_.get("normalize", False))
    lam = float(globals_.get("lambda", 1.0))
    if consensus == "sum":
        if not deltas:
            return base
        fast = _sum_consensus_arith(base, deltas, weights, normalize, lam, consume)
        if fast is not None:
            return fast
        weighted = [d * w for d, w in zip(deltas, weights)]
        total = weighted[0]
        for t in weighted[1:]:
            total = total + t
        majority = torch.where(total >= 0, 1.0, -1.0).to(base.dtype)
        mixed = None
        div = None
        for t, w in zip(weighted, weights):
            agree = torch.sign(t) == majority
            m = torch.where(agree, t, torch.zeros((), dtype=t.dtype, device=t.device))
            dw = agree.to(base.dtype) * w
            mixed = m if mixed is None else mixed + m
            div = dw if div is None else div + dw
        assert mixed is not None and div is not None  # deltas is not empty
        if normalize:
            div = torch.where(div == 0, torch.ones((), dtype=div.dtype, device=div.device), div)
            mixed = mixed / div
    else:
        mixed = None
        for d, w in zip(deltas, weights):
            t = d * w
            mixed = t if mixed is None else mixed + t
        if mixed is None:
            return base
        if normalize:
            wsum = sum(weights) if weight_sum is None else weight_sum
            mixed = mixed / (wsum if abs(wsum) >= 1e-8 else 1.0)
    if lam != 1.0:
        mixed = mixed * lam
    return _add(base, mixed)


_SIGN_BIT = -0x80000000  # float32 sign bit as an int32
_ONE_BITS = 0x3F800000  # float32 1.0
_F32_TRUE_MIN = float(np.array([1], dtype=np.uint32).view(np.float32)[0])  # 2**-149, smallest subnormal


def _sum_consensus_arith(
    base: torch.Tensor,
    deltas: list[torch.Tensor],
    weights: list[float],
    normalize: bool,
    lam: float,
    consume: bool = False,
) -> torch.Tensor | None:
    """TIES sign election and disjoint mean (``consensus: sum``) with arithmetic only (no boolean
    masks, whose CPU kernels are ~10x slower than float ones); the value of :func:`combine`'s
    masked formulation bit for bit, or None when a precondition fails (then :func:`combine` runs
    the masked one).

    With ``tᵢ = wᵢδᵢ``, ``s = copysign(1, Σtᵢ)`` and ``pᵢ = relu(s·tᵢ)`` (``s·tᵢ`` only flips a
    sign, exactly): ``pᵢ = |tᵢ|`` where ``tᵢ`` agrees with the elected sign, else 0, so
    ``Σ agreeing tᵢ = s·Σpᵢ`` (round-to-nearest-even is symmetric under negation, so the sums
    are equal bit for bit up to the sign of zeros), and the divisor counts ``sign(pᵢ)·wᵢ``.
    ``copysign`` elects −1 where ``Σtᵢ = −0`` (mergekit: +1), which only happens where every
    ``tᵢ`` is zero and nothing can agree. The divisor guard ``div == 0 → 1`` becomes
    ``clamp_min(div, 2⁻¹⁴⁹)``, exact when every weight is positive in float32 (then ``div`` is 0
    or at least the smallest weight, and where it is 0 the numerator is 0 too). Zeros of the
    mixed delta take the base value bit for bit (``base − (0 − mixed)``, as :func:`_add`).

    Preconditions (else None): every weight positive in float32 when normalizing, and ``Σtᵢ``
    finite everywhere (NaN or ±inf task vectors take the masked path, which defines them).
    """
    import torch

    if normalize and not all(np.float32(w) > 0 for w in weights):
        return None
    owned = [consume or w != 1.0 for w in weights]  # may be overwritten
    ts = [d if w == 1.0 else d * w for d, w in zip(deltas, weights)]
    total = ts[0] if len(ts) == 1 else torch.add(ts[0], ts[1])
    for t in ts[2:]:
        total.add_(t)
    if not math.isfinite(float(total.sum())):  # NaN or ±inf anywhere (or a float32 overflow: also safe)
        return None
    # copysign(1, Σtᵢ) on the bits: the sign bit kept, the rest 1.0's (two integer passes in place,
    # a third of torch.copysign's time on the CPU)
    if total.dtype == torch.float32 and total.is_contiguous():
        sgn = total if len(ts) > 1 else total.clone()
        sgn.view(torch.int32).bitwise_and_(_SIGN_BIT).bitwise_or_(_ONE_BITS)
    else:
        one = torch.ones((), dtype=total.dtype, device=total.device).expand_as(total)
        sgn = torch.copysign(one, total, out=total) if len(ts) > 1 else torch.copysign(one, total)
    acc = div = None
    for t, w, own in zip(ts, weights, owned):
        p = (t.mul_(sgn) if own else torch.mul(t, sgn)).relu_()
        if normalize:
            ind = torch.sign(p)
            if w != 1.0:
                ind.mul_(w)
            div = ind if div is None else div.add_(ind)
        acc = p if acc is None else acc.add_(p)
    assert acc is not None  # deltas is not empty
    acc.mul_(sgn)
    if normalize:
        assert div is not None
        acc.div_(div.clamp_min_(_F32_TRUE_MIN))
    if lam != 1.0:
        acc.mul_(lam)
    return torch.sub(base, torch.rsub(acc, 0.0))


def _add(base: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """``base + mixed``, keeping base values bit for bit where ``mixed == 0`` (so ``-0.0`` stays
    ``-0.0`` and untouched regions equal the base byte for byte)."""
    import torch

    return torch.where(mixed == 0, base, base + mixed)


def identity_on_zero_delta(spec: MethodSpec, weight_sum: float, globals_: dict) -> bool:
    """True when all-zero task vectors give back the base exactly (then a tensor no expert
    block touches is copied byte for byte). ``weight_sum``: the tensor's sum of weights."""
    return spec.identity_on_zero_delta(weight_sum, globals_)


def sum_in_order(ts: list[torch.Tensor]) -> torch.Tensor:
    acc = ts[0]
    for t in ts[1:]:
        acc = acc + t
    return acc


def model_stock_merge(
    base: torch.Tensor, deltas: list[torch.Tensor], t: float | None, width: int | None = None
) -> torch.Tensor:
    """mergekit's Model Stock in task-vector form: ``base + t · (Σδᵢ)/N``.

    Args:
        deltas: all N experts' task vectors in plan order (zeros where unread).
        t: the ratio (float) for the whole tensor; or None with ``width``: one ratio per
            ``width``-element filter (``filter_wise``), computed here from these rows with
            :func:`mergepipe.numerics.model_stock_t` (unread rows count as δ = 0).

    mergekit computes ``t·mean(θᵢ) + (1−t)·θ_base``; the task-vector form is the same value up to
    float32 rounding and returns the base bit for bit where every δ is 0.
    """
    import torch

    n = len(deltas)
    avg = sum_in_order(deltas) / n
    if t is None:
        if width is None:
            raise ValueError("model_stock_merge: a per-filter ratio (t=None) needs the filter width")
        ds = [d.detach().cpu().numpy() for d in deltas]
        sq = [segment_dots(x, x, width) for x in ds]
        dots = {(i, j): segment_dots(ds[i], ds[j], width) for i in range(n) for j in range(i + 1, n)}
        tf = torch.from_numpy(model_stock_t(n, sq, dots)).to(base.device)
        mixed = (avg.reshape(-1, width) * tf[:, None]).reshape(-1)
    else:
        mixed = avg * t
    return _add(base, mixed)


def slerp_merge(base: torch.Tensor, expert: torch.Tensor, c_base: float, c_expert: float) -> torch.Tensor:
    """mergekit's slerp output ``c_base·θ_base + c_expert·θ_expert`` (float32), with the
    coefficients from whole-tensor statistics (plan)."""
    return base * c_base + expert * c_expert


def nuslerp_merge(
    base: torch.Tensor,
    d0: torch.Tensor,
    d1: torch.Tensor,
    coef: tuple[float, float, float] | None,
    width: int | None = None,
    t: float = 0.5,
) -> torch.Tensor:
    """mergekit's nuslerp with a base: ``base + (a·δ₀ + b·δ₁)/s``.

    Args:
        coef: ``(a, b, s)`` for the whole tensor (plan); or None with ``width``: per
            ``width``-element row, computed here from these rows (``nuslerp_flatten=false``).
    """
    import torch

    if coef is None:
        if width is None:
            raise ValueError("nuslerp_merge: per-row coefficients (coef=None) need the row width")
        x0, x1 = d0.detach().cpu().numpy(), d1.detach().cpu().numpy()
        rows = nuslerp_coefficients_rows(
            t, segment_dots(x0, x0, width), segment_dots(x1, x1, width), segment_dots(x0, x1, width)
        )
        c = torch.from_numpy(rows).to(base.device)
        a, b, s = c[:, 0:1], c[:, 1:2], c[:, 2:3]
        mixed = ((d0.reshape(-1, width) * a + d1.reshape(-1, width) * b) / s).reshape(-1)
    else:
        ca, cb, cs = coef
        mixed = (d0 * ca + d1 * cb) / cs
    return _add(base, mixed)


# --- mergekit 0.1.5's newer methods ----------------------------------------------------------


def lincomb_merge(
    base: torch.Tensor, deltas: list[torch.Tensor], coefs: list[float], c_base: float = 1.0
) -> torch.Tensor:
    """``c_base·base + Σ cᵢ·δᵢ`` (float32, experts summed in plan order): multislerp
    (``c_base = 1``) and karcher, with the coefficients from whole-tensor statistics (plan:
    :func:`mergepipe.numerics.multislerp_coefficients`, :func:`~mergepipe.numerics.karcher_coefficients`).
    With ``c_base = 1`` entries where every δ is 0 are the base bit for bit."""
    mixed = None
    for d, c in zip(deltas, coefs):
        t = d * c
        mixed = t if mixed is None else mixed + t
    if c_base == 1.0:
        return base if mixed is None else _add(base, mixed)
    out = base * c_base
    return out if mixed is None else out + mixed


def nearswap_merge(base: torch.Tensor, expert: torch.Tensor, t: float) -> torch.Tensor:
    """mergekit 0.1.5 ``nearswap``: ``w·θ_e + (1 − w)·θ_b`` with ``w = clamp(t / max(|θ_b − θ_e|,
    1e-6), 0, 1)`` per entry — the expert's value where it is within ``t`` of the base, else the
    base moved by ``t`` towards it (the task vector clipped to ``[−t, t]``). Entries where the
    expert equals the base (or was not read) are the base bit for bit.

    Args:
        base, expert: float32 ``(n,)``.
        t: the distance threshold (``t ≥ 0``).
    """
    import torch

    absdiff = torch.abs(base - expert)
    w = (t / absdiff.clamp(min=1e-6)).clamp(min=0, max=1)
    out = w * expert + (1 - w) * base
    return torch.where(expert == base, base, out)


def ram_merge(
    base: torch.Tensor, deltas: list[torch.Tensor], epsilon: float, gains: list[float] | None = None
) -> torch.Tensor:
    """mergekit 0.1.5 ``ram`` / ``ramplus_tl`` on one chunk (float32).

    Per entry, the experts with ``|δᵢ| > epsilon`` contribute: an entry only one expert changes
    takes its δ (times its gain ``λᵢ`` in ramplus_tl), an entry several change takes the mean of
    theirs: ``Σᵢ [nzᵢ]·(uniqueᵢ·λᵢ·δᵢ + overlap·δᵢ/count)``, summed over the experts in order, as
    mergekit does. Unread blocks are δ = 0: they do not count.

    Args:
        deltas: K float32 ``(n,)`` task vectors (zeros where unread).
        gains: ramplus_tl's ``λᵢ`` (:func:`ramplus_gains`); None for ram (λ = 1).
    """
    import torch

    nz = [d.abs() > epsilon for d in deltas]
    count = nz[0].to(torch.int64)
    for m in nz[1:]:
        count = count + m
    unique = count == 1
    overlap = count > 1
    cnt = count.clamp(min=1)
    mixed = None
    for i, (d, m) in enumerate(zip(deltas, nz)):
        z = d * m
        u = z * unique
        if gains is not None:
            u = u * gains[i]
        term = u + z * overlap / cnt
        mixed = term if mixed is None else mixed + term
    return base if mixed is None else base + mixed


def ram_counts(deltas: list, epsilon: float) -> list[tuple[int, int]]:
    """Per expert ``(shared, unique)``: entries where ``|δᵢ| > epsilon`` and some other expert's
    too (shared), or only this expert's (unique) — ramplus_tl's whole-tensor counts."""
    import torch

    nz = [d.abs() > epsilon for d in deltas]
    count = nz[0].to(torch.int64)
    for m in nz[1:]:
        count = count + m
    return [(int((m & (count > 1)).sum()), int((m & (count == 1)).sum())) for m in nz]


def ramplus_gains(counts: list[tuple[int, int]], r: float, alpha: float, epsilon: float) -> list[float]:
    """ramplus_tl's per-expert gain ``λᵢ = 1 + r·clamp(sharedᵢ / max(uniqueᵢ, epsilon), 0, alpha)``
    in float32 arithmetic, as mergekit 0.1.5 computes it."""
    out = []
    for shared, unique in counts:
        rho = np.float32(shared) / np.float32(max(float(unique), epsilon))
        rho = np.float32(min(max(rho, np.float32(0.0)), np.float32(alpha)))
        out.append(float(np.float32(1.0) + np.float32(r) * rho))
    return out


def sce_merge(
    base: torch.Tensor, deltas: list[torch.Tensor], weights: list[float] | None, select_topk: float = 1.0
) -> torch.Tensor:
    """mergekit 0.1.5 ``sce`` (select, calculate, erase) on float32 task vectors.

    With ``select_topk < 1`` the entries whose variance across the experts is among the top
    ``int(nonzero · select_topk)`` of the tensor are kept (``torch.topk`` of the population
    variance, as mergekit), the rest zeroed; the weights are then computed from the masked task
    vectors (``weights`` must be None: this needs the whole tensor in one chunk). With
    ``select_topk = 1`` ``weights`` are the plan's (:func:`mergepipe.numerics.sce_weights`).
    Then TIES sign election on ``Σδᵢ`` (zeros never agree) and ``Σ wᵢmᵢδᵢ / max(Σ wᵢmᵢ, 1e-6)``.
    Entries where no expert agrees (all δ = 0: unread) are the base.
    """
    import torch

    if not deltas:
        return base
    if select_topk < 1.0:
        tvs = torch.stack(deltas, dim=0)
        if select_topk <= 0:
            mask = torch.zeros_like(tvs[0])
        else:
            var = torch.var(tvs, dim=0, unbiased=False)
            k = int(torch.count_nonzero(var) * select_topk)  # (float32 product, as mergekit)
            mask = torch.zeros_like(var)
            if k > 0:
                _, idx = torch.topk(var.abs().view(-1), k=k, largest=True)
                mask.view(-1)[idx] = 1
        deltas = list(tvs * mask.unsqueeze(0))
        energy = torch.stack(deltas).square().reshape(len(deltas), -1).mean(dim=1)
        ws = float(torch.sum(energy).item())
        weights = [1.0 / len(deltas)] * len(deltas) if abs(ws) < 1e-6 else (energy / ws).tolist()
    assert weights is not None
    total = deltas[0]
    for d in deltas[1:]:
        total = total + d
    majority = (total >= 0).to(base.dtype) * 2 - 1
    num = den = None
    for d, wi in zip(deltas, weights):
        ew = (torch.sign(d) == majority).to(base.dtype) * wi
        t = d * ew
        num = t if num is None else num + t
        den = ew if den is None else den + ew
    assert num is not None and den is not None  # deltas is not empty
    return base + num / den.clamp(min=1e-6)


def arcee_fusion_merge(base: torch.Tensor, expert: torch.Tensor, width: int) -> torch.Tensor:
    """mergekit 0.1.5 ``arcee_fusion`` on a whole tensor (float32, flat).

    Importance ``|θ_e − θ_b| · KL(softmax(θ_e) ‖ softmax(θ_b))`` with the KL divergence per row
    (over the last dimension, ``width`` entries; a 1-D tensor is one row); the threshold is
    ``median + 1.5·(q3 − q1)`` of the importance over the whole tensor, each quantile the entry
    at index ``⌊q·(n − 1)⌋`` of the sorted values (mergekit samples 10⁶ entries with replacement
    for larger tensors; here all entries: deterministic); the output is
    ``θ_b + (θ_e − θ_b)·[importance ≥ threshold]``.
    """
    import torch
    import torch.nn.functional as F

    if base.numel() == 0:
        return base
    p2 = expert.reshape(-1, width)
    b2 = base.reshape(-1, width)
    diff = (p2 - b2).abs()
    eps = 1e-8
    p = F.softmax(p2, dim=-1) + eps
    q = F.softmax(b2, dim=-1) + eps
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    imp = (diff * kl).reshape(-1)
    s, _ = torch.sort(imp)
    idx = (torch.tensor([0.25, 0.5, 0.75]) * (s.numel() - 1)).long()
    q1, med, q3 = s[idx]
    thr = med + 1.5 * (q3 - q1)
    mask = (imp >= thr).float()
    return base + (expert - base) * mask
