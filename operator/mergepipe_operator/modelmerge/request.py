"""A ModelMerge spec as the core's :class:`mergepipe.request.MergeRequest`, and the core's field
paths named as spec fields.

The operator does not validate method parameters itself: the spec's structured
``spec.parameters`` and ``spec.experts[i].parameters`` (and the ``weight`` shorthand) go into the
request as they are, and the core's one validator (:meth:`MergeRequest.resolve`) refuses them
with a field path that :func:`spec_where` renders as ``spec.experts[0].parameters.density``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mergepipe.request import ExpertRequest, Loc, MergeRequest, PlanningOptions, param_loc, sub_text

from .decisions import expert_names


def spec_settings(spec: Mapping[str, Any]) -> tuple[dict, list[dict]]:
    """The merge-wide settings (``spec.parameters``) and each expert's own settings
    (``spec.experts[i].parameters``, plus ``weight`` from the shorthand ``spec.experts[i].weight``
    unless ``parameters.weight`` is set too — the spec check refuses that), as given."""
    per = []
    for ex in spec.get("experts") or []:
        own = dict(ex.get("parameters") or {})
        if ex.get("weight") is not None and "weight" not in own:
            own = {"weight": ex["weight"], **own}
        per.append(own)
    return dict(spec.get("parameters") or {}), per


def merge_request(
    spec: Mapping[str, Any], *, budget: int | str | None = None, planning: PlanningOptions | None = None
) -> MergeRequest:
    """The merge request of a ModelMerge spec: base, experts (named as in status, URIs without the
    trailing slash, as the catalog keys them; ``format: lora`` marks a PEFT LoRA adapter), method, settings (:func:`spec_settings`), ``budget``
    (the admitted budget in bytes, given by the caller), fidelity, seed, output and the fidelity
    tiers (``spec.sketch``; unset: the planner's default, :data:`mergepipe.catalog.sketch.DEFAULT_SKETCH`),
    with the other planning options (block value, calibration set, block size) from ``planning``
    (given by the caller, which knows the operator's defaults).

    Raises:
        pydantic.ValidationError, KeyError: the spec does not have the CRD's shape (the API
            server's schema refuses such specs first).
    """
    glob, per = spec_settings(spec)
    experts = [
        ExpertRequest(name=name, uri=str(ex["uri"]).rstrip("/"), parameters=own, kind=ex.get("format"))
        for name, ex, own in zip(expert_names(spec), spec.get("experts") or [], per)
    ]
    return MergeRequest(
        base=str(spec["base"]["uri"]).rstrip("/"),
        experts=experts,
        method=spec["method"],
        parameters=glob,
        budget=budget,
        fidelity=spec.get("fidelity"),
        seed=int(spec.get("seed") or 0),
        output=(spec.get("output") or {}).get("uri"),
        planning=(planning or PlanningOptions()).model_copy(update={"sketch": spec.get("sketch")}),
    )


#: the request's planning and run options as the ModelMerge spec fields that set them (the block
#: size and working memory are the operator's, not the spec's: they name the spec as a whole)
_SPEC_OPTIONS = {
    "planning.value": "spec.blockValue",
    "planning.calibration": "spec.calibration.uri",
    "planning.sketch": "spec.sketch",
}


def spec_where(spec: Mapping[str, Any]) -> Callable[[Loc], str]:
    """Renders a request field path as the spec field it came from: ``spec.parameters.t``,
    ``spec.experts[0].parameters.density[1].value``, ``spec.experts[2].weight`` (when the expert
    set its weight with the shorthand), ``spec.experts[1].uri``, ``spec.experts``, ``spec.base.uri``,
    the planning options as ``spec.blockValue``, ``spec.calibration.uri``, ``spec.sketch``."""
    experts = [ex if isinstance(ex, Mapping) else {} for ex in (spec.get("experts") or [])]

    def where(loc: Loc) -> str:
        pl = param_loc(loc)
        if pl is not None:
            i, name, rest = pl
            if i is None:
                return f"spec.parameters.{name}{sub_text(rest)}"
            ex = experts[i] if i < len(experts) else {}
            if name == "weight" and ex.get("weight") is not None and "weight" not in (ex.get("parameters") or {}):
                return f"spec.experts[{i}].weight{sub_text(rest)}"
            return f"spec.experts[{i}].parameters.{name}{sub_text(rest)}"
        if not loc:
            return "spec"
        if loc[0] == "experts":
            return "spec.experts" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in loc[1:])
        if loc[0] in ("planning", "run") and len(loc) > 1:
            return _SPEC_OPTIONS.get(f"{loc[0]}.{loc[1]}", "spec")
        return {"base": "spec.base.uri", "output": "spec.output.uri"}.get(str(loc[0]), f"spec.{loc[0]}")

    return where
