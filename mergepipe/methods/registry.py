"""Merge methods as data: one registry, mergekit's names, parameters and defaults.

Most methods here are instances of generalized task arithmetic (mergekit's
``GeneralizedTaskArithmeticMerge``, kind ``gta``): per expert a task vector
``δᵢ = θᵢ − θ_base`` is *sparsified* (none / magnitude top-k / random Bernoulli / magnitude
window without outliers / DELLA's magnitude-ranked Bernoulli), optionally *rescaled* (L1-norm
matching), multiplied by its ``weight``, optionally passed through a *sign consensus* (TIES sign
election), summed, optionally *normalized* by the sum of (agreeing) weights, scaled by
``lambda`` and added to the base. ``linear`` is the weighted average of the models, which with a
base equals the base plus the weighted average of task vectors.

Three methods interpolate instead: ``model_stock`` (the base and the mean of the experts, with a
ratio from the experts' pairwise cosines), ``slerp`` (base and one expert along the great
circle) and ``nuslerp`` (two task vectors along the great circle). Their whole-tensor
statistics (norms, dot products) come from the catalog; see :mod:`mergepipe.numerics`.

Sources: Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089); TIES-Merging (Yadav et al.,
2023, arXiv:2306.01708); DARE (Yu et al., 2024, arXiv:2311.03099); Model Breadcrumbs
(Davari & Belilovsky, 2023, arXiv:2312.06795); DELLA-Merging (Deep et al., 2024,
arXiv:2406.11617); Model Stock (Jang et al., 2024, arXiv:2403.19522); SLERP (Shoemake, 1985);
mergekit 0.1.5 ``merge_methods/*.py`` and ``sparsify.py`` (names, parameters and defaults
below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mergepipe.errors import InputError
from mergepipe.limits import short_repr

Sparsify = Literal["none", "magnitude", "random", "outliers", "della"]
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

    def check(self, value, where: str, loc: tuple = ()):
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
GAMMA = ParamSpec(
    "gamma", 0.01, "expert", lo=0.0, hi=1.0, hi_open=True, doc="fraction of largest magnitudes dropped as outliers"
)
EPSILON = ParamSpec(
    "epsilon",
    0.15,
    "expert",
    lo=0.0,
    hi=1.0,
    doc="keep probabilities run from density-epsilon to density+epsilon by magnitude rank",
)
T = ParamSpec("t", None, "global", lo=0.0, hi=1.0, doc="interpolation position: 0 = base, 1 = expert")
FILTER_WISE = ParamSpec("filter_wise", False, "global", kind="bool", doc="one ratio per row (last-dim vector)")
NUSLERP_FLATTEN = ParamSpec("nuslerp_flatten", True, "global", kind="bool", doc="treat each tensor as one vector")
NUSLERP_ROW_WISE = ParamSpec(
    "nuslerp_row_wise",
    False,
    "global",
    kind="bool",
    doc="with nuslerp_flatten=false: interpolate columns instead of rows (not supported)",
)


WEIGHT_REQUIRED = ParamSpec(
    "weight", None, "expert", doc="interpolation weight of this expert (required, as in mergekit)"
)
NORMALIZE_WEIGHTS = ParamSpec("normalize_weights", True, "global", kind="bool", doc="divide the weights by their sum")
MULTISLERP_EPS = ParamSpec(
    "eps", 1e-8, "global", lo=0.0, lo_open=True, doc="added to every norm before dividing by it (0 divides 0 by 0)"
)
MAX_ITER = ParamSpec("max_iter", 10, "global", kind="int", lo=0, doc="iterations of the Karcher-mean fixed point")
KARCHER_TOL = ParamSpec(
    "tol",
    1e-5,
    "global",
    lo=0.0,
    lo_open=True,
    doc="stop when the tangent step is shorter; smaller norms and angles are 0 (0 divides 0 by 0)",
)
SELECT_TOPK = ParamSpec(
    "select_topk",
    1.0,
    "global",
    lo=0.0,
    hi=1.0,
    doc="fraction of entries kept by the experts' variance (1: all; below 1 needs whole tensors)",
)
NEARSWAP_T = ParamSpec(
    "t", None, "global", lo=0.0, doc="distance below which the expert's value is taken (|δ| clipped at t)"
)
RAM_EPSILON = ParamSpec("epsilon", 1e-5, "global", lo=0.0, doc="|δ| above which an expert contributes an entry")
RAM_R = ParamSpec("r", 0.1, "global", doc="gain on the experts' unique entries")
RAM_ALPHA = ParamSpec("alpha", 0.2, "global", lo=0.0, doc="cap of the shared/unique ratio")
SCALE = ParamSpec("scale", 1.0, "global", doc="factor on every floating tensor of the one input model")


def _normalize(default: bool) -> ParamSpec:
    return ParamSpec("normalize", default, "global", kind="bool", doc="divide by the sum of (agreeing) weights")


def _rescale(default: bool) -> ParamSpec:
    return ParamSpec("rescale", default, "global", kind="bool", doc="L1-norm matching after sparsification")


@dataclass(frozen=True)
class MethodSpec:
    """A merge method as data.

    Attributes:
        name: mergekit's method name.
        sparsify: how each task vector is sparsified (``gta`` methods).
        consensus: ``"sum"`` for TIES sign election, else ``None``.
        params: the parameters the method takes (others are refused).
        kind: ``gta`` (generalized task arithmetic), ``linear``, ``model_stock``, ``slerp``,
            ``nuslerp``.
        min_experts, max_experts: how many experts (models besides the base) it takes.
        paper: the algorithm's source.
        budget: how the method meets an expert-I/O budget. ``blocks``: every output entry
            depends only on the same entry of the inputs, given coefficients fixed at plan time
            from the catalog's whole-tensor statistics, so any subset of expert blocks can be
            read (an unread block counts as an expert equal to the base there). ``whole``: the
            method needs whole-tensor statistics of the expert values that the catalog does not
            keep (a quantile, a top-k across experts, counts of overlapping entries), so every
            expert block with a non-zero task vector is read and a budget is refused
            (:func:`budget_refusal`).
        budget_doc: one line on what a budget does with this method (README, ``explain``).
    """

    name: str
    sparsify: Sparsify
    consensus: Literal["sum"] | None
    params: tuple[ParamSpec, ...]
    kind: Kind = "gta"
    min_experts: int = 1
    max_experts: int | None = None
    paper: str = ""
    extra: dict = field(default_factory=dict)
    budget: Budget = "blocks"
    budget_doc: str = ""

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
    def needs_gram(self) -> bool:
        """Needs the experts' pairwise task-vector dot products from the catalog."""
        return self.kind in ("model_stock", "nuslerp", "multislerp", "karcher")

    @property
    def experts_text(self) -> str:
        if self.max_experts == self.min_experts:
            return f"exactly {self.min_experts}"
        if self.max_experts is None:
            return f"at least {self.min_experts}"
        return f"{self.min_experts} to {self.max_experts}"


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} registered twice")
    METHODS[spec.name] = spec
    return spec


