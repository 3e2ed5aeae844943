"""SCE: select, calculate, erase (Wan et al., FuseChat, 2024, arXiv:2408.07990; mergekit 0.1.5
``merge_methods/sce.py``). With ``select_topk = 1`` the weights come from the catalog's
``‖δᵢ‖²`` (:func:`mergepipe.numerics.sce_weights`); below 1 the mask is a top-k of the
experts' variance over the whole tensor, so the engine merges it in one chunk and a budget is
refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mergepipe.methods.base import INT8_MASK, MethodSpec, ParamSpec, TensorStatsView, ds_or_zeros

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

SELECT_TOPK = ParamSpec(
    "select_topk",
    1.0,
    "global",
    lo=0.0,
    hi=1.0,
    doc="fraction of entries kept by the experts' variance (1: all; below 1 needs whole tensors)",
)


@dataclass(frozen=True)
class SceMethod(MethodSpec):
    def budget_refusal(self, globals_: Mapping[str, Any]) -> str | None:
        v = globals_.get("select_topk", 1.0)
        items = v if isinstance(v, list) else [v]
        flat: list = []
        for e in items:
            e = e.get("value") if isinstance(e, dict) else e
            flat.extend(e if isinstance(e, list) else [e])
        if any(isinstance(x, (int, float)) and float(x) < 1.0 for x in flat):
            return (
                "with select_topk < 1 its mask is a top-k of the experts' per-entry variance over the whole "
                "tensor, and its weights are means over that mask"
            )
        return None

    def whole_tensor(self, g: Mapping[str, Any]) -> bool:
        return float(g.get("select_topk", 1.0)) < 1.0

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        from mergepipe.numerics import sce_weights

        if self.whole_tensor(ts.globals):
            return [1.0] * ts.n_experts, {}
        ws = sce_weights([st.delta_sq for st in ts.stats], ts.stats[0].numel)
        return ws, {f"w{i}": w for i, w in enumerate(ws)}

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import sce_merge

        topk = float(tp.params.get("select_topk", 1.0))
        ws = None if topk < 1.0 else [tp.derived[f"w{i}"] for i in range(n_experts)]
        return sce_merge(base, ds_or_zeros(present, n_experts, base), ws, topk)

    def explain_head(self, tp: TensorPlan) -> str:
        d = tp.derived
        if d:
            return f"sce: weights [{', '.join(f'{d[k]:.6g}' for k in sorted(d))}] from the catalog's ‖δᵢ‖²; "
        return "sce: whole-tensor statistics computed by the engine over the whole tensor (one chunk); "


METHODS: tuple[MethodSpec, ...] = (
    SceMethod(
        "sce",
        "none",
        "sum",
        (SELECT_TOPK, INT8_MASK),
        kind="sce",
        min_experts=1,
        paper="SCE: select, calculate, erase (Wan et al., FuseChat, 2024, arXiv:2408.07990); mergekit 0.1.5 "
        "merge_methods/sce.py",
        budget_doc="blocks with select_topk = 1 (weights from the catalog's ‖δᵢ‖²); select_topk < 1 refuses a "
        "budget (a top-k of the experts' variance over whole tensors)",
    ),
)
