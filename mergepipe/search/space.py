"""The search space of a layer-wise merge search: which parameter varies per layer block, within
which bounds, and how a point of the unit cube becomes mergepipe parameters.

A *varying parameter* is ``[EXPERT:]NAME=LO:HI``: parameter ``NAME`` of the method (mergekit's
names: ``weight``, ``density``, ``lambda``, ...) takes one value per *layer block* in
``[LO, HI]``; an expert-scoped parameter without ``EXPERT`` varies separately for every expert.
The ``L`` decoder layers of the base are cut into ``B`` contiguous blocks
(``block(ℓ) = ⌊ℓ·B/L⌋``, so every block holds ⌊L/B⌋ or ⌈L/B⌉ layers); each block value becomes one
entry of a mergepipe *filter list* per layer (``{"filter": "layers.ℓ.", "value": v}``, README
"Layer-wise parameters"), and tensors outside the decoder layers (embeddings, final norm,
``lm_head``) take the mean of the block values (a catch-all entry). The search therefore has
``d = Σ_vary (experts it applies to) × B`` dimensions; coordinate ``x ∈ [0, 1]`` maps to
``LO + x·(HI − LO)``.

A point becomes a candidate's parameter settings (:data:`Params`: merge-wide and per-expert
settings, structured values), from which the search builds a :class:`mergepipe.request.MergeRequest`
that goes through the normal validation of :func:`mergepipe.pipeline.build_plan`, so a candidate is
planned exactly like a user's merge.
This layout follows AP-BMM's per-layer merge weights (MiLab-HITSZ/AP-BMM), generalised to any
numeric parameter and to blocks of layers.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mergepipe.errors import InputError
from mergepipe.methods.params import LAYER_RE, layer_count
from mergepipe.methods.registry import get_method

#: A candidate's (or the fixed) parameter settings: ``{"parameters": {name: setting},
#: "experts": {expert name: {name: setting}}}`` — the parameter part of a merge request.
Params = dict


def params_from_args(items: Sequence[str], method: str, experts: Sequence[str]) -> Params:
    """:data:`Params` from ``--param`` strings (the command line's grammar,
    :func:`mergepipe.request.parse_param_args`)."""
    from mergepipe.request import parse_param_args

    glob, per = parse_param_args(items, method, experts)
    return {"parameters": glob, "experts": {n: p for n, p in zip(experts, per) if p}}


def as_params(fixed: Any, method: str, experts: Sequence[str]) -> Params:
    """``fixed`` as :data:`Params`; a list is ``--param`` strings (searches recorded before the
    settings were structured)."""
    if isinstance(fixed, (list, tuple)):
        return params_from_args(list(fixed), method, experts)
    fixed = dict(fixed or {})
    return {
        "parameters": dict(fixed.get("parameters") or {}),
        "experts": {k: dict(v) for k, v in (fixed.get("experts") or {}).items()},
    }


_VARY_RE = re.compile(r"(?:([^:=]+):)?([A-Za-z_][A-Za-z0-9_]*)=([^:]+):([^:]+)")


@dataclass(frozen=True)
class Vary:
    """One varying parameter: ``name`` in ``[lo, hi]`` per layer block, for ``expert`` (an expert
    name) or for every expert (``None``; or the merge, for a global parameter)."""

    name: str
    lo: float
    hi: float
    expert: str | None = None


@dataclass(frozen=True)
class Dim:
    """One coordinate of the search space.

    Attributes:
        name: the parameter; ``expert``: the expert it applies to (None: global parameter);
        block: layer block index; ``layers``: the decoder layers of that block; ``lo, hi``: bounds.
    """

    name: str
    expert: str | None
    block: int
    layers: tuple[int, ...]
    lo: float
    hi: float

    @property
    def label(self) -> str:
        who = f"{self.expert}:" if self.expert else ""
        span = f"{self.layers[0]}" if len(self.layers) == 1 else f"{self.layers[0]}-{self.layers[-1]}"
        return f"{who}{self.name}@L{span}"


def parse_vary(items: Sequence[str]) -> list[Vary]:
    """Parse ``--vary`` items ``[EXPERT:]NAME=LO:HI`` (e.g. ``weight=0:1``, ``math:density=0.2:0.9``).

    Raises:
        InputError: malformed item, non-numeric bounds, or reversed/empty bounds (``LO >= HI``).
    """
    out = []
    for it in items:
        m = _VARY_RE.fullmatch(it.strip())
        if not m:
            raise InputError(
                f"--vary {it!r}: expected [EXPERT:]NAME=LO:HI, e.g. --vary weight=0:1 or --vary math:density=0.2:0.9."
            )
        try:
            lo, hi = float(m.group(3)), float(m.group(4))
        except ValueError:
            raise InputError(f"--vary {it!r}: the bounds must be numbers, e.g. weight=0:1.") from None
        if not lo < hi:
            raise InputError(
                f"--vary {it!r}: the bounds are reversed or empty (LO={lo:g} >= HI={hi:g}); "
                f"write {m.group(2)}={min(lo, hi):g}:{max(lo, hi):g} with LO < HI."
            )
        out.append(Vary(m.group(2), lo, hi, m.group(1)))
    return out


def space_for_base(
    layout_names: Sequence[str],
    method: str,
    experts: Sequence[str],
    vary: Sequence[Vary],
    n_blocks: int,
    fixed: Params | None = None,
) -> SearchSpace:
    """The :class:`SearchSpace` of a base checkpoint whose tensor names are ``layout_names``
    (the number of layers and the layer path component come from the names)."""
    words = {m.group(0).strip(".").split(".")[0] for m in (LAYER_RE.search(n) for n in layout_names) if m}
    word = "layers" if "layers" in words or not words else sorted(words)[0]
    return SearchSpace(
        method, list(experts), list(vary), layer_count(layout_names), n_blocks, as_params(fixed, method, experts), word
    )


def layer_blocks(n_layers: int, n_blocks: int) -> list[tuple[int, ...]]:
    """Cut layers ``0..n_layers-1`` into ``n_blocks`` contiguous blocks (``⌊ℓ·B/L⌋``).

    Raises:
        InputError: ``n_blocks < 1``, more blocks than layers, or no layers.
    """
    if n_layers < 1:
        raise InputError(
            "--layer-blocks: the base has no decoder layers (no tensor name with a "
            "layers.N component); a layer-wise search needs them."
        )
    if not 1 <= n_blocks <= n_layers:
        raise InputError(f"--layer-blocks {n_blocks}: must be between 1 and the base's {n_layers} layers.")
    blocks: list[list[int]] = [[] for _ in range(n_blocks)]
    for ell in range(n_layers):
        blocks[ell * n_blocks // n_layers].append(ell)
    return [tuple(b) for b in blocks]


@dataclass
class SearchSpace:
    """Dimensions of the search and the map from ``[0, 1]^d`` to parameter settings.

    Attributes:
        method: merge method; ``experts``: expert names (order of the merge); ``vary``: the
        varying parameters; ``n_layers``: decoder layers of the base; ``n_blocks``: layer blocks;
        ``fixed``: the other settings (:data:`Params`), applied to every candidate; ``layer_word``:
        the path component before the layer index in the base's tensor names (``layers`` in
        ``model.layers.3.mlp…``, ``h`` in ``transformer.h.3…``).
    """

    method: str
    experts: list[str]
    vary: list[Vary]
    n_layers: int
    n_blocks: int
    fixed: Params = field(default_factory=dict)
    layer_word: str = "layers"

    def __post_init__(self) -> None:
        self.fixed = as_params(self.fixed, self.method, self.experts)
        self.validate()

    # -- construction / serialization --------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "method": self.method,
            "experts": list(self.experts),
            "vary": [asdict(v) for v in self.vary],
            "n_layers": self.n_layers,
            "n_blocks": self.n_blocks,
            "fixed": copy.deepcopy(self.fixed),
            "layer_word": self.layer_word,
        }

    @classmethod
    def from_json(cls, d: dict) -> SearchSpace:
        return cls(
            d["method"],
            list(d["experts"]),
            [Vary(**v) for v in d["vary"]],
            int(d["n_layers"]),
            int(d["n_blocks"]),
            d["fixed"],
            d.get("layer_word", "layers"),
        )

    def validate(self) -> None:
        """Check the varying parameters against the method (name, scope, allowed range of both
        bounds) and the experts.

        Raises:
            InputError: unknown parameter, boolean parameter, an expert that is not in the merge,
                a bound outside the parameter's range, reversed bounds, the same parameter varied
                twice for one expert, or a parameter both varied and fixed.
        """
        spec = get_method(self.method)
        if not self.vary:
            raise InputError("--vary: nothing varies; give e.g. --vary weight=0:1 (one value per layer block).")
        layer_blocks(self.n_layers, self.n_blocks)
        seen = set()
        for v in self.vary:
            where = f"--vary {(v.expert + ':') if v.expert else ''}{v.name}={v.lo:g}:{v.hi:g}"
            p = spec.param(v.name, where)
            if p.kind == "bool":
                raise InputError(f"{where}: {v.name} is a boolean; only numeric parameters vary per layer block.")
            if not v.lo < v.hi:
                raise InputError(f"{where}: the bounds are reversed or empty (LO >= HI); give LO < HI.")
            p.check(v.lo, f"{where} (LO)")
            p.check(v.hi, f"{where} (HI)")
            if v.expert is not None:
                if p.scope != "expert":
                    raise InputError(
                        f"{where}: {v.name} is a global parameter of {self.method}; vary it without an expert name."
                    )
                if v.expert not in self.experts:
                    raise InputError(f"{where}: no expert named {v.expert!r}; experts are {', '.join(self.experts)}.")
            for e in self._targets(v, p.scope):
                if (e, v.name) in seen:
                    raise InputError(f"{where}: {v.name} already varies for {e or 'the merge'}; vary it once.")
                seen.add((e, v.name))
        for e, name in seen:
            if name in self.fixed["parameters"]:
                raise InputError(f"--param {name}: {name} is also varied by --vary; drop one of the two.")
            for who, own in self.fixed["experts"].items():
                if name in own and (e is None or e == who):
                    raise InputError(f"--param {who}:{name}: {name} is also varied by --vary; drop one of the two.")

    def _targets(self, v: Vary, scope: str) -> list[str | None]:
        if scope == "global":
            return [None]
        return [v.expert] if v.expert else list(self.experts)

    # -- geometry -----------------------------------------------------------------------------
    @property
    def blocks(self) -> list[tuple[int, ...]]:
        return layer_blocks(self.n_layers, self.n_blocks)

    @property
    def dims(self) -> list[Dim]:
        """The coordinates, ordered by varying parameter, then expert, then layer block."""
        spec = get_method(self.method)
        out = []
        for v in self.vary:
            for e in self._targets(v, spec.param(v.name, v.name).scope):
                for b, layers in enumerate(self.blocks):
                    out.append(Dim(v.name, e, b, layers, v.lo, v.hi))
        return out

    @property
    def d(self) -> int:
        return len(self.dims)

    def values(self, x: Sequence[float]) -> list[float]:
        """Parameter value of each coordinate for a unit-cube point ``x`` (length ``d``).

        Raises:
            ValueError: wrong length or a coordinate outside [0, 1].
        """
        dims = self.dims
        if len(x) != len(dims):
            raise ValueError(f"point has {len(x)} coordinates, the space has {len(dims)}")
        out = []
        for xi, dm in zip(x, dims):
            if not -1e-9 <= float(xi) <= 1 + 1e-9:
                raise ValueError(f"coordinate {dm.label}={xi} is outside [0, 1]")
            xi = min(1.0, max(0.0, float(xi)))
            out.append(round(dm.lo + xi * (dm.hi - dm.lo), 6))
        return out

    def to_params(self, x: Sequence[float]) -> Params:
        """The settings of point ``x`` (:data:`Params`): the fixed ones plus one filter list per
        varied (expert, parameter): an entry per decoder layer with its block's value and a
        catch-all with the mean of the block values (embeddings, final norm, ``lm_head``)."""
        vals = self.values(x)
        groups: dict[tuple[str | None, str], list[float]] = {}
        for v, dm in zip(vals, self.dims):
            groups.setdefault((dm.expert, dm.name), []).append(v)
        out = copy.deepcopy(self.fixed)
        for (e, name), bv in groups.items():
            entries: list[dict] = []
            for b, layers in enumerate(self.blocks):
                entries += [{"filter": f"{self.layer_word}.{ell}.", "value": bv[b]} for ell in layers]
            entries.append({"value": round(sum(bv) / len(bv), 6)})
            if e is None:
                out["parameters"][name] = entries
            else:
                out["experts"].setdefault(e, {})[name] = entries
        return out

    def describe(self, x: Sequence[float]) -> dict:
        """``{dim label: value}`` for reports."""
        return {dm.label: v for dm, v in zip(self.dims, self.values(x))}
