"""Sparsifiers of the task-arithmetic family, one object each (mergekit 0.1.5 ``sparsify.py``).

A :class:`Sparsifier` holds everything one way of dropping task-vector entries needs: the kernel
that applies it to a chunk (:meth:`Sparsifier.apply`), the energy it keeps per block from the
catalog's key histogram (:meth:`Sparsifier.kept`), the exact-threshold refinement the engine makes
(:meth:`Sparsifier.exact_bound`) and its line in ``explain``. ``none`` keeps everything;
``magnitude`` is TIES's top-k by ``|δ|``; ``random`` DARE's Bernoulli drop; ``outliers``
breadcrumbs' magnitude window; ``della`` DELLA's magnitude-ranked Bernoulli drop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe.numerics import (
    N_KEYS,
    dare_keep_mask,
    della_keep_mask,
    della_probs,
    magnitude_keys,
    outlier_counts,
    outlier_window,
    topk_rank,
)

if TYPE_CHECKING:
    import torch

    from mergepipe.catalog.stats import TensorStats
    from mergepipe.planner.plan import TensorExpert

#: input dtypes whose magnitude trim (TIES) and window (breadcrumbs) rank the exact float32 |δ| (bf16 included: a
#: difference of two bf16 values is often not a bf16 value, so its key group holds distinct magnitudes; the engine
#: selects inside a group with a bit histogram, exact at any size in bounded memory)
EXACT_TRIM_DTYPES = ("BF16", "F16", "F32")


def row_numel_of(shape: Sequence[int]) -> int:
    """Elements per row of a tensor of ``shape`` (1 for a 1-D tensor: each element is a row)."""
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def magnitude_key_torch(delta: torch.Tensor) -> torch.Tensor:
    """Magnitude keys of a float32 torch tensor; equals :func:`mergepipe.numerics.magnitude_keys`."""
    import torch

    return delta.abs().to(torch.bfloat16).view(torch.int16).to(torch.int32).clamp_(max=0x7F80)


def magnitude_shrink_lambda(min_key: int) -> float | None:
    """The float32 ``λ`` with ``|δ| > λ  ⇔  magnitude_key(δ) >= min_key`` for every finite and
    infinite float32 ``δ`` (and NaN kept on both sides), or None when there is none
    (``min_key`` outside ``[1, 0x7F80]``).

    The key rounds ``|δ|`` to bf16 with round-to-nearest-even, which is monotone: the smallest
    float32 whose key is ``>= m`` is the midpoint between the bf16 values ``m − 1`` and ``m``
    (bit pattern ``(m − 1) << 16 | 0x8000``) when ``m`` is even (the tie rounds to ``m``), one
    ulp above it when ``m`` is odd. ``λ`` is the float32 just below that value, so
    ``torch.nn.functional.hardshrink(δ, λ)`` (``0`` where ``−λ <= δ <= λ``) is the magnitude
    trim in a single vectorized pass, bit-identical to ``where(key >= m, δ, 0)`` (tested
    exhaustively over every key boundary in ``tests/unit/test_kernels_fast.py``).
    """
    if not 1 <= min_key <= 0x7F80:
        return None
    lower = ((min_key - 1) << 16) | 0x8000
    if min_key & 1:
        lower += 1
    return float(np.array([lower - 1], dtype=np.uint32).view(np.float32)[0])


#: (rank inside the threshold key group, breadcrumbs window ``(τ_lo, r_lo, τ_hi, r_hi)`` or None)
Bound = tuple[int, "tuple[int, int, int, int] | None"]


@dataclass(frozen=True)
class ExpertTensorParams:
    """What one expert contributes to one tensor.

    Attributes:
        weight: mergekit ``weight``.
        density: mergekit ``density`` (1.0 = no sparsification).
        min_key: magnitude threshold key (keep ``key >= min_key``; 0 keeps all), fixed at
            plan time from the catalog's key histogram.
        max_key: breadcrumbs' outlier bound (keep ``key < max_key``; ``N_KEYS`` = none).
        stream_key: key of the DARE / DELLA random stream of this (expert, tensor).
        epsilon: DELLA's ``epsilon``.
        shrink: exact magnitude trim for bf16/float16/float32 inputs (keep ``|δ| > shrink``, a
            float32), found by the engine inside the threshold key group
            (:func:`mergepipe.numerics.exact_shrink`); None: the key rule ``key >= min_key``.
            Breadcrumbs: the window's lower end the same way.
        shrink_hi: breadcrumbs' exact outlier bound for bf16/float16/float32 inputs (keep
            ``|δ| <= shrink_hi``); None: the key rule ``key < max_key``.
    """

    weight: float
    density: float
    min_key: int = 0
    stream_key: int = 0
    max_key: int = N_KEYS
    epsilon: float = 0.0
    shrink: float | None = None
    shrink_hi: float | None = None


class Sparsifier:
    """Keep every entry (``none``); the base of the others."""

    name = "none"
    #: the kernel computes row-local statistics (ranks within rows)
    row_stats = False

    def apply(
        self, delta: torch.Tensor, ep: ExpertTensorParams, offset: int, shape: Sequence[int] | None
    ) -> torch.Tensor:
        """``δ ⊙ mask`` of a float32 torch chunk ``delta`` (flat elements ``[offset, offset + n)``
        of a tensor of ``shape``, whole rows) for expert parameters ``ep``
        (:class:`ExpertTensorParams`, ``density < 1``); not rescaled."""
        return delta

    def exact_bound(self, st: TensorStats, ep: Mapping[str, Any], group_cap: int | None) -> Bound:
        """The exact-threshold refinement of expert ``ep`` on a tensor of an
        :data:`EXACT_TRIM_DTYPES` dtype with catalog statistics ``st``: ``(0, None)`` for none."""
        return 0, None

    def kept(self, st: TensorStats, ep: Mapping[str, Any], rescale: bool, bound: Bound) -> tuple[np.ndarray, int, int]:
        """float64 ``[n_blocks]`` task-vector energy kept per block at ``density < 1``, and the
        magnitude-key window ``(min_key, max_key)`` the engine keeps."""
        return st.sq_norm.copy(), 0, N_KEYS

    def explain(self, te: TensorExpert) -> str:
        """The threshold text of one ``TensorExpert`` (``""``: nothing to say)."""
        return ""


def _where(keep: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.where(keep, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))


class Magnitude(Sparsifier):
    """TIES: keep the ``density`` share of entries with the largest ``|δ|`` (Yadav et al., 2023)."""

    name = "magnitude"

    def apply(
        self, delta: torch.Tensor, ep: ExpertTensorParams, offset: int, shape: Sequence[int] | None
    ) -> torch.Tensor:
        import torch

        if ep.shrink is not None:  # exact top-k on bf16/float16/float32 values (one vectorized pass)
            return torch.nn.functional.hardshrink(delta, ep.shrink)
        if ep.min_key <= 0:
            return delta
        lam = magnitude_shrink_lambda(ep.min_key)
        if lam is not None:  # one vectorized pass: 0 where |δ| <= λ, δ elsewhere (NaN kept, as its key is)
            return torch.nn.functional.hardshrink(delta, lam)
        return _where(magnitude_key_torch(delta) >= ep.min_key, delta)

    def exact_bound(self, st: TensorStats, ep: Mapping[str, Any], group_cap: int | None) -> Bound:
        tau, rank, ties = st.trim_rank(float(ep.get("density", 1.0)))
        if tau > 0 and rank < ties and (group_cap is None or ties <= group_cap):
            return rank, None
        return 0, None

    def kept(self, st: TensorStats, ep: Mapping[str, Any], rescale: bool, bound: Bound) -> tuple[np.ndarray, int, int]:
        dens = float(ep.get("density", 1.0))
        mk = st.min_key(dens)
        if bound[0]:
            mk = st.trim_rank(dens)[0]  # τ: part of its group kept
        return st.kept_energy(mk), mk, N_KEYS

    def explain(self, te: TensorExpert) -> str:
        return f", trim key>={te.min_key}" if te.min_key else ""


class Outliers(Sparsifier):
    """Model Breadcrumbs: drop the ``gamma`` share of largest and keep the next ``density``
    share of entries by ``|δ|`` (Davari & Belilovsky, 2023)."""

    name = "outliers"

    def apply(
        self, delta: torch.Tensor, ep: ExpertTensorParams, offset: int, shape: Sequence[int] | None
    ) -> torch.Tensor:
        if ep.shrink is None and ep.shrink_hi is None:
            k = magnitude_key_torch(delta)
            keep = (k >= ep.min_key) & (k < ep.max_key)
        else:  # exact window on bf16/float16/float32 values (a bound without a shrink uses its key)
            a = delta.abs()
            keep = (a > ep.shrink) if ep.shrink is not None else (magnitude_key_torch(delta) >= ep.min_key)
            keep &= (a <= ep.shrink_hi) if ep.shrink_hi is not None else (magnitude_key_torch(delta) < ep.max_key)
        return _where(keep, delta)

    def exact_bound(self, st: TensorStats, ep: Mapping[str, Any], group_cap: int | None) -> Bound:
        ks = outlier_counts(st.numel, float(ep.get("density", 1.0)), float(ep.get("gamma", 0.0)))
        if ks is None or ks[0] == ks[1]:  # keep all, or nothing (target 0)
            return 0, None
        lo = topk_rank(st.hist_keys, st.hist_counts, ks[0], st.key_table)
        hi = topk_rank(st.hist_keys, st.hist_counts, ks[1], st.key_table)
        if group_cap is not None and max(lo[2], hi[2]) > group_cap // 2:
            return 0, None
        w = (lo[0], lo[1] if 0 < lo[1] < lo[2] else 0, hi[0], hi[1] if 0 < hi[1] < hi[2] else 0)
        if w[1] or w[3]:
            return w[1] or -1, w  # (-1: only the outlier bound is refined)
        return 0, None

    def kept(self, st: TensorStats, ep: Mapping[str, Any], rescale: bool, bound: Bound) -> tuple[np.ndarray, int, int]:
        dens = float(ep.get("density", 1.0))
        mk, xk = outlier_window(st.hist_keys, st.hist_counts, st.numel, dens, float(ep["gamma"]), st.key_table)
        win = bound[1]
        if win is not None:  # exact ends: the cut groups are inside the key window
            tl, rl, th, rh = win
            mk = tl if rl else mk
            xk = th + 1 if rh else xk
        return st.kept_energy_window(mk, xk), mk, xk

    def explain(self, te: TensorExpert) -> str:
        return f", keep keys in [{te.min_key}, {te.max_key})" if te.density < 1.0 else ""


class Random(Sparsifier):
    """DARE: keep each entry with probability ``density`` (Yu et al., 2024)."""

    name = "random"

    def apply(
        self, delta: torch.Tensor, ep: ExpertTensorParams, offset: int, shape: Sequence[int] | None
    ) -> torch.Tensor:
        import torch

        m = dare_keep_mask(ep.stream_key, offset, delta.numel(), ep.density)
        return _where(torch.from_numpy(m).to(delta.device), delta)

    def kept(self, st: TensorStats, ep: Mapping[str, Any], rescale: bool, bound: Bound) -> tuple[np.ndarray, int, int]:
        dens = float(ep.get("density", 1.0))
        return st.sq_norm * (1.0 / dens if rescale else dens), 0, N_KEYS


class Della(Sparsifier):
    """DELLA: keep probabilities from ``density − epsilon`` to ``density + epsilon`` by
    magnitude rank within rows (Deep et al., 2024)."""

    name = "della"
    row_stats = True

    def apply(
        self, delta: torch.Tensor, ep: ExpertTensorParams, offset: int, shape: Sequence[int] | None
    ) -> torch.Tensor:
        import torch

        if shape is None:
            raise ValueError("della: the tensor's shape is needed (keep probabilities are ranked within rows)")
        d = delta.detach().cpu().numpy()
        rows = d.size // row_numel_of(shape) if len(shape) > 1 else 1
        p = della_probs(magnitude_keys(d), shape, rows, ep.density, ep.epsilon)
        return _where(torch.from_numpy(della_keep_mask(ep.stream_key, offset, p)).to(delta.device), delta)

    def kept(self, st: TensorStats, ep: Mapping[str, Any], rescale: bool, bound: Bound) -> tuple[np.ndarray, int, int]:
        dens = float(ep.get("density", 1.0))
        kept = st.della_kept_energy(dens, float(ep["epsilon"]))
        return (kept / dens**2 if rescale else kept), 0, N_KEYS


SPARSIFIERS: dict[str, Sparsifier] = {s.name: s for s in (Sparsifier(), Magnitude(), Outliers(), Random(), Della())}