register(
    MethodSpec(
        "linear",
        "none",
        None,
        (WEIGHT, _normalize(True)),
        kind="linear",
        paper="Model soups (Wortsman et al., 2022, arXiv:2203.05482)",
    )
)
register(
    MethodSpec(
        "task_arithmetic",
        "none",
        None,
        (WEIGHT, LAMBDA, _normalize(False), INT8_MASK),
        paper="Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089)",
    )
)
register(
    MethodSpec(
        "ties",
        "magnitude",
        "sum",
        (WEIGHT, DENSITY, LAMBDA, _normalize(True), _rescale(False), INT8_MASK),
        paper="TIES-Merging (Yadav et al., 2023, arXiv:2306.01708)",
    )
)
register(
    MethodSpec(
        "dare_ties",
        "random",
        "sum",
        (WEIGHT, DENSITY, LAMBDA, _normalize(False), _rescale(True), INT8_MASK),
        paper="DARE (Yu et al., 2024, arXiv:2311.03099) with TIES sign consensus",
    )
)
register(
    MethodSpec(
        "dare_linear",
        "random",
        None,
        (WEIGHT, DENSITY, LAMBDA, _normalize(False), _rescale(True), INT8_MASK),
        paper="DARE (Yu et al., 2024, arXiv:2311.03099)",
    )
)
register(
    MethodSpec(
        "breadcrumbs",
        "outliers",
        None,
        (WEIGHT, DENSITY, GAMMA, LAMBDA, _normalize(False), _rescale(False), INT8_MASK),
        paper="Model Breadcrumbs (Davari & Belilovsky, 2023, arXiv:2312.06795)",
    )
)
register(
    MethodSpec(
        "breadcrumbs_ties",
        "outliers",
        "sum",
        (WEIGHT, DENSITY, GAMMA, LAMBDA, _normalize(False), _rescale(False), INT8_MASK),
        paper="Model Breadcrumbs (arXiv:2312.06795) with TIES sign consensus",
    )
)
register(
    MethodSpec(
        "della",
        "della",
        "sum",
        (WEIGHT, DENSITY, EPSILON, LAMBDA, _normalize(True), _rescale(True), INT8_MASK),
        paper="DELLA-Merging (Deep et al., 2024, arXiv:2406.11617)",
    )
)
register(
    MethodSpec(
        "della_linear",
        "della",
        None,
        (WEIGHT, DENSITY, EPSILON, LAMBDA, _normalize(False), _rescale(True), INT8_MASK),
        paper="DELLA-Merging (Deep et al., 2024, arXiv:2406.11617), no sign consensus",
    )
)
register(
    MethodSpec(
        "model_stock",
        "none",
        None,
        (FILTER_WISE,),
        kind="model_stock",
        min_experts=2,
        paper="Model Stock (Jang et al., 2024, arXiv:2403.19522)",
    )
)
register(
    MethodSpec(
        "slerp",
        "none",
        None,
        (T,),
        kind="slerp",
        min_experts=1,
        max_experts=1,
        paper="Spherical linear interpolation (Shoemake, 1985)",
    )
)
register(
    MethodSpec(
        "nuslerp",
        "none",
        None,
        (WEIGHT, NUSLERP_FLATTEN, NUSLERP_ROW_WISE),
        kind="nuslerp",
        min_experts=2,
        max_experts=2,
        paper="mergekit's NuSLERP (slerp of two task vectors)",
    )
)

