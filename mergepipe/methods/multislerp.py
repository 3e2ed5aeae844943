"""Multi-SLERP and the Karcher mean: points on the unit sphere combined as ``c_b·base + Σ cᵢδᵢ``
with coefficients from the catalog's norms and pair statistics (mergekit 0.1.5
``merge_methods/multislerp.py`` and ``karcher.py``; :func:`mergepipe.numerics.multislerp_coefficients`,
:func:`mergepipe.numerics.karcher_coefficients`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mergepipe.errors import InputError
from mergepipe.methods.base import MethodSpec, ParamSpec, TensorStatsView
from mergepipe.numerics import f32

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

WEIGHT_REQUIRED = ParamSpec(
    "weight", None, "expert", doc="interpolation weight of this expert (required, as in mergekit)"
)
NORMALIZE_WEIGHTS = ParamSpec("normalize_weights", True, "global", kind="bool", doc="divide the weights by their sum")
MULTISLERP_EPS = ParamSpec(
    "eps", 1e-8, "global", lo=0.0, lo_open=True, doc="added to every norm before dividing by it (0 divides 0 by 0)"
)
MAX_ITER = ParamSpec("max_iter", 10, "global", kind="int", lo=0, doc="iterations of the Karcher-mean fixed point")
KARCHER_TOL = ParamSpec(
    "tol",
    1e-5,
    "global",
    lo=0.0,
    lo_open=True,
    doc="stop when the tangent step is shorter; smaller norms and angles are 0 (0 divides 0 by 0)",
)


def raw_gram(ts: TensorStatsView) -> np.ndarray:
    """float64 ``[K, K]`` Gram matrix of the points ``θᵢ = base + δᵢ``:
    ``⟨θᵢ,θⱼ⟩ = ⟨b,θᵢ⟩ + ⟨b,θⱼ⟩ − ‖b‖² + ⟨δᵢ,δⱼ⟩`` (``‖θᵢ‖²`` exact on the diagonal)."""
    bb = ts.stats[0].base_sq
    bx = np.array([st.base_dot_expert for st in ts.stats])
    gt = ts.gram_matrix() + bx[:, None] + bx[None, :] - bb
    for i in range(ts.n_experts):
        gt[i, i] = ts.stats[i].expert_sq
    return gt


def _points(cs: list[float]) -> dict:
    """``derived`` of a combination ``Σ cᵢθᵢ = (Σ cᵢ)·base + Σ cᵢδᵢ`` of the raw points."""
    return {"c_base": f32(math.fsum(float(np.float32(c)) for c in cs)), **{f"c{i}": c for i, c in enumerate(cs)}}


@dataclass(frozen=True)
class _SphereMethod(MethodSpec):
    needs_gram: ClassVar[bool] = True

    def copies_base(self, tp: TensorPlan) -> bool:
        return not tp.experts and tp.derived.get("c_base", 1.0) == 1.0  # (else the base is rescaled)

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import lincomb_merge

        dv = tp.derived
        order = sorted(present)
        return lincomb_merge(base, [present[i][1] for i in order], [dv[f"c{i}"] for i in order], dv["c_base"])

    def explain_head(self, tp: TensorPlan) -> str:
        d = tp.derived
        cs = ", ".join(
            f"{d[k]:.6g}" for k in sorted(d, key=lambda k: (len(k), k)) if k.startswith("c") and k != "c_base"
        )
        return (
            f"{self.kind}: base·{d.get('c_base', 1.0):.6g} + Σ cᵢδᵢ, c = [{cs}] from the catalog's norms and pair "
            "statistics; "
        )


@dataclass(frozen=True)
class MultislerpMethod(_SphereMethod):
    """Over the task vectors; over the raw weights when the base is one of the inputs (a
    mergekit config without ``base_model``: the first model is the origin)."""

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        from mergepipe.numerics import multislerp_coefficients

        g = ts.globals
        gram = raw_gram(ts) if ts.base_is_input else ts.gram_matrix()
        try:
            cs = multislerp_coefficients(list(ts.weights), gram, bool(g["normalize_weights"]), float(g["eps"]))
        except ValueError as e:
            raise InputError(f"multislerp: tensor {ts.name!r}: {e}; change the weights.") from None
        if ts.base_is_input:
            return cs, _points(cs)
        return cs, {"c_base": 1.0, **{f"c{i}": c for i, c in enumerate(cs)}}


@dataclass(frozen=True)
class KarcherMethod(_SphereMethod):
    """The Karcher mean of the points ``θᵢ``: every tensor is rescaled (``c_b ≠ 1``)."""

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        from mergepipe.numerics import karcher_coefficients

        cs = karcher_coefficients(raw_gram(ts), int(ts.globals["max_iter"]), float(ts.globals["tol"]))
        return cs, _points(cs)

    def identity_on_zero_delta(self, weight_sum: float, globals_: Mapping[str, Any]) -> bool:
        return False  # Σcᵢ·base: copied only when the coefficients sum to 1 (copies_base)


METHODS: tuple[MethodSpec, ...] = (
    MultislerpMethod(
        "multislerp",
        "none",
        None,
        (WEIGHT_REQUIRED, NORMALIZE_WEIGHTS, MULTISLERP_EPS),
        kind="multislerp",
        min_experts=1,
        paper="Multi-SLERP (Goddard, goddard.blog/posts/multislerp-wow-what-a-cool-idea); mergekit 0.1.5 "
        "merge_methods/multislerp.py",
        budget_doc="blocks: base + Σ cᵢδᵢ with cᵢ from the catalog's norms and pair statistics; unread blocks "
        "are the base",
    ),
    KarcherMethod(
        "karcher",
        "none",
        None,
        (MAX_ITER, KARCHER_TOL),
        kind="karcher",
        min_experts=1,
        paper="Karcher mean on the unit sphere (Karcher, 1977; arXiv:2603.04972); mergekit 0.1.5 "
        "merge_methods/karcher.py",
        budget_doc="blocks: c_b·base + Σ cᵢδᵢ from the catalog's norms and pair statistics; every tensor is "
        "rescaled (c_b ≠ 1), unread blocks are c_b·base",
    ),
)
