"""Parameter settings — scalars, layer gradients, name filters — and their resolution per tensor.

A setting takes one of mergekit's forms:

* a **scalar**: ``0.5``, ``true``;
* a **gradient**: a list of at least two numbers, interpolated piecewise-linearly over the
  layers. For a tensor in layer ``ℓ`` of ``L`` layers, ``t = ℓ / (L − 1)`` (``t = 1`` when
  ``L = 1``), ``x = t·(n − 1)``, ``i = int(x)``, and the value is
  ``(1 − (x − i))·v[i] + (x − i)·v[min(i + 1, n − 1)]`` (mergekit ``evaluate_setting``).
  Tensors without a layer index — embeddings, the final norm, ``lm_head`` — get ``t = 0``, the
  gradient's first value: mergekit plans its pre-layer and post-layer weights with a
  ``ConfigReader(t=0)`` (mergekit 0.1.5 ``plan.py`` ``plan_module``);
* a **filter list**: ``[{filter: <substring of the tensor name>, value: <scalar or gradient>},
  …]``. The first entry whose filter occurs in the tensor name applies (an entry without
  ``filter``, or with ``"*"``, matches every tensor); when none matches, the setting has no
  value for that tensor and resolution falls through to the next scope.

**Precedence** (mergekit's): an expert's own setting, then the merge-wide setting, then the
method's default. Within a filter list the first match wins, as in mergekit; so that this is
also the *most specific* match, a list where an earlier entry shadows a later one is refused:
a catch-all entry that is not last, or an entry whose filter contains an earlier entry's filter
(every tensor it would match is taken by the earlier one). Filters that merely overlap (neither
contains the other, e.g. ``self_attn`` and ``q_proj``) resolve by list order.

Layer index of a tensor: the integer after a ``layers``/``layer``/``h``/``blocks``/``block``
path component (``model.layers.12.mlp…``, ``transformer.h.3…``, ``encoder.layer.5…``); the
number of layers ``L`` is one more than the largest index among the base's tensors. (mergekit
counts layers from the architecture's config; for the decoder-only models both agree.)

Booleans are scalars only (not layer-wise). Every value is validated where it is given, with
the key path in the message; interpolated values lie between validated endpoints.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mergepipe.errors import InputError
from mergepipe.methods.registry import MethodSpec, ParamSpec, get_method

LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The layer a tensor belongs to, from its name; None for embeddings, final norm, head."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def layer_count(names: Iterable[str]) -> int:
    """Number of layers: one more than the largest layer index (0 when no name has one)."""
    idx = [i for i in (layer_index(n) for n in names) if i is not None]
    return max(idx) + 1 if idx else 0


def layer_t(name: str, n_layers: int) -> float:
    """mergekit's gradient position of a tensor: ``ℓ/(L−1)``, 1 for a single layer, 0 without
    a layer index."""
    i = layer_index(name)
    if i is None:
        return 0.0
    if n_layers <= 1:
        return 1.0
    return i / (n_layers - 1)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool, str)) and not isinstance(v, (list, dict))


#: A field of a merge request as a path: ``("parameters", "density")`` (merge-wide),
#: ``("experts", 1, "parameters", "density", 0, "value")`` (an expert's setting, inside it the
#: first filter entry's value), ``("experts",)``, ``("experts", 0, "uri")``, ``("method",)``.
Loc = tuple  # tuple[str | int, ...]
#: How a front end names a field in its own terms: ``Loc -> str`` (e.g. ``--param math:density``).
Where = Callable[[Loc], str]


def sub_text(rest: Sequence[str | int]) -> str:
    """The part of a path inside a setting in the usual notation: ``(0, "value", 1)`` -> ``[0].value[1]``."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in rest)


