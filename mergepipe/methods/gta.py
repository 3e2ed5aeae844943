"""Generalized task arithmetic: task_arithmetic, TIES, DARE, breadcrumbs, DELLA (mergekit's
``GeneralizedTaskArithmeticMerge``, ``merge_methods/generalized_task_arithmetic.py``).

Per expert a task vector ``δᵢ = θᵢ − θ_base`` is sparsified (:mod:`mergepipe.methods.sparsify`),
optionally L1-rescaled, multiplied by its ``weight``, optionally passed through TIES's sign
election (``consensus="sum"``), summed, optionally normalized by the sum of (agreeing) weights,
scaled by ``lambda`` and added to the base (:func:`mergepipe.methods.kernels.combine`). Every
step is elementwise given plan-time parameters, so any subset of blocks can be read: a block is
worth ``wᵢ²`` times the energy its sparsifier keeps.

Sources: Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089); TIES-Merging (Yadav et al.,
2023, arXiv:2306.01708); DARE (Yu et al., 2024, arXiv:2311.03099); Model Breadcrumbs (Davari &
Belilovsky, 2023, arXiv:2312.06795); DELLA-Merging (Deep et al., 2024, arXiv:2406.11617).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from mergepipe.methods.base import (
    DENSITY,
    INT8_MASK,
    LAMBDA,
    WEIGHT,
    BlockValue,
    MethodSpec,
    ParamSpec,
    Sparsify,
    TensorStatsView,
    normalize_param,
    rescale_param,
)
from mergepipe.methods.kernels import TILE_DTYPES, task_arithmetic_combine
from mergepipe.methods.sparsify import EXACT_TRIM_DTYPES, SPARSIFIERS, Sparsifier

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorExpert, TensorPlan

GAMMA = ParamSpec(
    "gamma", 0.01, "expert", lo=0.0, hi=1.0, hi_open=True, doc="fraction of largest magnitudes dropped as outliers"
)
EPSILON = ParamSpec(
    "epsilon",
    0.15,
    "expert",
    lo=0.0,
    hi=1.0,
    doc="keep probabilities run from density-epsilon to density+epsilon by magnitude rank",
)


@dataclass(frozen=True)
class TaskArithmeticMethod(MethodSpec):
    """A generalized-task-arithmetic method: its sparsifier, consensus and defaults are data."""

    sketch_tiers: ClassVar[bool] = True
    combines_task_vectors: ClassVar[bool] = True

    @property
    def sparsifier(self) -> Sparsifier:
        """The sparsifier object of :attr:`sparsify` (:data:`mergepipe.methods.sparsify.SPARSIFIERS`)."""
        return SPARSIFIERS[self.sparsify]

    def check_tensor(self, name: str, experts: Sequence[Mapping[str, Any]]) -> tuple[int, tuple[str, ...], str] | None:
        if self.sparsify != "della":
            return None
        for i, d in enumerate(experts):
            dens, eps = d["density"], d["epsilon"]
            if dens < 1.0 and not (dens - eps > 0.0 and dens + eps < 1.0):
                return (
                    i,
                    ("density", "epsilon"),
                    f"for tensor {name!r}, density={dens:g} and epsilon={eps:g}; {self.name} needs density - "
                    "epsilon > 0 and density + epsilon < 1 wherever density < 1 (keep probabilities run from "
                    "density - epsilon to density + epsilon; mergekit refuses the same). Lower epsilon or move "
                    "density.",
                )
        return None

    def rescales(self, g: Mapping[str, Any]) -> bool:
        return bool(g.get("rescale")) and self.sparsify != "none"

    def exact_bounds(
        self, ts: TensorStatsView, experts: Sequence[Mapping[str, Any]], dtype: str, group_cap: int | None
    ) -> tuple[list[int], list[tuple[int, int, int, int] | None]]:
        ranks: list[int] = [0] * ts.n_experts
        windows: list[tuple[int, int, int, int] | None] = [None] * ts.n_experts
        if dtype in EXACT_TRIM_DTYPES:
            for i, st in enumerate(ts.stats):
                ranks[i], windows[i] = self.sparsifier.exact_bound(st, experts[i], group_cap)
        return ranks, windows

    def block_value(
        self,
        ts: TensorStatsView,
        i: int,
        ep: Mapping[str, Any],
        coef: float,
        row_stats: bool,
        bounds: tuple[int, tuple[int, int, int, int] | None],
    ) -> BlockValue:
        """``wᵢ²`` times the energy the sparsifier keeps per block; with an L1 rescale, blocks
        below the threshold keep a tiny positive value (they still change the tensor's L1 norm)."""
        st = ts.stats[i]
        dens = float(ep.get("density", 1.0))
        rescale = self.rescales(ts.globals)
        if dens < 1.0:
            kept, mk, xk = self.sparsifier.kept(st, ep, rescale, bounds)
        else:
            kept, mk, xk = SPARSIFIERS["none"].kept(st, ep, rescale, bounds)
        if rescale and dens < 1.0:
            # below-threshold blocks still count in the L1 norm the rescale matches
            kept = np.where((kept <= 0) & (st.sq_norm > 0), 1e-12 * st.sq_norm, kept)
        return BlockValue(kept * ts.weights[i] ** 2, mk, xk)

    def row_stats(self, g: Mapping[str, Any]) -> bool:
        return self.sparsifier.row_stats

    def zero_delta_droppable(self, globals_: Mapping[str, Any]) -> bool:
        """Yes: a zero task vector adds zeros to the sign election, the sums and the divisor,
        which change no value (a zero added to a float32 sum leaves it, up to the sign of a zero
        result) and a zero merged delta takes the base bit for bit (``_add``, ``base − (0 −
        mixed)``); its sparsifier (magnitude, random, outliers) keeps zeros zero."""
        return True

    def elementwise(self, dtype: str) -> bool:
        return not self.sparsifier.row_stats and dtype in TILE_DTYPES

    def work_floats(self, n_experts: int, elementwise: bool) -> int:
        return n_experts + 3 if elementwise else 2 * n_experts + 11

    def combine(
        self,
        base: torch.Tensor,
        deltas: list[torch.Tensor],
        weights: list[float],
        globals_: Mapping[str, Any],
        weight_sum: float | None = None,
        consume: bool = False,
    ) -> torch.Tensor:
        """Sign consensus (if any), normalize, ``lambda``, base: :func:`~mergepipe.methods.kernels.task_arithmetic_combine`."""
        return task_arithmetic_combine(base, deltas, weights, globals_, self.consensus, weight_sum, consume)

    def explain_head(self, tp: TensorPlan) -> str:
        if self.sparsify == "della":
            return "della: per-row magnitude ranks computed by the engine from the rows it reads; "
        return ""

    def explain_expert(self, te: TensorExpert) -> tuple[str, str]:
        return super().explain_expert(te)[0], self.sparsifier.explain(te)


def _gta(
    name: str, sparsify: Sparsify, consensus: Literal["sum"] | None, params: tuple[ParamSpec, ...], paper: str
) -> TaskArithmeticMethod:
    return TaskArithmeticMethod(name, sparsify, consensus, params, paper=paper)


METHODS: tuple[MethodSpec, ...] = (
    _gta(
        "task_arithmetic",
        "none",
        None,
        (WEIGHT, LAMBDA, normalize_param(False), INT8_MASK),
        "Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089)",
    ),
    _gta(
        "ties",
        "magnitude",
        "sum",
        (WEIGHT, DENSITY, LAMBDA, normalize_param(True), rescale_param(False), INT8_MASK),
        "TIES-Merging (Yadav et al., 2023, arXiv:2306.01708)",
    ),
    _gta(
        "dare_ties",
        "random",
        "sum",
        (WEIGHT, DENSITY, LAMBDA, normalize_param(False), rescale_param(True), INT8_MASK),
        "DARE (Yu et al., 2024, arXiv:2311.03099) with TIES sign consensus",
    ),
    _gta(
        "dare_linear",
        "random",
        None,
        (WEIGHT, DENSITY, LAMBDA, normalize_param(False), rescale_param(True), INT8_MASK),
        "DARE (Yu et al., 2024, arXiv:2311.03099)",
    ),
    _gta(
        "breadcrumbs",
        "outliers",
        None,
        (WEIGHT, DENSITY, GAMMA, LAMBDA, normalize_param(False), rescale_param(False), INT8_MASK),
        "Model Breadcrumbs (Davari & Belilovsky, 2023, arXiv:2312.06795)",
    ),
    _gta(
        "breadcrumbs_ties",
        "outliers",
        "sum",
        (WEIGHT, DENSITY, GAMMA, LAMBDA, normalize_param(False), rescale_param(False), INT8_MASK),
        "Model Breadcrumbs (arXiv:2312.06795) with TIES sign consensus",
    ),
    _gta(
        "della",
        "della",
        "sum",
        (WEIGHT, DENSITY, EPSILON, LAMBDA, normalize_param(True), rescale_param(True), INT8_MASK),
        "DELLA-Merging (Deep et al., 2024, arXiv:2406.11617)",
    ),
    _gta(
        "della_linear",
        "della",
        None,
        (WEIGHT, DENSITY, EPSILON, LAMBDA, normalize_param(False), rescale_param(True), INT8_MASK),
        "DELLA-Merging (Deep et al., 2024, arXiv:2406.11617), no sign consensus",
    ),
)
