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
numeric parameter and to blocks of layers. Three extensions:

* **outer coordinates** (``outer_parts(...)``, ``--search-outer``): the embeddings and ``lm_head``
  (on a small model most of the task-vector energy) get coordinates of their own per varied
  (expert, parameter) instead of the mean of the block values: filter entries naming those
  tensors exactly; the final norm keeps the mean.
* a **shared** coordinate ``*:NAME=LO:HI``: one value per layer block applied to *every* expert
  (under a method that normalises by the sum of the weights a shared ``weight`` cancels out;
  the model-level space is ``weight=0:1 --layer-blocks 1``, one weight per expert).
* a **budget** coordinate ``budget=LO:HI`` (fractions in (0, 1]): the candidate's expert-I/O
  budget, ``100·v %`` of the experts' bytes, so a search can trade quality against bytes read
  (objective ``io:expert_read_bytes``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mergepipe.errors import InputError
from mergepipe.methods.params import LAYER_RE, layer_count
from mergepipe.methods.registry import budget_refusal, get_method

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


#: ``--vary budget=LO:HI``: the candidate's expert-I/O budget as a fraction of the experts' bytes.
BUDGET = "budget"
#: ``--vary *:NAME=LO:HI``: one coordinate per block shared by every expert.
SHARED = "*"

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
        name: the parameter (or :data:`BUDGET`); ``expert``: the expert it applies to (None:
        global parameter; :data:`SHARED`: every expert); block: layer block index; ``layers``:
        the decoder layers of that block (empty for an outer part and the budget); ``lo, hi``:
        bounds; ``part``: the outer part (``embed``/``head``) or None; ``tensors``: an outer
        part's tensor names.
    """

    name: str
    expert: str | None
    block: int
    layers: tuple[int, ...]
    lo: float
    hi: float
    part: str | None = None
    tensors: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.name == BUDGET:
            return BUDGET
        who = f"{self.expert}:" if self.expert else ""
        if self.part:
            return f"{who}{self.name}@{self.part}"
        span = f"{self.layers[0]}" if len(self.layers) == 1 else f"{self.layers[0]}-{self.layers[-1]}"
        return f"{who}{self.name}@L{span}"


def parse_vary(items: Sequence[str]) -> list[Vary]:
    """Parse ``--vary`` items ``[EXPERT:]NAME=LO:HI`` (e.g. ``weight=0:1``, ``math:density=0.2:0.9``,
    ``*:weight=0:1`` shared by every expert, ``budget=0.1:1``).

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


def outer_parts(layout_names: Sequence[str]) -> list[list]:
    """The outer parts of a checkpoint (tensors outside the decoder layers) that get their own
    coordinates with ``--search-outer``: ``[["embed", [names]], ["head", [names]]]`` — token and
    position embeddings (a name containing ``embed``, ``wte`` or ``wpe``) and the output head
    (``lm_head``); a part with no tensor is left out (tied embeddings: no ``head``)."""
    outer = [n for n in layout_names if LAYER_RE.search(n) is None]
    embed = sorted(n for n in outer if any(k in n for k in ("embed", "wte", "wpe")))
    head = sorted(n for n in outer if "lm_head" in n and n not in embed)
    return [[p, names] for p, names in (("embed", embed), ("head", head)) if names]


def space_for_base(
    layout_names: Sequence[str],
    method: str,
    experts: Sequence[str],
    vary: Sequence[Vary],
    n_blocks: int,
    fixed: Params | None = None,
    outer: bool = False,
) -> SearchSpace:
    """The :class:`SearchSpace` of a base checkpoint whose tensor names are ``layout_names``
    (the number of layers and the layer path component come from the names); ``outer``: give
    the embeddings and ``lm_head`` coordinates of their own (:func:`outer_parts`).

    Raises:
        InputError: ``outer`` but the checkpoint has no embedding or head tensor outside the layers.
    """
    words = {m.group(0).strip(".").split(".")[0] for m in (LAYER_RE.search(n) for n in layout_names) if m}
    word = "layers" if "layers" in words or not words else sorted(words)[0]
    parts = outer_parts(layout_names) if outer else []
    if outer and not parts:
        raise InputError(
            "--search-outer: the base has no embedding or lm_head tensor outside its layers; drop --search-outer."
        )
    return SearchSpace(
        method,
        list(experts),
        list(vary),
        layer_count(layout_names),
        n_blocks,
        as_params(fixed, method, experts),
        word,
        parts,
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
        ``model.layers.3.mlp…``, ``h`` in ``transformer.h.3…``); ``outer``: the outer parts with
        coordinates of their own (:func:`outer_parts`; empty: they take the mean of the blocks).
    """

    method: str
    experts: list[str]
    vary: list[Vary]
    n_layers: int
    n_blocks: int
    fixed: Params = field(default_factory=dict)
    layer_word: str = "layers"
    outer: list = field(default_factory=list)

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
            "outer": copy.deepcopy(self.outer),
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
            d.get("outer") or [],
        )

    def validate(self) -> None:  # noqa: C901, PLR0912 - one refusal per field of a varied parameter, each naming the --vary entry
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
        seen: set[tuple[str | None, str]] = set()
        for v in self.vary:
            where = f"--vary {(v.expert + ':') if v.expert else ''}{v.name}={v.lo:g}:{v.hi:g}"
            if v.name == BUDGET:
                if v.expert is not None:
                    raise InputError(f"{where}: the budget is the merge's; vary it without an expert name.")
                if not 0 < v.lo < v.hi <= 1:
                    raise InputError(
                        f"{where}: the budget varies as a fraction of the experts' bytes; give 0 < LO < HI <= 1."
                    )
                why = budget_refusal(spec, dict(as_params(self.fixed, self.method, self.experts)["parameters"]))
                if why is not None:
                    raise InputError(f"{where}: {self.method} cannot honour an expert-I/O budget: {why}.")
                if (None, BUDGET) in seen:
                    raise InputError(f"{where}: the budget already varies; vary it once.")
                seen.add((None, BUDGET))
                continue
            p = spec.param(v.name, where)
            if p.kind in ("bool", "int"):
                raise InputError(
                    f"{where}: {v.name} is {'a boolean' if p.kind == 'bool' else 'an integer'}; only real-valued "
                    "parameters vary per layer block."
                )
            if not v.lo < v.hi:
                raise InputError(f"{where}: the bounds are reversed or empty (LO >= HI); give LO < HI.")
            p.check(v.lo, f"{where} (LO)")
            p.check(v.hi, f"{where} (HI)")
            if v.expert is not None:
                if p.scope != "expert":
                    raise InputError(
                        f"{where}: {v.name} is a global parameter of {self.method}; vary it without an expert name."
                    )
                if v.expert != SHARED and v.expert not in self.experts:
                    raise InputError(f"{where}: no expert named {v.expert!r}; experts are {', '.join(self.experts)}.")
            for e in self._targets(v, p.scope):
                for who in self.experts if e == SHARED else [e]:
                    if (who, v.name) in seen:
                        raise InputError(f"{where}: {v.name} already varies for {who or 'the merge'}; vary it once.")
                    seen.add((who, v.name))
        for e, name in seen:
            if name == BUDGET:
                continue
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
            if v.name == BUDGET:
                out.append(Dim(BUDGET, None, 0, (), v.lo, v.hi))
                continue
            for e in self._targets(v, spec.param(v.name, v.name).scope):
                for b, layers in enumerate(self.blocks):
                    out.append(Dim(v.name, e, b, layers, v.lo, v.hi))
                for j, (part, names) in enumerate(self.outer):
                    out.append(Dim(v.name, e, self.n_blocks + j, (), v.lo, v.hi, part, tuple(names)))
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
        varied (expert, parameter): an entry per decoder layer with its block's value, with
        outer coordinates an entry per outer tensor (exact name) with its part's value, and a
        catch-all with the mean of the block values (the other tensors outside the layers:
        final norm; without outer coordinates also embeddings and ``lm_head``). A shared
        coordinate's list goes to every expert; a budget coordinate ``v`` sets
        ``out["budget"] = "<100·v>%"``."""
        vals = self.values(x)
        groups: dict[tuple[str | None, str], list[float]] = {}
        out = copy.deepcopy(self.fixed)
        for v, dm in zip(vals, self.dims):
            if dm.name == BUDGET:
                out["budget"] = f"{round(100 * v, 4):g}%"
                continue
            groups.setdefault((dm.expert, dm.name), []).append(v)
        nb = self.n_blocks
        for (e, name), gv in groups.items():
            bv, ov = gv[:nb], gv[nb:]
            entries: list[dict] = []
            for b, layers in enumerate(self.blocks):
                entries += [{"filter": f"{self.layer_word}.{ell}.", "value": bv[b]} for ell in layers]
            for (_, names), pv in zip(self.outer, ov):
                entries += [{"filter": n, "value": pv} for n in names]
            entries.append({"value": round(sum(bv) / len(bv), 6)})
            if e is None:
                out["parameters"][name] = entries
            elif e == SHARED:
                for who in self.experts:
                    out["experts"].setdefault(who, {})[name] = copy.deepcopy(entries)
            else:
                out["experts"].setdefault(e, {})[name] = entries
        return out

    def describe(self, x: Sequence[float]) -> dict:
        """``{dim label: value}`` for reports."""
        return {dm.label: v for dm, v in zip(self.dims, self.values(x))}
