"""Block-wise merge kernels (torch, any device) for the methods of :mod:`.registry`.

All arithmetic is elementwise in float32 with a fixed order of operations (experts are summed
one by one in plan order), so the result of an element does not depend on how a tensor is cut
into chunks or blocks, nor on the device: block-wise execution is bit-identical to a dense
whole-tensor merge (``tests/test_methods.py`` checks this against :mod:`.reference`).

Unread expert blocks enter as ``δ = 0`` (the expert is assumed equal to the base there): they
are pruned by every sparsifier and take no part in the sign election or the divisor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mergepipe.methods.registry import MethodSpec
from mergepipe.numerics import dare_keep_mask


@dataclass(frozen=True)
class ExpertTensorParams:
    """What one expert contributes to one tensor.

    Attributes:
        weight: mergekit ``weight``.
        density: mergekit ``density`` (1.0 = no sparsification).
        min_key: magnitude-trim threshold key (keep ``key >= min_key``; 0 keeps all), fixed at
            plan time from the catalog's key histogram.
        stream_key: key of the DARE random stream of this (expert, tensor).
    """

    weight: float
    density: float
    min_key: int = 0
    stream_key: int = 0


def magnitude_key_torch(delta):
    """Magnitude keys of a float32 torch tensor; equals :func:`mergepipe.numerics.magnitude_keys`."""
    import torch

    return delta.abs().to(torch.bfloat16).view(torch.int16).to(torch.int32).clamp_(max=0x7F80)


def sparsify(delta, spec: MethodSpec, ep: ExpertTensorParams, offset: int):
    """Apply the method's sparsifier to a chunk of one expert's task vector.

    Args:
        delta: float32 tensor ``(n,)``: flat elements ``[offset, offset + n)`` of the tensor.
        offset: flat index of the chunk's first element (for the DARE stream).

    Returns:
        ``δ ⊙ mask`` (float32, same device), not yet rescaled.
    """
    import torch

    if spec.sparsify == "none" or ep.density >= 1.0:
        return delta
    if spec.sparsify == "magnitude":
        keep = magnitude_key_torch(delta) >= ep.min_key
    elif spec.sparsify == "random":
        m = dare_keep_mask(ep.stream_key, offset, delta.numel(), ep.density)
        keep = torch.from_numpy(m).to(delta.device)
    else:  # pragma: no cover - registry guards this
        raise ValueError(spec.sparsify)
    return torch.where(keep, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


def l1_row_sums(x, row_numel: int) -> list[float]:
    """float64 ``Σ|x|`` of each row of a flat chunk (``row_numel`` elements per row)."""
    import torch

    if x.numel() == 0:
        return []
    return x.reshape(-1, row_numel).abs().sum(dim=1, dtype=torch.float64).cpu().tolist()


def l1_rows(x, row_numel: int) -> float:
    """``Σ|x|`` as the exactly rounded sum (``math.fsum``) of float64 row sums, so the value does
    not depend on how rows are grouped into chunks."""
    return math.fsum(l1_row_sums(x, row_numel))


def rescale_factor(l1_all: float, l1_kept: float) -> float:
    """mergekit's ``rescale_sum``: ``‖δ‖₁ / ‖mask ⊙ δ‖₁`` (1 when either is ~0)."""
    if l1_all < 1e-8 or l1_kept < 1e-8:
        return 1.0
    return l1_all / l1_kept


def combine(base, deltas: list, weights: list[float], spec: MethodSpec, globals_: dict,
            weight_sum: float | None = None):
    """Combine sparsified (and rescaled) task vectors with the base.

    Args:
        base: float32 ``(n,)``.
        deltas: K float32 ``(n,)`` tensors, already sparsified/rescaled, in plan order.
        weights: K weights.
        globals_: resolved global parameters (``normalize``, ``lambda``).
        weight_sum: sum of the weights of *all* experts of the merge (experts with no block
            in this chunk count as ``δ = 0``); defaults to ``sum(weights)``.

    Returns:
        float32 ``(n,)`` merged values.

    Follows mergekit 0.1.5 ``GeneralizedTaskArithmeticMerge``: weighted task vectors; with
    consensus ``sum``, the elected sign is ``sign(Σ wᵢδᵢ)`` with 0 counted as +, and only
    entries agreeing with it (zeros never agree) are summed and counted in the divisor; the
    divisor is replaced by 1 where ``|divisor| < 1e-8``.
    """
    import torch

    normalize = bool(globals_.get("normalize", False))
    if spec.linear:
        acc = None
        for d, w in zip(deltas, weights):
            t = d * w
            acc = t if acc is None else acc + t
        wsum = sum(weights) if weight_sum is None else weight_sum
        if normalize:
            div = wsum if abs(wsum) >= 1e-8 else 1.0
            return _add(base, acc / div) if acc is not None else base
        return base * wsum + (acc if acc is not None else 0.0)

    lam = float(globals_.get("lambda", 1.0))
    if spec.consensus == "sum":
        if not deltas:
            return base
        weighted = [d * w for d, w in zip(deltas, weights)]
        total = None
        for t in weighted:
            total = t if total is None else total + t
        majority = torch.where(total >= 0, 1.0, -1.0).to(base.dtype)
        mixed = None
        div = None
        for t, w in zip(weighted, weights):
            agree = torch.sign(t) == majority
            m = torch.where(agree, t, torch.zeros((), dtype=t.dtype, device=t.device))
            dw = agree.to(base.dtype) * w
            mixed = m if mixed is None else mixed + m
            div = dw if div is None else div + dw
        if normalize:
            div = torch.where(div.abs() < 1e-8, torch.ones((), dtype=div.dtype, device=div.device), div)
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


def _add(base, mixed):
    """``base + mixed``, keeping base values bit for bit where ``mixed == 0`` (so ``-0.0`` stays
    ``-0.0`` and untouched regions equal the base byte for byte)."""
    import torch

    return torch.where(mixed == 0, base, base + mixed)


def identity_on_zero_delta(spec: MethodSpec, weights: list[float], globals_: dict) -> bool:
    """True when all-zero task vectors give back the base exactly (then a tensor no expert
    block touches is copied byte for byte)."""
    if spec.linear and not globals_.get("normalize", True):
        return sum(weights) == 1.0
    return True
