"""Reinforced Agent Merging (arXiv:2601.13572; mergekit 0.1.5 ``merge_methods/ram.py``): ``ram``
averages the experts whose ``|δ|`` exceeds ``epsilon`` entry by entry (elementwise, any blocks);
``ramplus_tl`` also gains each expert by its shared and unique entries counted over the whole
tensor, so it merges whole tensors and refuses a budget."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mergepipe.methods.base import MethodSpec, ParamSpec

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorPlan

RAM_EPSILON = ParamSpec("epsilon", 1e-5, "global", lo=0.0, doc="|δ| above which an expert contributes an entry")
RAM_R = ParamSpec("r", 0.1, "global", doc="gain on the experts' unique entries")
RAM_ALPHA = ParamSpec("alpha", 0.2, "global", lo=0.0, doc="cap of the shared/unique ratio")


@dataclass(frozen=True)
class RamMethod(MethodSpec):
    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        from mergepipe.methods.kernels import ram_counts, ram_merge, ramplus_gains

        ds = [present[i][1] for i in sorted(present)]
        if not ds:
            return base
        eps = float(tp.params["epsilon"])
        gains = None
        if self.whole_tensor(tp.params):  # the whole tensor is this chunk
            gains = ramplus_gains(ram_counts(ds, eps), float(tp.params["r"]), float(tp.params["alpha"]), eps)
        return ram_merge(base, ds, eps, gains)


METHODS: tuple[MethodSpec, ...] = (
    RamMethod(
        "ram",
        "none",
        None,
        (RAM_EPSILON,),
        kind="ram",
        min_experts=1,
        paper="Reinforced Agent Merging (arXiv:2601.13572); mergekit 0.1.5 merge_methods/ram.py",
        budget_doc="blocks: elementwise (mean of the experts with |δ| > epsilon); unread blocks do not count",
    ),
    RamMethod(
        "ramplus_tl",
        "none",
        None,
        (RAM_R, RAM_ALPHA, RAM_EPSILON),
        kind="ramplus_tl",
        min_experts=1,
        paper="Reinforced Agent Merging Plus, tensor-local (arXiv:2601.13572); mergekit 0.1.5 merge_methods/ram.py",
        budget="whole",
        budget_doc="whole: refuses a budget (each expert's gain counts its shared and unique entries over the "
        "whole tensor)",
        extra={"whole": "each expert's gain counts its shared and unique entries over the whole tensor"},
    ),
)
