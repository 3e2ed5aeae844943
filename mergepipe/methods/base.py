"""The merge-method protocol: a method is one :class:`MethodSpec` object, its behaviour in methods.

A method declares its parameters (:class:`ParamSpec`) and, through the methods below, everything
the planner, the engine and ``explain`` ask of it:

* **budget semantics** -- :attr:`MethodSpec.budget`, :meth:`MethodSpec.budget_refusal`,
  :meth:`MethodSpec.whole_tensor`, :attr:`MethodSpec.sketch_tiers`;
* **coefficients from catalog statistics** -- :meth:`MethodSpec.coefficients` (whole-tensor
  norms and pair dot products, fixed at plan time and recorded in ``TensorPlan.derived``);
* **block value under a budget** -- :meth:`MethodSpec.block_value` (the retained task-vector
  energy per block the planner's knapsack maximises per byte);
* **chunk kernel** -- :meth:`MethodSpec.merge_chunk` (float32 torch, one row chunk), with
  :meth:`MethodSpec.elementwise`, :meth:`MethodSpec.work_floats`, :meth:`MethodSpec.row_stats`;
* **explanation** -- :meth:`MethodSpec.explain_head` and :meth:`MethodSpec.explain_expert`.

The defaults here are those of an *interpolating* method: the output is ``c_b·base + Σ cᵢδᵢ``-like
with coefficients from the catalog, a block is worth ``cᵢ²·‖δᵢ‖²``. The task-arithmetic family
(:mod:`mergepipe.methods.gta`) overrides the value and the kernel with its sparsifiers
(:mod:`mergepipe.methods.sparsify`). One module per family registers its methods in
:mod:`mergepipe.methods.registry`, as mergekit's ``merge_methods/`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from mergepipe.errors import InputError
from mergepipe.limits import short_repr

if TYPE_CHECKING:
    import torch

    from mergepipe.planner.plan import TensorExpert, TensorPlan

Sparsify = Literal["none", "magnitude", "random", "outliers", "della"]
#: the family names of the registered methods (data for front ends and tests; a new family may
#: use its own name: :attr:`MethodSpec.kind` is a plain string)
Kind = Literal[
    "gta",
    "linear",
    "model_stock",
    "slerp",
    "nuslerp",
    "multislerp",
    "karcher",
    "sce",
    "nearswap",
    "ram",
    "ramplus_tl",
    "arcee_fusion",
    "passthrough",
]
#: How a method meets an expert-I/O budget (see :attr:`MethodSpec.budget`).
Budget = Literal["blocks", "whole"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, default (``None`` = required), allowed range and scope
    (``expert``: settable per expert; ``global``: one value for the merge)."""

    name: str
    default: float | bool | None
    scope: Literal["expert", "global"]
    kind: Literal["float", "bool", "int"] = "float"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    doc: str = ""

    @property
    def range_text(self) -> str:
        if self.kind == "bool":
            return "true or false"
        if self.kind == "int":
            lo = "-inf" if self.lo is None else f"{int(self.lo)}"
            hi = "inf" if self.hi is None else f"{int(self.hi)}"
            return f"integers in [{lo}, {hi}{')' if self.hi is None else ']'}"
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"

    def check(self, value: object, where: str, loc: tuple[str | int, ...] = ()) -> Any:  # bool, int or float
        """Validate one scalar value and return it as ``bool`` or ``float``. Values are typed: a
        boolean parameter takes ``True``/``False``, a numeric one an ``int`` or ``float`` (the
        command line converts its text at its edge, :func:`mergepipe.request.parse_param_args`).

        Args:
            where: the key as the front end names it, prefixed to the message.
            loc: the key as a request field path (:attr:`mergepipe.errors.InputError.loc`).

        Raises:
            InputError: not a boolean / finite number, or outside :attr:`range_text`.
        """

        def bad(problem: str) -> InputError:
            return InputError(f"{where}: {problem}" if where else problem, loc=loc, problem=problem)

        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            raise bad(f"{self.name} must be true or false, got {short_repr(value)}.")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"{self.name} must be a number in {self.range_text}, got {short_repr(value)}.")
        if self.kind == "int" and not (isinstance(value, int) or float(value).is_integer()):
            raise bad(f"{self.name} must be an integer in {self.range_text}, got {short_repr(value)}.")
        v = float(value)
        if v != v or v in (float("inf"), float("-inf")):
            raise bad(f"{self.name} must be a finite number in {self.range_text}, got {short_repr(value)}.")
        out = (self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo))) or (
            self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi))
        )
        if out:
            raise bad(f"{self.name}={v:g} is outside {self.range_text}.")
        return int(v) if self.kind == "int" else v


