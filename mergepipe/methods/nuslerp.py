"""NuSLERP: two task vectors along the great circle (mergekit ``merge_methods/nuslerp.py``);
whole-tensor coefficients from the catalog's ``‖δᵢ‖²`` and ``⟨δ₀,δ₁⟩``, or per row
(``nuslerp_flatten=false``) computed by the engine from the rows it reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mergepipe.methods.base import WEIGHT, MethodSpec, ParamSpec, TensorStatsView, ds_or_zeros

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorExpert, TensorPlan

NUSLERP_FLATTEN = ParamSpec("nuslerp_flatten", True, "global", kind="bool", doc="treat each tensor as one vector")
NUSLERP_ROW_WISE = ParamSpec(
    "nuslerp_row_wise",
    False,
    "global",
    kind="bool",
    doc="with nuslerp_flatten=false: interpolate columns instead of rows (not supported)",
)


@dataclass(frozen=True)
class NuslerpMethod(MethodSpec):
    needs_gram: ClassVar[bool] = True

    def check_globals(self, g: Mapping[str, Any]) -> tuple[str, str] | None:
        if g.get("nuslerp_row_wise") and not g.get("nuslerp_flatten"):
            return (
                "nuslerp_row_wise",
                "nuslerp_row_wise=true with nuslerp_flatten=false interpolates "
                "columns, which needs per-column statistics over all rows that mergepipe does not keep; "
                "use nuslerp_flatten=true (default, whole tensors) or nuslerp_flatten=false with "
                "nuslerp_row_wise=false (rows).",
            )
        return None

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        from mergepipe.numerics import nuslerp_coefficients

        w = ts.weights
        total = w[0] + w[1]
        t = 0.5 if abs(total) < 1e-6 else w[1] / total
        a, b, s = nuslerp_coefficients(t, ts.stats[0].delta_sq, ts.stats[1].delta_sq, ts.pair(0, 1))
        derived: dict = {"t": t}
        if ts.globals.get("nuslerp_flatten", True):
            derived.update({"a": a, "b": b, "s": s})
        return [a / s, b / s], derived

    def row_stats(self, g: Mapping[str, Any]) -> bool:
        return not g.get("nuslerp_flatten", True)

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import filter_width, nuslerp_merge

        d0, d1 = ds_or_zeros(present, 2, base)
        dv = tp.derived
        coef = (dv["a"], dv["b"], dv["s"]) if "a" in dv else None
        return nuslerp_merge(base, d0, d1, coef, filter_width(tp.shape), t=dv["t"])

    def explain_head(self, tp: TensorPlan) -> str:
        d = tp.derived
        if "a" in d:
            return f"nuslerp t={d['t']:.6g}: coefficients from the catalog's norms and ⟨δ₀,δ₁⟩; "
        return f"nuslerp t={d['t']:.6g}: per-row coefficients computed by the engine from the rows it reads; "

    def explain_expert(self, te: TensorExpert) -> tuple[str, str]:
        return "", ""  # (its weights only set t, shown in the head)


METHODS: tuple[MethodSpec, ...] = (
    NuslerpMethod(
        "nuslerp",
        "none",
        None,
        (WEIGHT, NUSLERP_FLATTEN, NUSLERP_ROW_WISE),
        kind="nuslerp",
        min_experts=2,
        max_experts=2,
        paper="mergekit's NuSLERP (slerp of two task vectors)",
    ),
)