def param_loc(loc: Loc) -> tuple[int | None, str, tuple] | None:
    """``(expert index or None for merge-wide, parameter name, path inside the setting)`` of a
    parameter path, or None when ``loc`` names another field."""
    if len(loc) >= 2 and loc[0] == "parameters":
        return None, str(loc[1]), tuple(loc[2:])
    if len(loc) >= 4 and loc[0] == "experts" and loc[2] == "parameters":
        return int(loc[1]), str(loc[3]), tuple(loc[4:])
    return None


_CLI_FIELDS = {
    "base": "--base",
    "experts": "--expert",
    "method": "--method",
    "budget": "--budget",
    "fidelity": "--fidelity",
    "seed": "--seed",
    "output": "--out",
    "planning.value": "--value",
    "planning.calibration": "--calibration",
    "planning.sketch": "--sketch",
    "planning.block_bytes": "--block-size",
    "planning.deadline": "--deadline",
    "run.work_bytes": "--work-memory",
    "run.workers": "--workers",
    "run.resume": "--resume",
    "run.device": "--device",
}


def cli_where(names: Sequence[str] | None = None) -> Where:
    """Fields in command-line terms: ``--param density``, ``--param math:density[1]`` (an expert
    by ``names[i]``, or by 1-based position without names), ``--expert``, ``--budget``, ..."""

    def where(loc: Loc) -> str:
        pl = param_loc(loc)
        if pl is not None:
            i, name, rest = pl
            who = "" if i is None else f"{names[i] if names else i + 1}:"
            return f"--param {who}{name}{sub_text(rest)}"
        if loc and loc[0] == "experts" and len(loc) >= 2:
            return f"--expert {names[loc[1]] if names else loc[1] + 1}"
        if not loc:
            return "request"
        key = ".".join(map(str, loc[:2])) if loc[0] in ("planning", "run", "options") else str(loc[0])
        return _CLI_FIELDS.get(key, key)

    return where


def _fail(where: Where, loc: Loc, problem: str) -> InputError:
    return InputError(f"{where(loc)}: {problem}", loc=loc, problem=problem)


def parse_setting(p: ParamSpec, raw: Any, loc: Loc, where: Where) -> Any:
    """Validate a setting and return it in canonical JSON form (the one validator of parameter
    values; every front end reaches it through :class:`mergepipe.request.MergeRequest`).

    Args:
        raw: a scalar (numbers may be numeric strings, booleans ``true``/``yes``/``1``...), a list
            (gradient or filter entries) or one ``{filter, value}`` mapping.
        loc: the setting's request field path, e.g. ``("parameters", "density")``.
        where: renders a field path in the front end's terms, for messages.

    Raises:
        InputError: naming the field (``loc`` attached) and the allowed values.
    """
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        return p.check(raw, where(loc), loc)
    _check_listable(p, raw, loc, where)
    if all(_is_scalar(e) for e in raw):
        return _gradient(p, raw, loc, where)
    if not all(isinstance(e, dict) for e in raw):
        raise _fail(
            where,
            loc,
            "the list mixes numbers and {filter, value} entries; use a gradient "
            "(numbers only) or filter entries (mappings only).",
        )
    return _filter_entries(p, raw, loc, where)


def _check_listable(p: ParamSpec, raw: list, loc: Loc, where: Where) -> None:
    """Refuse a list for a boolean or integer parameter, and an empty list.

    Raises:
        InputError: naming the field.
    """
    if p.kind == "bool":
        raise _fail(
            where,
            loc,
            f"{p.name} is a boolean and takes one value (true or false), not a list; "
            "boolean parameters are not layer-wise.",
        )
    if p.kind == "int":
        raise _fail(
            where,
            loc,
            f"{p.name} is an integer and takes one value, not a list; integer parameters are not layer-wise.",
        )
    if not raw:
        raise _fail(
            where,
            loc,
            "empty list; give a number, a gradient of at least two numbers such as "
            '[0.2, 0.8], or filter entries [{"filter": "mlp", "value": 0.5}, {"value": 0.3}].',
        )