register(
    MethodSpec(
        "multislerp",
        "none",
        None,
        (WEIGHT_REQUIRED, NORMALIZE_WEIGHTS, MULTISLERP_EPS),
        kind="multislerp",
        min_experts=1,
        paper="Multi-SLERP (Goddard, goddard.blog/posts/multislerp-wow-what-a-cool-idea); mergekit 0.1.5 "
        "merge_methods/multislerp.py",
        budget_doc="blocks: base + Σ cᵢδᵢ with cᵢ from the catalog's norms and pair statistics; unread blocks "
        "are the base",
    )
)
register(
    MethodSpec(
        "karcher",
        "none",
        None,
        (MAX_ITER, KARCHER_TOL),
        kind="karcher",
        min_experts=1,
        paper="Karcher mean on the unit sphere (Karcher, 1977; arXiv:2603.04972); mergekit 0.1.5 "
        "merge_methods/karcher.py",
        budget_doc="blocks: c_b·base + Σ cᵢδᵢ from the catalog's norms and pair statistics; every tensor is "
        "rescaled (c_b ≠ 1), unread blocks are c_b·base",
    )
)
register(
    MethodSpec(
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
    )
)
register(
    MethodSpec(
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
    )
)
register(
    MethodSpec(
        "ram",
        "none",
        None,
        (RAM_EPSILON,),
        kind="ram",
        min_experts=1,
        paper="Reinforced Agent Merging (arXiv:2601.13572); mergekit 0.1.5 merge_methods/ram.py",
        budget_doc="blocks: elementwise (mean of the experts with |δ| > epsilon); unread blocks do not count",
    )
)
register(
    MethodSpec(
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
    )
)
register(
    MethodSpec(
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
    )
)


def method_names() -> tuple[str, ...]:
    """mergekit's names of the registered merge methods, in registration order.

    The one list of methods in the core: front ends (the CLI's ``--method`` help, the operator's
    CRD enum) take theirs from here rather than keeping a copy.
    """
    return tuple(METHODS)


register(
    MethodSpec(
        "passthrough",
        "none",
        None,
        (SCALE,),
        kind="passthrough",
        min_experts=0,
        max_experts=0,
        paper="mergekit 0.1.5 merge_methods/passthrough.py (one input model, optionally scaled)",
        budget_doc="no experts: reads only the one model (the base), expert bytes 0 under any budget",
    )
)


def budget_refusal(spec: MethodSpec, globals_: dict) -> str | None:
    """Why ``spec`` with the merge-wide settings ``globals_`` (as given: scalars, gradients or
    filter lists) cannot honour an expert-I/O budget or a fidelity target, or None when it can
    (see :attr:`MethodSpec.budget`). ``sce`` reads whole tensors only when ``select_topk`` is
    below 1 for some tensor."""
    if spec.budget == "whole":
        return str(spec.extra["whole"])
    if spec.kind == "sce":
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


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``.

    Raises:
        InputError: unknown method, listing the allowed names.
    """
    try:
        return METHODS[name]
    except KeyError:
        raise InputError(f"unknown merge method {name!r}; allowed: {', '.join(METHODS)}.") from None
