"""Model Stock: the base and the mean of the experts, with a ratio from the experts' pairwise
cosines (Jang et al., 2024, arXiv:2403.19522; mergekit ``merge_methods/model_stock.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mergepipe.methods.base import MethodSpec, ParamSpec, TensorStatsView, ds_or_zeros

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

FILTER_WISE = ParamSpec("filter_wise", False, "global", kind="bool", doc="one ratio per row (last-dim vector)")


@dataclass(frozen=True)
class ModelStockMethod(MethodSpec):
    needs_gram: ClassVar[bool] = True
    experts_note: ClassVar[str] = " (3 models including the base)"

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        from mergepipe.numerics import model_stock_t

        K = ts.n_experts
        assert ts.gram is not None
        t = float(
            model_stock_t(K, [st.delta_sq for st in ts.stats], {k: float(v[ts.name]) for k, v in ts.gram.items()})
        )
        return [t / K] * K, ({} if ts.globals.get("filter_wise") else {"t": t})

    def row_stats(self, g: Mapping[str, Any]) -> bool:
        return bool(g.get("filter_wise"))

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import filter_width, model_stock_merge

        t = None if tp.params.get("filter_wise") else tp.derived["t"]
        return model_stock_merge(base, ds_or_zeros(present, n_experts, base), t, filter_width(tp.shape))

    def explain_head(self, tp: TensorPlan) -> str:
        if tp.params.get("filter_wise"):
            return (
                "model_stock filter_wise: per-row ratio computed by the engine from the rows it reads (unread "
                "rows count as δ = 0); "
            )
        return f"model_stock t={tp.derived['t']:.6g} from the catalog's pairwise cosines; "


METHODS: tuple[MethodSpec, ...] = (
    ModelStockMethod(
        "model_stock",
        "none",
        None,
        (FILTER_WISE,),
        kind="model_stock",
        min_experts=2,
        paper="Model Stock (Jang et al., 2024, arXiv:2403.19522)",
    ),
)