def _filter_entries(p: ParamSpec, raw: list[dict], loc: Loc, where: Where) -> list[dict[str, Any]]:
    """Validate mergekit filter entries ``[{filter, value}, ...]`` (first match wins; ``'*'`` or
    no filter is the catch-all, which must come last) into ``[{"filter": str | None, "value": ...}]``.

    Raises:
        InputError: an unknown key, a missing value, a bad or shadowed filter, an entry after the
            catch-all, a value that is neither a number nor a gradient.
    """
    out: list[dict[str, Any]] = []
    catch_all = None
    for i, e in enumerate(raw):
        el = (*loc, i)
        extra = set(e) - {"filter", "value"}
        if extra:
            raise _fail(
                where, el, f"unknown key(s) {', '.join(sorted(map(str, extra)))}; an entry has only filter and value."
            )
        if "value" not in e:
            raise _fail(where, el, "value is missing; an entry is {filter: <substring of tensor names>, value: ...}.")
        f = e.get("filter")
        if f is not None and (not isinstance(f, str) or not f):
            raise _fail(where, (*el, "filter"), f"must be a non-empty substring of tensor names (or '*'), got {f!r}.")
        if f == "*":
            f = None
        if catch_all is not None:
            raise _fail(
                where,
                (*loc, catch_all),
                f"the entry without filter matches every tensor, so entry {i} "
                "after it is never used (first match wins); move the catch-all last.",
            )
        for j, prev in enumerate(out):
            if prev["filter"] is not None and f is not None and prev["filter"] in f:
                raise _fail(
                    where,
                    (*el, "filter"),
                    f"{f!r} is never used: every tensor it matches also matches entry {j} "
                    f"({prev['filter']!r}) before it (first match wins); put the more specific filter first.",
                )
        val = _entry_value(p, e["value"], (*el, "value"), where)
        if f is None:
            catch_all = i
        out.append({"filter": f, "value": val})
    return out


def _entry_value(p: ParamSpec, v: Any, vl: Loc, where: Where) -> Any:
    """One filter entry's value (a number or a gradient), validated; ``vl`` is its field path."""
    if isinstance(v, list):
        if not all(_is_scalar(x) for x in v):
            raise _fail(where, vl, "a value is a number or a gradient of numbers, not nested entries.")
        return _gradient(p, v, vl, where)
    if isinstance(v, dict):
        raise _fail(where, vl, "a value is a number or a gradient of numbers, not a mapping.")
    return p.check(v, where(vl), vl)


def _gradient(p: ParamSpec, raw: list, loc: Loc, where: Where) -> list:
    if len(raw) < 2:
        raise _fail(
            where,
            loc,
            f"a gradient needs at least two values (first layer … last layer), got "
            f"{len(raw)}; for one value write the number itself.",
        )
    return [p.check(v, where((*loc, i)), (*loc, i)) for i, v in enumerate(raw)]


def evaluate(setting: Any, tensor_name: str, t: float) -> Any:
    """The value of a (validated, canonical) setting for one tensor at gradient position ``t``;
    None when a filter list has no entry for the tensor."""
    if isinstance(setting, list):
        if setting and isinstance(setting[0], dict):
            for e in setting:
                if e["filter"] is None or e["filter"] in tensor_name:
                    return evaluate(e["value"], tensor_name, t)
            return None
        n = len(setting)
        x = t * (n - 1)
        i0 = int(x)
        i1 = min(n - 1, i0 + 1)
        frac = x - i0
        a, b = float(setting[i0]), float(setting[i1])
        v = (1 - frac) * a + frac * b
        return min(max(v, min(a, b)), max(a, b))  # no rounding step outside the validated endpoints
    return setting


def is_layerwise(setting: Any) -> bool:
    return isinstance(setting, list)


@dataclass(frozen=True)
class TensorParams:
    """Concrete parameter values for one tensor: merge-wide and per expert."""

    globals: dict
    experts: tuple[dict, ...]


