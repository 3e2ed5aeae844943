"""Merge methods as data: one registry, mergekit's names, parameters and defaults.

Every method here is an instance of generalized task arithmetic (mergekit's
``GeneralizedTaskArithmeticMerge``): per expert a task vector ``δᵢ = θᵢ − θ_base`` is
*sparsified* (none / magnitude top-k / random Bernoulli), optionally *rescaled* (L1-norm
matching), multiplied by its ``weight``, optionally passed through a *sign consensus* (TIES sign
election), summed, optionally *normalized* by the sum of (agreeing) weights, scaled by
``lambda`` and added to the base. ``linear`` is the weighted average of the models, which with a
base equals the base plus the weighted average of task vectors.

Sources: Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089); TIES-Merging (Yadav et al.,
2023, arXiv:2306.01708); DARE (Yu et al., 2024, arXiv:2311.03099); mergekit 0.1.5
``merge_methods/generalized_task_arithmetic.py`` and ``sparsify.py`` (defaults below).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mergepipe.errors import InputError

Sparsify = Literal["none", "magnitude", "random"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, default (``None`` = required), allowed range and scope
    (``expert``: settable per expert; ``global``: one value for the merge)."""

    name: str
    default: float | bool | None
    scope: Literal["expert", "global"]
    kind: Literal["float", "bool"] = "float"
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    doc: str = ""

    def check(self, value, where: str):
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise InputError(f"{where}: {self.name} must be true or false, got {value!r}.")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise InputError(f"{where}: {self.name} must be a number, got {value!r}.") from None
        if v != v:
            raise InputError(f"{where}: {self.name} is NaN.")
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            rng = f"({self.lo}, {self.hi}]" if self.lo_open else f"[{self.lo}, {self.hi}]"
            raise InputError(f"{where}: {self.name}={v} is outside {rng}.")
        if self.hi is not None and v > self.hi:
            rng = f"({self.lo}, {self.hi}]" if self.lo_open else f"[{self.lo}, {self.hi}]"
            raise InputError(f"{where}: {self.name}={v} is outside {rng}.")
        return v


WEIGHT = ParamSpec("weight", 1.0, "expert", doc="scale of this expert's task vector")
DENSITY = ParamSpec("density", 1.0, "expert", lo=0.0, hi=1.0, lo_open=True, doc="fraction of task-vector entries kept")
LAMBDA = ParamSpec("lambda", 1.0, "global", doc="scale of the merged task vector")


def _normalize(default: bool) -> ParamSpec:
    return ParamSpec("normalize", default, "global", kind="bool", doc="divide by the sum of (agreeing) weights")


def _rescale(default: bool) -> ParamSpec:
    return ParamSpec("rescale", default, "global", kind="bool", doc="L1-norm matching after sparsification")


@dataclass(frozen=True)
class MethodSpec:
    """A merge method as data.

    Attributes:
        name: mergekit's method name.
        sparsify: how each task vector is sparsified.
        consensus: ``"sum"`` for TIES sign election, else ``None``.
        params: the parameters the method takes (others are refused).
        linear: True for ``linear`` (weighted average of models, not of task vectors).
        paper: the algorithm's source.
    """

    name: str
    sparsify: Sparsify
    consensus: Literal["sum"] | None
    params: tuple[ParamSpec, ...]
    linear: bool = False
    paper: str = ""
    extra: dict = field(default_factory=dict)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        allowed = ", ".join(p.name for p in self.params)
        raise InputError(f"method {self.name!r} takes no parameter {name!r}; allowed: {allowed}.")

    @property
    def uses_density(self) -> bool:
        return self.sparsify != "none"


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} registered twice")
    METHODS[spec.name] = spec
    return spec


register(MethodSpec("linear", "none", None, (WEIGHT, _normalize(True)), linear=True,
                    paper="Model soups (Wortsman et al., 2022, arXiv:2203.05482)"))
register(MethodSpec("task_arithmetic", "none", None, (WEIGHT, LAMBDA, _normalize(False)),
                    paper="Task arithmetic (Ilharco et al., 2023, arXiv:2212.04089)"))
register(MethodSpec("ties", "magnitude", "sum", (WEIGHT, DENSITY, LAMBDA, _normalize(True), _rescale(False)),
                    paper="TIES-Merging (Yadav et al., 2023, arXiv:2306.01708)"))
register(MethodSpec("dare_ties", "random", "sum", (WEIGHT, DENSITY, LAMBDA, _normalize(False), _rescale(True)),
                    paper="DARE (Yu et al., 2024, arXiv:2311.03099) with TIES sign consensus"))
register(MethodSpec("dare_linear", "random", None, (WEIGHT, DENSITY, LAMBDA, _normalize(False), _rescale(True)),
                    paper="DARE (Yu et al., 2024, arXiv:2311.03099)"))


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``.

    Raises:
        InputError: unknown method, listing the allowed names.
    """
    try:
        return METHODS[name]
    except KeyError:
        raise InputError(f"unknown merge method {name!r}; allowed: {', '.join(METHODS)}.") from None


@dataclass(frozen=True)
class ResolvedParams:
    """Parameters of one merge, validated: ``experts[i]`` holds weight/density of expert ``i``."""

    method: str
    experts: tuple[dict, ...]
    globals: dict


def resolve_params(method: str, global_params: dict, expert_params: list[dict]) -> ResolvedParams:
    """Validate and resolve parameters with precedence per-expert > global > method default.

    Args:
        global_params: ``{name: value}`` applying to the merge (and, for expert-scoped names,
            to every expert).
        expert_params: one ``{name: value}`` per expert.

    Raises:
        InputError: a parameter the method does not take, a value out of range (density must
            be in (0, 1]), or a global-only parameter given per expert.
    """
    spec = get_method(method)
    for k in global_params:
        spec.param(k)
    g = {}
    for p in spec.params:
        if p.scope == "global":
            v = global_params.get(p.name, p.default)
            g[p.name] = p.check(v, f"parameter {p.name}")
    experts = []
    for i, ep in enumerate(expert_params):
        d = {}
        for k in ep:
            p = spec.param(k)
            if p.scope != "expert":
                raise InputError(f"expert {i + 1}: {k} is a global parameter of {method}; set it without an expert prefix.")
        for p in spec.params:
            if p.scope == "expert":
                v = ep.get(p.name, global_params.get(p.name, p.default))
                d[p.name] = p.check(v, f"expert {i + 1} parameter {p.name}")
        experts.append(d)
    return ResolvedParams(method, tuple(experts), g)
