"""mergekit ``slices`` configs compiled into a merge of stacked views (:mod:`mergepipe.stack`).

mergekit 0.1.5 (``plan.py``, ``MergePlanner.plan_module``) builds the output of a ``slices``
config as: the *pre*-weights (embeddings) merged over the first slice's sources, then for each
slice and each of its ``n`` layers (``layer_range: [a, b)``, the same length for every source of
the slice) the merge of the sources' layer ``a + i`` as output layer ``o`` (renumbered from 0),
then the *post*-weights (final norm, ``lm_head``) merged over the last slice's sources. A
parameter is read with the precedence slice source > slice > merge-wide (``ConfigReader``), and
a gradient is evaluated at the position of the layer **within its slice**
(``t = i / (n − 1)``, 1 for a one-layer slice; 0 for pre/post-weights). Filters match the output
tensor name.

mergepipe compiles this into the ordinary merge it plans and budgets:

* ``passthrough``: one source per slice (mergekit's passthrough takes one input); the output is
  the single view stacking the slices — every output tensor is a copy of one source tensor,
  read from that source.
* any other method: every slice lists the same models (each once, the ``base_model`` among
  them when the method takes a base); each model becomes the view of its own layer ranges, in
  slice order, and the merge runs over the views (the base's view is the base). A model whose
  view is itself (one slice over all its layers) is used directly.
* parameters given per slice or per source, and gradients when there are several slices, are
  evaluated per output tensor with mergekit's precedence and positions and passed on as filter
  lists naming each output tensor exactly (boolean and integer parameters take one value per
  merge: they must agree across slices).

Refused with the key named: ``residual_weight`` (mergekit 0.1.5 parses it and does not use it),
a per-slice ``base_model`` other than the merge's, LoRA references inside slices, slices whose
sources differ in model set or in layer count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import load_layout
from mergepipe.methods.params import evaluate, parse_setting
from mergepipe.methods.registry import get_method
from mergepipe.stack import StackSpec, StackView, is_pre_weight, layer_of, register_view


@dataclass
class CompiledSlices:
    """A ``slices`` config as a ``models`` config over views.

    Attributes:
        models: ``(model URI, parameters)`` in the first slice's source order (views or models).
        base: the base URI (a view or a model), or None (linear/karcher without ``base_model``).
        parameters: merge-wide parameters (compiled, or the config's when nothing varies by slice).
        names: URI -> expert name (the source model's folder name).
        stacks: view URI -> ``{"spec": ..., "model": source, "layers": [...]}`` (recorded in the plan's
            ``source``; ``explain`` reports where the bytes of each view come from).
    """

    models: list[tuple[str, dict | None]]
    base: str | None
    parameters: dict | None
    names: dict[str, str] = field(default_factory=dict)
    stacks: dict[str, dict] = field(default_factory=dict)


def _name(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1] or uri


def _n_layers(storage, uri: str) -> int:
    idx = [i for i in (layer_of(n) for n in load_layout(storage, uri, role="catalog").tensors) if i is not None]
    return max(idx) + 1 if idx else 0


def compile_slices(cfg: Any, p: str) -> CompiledSlices:
    """Compile ``cfg.slices`` (a validated :class:`mergepipe.config._Config`) of config file ``p``.

    Reads the sources' shard headers (no tensor byte) and registers the views.

    Raises:
        InputError: naming ``slices[i]...`` and the fix — see the module docstring.
    """
    from mergepipe.config_refs import model_uri as _model_uri
    from mergepipe.planner.plan import EXTRA_FILES
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage

    try:
        spec = get_method(cfg.merge_method)
    except InputError as e:
        raise InputError(f"{p}: merge_method: {e.problem or e}") from None
    if not cfg.slices:
        raise InputError(f"{p}: slices: empty; give at least one slice with sources and layer_range.")
    storage = open_storage(None, IOCounters())
    base = _model_uri(cfg.base_model, f"{p}: base_model") if cfg.base_model is not None else None
    srcs, n_layers = _read_sources(cfg.slices, p, base, storage)
    out = CompiledSlices(models=[], base=None, parameters=cfg.parameters)
    views: dict[str, StackView] = {}
    if cfg.merge_method == "passthrough":
        model_of = _compile_passthrough(p, srcs, base, storage, list(EXTRA_FILES), out, views)
    else:
        model_of = _compile_model_views(p, srcs, base, n_layers, storage, list(EXTRA_FILES), out, views)
    for u, v in views.items():
        out.stacks[u] = {
            "spec": v.spec.to_json(),
            "layers": [[src, a, b] for src, a, b in v.spec.layers],
        }
    _compile_params(cfg, p, spec, srcs, out, model_of, storage)
    return out


#: one slice source: ``(model URI, layer start, layer end (exclusive), its parameters)``
_Source = tuple[str, int, int, dict | None]


def _read_sources(slices: list, p: str, base: str | None, storage: Any) -> tuple[list[list[_Source]], dict[str, int]]:
    """Each slice's sources, validated (layer ranges against the models' layer counts, read from
    their shard headers); returns them and ``model URI -> number of layers``.

    Raises:
        InputError: ``residual_weight``, empty sources, a per-slice base other than the merge's,
            a LoRA source, a bad or out-of-range layer range, sources of different lengths.
    """
    from mergepipe.config_refs import model_ref as _model_ref, model_uri as _model_uri

    srcs: list[list[_Source]] = []
    n_layers: dict[str, int] = {}
    for i, sl in enumerate(slices):
        w = f"{p}: slices[{i}]"
        if sl.residual_weight is not None:
            raise InputError(
                f"{w}.residual_weight: not supported (mergekit 0.1.5 parses it and never uses it); remove it."
            )
        if not sl.sources:
            raise InputError(f"{w}.sources: empty; give at least one {{model, layer_range}}.")
        if sl.base_model is not None and _model_uri(sl.base_model, f"{w}.base_model") != base:
            raise InputError(
                f"{w}.base_model: differs from the merge's base_model; mergepipe merges every slice against one "
                "base — remove the slice's base_model or make it the merge's."
            )
        row = []
        for j, s in enumerate(sl.sources):
            ws = f"{w}.sources[{j}]"
            uri, adapter = _model_ref(s.model, f"{ws}.model")
            if adapter is not None:
                raise InputError(
                    f"{ws}.model: a LoRA adapter inside slices is not supported; merge the adapter into its "
                    "model first (or use models:)."
                )
            a, b = s.layer_range
            if not 0 <= a < b:
                raise InputError(f"{ws}.layer_range: [{a}, {b}] must satisfy 0 <= start < end (end exclusive).")
            if uri not in n_layers:
                n_layers[uri] = _n_layers(storage, uri)
            if b > n_layers[uri]:
                raise InputError(
                    f"{ws}.layer_range: [{a}, {b}] is outside the {n_layers[uri]} layers of {uri}; give a range "
                    f"within [0, {n_layers[uri]}] (end exclusive)."
                )
            row.append((uri, a, b, s.parameters))
        lens = {b - a for _, a, b, _ in row}
        if len(lens) > 1:
            raise InputError(
                f"{w}.sources: layer ranges of different lengths {sorted(lens)}; every source of a slice gives "
                "the same number of layers (mergekit: 'All inputs to a slice must contain the same number of layers')."
            )
        srcs.append(row)
    return srcs, n_layers


def _compile_passthrough(
    p: str,
    srcs: list[list[_Source]],
    base: str | None,
    storage: Any,
    extra: list[str],
    out: CompiledSlices,
    views: dict[str, StackView],
) -> dict[str, str | None]:
    """passthrough: one view stacking each slice's one source, the only model of ``out`` (no
    base); registers it in ``views``. Returns ``view URI -> None`` (the view has no one model).

    Raises:
        InputError: a slice with several sources, a ``base_model`` that is none of the sources.
    """
    for i, row in enumerate(srcs):
        if len(row) != 1:
            raise InputError(
                f"{p}: slices[{i}].sources: passthrough takes one source per slice (mergekit: exactly one "
                f"input per tensor), got {len(row)}; merge them with another merge_method."
            )
    if base is not None and all(base != row[0][0] for row in srcs):
        raise InputError(
            f"{p}: base_model: passthrough copies its slices' sources and {base!r} is none of them; remove "
            "base_model (the first source's config and tokenizer are used) or name one of the sources."
        )
    donor = base or srcs[0][0][0]
    st = StackSpec(srcs[0][0][0], srcs[-1][0][0], tuple((u, a, b) for (u, a, b, _) in (r[0] for r in srcs)), donor)
    v = register_view(storage, st, extra)
    views[v.uri] = v
    out.models = [(v.uri, None)]
    out.base = None
    out.names[v.uri] = "stack"
    return {v.uri: None}


def _compile_model_views(
    p: str,
    srcs: list[list[_Source]],
    base: str | None,
    n_layers: dict[str, int],
    storage: Any,
    extra: list[str],
    out: CompiledSlices,
    views: dict[str, StackView],
) -> dict[str, str | None]:
    """Any other method: each model becomes the view of its layer ranges in slice order (or
    itself when that is all its layers), in the first slice's order; fills ``out.models``,
    ``out.names``, ``out.base`` and ``views``. Returns ``URI -> source model``.

    Raises:
        InputError: a model twice in a slice, slices over different models, a base that is not a source.
    """
    order = [u for u, *_ in srcs[0]]
    if len(set(order)) != len(order):
        raise InputError(f"{p}: slices[0].sources: a model is listed twice in one slice; list each once.")
    for i, row in enumerate(srcs[1:], 1):
        us = [u for u, *_ in row]
        if sorted(us) != sorted(order):
            raise InputError(
                f"{p}: slices[{i}].sources: its models differ from slices[0]'s; mergepipe merges every slice "
                "over the same models (a frankenmerge of different models is merge_method: passthrough)."
            )
    if base is not None and base not in order:
        raise InputError(
            f"{p}: base_model: not among the slices' sources; list the base in every slice with the same "
            "layer_range as the others (mergekit gathers a slice's tensors from its sources only)."
        )
    model_of: dict[str, str | None] = {}
    for m in order:
        runs = tuple((m, a, b) for row in srcs for (u, a, b, _) in row if u == m)
        if len(runs) == 1 and runs[0][1] == 0 and runs[0][2] == n_layers[m]:
            uri = m  # the model itself
        else:
            v = register_view(storage, StackSpec(m, m, runs, m), extra)
            views[v.uri] = v
            uri = v.uri
        model_of[uri] = m
        out.names[uri] = _name(m)
        out.models.append((uri, None))
    if base is not None:
        out.base = next(u for u, m in model_of.items() if m == base)
    return model_of


def _positions(srcs) -> list[tuple[int, float]]:
    """Per output layer: (slice index, mergekit's t within the slice)."""
    pos = []
    for i, row in enumerate(srcs):
        n = row[0][2] - row[0][1]
        for k in range(n):
            pos.append((i, k / (n - 1) if n > 1 else 1.0))
    return pos


def _compile_params(cfg, p: str, spec, srcs, out: CompiledSlices, model_of: dict, storage) -> None:
    """Fill ``out.parameters`` and the models' parameters (see the module docstring)."""
    slice_params = [sl.parameters or {} for sl in cfg.slices]
    src_params = [{u: (ps or {}) for (u, _, _, ps) in row} for row in srcs]
    # a single slice without slice-level parameters: its sources' parameters are the models' own
    if len(srcs) == 1 and not slice_params[0]:
        out.models = [(u, (src_params[0].get(model_of[u] or srcs[0][0][0]) or None)) for u, _ in out.models]
        return
    params = {q.name: q for q in spec.params}
    parsed = _parse_given(cfg, p, params, slice_params, srcs)
    # output tensor names and their (slice, t): from the base's (or first model's) view or model
    first = out.base or out.models[0][0]
    ev = _SliceParams(p, parsed, list(load_layout(storage, first, role="catalog").tensors), srcs, _positions(srcs))
    new_globals: dict[str, Any] = {}
    model_params: dict[str, dict] = {u: {} for u, _ in out.models}
    for k, q in params.items():
        if not any(key.endswith(f"parameters.{k}") for key in parsed):
            continue
        enc = ev.merge_wide(k, q.kind)
        if enc is not None:
            new_globals[k] = enc
        for u, _ in out.models:
            m = model_of[u]
            enc = ev.of_model(k, q.kind, m)
            if enc is not None:
                if m is None:  # passthrough's one input: its parameters are the merge's
                    new_globals[k] = enc if k not in new_globals else _overlay(enc, new_globals[k])
                else:
                    model_params[u][k] = enc
    out.parameters = new_globals or None
    out.models = [(u, model_params[u] or None) for u, _ in out.models]


def _parse_given(cfg, p: str, params: dict, slice_params: list[dict], srcs) -> dict[str, Any]:
    """Every parameter given merge-wide, per slice and per source, parsed: config key (e.g.
    ``slices[1].sources[0].parameters.weight``) -> setting.

    Raises:
        InputError: a parameter the method does not take, or an invalid value (naming the key).
    """
    given: list[tuple[str, Any, str]] = [(k, v, f"parameters.{k}") for k, v in (cfg.parameters or {}).items()]
    for i, sp in enumerate(slice_params):
        given += [(k, v, f"slices[{i}].parameters.{k}") for k, v in sp.items()]
    for i, row in enumerate(srcs):
        for j, (_, _, _, ps) in enumerate(row):
            given += [(k, v, f"slices[{i}].sources[{j}].parameters.{k}") for k, v in (ps or {}).items()]
    parsed: dict[str, Any] = {}
    for k, v, key in given:
        if k not in params:
            raise InputError(
                f"{p}: {key}: {cfg.merge_method} takes no parameter {k!r}; it takes {', '.join(params) or 'none'}."
            )
        parsed[key] = parse_setting(
            params[k], v, (key,), lambda loc: f"{p}: {loc[0]}" + "".join(f"[{x}]" for x in loc[1:])
        )
    return parsed


@dataclass
class _SliceParams:
    """Evaluates parsed slice parameters per output tensor with mergekit's precedence (source >
    slice > merge-wide) at the tensor's position ``(slice, t)``; ``names`` are the output tensors,
    ``pos`` the (slice, t) of each output layer (:func:`_positions`)."""

    p: str
    parsed: dict[str, Any]
    names: list[str]
    srcs: list
    pos: list[tuple[int, float]]

    def where_of(self, n: str) -> tuple[int, float]:
        """Output tensor ``n``'s slice and t (pre-weights: first slice, post-weights: last, t = 0)."""
        li = layer_of(n)
        if li is None:
            return (0 if is_pre_weight(n) else len(self.srcs) - 1), 0.0
        return self.pos[li]

    def chain(self, k: str, s: int, src_j: int | None) -> list[str]:
        """The given keys for parameter ``k`` in slice ``s`` (and its source ``src_j``), by precedence."""
        keys = []
        if src_j is not None:
            keys.append(f"slices[{s}].sources[{src_j}].parameters.{k}")
        keys += [f"slices[{s}].parameters.{k}", f"parameters.{k}"]
        return [x for x in keys if x in self.parsed]

    def value(self, keys: list[str], n: str, t: float):
        """The first of ``keys`` whose setting has a value for tensor ``n`` at ``t``, or None."""
        for key in keys:
            x = evaluate(self.parsed[key], n, t)
            if x is not None:
                return x
        return None

    def encode(self, vals: dict[str, Any], what: str, kind: str):
        """Per-tensor values as one setting: None, a scalar when uniform over every tensor, else
        (float parameters only) a filter list naming each tensor, longest name first.

        Raises:
            InputError: a boolean or integer parameter that varies across tensors.
        """
        if not vals:
            return None
        distinct = set(vals.values())
        if len(distinct) == 1 and len(vals) == len(self.names):
            return next(iter(distinct))
        if kind != "float":
            raise InputError(
                f"{self.p}: {what}: takes one value per merge (boolean and integer parameters are not layer-wise), "
                f"but the slices give {sorted(map(str, distinct))}; give one value under parameters."
            )
        return [{"filter": n, "value": vals[n]} for n in sorted(vals, key=lambda x: (-len(x), x))]

    def merge_wide(self, k: str, kind: str):
        """Parameter ``k`` from the slice-level and merge-wide keys, encoded (or None)."""
        g: dict[str, Any] = {}
        for n in self.names:
            s, t = self.where_of(n)
            x = self.value(self.chain(k, s, None), n, t)
            if x is not None:
                g[n] = x
        return self.encode(g, f"parameters.{k}", kind)

    def of_model(self, k: str, kind: str, m: str | None):
        """Parameter ``k`` from model ``m``'s source keys (``m`` None: passthrough's one source
        per slice), encoded (or None)."""
        e: dict[str, Any] = {}
        for n in self.names:
            s, t = self.where_of(n)
            row = self.srcs[s]
            js = [j for j, (su, *_r) in enumerate(row) if su == (m if m is not None else su)]
            if m is None:  # passthrough: the one source of the slice
                js = [0]
            ks = [x for x in self.chain(k, s, js[0]) if ".sources[" in x] if js else []
            x = self.value(ks, n, t)
            if x is not None:
                e[n] = x
        return self.encode(e, f"slices[*].sources[*].parameters.{k}", kind)


def _overlay(first: Any, then: Any) -> Any:
    """A setting that takes ``first`` where it has a value and ``then`` elsewhere (filter lists)."""
    a = first if isinstance(first, list) else [{"filter": None, "value": first}]
    b = then if isinstance(then, list) and then and isinstance(then[0], dict) else [{"filter": None, "value": then}]
    have = {e["filter"] for e in a}
    return a + [e for e in b if e["filter"] not in have]


def _source_of(spec: dict, name: str) -> str:
    """The source checkpoint a view's output tensor ``name`` is read from."""
    li = layer_of(name)
    if li is None:
        return spec["pre"] if is_pre_weight(name) else spec["post"]
    o = 0
    for src, a, b in spec["layers"]:
        if li < o + (b - a):
            return src
        o += b - a
    return spec["post"]


def bytes_by_source(plan: Any) -> tuple[list[str], list[tuple[str, int, int, int]]]:
    """Where a plan over stacked views (slices, merged vocabularies) reads its bytes.

    Returns:
        ``(views, rows)``: one line per view (``base = a[0:3] + b[1:4] (6 layers)``), and per
        source model ``(name, copied, merged_base, merged_expert)`` in bytes: tensors copied
        whole (a passthrough layer, a tensor no expert changes), the base rows of merged tensors
        (once per pass), and the expert blocks (exact and sketch) the plan reads. Empty lists
        for a plan without views.
    """
    from mergepipe.formats.safetensors import DTYPES

    stacks = (plan.source or {}).get("stacks") or {}
    if not stacks:
        return [], []
    views = []
    for uri, st in stacks.items():
        spec = st["spec"]
        who = "base" if uri == plan.base.uri else next((e.name for e in plan.experts if e.uri == uri), uri)
        runs = " + ".join(f"{_name(s)}[{a}:{b}]" for s, a, b in spec["layers"])
        voc = f", vocabulary of {spec['vocab']['vocab_size']} rows" if spec.get("vocab") else ""
        views.append(f"{who} = {runs} ({sum(b - a for _, a, b in spec['layers'])} layers{voc})")
    acc: dict[str, list[int]] = {}

    def src(uri: str, name: str) -> str:
        st = stacks.get(uri)
        return _name(_source_of(st["spec"], name) if st else uri)

    for tp in plan.tensors:
        nb = math.prod(tp.shape) * DTYPES[tp.dtype][0]
        s = src(plan.base.uri, tp.name)
        if not tp.experts:
            acc.setdefault(s, [0, 0, 0])[0] += nb
            continue
        acc.setdefault(s, [0, 0, 0])[1] += nb * max(1, tp.passes)
        for te in tp.experts:
            es = src(plan.experts[te.expert].uri, tp.name)
            acc.setdefault(es, [0, 0, 0])[2] += te.bytes + te.sketch_bytes
    return views, [(k, *v) for k, v in sorted(acc.items())]  # type: ignore[misc]


def explain_stacks(plan: Any) -> str:
    """:func:`bytes_by_source` as a sentence for ``plan.explain``; empty without views."""
    views, rows = bytes_by_source(plan)
    if not views:
        return ""

    def fmt(i: int) -> str:
        return ", ".join(f"{r[0]} {r[i]:,} B" for r in rows if r[i]) or "none"

    return (
        f" Slices (stacked views): {'; '.join(views)}. Bytes by source model — copied layers/tensors: "
        f"{fmt(1)}; merged tensors' base reads: {fmt(2)}; merged expert blocks: {fmt(3)}."
    )