@dataclass(frozen=True)
class ResolvedParams:
    """Validated parameter settings of one merge.

    Attributes:
        method: the method name.
        globals: merge-wide parameters: ``name -> setting`` (defaults filled in).
        experts: per expert, ``name -> setting`` of its expert-scoped parameters; the expert's
            own setting, else the merge-wide one, else the default. When the expert's own
            setting is a filter list, the fallback is appended as a final catch-all entry, so
            the single setting resolves exactly like the precedence chain.
        where: names a request field in the front end's terms, for the per-tensor messages.
    """

    method: str
    experts: tuple[dict, ...]
    globals: dict
    where: Where = field(default_factory=cli_where, repr=False, compare=False)

    @property
    def spec(self) -> MethodSpec:
        return get_method(self.method)

    @property
    def layerwise(self) -> bool:
        return any(is_layerwise(v) for v in self.globals.values()) or any(
            is_layerwise(v) for e in self.experts for v in e.values()
        )

    def for_tensor(self, name: str, t: float = 0.0) -> TensorParams:
        """Concrete values for tensor ``name`` at gradient position ``t``.

        Raises:
            InputError: a required parameter has no value for this tensor, or values that are
                valid one by one are invalid together (DELLA's density ± epsilon).
        """
        spec = self.spec
        g = {}
        for p in spec.params:
            if p.scope == "global":
                v = evaluate(self.globals.get(p.name, p.default), name, t)
                if v is None:
                    v = p.default
                if v is None:
                    raise _fail(
                        self.where,
                        ("parameters", p.name),
                        f"no value for tensor {name!r} (no filter entry matches it and {self.method} has "
                        'no default); add a catch-all entry {"value": ...} at the end.',
                    )
                g[p.name] = v
        es: list[dict] = []
        for ep in self.experts:
            d = {}
            for p in spec.params:
                if p.scope == "expert":
                    v = evaluate(ep.get(p.name, p.default), name, t)
                    if v is None and p.default is None:
                        raise _fail(
                            self.where,
                            ("experts", len(es), "parameters", p.name),
                            f"no value for tensor {name!r} (no filter entry matches it and {self.method} has no "
                            'default); add a catch-all entry {"value": ...} at the end.',
                        )
                    d[p.name] = p.default if v is None else v
            es.append(d)
        out = TensorParams(g, tuple(es))
        _check_tensor(self, name, out)
        return out

    def check_tensors(self, names: Sequence[str]) -> None:
        """Resolve every tensor (raising the first problem) — run before reading tensor data."""
        n = layer_count(names)
        for name in names:
            self.for_tensor(name, layer_t(name, n))


def _check_tensor(rp: ResolvedParams, name: str, tpar: TensorParams) -> None:
    bad = rp.spec.check_tensor(name, tpar.experts)
    if bad is None:
        return
    i, names, problem = bad
    locs = [("experts", i, "parameters", n) for n in names]
    raise InputError(f"{' / '.join(rp.where(loc) for loc in locs)}: {problem}", loc=locs[0], problem=problem)


def _global_settings(spec: MethodSpec, global_params: dict, where: Where) -> tuple[dict, dict]:
    """The merge-wide settings, parsed: ``(global-scoped, expert-scoped)`` by name; the
    expert-scoped ones are every expert's fallback."""
    g: dict = {}
    shared: dict = {}
    for name, raw in global_params.items():
        loc: Loc = ("parameters", name)
        p = spec.param(name, where(loc), loc)
        v = parse_setting(p, raw, loc, where)
        (g if p.scope == "global" else shared)[name] = v
    return g, shared


