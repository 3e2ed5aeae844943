"""NearSwap: take the expert's value where it is near the base (alchemonaut,
huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001; mergekit 0.1.5 ``merge_methods/nearswap.py``).
Elementwise: ``base + δ`` clipped to ``[−t, t]``; unread blocks are the base."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mergepipe.methods.base import MethodSpec, ParamSpec, value_or_base

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

NEARSWAP_T = ParamSpec(
    "t", None, "global", lo=0.0, doc="distance below which the expert's value is taken (|δ| clipped at t)"
)


@dataclass(frozen=True)
class NearswapMethod(MethodSpec):
    needs_expert_values: ClassVar[bool] = True

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import nearswap_merge

        return nearswap_merge(base, value_or_base(present, base), float(tp.params["t"]))


METHODS: tuple[MethodSpec, ...] = (
    NearswapMethod(
        "nearswap",
        "none",
        None,
        (NEARSWAP_T,),
        kind="nearswap",
        min_experts=1,
        max_experts=1,
        paper="NearSwap (alchemonaut, huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001); mergekit 0.1.5 "
        "merge_methods/nearswap.py",
        budget_doc="blocks: elementwise (base + δ clipped to [−t, t]); unread blocks are the base",
    ),
)
