"""Validation of a ModelMerge spec beyond what the CRD schema checks (:func:`validate_merge_spec`),
the issues' rendering (:func:`format_issues`) and the budget a merge asks for."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from mergepipe.errors import InputError
from mergepipe.methods.params import resolve_params
from mergepipe.methods.registry import METHODS as CORE_METHODS

from ..k8s.conditions import Issue
from ..quantities import QuantityError, is_number, parse_quantity
from ..settings import Settings
from .model import ModelMergeSpec
from .request import spec_settings, spec_where


def _prefix(uri: str) -> str:
    return uri.rstrip("/") + "/"


def _pydantic_issues(err: ValidationError) -> list[Issue]:
    out: list[Issue] = []
    for e in err.errors(include_url=False):
        loc = e["loc"]
        if loc and loc[0] in ("budget", "fidelity"):  # checked below with better messages
            continue
        # drop the union-branch names pydantic inserts ("str", "int", "constrained-str", ...)
        parts = [
            p
            for p in loc
            if not (
                isinstance(p, str)
                and (
                    p in ("str", "int", "float", "bool")
                    or "[" in p
                    or p.startswith("constrained")
                    or p.startswith("function")
                )
            )
        ]
        path = "spec"
        for p in parts:
            path += f"[{p}]" if isinstance(p, int) else f".{p}"
        t, msg = e["type"], e["msg"]
        if t == "extra_forbidden":
            msg = "unknown field; check the spelling (kubectl explain modelmerge.spec lists the fields)."
        elif t == "missing":
            msg = "required field is missing."
        elif t == "string_pattern_mismatch" and path == "spec.output.uri":
            msg = f"{e.get('input')!r} is not an s3:// prefix; write s3://bucket/prefix (not a bucket root)."
        elif t == "string_pattern_mismatch" and path.endswith(".uri"):
            msg = f"{e.get('input')!r} is not an s3:// URI; write s3://bucket/prefix."
        elif t == "string_pattern_mismatch":
            msg = f"{e.get('input')!r} does not match the pattern {e.get('ctx', {}).get('pattern')}."
        else:
            msg = msg.rstrip(".") + "."
        out.append((path, msg))
    # de-duplicate while keeping order
    return list(dict.fromkeys(out))  # without repeats, in order


def _method_issues(spec: Mapping[str, Any], method: Any, experts: list) -> list[Issue]:
    """The core's one validator of method parameters (:func:`mergepipe.methods.params.resolve_params`)
    on the spec's settings: the first problem it finds, at the spec field it names. Nothing when the
    method is not a core method or the parameters are not maps (the schema issues report those)."""
    if method not in CORE_METHODS or not all(isinstance(ex, Mapping) for ex in experts):
        return []
    if not isinstance(spec.get("parameters") or {}, Mapping) or not all(
        isinstance(ex.get("parameters") or {}, Mapping) for ex in experts
    ):
        return []
    where = spec_where(spec)
    try:
        resolve_params(method, *spec_settings(spec), where=where)
    except InputError as e:
        return [(where(e.loc) if e.loc else "spec", e.problem)]
    return []


def parse_merge_spec(spec: Mapping[str, Any]) -> tuple[ModelMergeSpec | None, list[Issue]]:
    """A ModelMerge spec parsed once into its typed model, with its problems
    (:func:`validate_merge_spec`): ``(model, [])`` when valid, ``(None, issues)`` otherwise (each
    issue a ``(field path, message)`` the controller reports as ``Ready=False``, reason
    ``InvalidSpec``, and as an Event)."""
    issues = validate_merge_spec(spec)
    if issues:
        return None, issues
    return ModelMergeSpec.model_validate(dict(spec)), []


def validate_merge_spec(spec: Mapping[str, Any]) -> list[Issue]:  # noqa: C901, PLR0912 - one check per spec rule the CRD schema cannot state, each naming the field
    """Problems in a ModelMerge spec, as ``(field path, message)``; empty when valid.

    Covers what the CRD schema cannot (or what a client that skipped the API server would miss):
    at most one of budget/fidelity; budget syntax and positivity; fidelity in (0, 1]; weight set
    twice for one expert; duplicate expert names or URIs; an output prefix overlapping an input;
    and the core's verdict on the method (:func:`_method_issues`: the expert count it takes, the
    names, scopes, shapes and ranges of every — possibly layer-wise — parameter setting).
    """
    if not isinstance(spec, Mapping):
        return [("spec", "spec must be an object.")]
    spec = dict(spec)
    out: list[Issue] = []
    try:
        ModelMergeSpec.model_validate(spec)
    except ValidationError as e:
        out.extend(_pydantic_issues(e))

    if spec.get("budget") is not None and spec.get("fidelity") is not None:
        out.append(
            (
                "spec.fidelity",
                "set at most one of spec.budget and spec.fidelity (budget caps expert reads; fidelity targets retained task-vector energy).",
            )
        )
    if spec.get("budget") is not None:
        try:
            if parse_quantity(spec["budget"], field="spec.budget") < 1:
                out.append(("spec.budget", "the budget must be at least 1 byte; omit it for the default budget."))
        except QuantityError as e:
            out.append(("spec.budget", str(e).split(": ", 1)[1]))
    f = spec.get("fidelity")
    if f is not None and (not is_number(f) or not math.isfinite(f) or not 0 < f <= 1):
        out.append(("spec.fidelity", f"fidelity must be a number in (0, 1], got {f!r}."))

    method = spec.get("method")
    raw_experts = spec.get("experts")
    experts: list[Any] = raw_experts if isinstance(raw_experts, list) else []
    out.extend(_method_issues(spec, method, experts))
    names: dict[str, int] = {}
    uris: dict[str, int] = {}
    for i, ex in enumerate(experts):
        if not isinstance(ex, dict):
            continue
        epath = f"spec.experts[{i}]"
        if ex.get("weight") is not None and "weight" in (ex.get("parameters") or {}):
            out.append((f"{epath}.weight", "weight is set twice (weight and parameters.weight); keep one."))
        name = ex.get("name") or f"expert-{i}"
        if name in names:
            out.append((f"{epath}.name", f"expert name {name!r} is already used by spec.experts[{names[name]}]."))
        names.setdefault(name, i)
        uri = ex.get("uri")
        if isinstance(uri, str):
            if _prefix(uri) in uris:
                out.append((f"{epath}.uri", f"{uri} is already listed as spec.experts[{uris[_prefix(uri)]}]."))
            uris.setdefault(_prefix(uri), i)

    base_uri = (spec.get("base") or {}).get("uri") if isinstance(spec.get("base"), dict) else None
    out_uri = (spec.get("output") or {}).get("uri") if isinstance(spec.get("output"), dict) else None
    inputs = [("spec.base.uri", base_uri)] + [
        (f"spec.experts[{i}].uri", ex.get("uri")) for i, ex in enumerate(experts) if isinstance(ex, dict)
    ]
    for path, uri in inputs:
        if isinstance(uri, str) and path != "spec.base.uri" and base_uri and _prefix(uri) == _prefix(base_uri):
            out.append((path, "an expert cannot be the base checkpoint itself."))
        if isinstance(uri, str) and isinstance(out_uri, str):
            a, b = _prefix(uri), _prefix(out_uri)
            if a.startswith(b) or b.startswith(a):
                out.append(
                    (
                        "spec.output.uri",
                        f"the output prefix {out_uri} overlaps the input {path} ({uri}); write the snapshot elsewhere.",
                    )
                )
    return list(dict.fromkeys(out))  # without repeats, in order


def format_issues(issues: Iterable[Issue], limit: int = 10) -> str:
    """One message for a condition: ``path: message; path: message`` (at most ``limit``)."""
    issues = list(issues)
    text = "; ".join(f"{p}: {m}" for p, m in issues[:limit])
    if len(issues) > limit:
        text += f"; and {len(issues) - limit} more"
    return text


def budget_refusal_text(spec: Mapping[str, Any]) -> str | None:
    """Why the merge's method cannot honour an expert-I/O budget, as ``"<method> reads every
    expert block (<reason>)"`` (:func:`mergepipe.methods.registry.budget_refusal`: arcee_fusion,
    ramplus_tl, sce with select_topk < 1), or None when it can."""
    from mergepipe.methods.registry import METHODS, budget_refusal

    name = str(spec.get("method"))
    m = METHODS.get(name)
    why = budget_refusal(m, dict(spec.get("parameters") or {})) if m is not None else None
    return None if why is None else f"{name} reads every expert block ({why})"


def requested_budget(spec: ModelMergeSpec, settings: Settings) -> int | None:
    """The budget a merge asks for, in bytes: ``spec.budget``, else (without a fidelity target)
    the operator's default budget, else ``None`` (unbounded / fidelity-driven). Methods that cannot
    honour a budget (:func:`mergepipe.methods.registry.budget_refusal`: arcee_fusion, ramplus_tl,
    sce with select_topk < 1) get no default budget; an explicit ``spec.budget`` is refused for
    them by the core's validator. Both read by the one byte grammar
    (:func:`~mergepipe_operator.quantities.parse_quantity`)."""
    if spec.budget is not None:
        return spec.budget_bytes
    if (
        spec.fidelity is None
        and settings.default_budget
        and budget_refusal_text({"method": spec.method, "parameters": spec.parameters}) is None
    ):
        return settings.default_budget_bytes
    return None
