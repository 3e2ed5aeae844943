"""The operator's validator of merge-method parameters (``spec.parameters`` and
``spec.experts[].parameters``) and their rendering as the core's ``--param`` strings
(:func:`merge_params`).

Kept together in this one module: the core's typed request (issue 11 item 1) replaces all of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from mergepipe.methods.registry import METHODS as CORE_METHODS

from ..crd import expert_count_message
from ..k8s.conditions import Issue
from ..k8s.quantities import is_number as _is_number


@dataclass(frozen=True)
class Param:
    """A merge parameter: ``scope='model'`` may be set per expert (and globally as the default for
    every expert); ``scope='global'`` only globally. Numbers may be layer-wise; booleans may not."""

    kind: Literal["number", "bool"]
    scope: Literal["model", "global"]
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def range_text(self) -> str:
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"

    def in_range(self, v: float) -> bool:
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return False
        return True


def _core_method_params() -> dict[str, dict[str, Param]]:
    """Parameters per method from the core's registry (``mergepipe.methods.registry``, stdlib-only):
    one source of truth for names, scopes and ranges, so the operator refuses exactly what the
    planner would refuse."""
    return {
        name: {
            p.name: Param(
                "bool" if p.kind == "bool" else "number",
                "model" if p.scope == "expert" else "global",
                p.lo,
                p.hi,
                lo_open=p.lo_open,
            )
            for p in spec.params
        }
        for name, spec in CORE_METHODS.items()
    }


#: Parameters per method (mergekit names), from the core registry.
METHOD_PARAMS: dict[str, dict[str, Param]] = _core_method_params()

#: (method, predicate on the expert count, message) for the methods whose expert count is bounded
#: beyond "at least 1": from the core's registry, as the CRD's CEL rules (crd.expert_count_rules).
EXPERT_COUNT_RULES: dict[str, tuple[Any, str]] = {
    name: (
        lambda n, m=m: m.min_experts <= n and (m.max_experts is None or n <= m.max_experts),
        expert_count_message(name),
    )
    for name, m in CORE_METHODS.items()
    if m.min_experts > 1 or m.max_experts is not None
}



def _check_number(p: Param, name: str, v: Any, path: str, out: list[Issue]) -> None:
    if not _is_number(v):
        out.append((path, f"{name} must be a number, got {v!r}."))
    elif not math.isfinite(v):
        out.append((path, f"{name} must be finite, got {v!r}."))
    elif not p.in_range(v):
        out.append((path, f"{name}={v:g} is outside {p.range_text()}."))


def check_param_value(name: str, p: Param, value: Any, path: str) -> list[Issue]:
    """Check one parameter value: a scalar, a gradient (list of numbers) or a list of
    ``{filter, value}`` entries (first match wins; an entry without ``filter`` matches all and must
    come last). Booleans are scalars only."""
    out: list[Issue] = []
    if p.kind == "bool":
        if not isinstance(value, bool):
            out.append((path, f"{name} must be true or false, got {value!r} (boolean parameters are not layer-wise)."))
        return out
    if not isinstance(value, list):
        _check_number(p, name, value, path, out)
        return out
    if not value:
        out.append((path, f"{name} is an empty list; give a number, a gradient [v0, v1, ...] or [{{filter, value}}, ...]."))
        return out
    if all(not isinstance(x, dict) for x in value):
        if len(value) < 2:
            out.append((path, f"{name} gradient needs at least two values (first layer … last layer), got {value!r}; use a scalar for one value."))
        for i, x in enumerate(value):
            _check_number(p, name, x, f"{path}[{i}]", out)
        return out
    if not all(isinstance(x, dict) for x in value):
        out.append((path, f"{name} mixes numbers and {{filter, value}} entries; use one form."))
        return out
    catch_all_at = None
    for i, entry in enumerate(value):
        epath = f"{path}[{i}]"
        extra = set(entry) - {"filter", "value"}
        if extra:
            out.append((epath, f"unknown key(s) {sorted(extra)}; an entry has only filter and value."))
        if "filter" in entry:
            f = entry["filter"]
            if not isinstance(f, str) or not f:
                out.append((f"{epath}.filter", f"filter must be a non-empty string (a substring of tensor names), got {f!r}."))
        elif catch_all_at is None:
            catch_all_at = i
        else:
            out.append((epath, "a second entry without filter is never used; only the first catch-all applies."))
        if "value" not in entry:
            out.append((f"{epath}.value", "value is required."))
            continue
        v = entry["value"]
        if isinstance(v, list):
            if len(v) < 2:
                out.append((f"{epath}.value", f"{name} gradient needs at least two values (first layer … last layer), got {v!r}."))
            for j, x in enumerate(v):
                _check_number(p, name, x, f"{epath}.value[{j}]", out)
        else:
            _check_number(p, name, v, f"{epath}.value", out)
    if catch_all_at is not None and catch_all_at != len(value) - 1:
        out.append((f"{path}[{catch_all_at}]", "the entry without filter matches every tensor, so the entries after it are never used; move it last."))
    return out


def _params(method: str, params: Any, path: str, *, per_expert: bool) -> list[Issue]:
    if params is None:
        return []
    if not isinstance(params, dict):
        return [(path, "parameters must be a map of name: value.")]
    out: list[Issue] = []
    table = METHOD_PARAMS.get(method, {})
    for name, value in params.items():
        ppath = f"{path}.{name}"
        p = table.get(name)
        if p is None:
            allowed = ", ".join(table) or "none"
            out.append((ppath, f"method {method} takes no parameter {name!r}; allowed: {allowed}."))
            continue
        if per_expert and p.scope == "global":
            out.append((ppath, f"{name} is a global parameter of {method}; set it in spec.parameters, not per expert."))
            continue
        out.extend(check_param_value(name, p, value, ppath))
    return out




def _param_value(v: Any) -> str:
    # JSON for everything: numbers and booleans as the core's scalar parser reads them, layer-wise
    # lists (gradients, [{filter, value}]) as the JSON lists it parses from strings starting with "["
    return json.dumps(v, separators=(",", ":"), allow_nan=False)


def merge_params(spec: Mapping[str, Any]) -> list[str]:
    """The ModelMerge's parameters in the core's ``--param`` syntax: ``NAME=VALUE`` for
    ``spec.parameters`` and ``POSITION:NAME=VALUE`` (1-based) for each expert's ``weight`` and
    ``parameters``. Values are JSON (lists for layer-wise settings). Positions, not names,
    address experts: a DNS-label name may be all digits, which the core reads as a position."""
    out = [f"{k}={_param_value(v)}" for k, v in (spec.get("parameters") or {}).items()]
    for i, ex in enumerate(spec.get("experts") or [], start=1):
        if ex.get("weight") is not None:
            out.append(f"{i}:weight={_param_value(ex['weight'])}")
        out += [f"{i}:{k}={_param_value(v)}" for k, v in (ex.get("parameters") or {}).items()]
    return out


