"""Linear: the weighted average of the models (mergekit ``merge_methods/linear.py``); with a
base, the base plus the weighted average of the task vectors (Model soups, Wortsman et al.,
2022, arXiv:2203.05482)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mergepipe.methods.base import WEIGHT, MethodSpec, normalize_param
from mergepipe.methods.gta import TaskArithmeticMethod

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LinearMethod(TaskArithmeticMethod):
    """A task-arithmetic method whose combination is the weighted sum (``normalize``: mean)."""

    def work_floats(self, n_experts: int, elementwise: bool) -> int:
        return n_experts + 3 if elementwise else n_experts + 7

    def combine(
        self,
        base: torch.Tensor,
        deltas: list[torch.Tensor],
        weights: list[float],
        globals_: Mapping[str, Any],
        weight_sum: float | None = None,
        consume: bool = False,
    ) -> torch.Tensor:
        """The weighted sum (mean with ``normalize``): :func:`~mergepipe.methods.kernels.linear_combine`."""
        from mergepipe.methods.kernels import linear_combine

        return linear_combine(base, deltas, weights, globals_, weight_sum)

    def zero_delta_droppable(self, globals_: Mapping[str, Any]) -> bool:
        # without normalize the output is base·Σwᵢ + Σwᵢδᵢ, where the sign of a zero sum can show
        # (a negative weight makes a zero task vector −0)
        return bool(globals_.get("normalize", True))

    def identity_on_zero_delta(self, weight_sum: float, globals_: Mapping[str, Any]) -> bool:
        # without normalize the output is base·Σwᵢ + Σwᵢδᵢ: the base only when Σwᵢ = 1
        return bool(globals_.get("normalize", True)) or weight_sum == 1.0


METHODS: tuple[MethodSpec, ...] = (
    LinearMethod(
        "linear",
        "none",
        None,
        (WEIGHT, normalize_param(True)),
        kind="linear",
        paper="Model soups (Wortsman et al., 2022, arXiv:2203.05482)",
    ),
)