WEIGHT = ParamSpec("weight", 1.0, "expert", doc="scale of this expert's task vector")
DENSITY = ParamSpec("density", 1.0, "expert", lo=0.0, hi=1.0, lo_open=True, doc="fraction of task-vector entries kept")
LAMBDA = ParamSpec("lambda", 1.0, "global", doc="scale of the merged task vector")
INT8_MASK = ParamSpec(
    "int8_mask",
    False,
    "global",
    kind="bool",
    doc="accepted for mergekit compatibility; only changes mergekit's mask dtype (no numerical effect)",
)


def normalize_param(default: bool) -> ParamSpec:
    """mergekit's ``normalize`` with the method's default."""
    return ParamSpec("normalize", default, "global", kind="bool", doc="divide by the sum of (agreeing) weights")


def rescale_param(default: bool) -> ParamSpec:
    """mergekit's ``rescale`` with the method's default."""
    return ParamSpec("rescale", default, "global", kind="bool", doc="L1-norm matching after sparsification")


@dataclass(frozen=True)
class TensorStatsView:
    """What a method's plan-time hooks see of one tensor: its name, its resolved merge-wide
    parameters, the catalog's statistics of each expert and the pair statistics.

    Attributes:
        name: the tensor's name.
        globals: the resolved global parameters for this tensor (``TensorParams.globals``).
        stats: per expert the catalog's :class:`~mergepipe.catalog.catalog.TensorStats`
            (``sq_norm`` float64 ``[n_blocks]``, ``delta_sq``, ``base_sq``, ``expert_sq``,
            ``base_dot_expert``, the key histogram ...), in plan order.
        weights: per expert its resolved ``weight`` (1.0 where the method has none).
        gram: ``{(i, j): {tensor: ⟨δᵢ,δⱼ⟩}}`` pair statistics (None unless
            :attr:`MethodSpec.needs_gram`).
        base_is_input: the base is also one of the experts (a mergekit config without
            ``base_model``: multislerp then works on the raw weights).
    """

    name: str
    globals: Mapping[str, Any]
    stats: Sequence[Any]
    weights: Sequence[float]
    gram: Mapping | None = None
    base_is_input: bool = False

    @property
    def n_experts(self) -> int:
        return len(self.stats)

    def pair(self, i: int, j: int) -> float:
        """``⟨δᵢ,δⱼ⟩`` of this tensor from the pair statistics (i < j)."""
        assert self.gram is not None  # needs_gram methods are refused without it
        return float(self.gram[(i, j)][self.name])

    def gram_matrix(self) -> np.ndarray:
        """float64 ``[K, K]``: ``‖δᵢ‖²`` on the diagonal, ``⟨δᵢ,δⱼ⟩`` off it."""
        K = self.n_experts
        dd = np.zeros((K, K))
        for i in range(K):
            dd[i, i] = self.stats[i].delta_sq
            for j in range(i + 1, K):
                dd[i, j] = dd[j, i] = self.pair(i, j)
        return dd


