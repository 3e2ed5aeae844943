"""SLERP: the base and one expert along the great circle (Shoemake, 1985; mergekit
``merge_methods/slerp.py``). The coefficients come from the catalog's exact ``Σθ_b²``,
``Σθ_e²`` and ``Σθ_b·θ_e`` of the tensor (:func:`mergepipe.numerics.slerp_coefficients`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mergepipe.methods.base import MethodSpec, ParamSpec, TensorStatsView, value_or_base

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

T = ParamSpec("t", None, "global", lo=0.0, hi=1.0, doc="interpolation position: 0 = base, 1 = expert")


@dataclass(frozen=True)
class SlerpMethod(MethodSpec):
    needs_expert_values: ClassVar[bool] = True
    experts_note: ClassVar[str] = " (the base and one expert)"

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        from mergepipe.numerics import slerp_coefficients

        st = ts.stats[0]
        ca, cb = slerp_coefficients(float(ts.globals["t"]), st.base_sq, st.expert_sq, st.base_dot_expert)
        return [cb], {"c_base": ca, "c_expert": cb}

    def copies_base(self, tp: TensorPlan) -> bool:
        return tp.params["t"] == 0.0  # t = 0 is the base; otherwise slerp rescales even the base

    def identity_on_zero_delta(self, weight_sum: float, globals_: Mapping[str, Any]) -> bool:
        return globals_.get("t") == 0.0

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import slerp_merge

        return slerp_merge(base, value_or_base(present, base), tp.derived["c_base"], tp.derived["c_expert"])

    def explain_copy(self, tp: TensorPlan) -> str | None:
        return "copied from base: slerp t=0" if tp.params.get("t") == 0.0 else None

    def explain_head(self, tp: TensorPlan) -> str:
        d = tp.derived
        return (
            f"slerp t={tp.params['t']:g}: {d['c_base']:.6g}·base + {d['c_expert']:.6g}·expert (coefficients "
            "from the catalog's whole-tensor norms and dot product); "
        )


METHODS: tuple[MethodSpec, ...] = (
    SlerpMethod(
        "slerp",
        "none",
        None,
        (T,),
        kind="slerp",
        min_experts=1,
        max_experts=1,
        paper="Spherical linear interpolation (Shoemake, 1985)",
    ),
)
