"""Passthrough: one input model, optionally scaled (mergekit 0.1.5 ``merge_methods/passthrough.py``);
no experts, so it reads only the base."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mergepipe.methods.base import MethodSpec, ParamSpec

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

SCALE = ParamSpec("scale", 1.0, "global", doc="factor on every floating tensor of the one input model")


@dataclass(frozen=True)
class PassthroughMethod(MethodSpec):
    def identity_on_zero_delta(self, weight_sum: float, globals_: Mapping[str, Any]) -> bool:
        return globals_.get("scale", 1.0) == 1.0

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        return base * float(tp.params["scale"])  # mergekit: tensor * scale


METHODS: tuple[MethodSpec, ...] = (
    PassthroughMethod(
        "passthrough",
        "none",
        None,
        (SCALE,),
        kind="passthrough",
        min_experts=0,
        max_experts=0,
        paper="mergekit 0.1.5 merge_methods/passthrough.py (one input model, optionally scaled)",
        budget_doc="no experts: reads only the one model (the base), expert bytes 0 under any budget",
    ),
)
