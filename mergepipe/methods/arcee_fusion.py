"""Arcee Fusion (arcee.ai; mergekit 0.1.5 ``merge_methods/arcee_fusion.py``): the expert's
values where their importance exceeds a quantile of it over the whole tensor; merges whole
tensors and refuses a budget."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mergepipe.methods.base import MethodSpec, value_or_base

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan


@dataclass(frozen=True)
class ArceeFusionMethod(MethodSpec):
    needs_expert_values: ClassVar[bool] = True

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import arcee_fusion_merge, filter_width

        return arcee_fusion_merge(base, value_or_base(present, base), filter_width(tp.shape))


METHODS: tuple[MethodSpec, ...] = (
    ArceeFusionMethod(
        "arcee_fusion",
        "none",
        None,
        (),
        kind="arcee_fusion",
        min_experts=1,
        max_experts=1,
        paper="Arcee Fusion (arcee.ai); mergekit 0.1.5 merge_methods/arcee_fusion.py",
        budget="whole",
        budget_doc="whole: refuses a budget (its threshold is a quantile of the importance over the whole tensor)",
        extra={"whole": "its threshold is a quantile of the importance over the whole tensor"},
    ),
)