def _expert_settings(spec: MethodSpec, method: str, i: int, ep: dict, shared: dict, where: Where) -> dict:
    """Expert ``i``'s view of every expert-scoped parameter: its own setting, else the merge's,
    else the default; an own filter list without a catch-all falls back to the merge's setting.

    Raises:
        InputError: a global parameter set per expert, a bad setting, a required one missing.
    """
    d = {}
    for name, raw in ep.items():
        loc: Loc = ("experts", i, "parameters", name)
        p = spec.param(name, where(loc), loc)
        if p.scope != "expert":
            raise _fail(where, loc, f"{name} is a global parameter of {method}; set it for the merge, not per expert.")
        d[name] = parse_setting(p, raw, loc, where)
    view = {}
    for p in spec.params:
        if p.scope != "expert":
            continue
        own, fb = d.get(p.name), shared.get(p.name, p.default)
        if own is None:
            view[p.name] = fb
        elif isinstance(own, list) and own and isinstance(own[0], dict):
            if fb is None or own[-1]["filter"] is None:  # no fallback, or own catch-all
                view[p.name] = own
            elif isinstance(fb, list) and fb and isinstance(fb[0], dict):
                view[p.name] = own + fb
            else:
                view[p.name] = own + [{"filter": None, "value": fb}]
        else:
            view[p.name] = own
        if view[p.name] is None:  # a required per-expert parameter (multislerp's weight)
            w = where(("experts", i, "parameters", p.name))
            raise _fail(
                where,
                ("experts", i, "parameters", p.name),
                f"{method} needs {p.name} for every expert (it has no default, as in mergekit); e.g. "
                f"{w}=0.5, or set it for the merge.",
            )
    return view


def _fill_global_defaults(spec: MethodSpec, method: str, g: dict, where: Where) -> None:
    """Add to ``g`` the default of every global parameter not given (what is missing, after
    what is given).

    Raises:
        InputError: a required global parameter (no default, e.g. slerp's t) is missing.
    """
    for p in spec.params:
        if p.scope == "global" and p.name not in g:
            if p.default is None:
                w = where(("parameters", p.name))
                raise _fail(
                    where,
                    ("parameters", p.name),
                    f"{method} needs {p.name} in {p.range_text} (e.g. {w}=0.5); it has no default.",
                )
            g[p.name] = p.default


def resolve_params(
    method: str,
    global_params: dict,
    expert_params: Sequence[dict],
    *,
    where: Where | None = None,
) -> ResolvedParams:
    """Validate parameter settings with precedence per-expert > global > method default: the one
    validator of method parameters (the CLI, mergekit configs, the operator and the search reach
    it through :meth:`mergepipe.request.MergeRequest.resolve`).

    Args:
        global_params: ``{name: setting}`` applying to the merge (and, for expert-scoped names,
            to every expert); a setting is a scalar, a gradient or a filter list.
        expert_params: one ``{name: setting}`` per expert.
        where: renders a request field path (:data:`Loc`) in the front end's terms for messages
            (default: command-line terms with experts by position, :func:`cli_where`).

    Raises:
        InputError: with ``loc``, the field at fault: unknown method; wrong number of experts
            for the method; a parameter the method does not take; a value out of range (density
            in (0, 1], t in [0, 1], gamma in [0, 1), epsilon in [0, 1]); a malformed gradient or
            filter list; a global-only parameter given per expert; a required parameter (slerp's
            t) missing; nuslerp_row_wise with nuslerp_flatten false (unsupported).
    """
    where = where or cli_where()
    try:
        spec = get_method(method)
    except InputError as e:
        raise _fail(where, ("method",), e.problem) from None
    k = len(expert_params)
    if k < spec.min_experts or (spec.max_experts is not None and k > spec.max_experts):
        raise _fail(
            where,
            ("experts",),
            f"{method} takes {spec.experts_text} expert(s) besides the base{spec.experts_note}; got {k}.",
        )
    g, shared = _global_settings(spec, global_params, where)
    experts = [_expert_settings(spec, method, i, ep, shared, where) for i, ep in enumerate(expert_params)]
    _fill_global_defaults(spec, method, g, where)
    refused = spec.check_globals(g)
    if refused is not None:
        raise _fail(where, ("parameters", refused[0]), refused[1])
    rp = ResolvedParams(method, tuple(experts), g, where)
    if not rp.layerwise:
        rp.for_tensor("", 0.0)  # scalar settings: the per-tensor checks hold for every tensor
    return rp