@dataclass(frozen=True)
class BlockValue:
    """One expert's value per block of a tensor, and the magnitude-key window the engine keeps.

    Attributes:
        value: float64 ``[n_blocks]``: retained (weighted) task-vector energy per block.
        min_key, max_key: keep entries with ``min_key <= magnitude key < max_key`` (TIES trim,
            breadcrumbs window; ``0, N_KEYS`` = all).
    """

    value: np.ndarray
    min_key: int = 0
    max_key: int = 1 << 15


@dataclass(frozen=True)
class MethodSpec:
    """A merge method: its data (name, parameters, experts, paper, budget semantics) and its
    behaviour (the methods below; the defaults are an interpolating method's).

    Attributes:
        name: mergekit's method name.
        sparsify: how each task vector is sparsified (``gta`` methods; :attr:`sparsifier`).
        consensus: ``"sum"`` for TIES sign election, else ``None``.
        params: the parameters the method takes (others are refused).
        kind: the family (``gta``, ``linear``, ``model_stock``, ``slerp``, ...): data for front
            ends and tests; behaviour is in the subclass's methods, never dispatched on it.
        min_experts, max_experts: how many experts (models besides the base) it takes.
        paper: the algorithm's source.
        budget: how the method meets an expert-I/O budget. ``blocks``: every output entry
            depends only on the same entry of the inputs, given coefficients fixed at plan time
            from the catalog's whole-tensor statistics, so any subset of expert blocks can be
            read (an unread block counts as an expert equal to the base there). ``whole``: the
            method needs whole-tensor statistics of the expert values that the catalog does not
            keep (a quantile, a top-k across experts, counts of overlapping entries), so every
            expert block with a non-zero task vector is read and a budget is refused
            (:meth:`budget_refusal`).
        budget_doc: one line on what a budget does with this method (README, ``explain``).
    """

    name: str
    sparsify: Sparsify
    consensus: Literal["sum"] | None
    params: tuple[ParamSpec, ...]
    kind: str = "gta"
    min_experts: int = 1
    max_experts: int | None = None
    paper: str = ""
    extra: dict = field(default_factory=dict)
    budget: Budget = "blocks"
    budget_doc: str = ""

    #: needs the experts' pairwise task-vector dot products from the catalog
    needs_gram: ClassVar[bool] = False
    #: the chunk kernel needs the experts' values θᵢ, not only their task vectors δᵢ
    needs_expert_values: ClassVar[bool] = False
    #: blocks may be merged from sign-plane sketches (the task-arithmetic family)
    sketch_tiers: ClassVar[bool] = False
    #: text added to "takes N expert(s) besides the base" refusals
    experts_note: ClassVar[str] = ""
    #: the engine merges it as sparsify -> L1 rescale -> :func:`~mergepipe.methods.kernels.combine`
    #: (the task-arithmetic family) rather than with :meth:`merge_chunk`
    combines_task_vectors: ClassVar[bool] = False

    # --- parameters -----------------------------------------------------------------------

    def param(self, name: str, where: str = "", loc: tuple = ()) -> ParamSpec:
        """The parameter ``name``.

        Raises:
            InputError: the method takes no such parameter (message prefixed with ``where``,
                ``loc`` attached), listing the ones it takes.
        """
        for p in self.params:
            if p.name == name:
                return p
        allowed = ", ".join(p.name for p in self.params) or "none"
        problem = f"method {self.name!r} takes no parameter {name!r}; allowed: {allowed}."
        raise InputError(f"{where}: {problem}" if where else problem, loc=loc, problem=problem)

    def check_globals(self, g: Mapping[str, Any]) -> tuple[str, str] | None:
        """A combination of resolved global parameters the method refuses: ``(parameter,
        problem)``, or None. Called once per request (:func:`mergepipe.methods.params.resolve_params`)."""
        return None

    def check_tensor(self, name: str, experts: Sequence[Mapping[str, Any]]) -> tuple[int, tuple[str, ...], str] | None:
        """A per-tensor combination of expert parameters the method refuses: ``(expert index,
        the parameters involved (the first is the error's field), problem)``, or None."""
        return None

    @property
    def linear(self) -> bool:
        return self.kind == "linear"

    @property
    def uses_density(self) -> bool:
        return self.sparsify != "none"

    @property
    def has_weights(self) -> bool:
        return any(p.name == "weight" for p in self.params)

    @property
    def experts_text(self) -> str:
        if self.max_experts == self.min_experts:
            return f"exactly {self.min_experts}"
        if self.max_experts is None:
            return f"at least {self.min_experts}"
        return f"{self.min_experts} to {self.max_experts}"

    # --- budget semantics -----------------------------------------------------------------

    def budget_refusal(self, globals_: Mapping[str, Any]) -> str | None:
        """Why this method with the merge-wide settings ``globals_`` (as given: scalars,
        gradients or filter lists) cannot honour an expert-I/O budget or a fidelity target, or
        None when it can (see :attr:`budget`)."""
        if self.budget == "whole":
            return str(self.extra["whole"])
        return None

    def whole_tensor(self, g: Mapping[str, Any]) -> bool:
        """The engine merges this tensor in one chunk: its statistics are whole-tensor functions
        of the expert values that the catalog does not keep."""
        return self.budget == "whole"

    def rescales(self, g: Mapping[str, Any]) -> bool:
        """The method L1-rescales each sparsified task vector (``rescale`` on a sparsifying
        task-arithmetic method): the one rescale rule of the planner and the engine."""
        return False

    # --- plan time: coefficients and block values -----------------------------------------

    def coefficients(self, ts: TensorStatsView) -> tuple[list[float], dict]:
        """Per-expert coefficient of the task vector in the output, from the catalog's
        whole-tensor statistics, and what the engine needs of them (``TensorPlan.derived``).

        Returns:
            (K floats, derived dict). Default: ``[1.0] * K`` and nothing derived.

        Raises:
            InputError: the statistics admit no coefficients (e.g. multislerp weights whose
                combination has zero norm).
        """
        return [1.0] * ts.n_experts, {}

    def exact_bounds(
        self, ts: TensorStatsView, experts: Sequence[Mapping[str, Any]], dtype: str, group_cap: int | None
    ) -> tuple[list[int], list[tuple[int, int, int, int] | None]]:
        """Exact-threshold refinements the engine makes inside magnitude-key groups (TIES's
        trim, breadcrumbs' window): per expert the rank inside the threshold group (0: none,
        -1: only the outlier bound) and the breadcrumbs window ``(τ_lo, r_lo, τ_hi, r_hi)``.
        Default: none."""
        K = ts.n_experts
        return [0] * K, [None] * K

    def block_value(
        self,
        ts: TensorStatsView,
        i: int,
        ep: Mapping[str, Any],
        coef: float,
        row_stats: bool,
        bounds: tuple[int, tuple[int, int, int, int] | None],
    ) -> BlockValue:
        """Expert ``i``'s value per block of the tensor: the energy its blocks contribute to
        the output, ``cᵢ²·‖δᵢ,block‖²`` by default. With ``row_stats`` the coefficient is an
        estimate (the engine computes it per row), floored so that every block with a non-zero
        task vector has a positive value."""
        c2 = coef**2
        if row_stats:
            c2 = max(c2, 1e-12)
        return BlockValue(ts.stats[i].sq_norm * c2)

    def copies_base(self, tp: TensorPlan) -> bool:
        """A floating tensor no expert block reaches (``tp.experts`` empty after selection) is
        copied from the base: all-zero task vectors give back the base exactly."""
        return not tp.experts and self.identity_on_zero_delta(tp.weight_sum, tp.params)

    def identity_on_zero_delta(self, weight_sum: float, globals_: Mapping[str, Any]) -> bool:
        """True when all-zero task vectors give back the base exactly. ``weight_sum``: the
        tensor's sum of weights."""
        return True

    def zero_delta_droppable(self, globals_: Mapping[str, Any]) -> bool:
        """True when :meth:`combine` gives the same bits with an expert whose task vector is
        all zeros left out of ``deltas``/``weights`` (``weight_sum`` still counts it), so the
        tiled engine skips experts with nothing on a tile. Default: no."""
        return False

    # --- engine: the chunk kernel ---------------------------------------------------------

    def row_stats(self, g: Mapping[str, Any]) -> bool:
        """The engine computes row-local statistics (a 1-D tensor must then be one chunk)."""
        return False

    def elementwise(self, dtype: str) -> bool:
        """The engine merges a tensor of ``dtype`` tile by tile (every operation elementwise
        given the plan's parameters). Default: no (whole chunks)."""
        return False

    def work_floats(self, n_experts: int, elementwise: bool) -> int:
        """float32 arrays per tensor element the engine holds while merging one chunk
        (:func:`mergepipe.methods.kernels.work_floats` documents the measurements)."""
        return n_experts + 3 if elementwise else n_experts + 7

    def merge_chunk(
        self, base: torch.Tensor, present: Mapping[int, tuple], tp: TensorPlan, n_experts: int
    ) -> torch.Tensor:
        """Merge one row chunk on its torch device.

        Args:
            base: float32 ``(n,)`` the base's elements of the chunk.
            present: expert index -> ``(TensorExpert, δ, θ)``: float32 ``(n,)`` task vector
                (zeros on unread rows) and, when :attr:`needs_expert_values`, the expert's
                values (the base on unread rows), else None. Experts with no block in the
                tensor are absent.
            tp: the :class:`~mergepipe.planner.plan.TensorPlan` (``params``, ``derived``, shape).
            n_experts: K, the merge's number of experts.

        Returns:
            float32 ``(n,)`` merged values.
        """
        raise NotImplementedError(f"{self.name}: no chunk kernel")

    def combine(
        self,
        base: torch.Tensor,
        deltas: list[torch.Tensor],
        weights: list[float],
        globals_: Mapping[str, Any],
        weight_sum: float | None = None,
        consume: bool = False,
    ) -> torch.Tensor:
        """The task-arithmetic family's combination of sparsified, rescaled task vectors
        (:attr:`combines_task_vectors`; :func:`mergepipe.methods.kernels.combine` documents the
        arguments). float32 ``(n,)``."""
        raise NotImplementedError(f"{self.name}: not a task-arithmetic method")

    # --- explanation ----------------------------------------------------------------------

    def explain_head(self, tp: TensorPlan) -> str:
        """The tensor explanation's opening: how this tensor's coefficients were found (``""``
        when there is nothing to say)."""
        if self.budget == "whole":
            return f"{self.kind}: whole-tensor statistics computed by the engine over the whole tensor (one chunk); "
        return ""

    def explain_expert(self, te: TensorExpert) -> tuple[str, str]:
        """(parameters, threshold) texts of one ``TensorExpert`` in the tensor explanation."""
        if not self.has_weights:
            return "", ""
        return f" (weight {te.weight:g}" + (f", density {te.density:g}" if self.uses_density else "") + ")", ""

    def explain_copy(self, tp: TensorPlan) -> str | None:
        """Why a floating tensor was copied from the base, when the method has its own reason."""
        return None


def ds_or_zeros(present: Mapping[int, tuple], n_experts: int, like: torch.Tensor) -> list[torch.Tensor]:
    """Every expert's task vector in plan order, zeros for experts absent from the chunk."""
    import torch

    return [present[i][1] if i in present else torch.zeros_like(like) for i in range(n_experts)]


def value_or_base(present: Mapping[int, tuple], base: torch.Tensor) -> torch.Tensor:
    """Expert 0's values over the chunk (the base where it has no block)."""
    return present[0][2] if 0 in present else base
