"""The operator's decisions as pure functions: no Kubernetes client, no object storage, no clock.

Handlers in :mod:`mergepipe_operator.main` fetch objects, call these functions and write their
results back. Every function here takes plain dicts (the objects' JSON) and an explicit ``now``.
From the core it uses only the manifest format of :mod:`mergepipe.commit.manifest` (stdlib-only).

- :func:`parse_quantity`, :func:`human_bytes`, :func:`parse_duration`: units.
- :func:`validate_merge_spec`: everything about a ModelMerge spec the CRD schema cannot check.
- :func:`admit`, :func:`settle`, :func:`release`, :func:`quota_status`: MergeQuota accounting.
- :func:`set_condition`, :func:`get_condition`: conditions per the Kubernetes API conventions;
  :func:`transition_events`: the Kubernetes Events for their transitions;
  :func:`generation_settled`: whether a generation needs reconciling at all.
- :func:`merge_experts`, :func:`merge_params`: a ModelMerge spec in the core planner's terms.
- :func:`job_name`, :func:`build_job`, :func:`job_outcome`: the merge Job; :func:`choose_job`:
  follow an existing Job or create one (a retry after an earlier generation's failure).
- :func:`analysis_id`, :func:`analyze_job_name`, :func:`build_analyze_job`: the analyze Job.
- :func:`manifest_facts`, :func:`snapshot_ready`: verification of a committed snapshot.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from fractions import Fraction
from typing import Any, Literal

from mergepipe.k8s_names import dns_label, label_value  # noqa: F401  (one naming rule for operator and driver)

from pydantic import ValidationError

from mergepipe.commit.manifest import MANIFEST_FORMAT, snapshot_id
from mergepipe.commit.manifest import manifest_bytes as _core_manifest_bytes

from .crd import API_VERSION, BYTES_PATTERN, CONDITION_REASON_PATTERN, GROUP, METHODS, ModelMergeSpec
from .settings import Settings

# --- labels, annotations, reasons ---------------------------------------------------------------

MANAGER = "mergepipe-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MERGE = f"{GROUP}/model-merge"
LABEL_PLAN = f"{GROUP}/plan-digest"
ANN_PLAN_DIGEST = f"{GROUP}/plan-digest"
ANN_PLAN_URI = f"{GROUP}/plan-uri"
ANN_MERGE = f"{GROUP}/model-merge"
ANN_GENERATION = f"{GROUP}/generation"
FINALIZER = f"{GROUP}/finalizer"


class Reason:
    """Reasons of the summary ``Ready`` condition."""

    # ModelMerge
    PLANNING = "Planning"
    ANALYZING = "Analyzing"
    QUOTA_EXCEEDED = "QuotaExceeded"
    JOB_RUNNING = "JobRunning"
    JOB_FAILED = "JobFailed"
    INVALID_SPEC = "InvalidSpec"
    COMMITTED = "Committed"
    # MergedSnapshot
    VERIFIED = "Verified"
    VERIFYING = "Verifying"
    MANIFEST_MISSING = "ManifestMissing"
    MANIFEST_INVALID = "ManifestInvalid"
    MANIFEST_HASH_MISMATCH = "ManifestHashMismatch"
    PLAN_DIGEST_MISMATCH = "PlanDigestMismatch"
    OUTPUT_MISMATCH = "OutputMismatch"
    BUDGET_EXCEEDED = "BudgetExceeded"
    # MergeQuota admission
    ADMITTED = "Admitted"
    CLAMPED = "Clamped"
    ALREADY_ADMITTED = "AlreadyAdmitted"
    # MergeSearch (search_decisions.SearchReason; Completed is Ready=True)
    SEARCH_FAILED = "Failed"


#: Ready=False reasons that need a change (spec, quota or storage) rather than time.
TERMINAL_MERGE_REASONS = frozenset({Reason.INVALID_SPEC, Reason.JOB_FAILED, Reason.QUOTA_EXCEEDED})
TERMINAL_SNAPSHOT_REASONS = frozenset(
    {
        Reason.MANIFEST_INVALID,
        Reason.MANIFEST_HASH_MISMATCH,
        Reason.PLAN_DIGEST_MISMATCH,
        Reason.OUTPUT_MISMATCH,
        Reason.BUDGET_EXCEEDED,
    }
)

# --- quantities and durations -------------------------------------------------------------------


class QuantityError(ValueError):
    """A byte quantity or duration that cannot be parsed; the message names the fix."""


_DEC = {"": 1, "B": 1, "k": 10**3, "K": 10**3, "kB": 10**3, "KB": 10**3}
for _i, _p in enumerate("MGTPE", start=2):
    _DEC[_p] = _DEC[_p + "B"] = 1000**_i
_BIN = {}
for _i, _p in enumerate("KMGTPE", start=1):
    _BIN[_p + "i"] = _BIN[_p + "iB"] = 1024**_i
UNITS: dict[str, int] = {**_DEC, **_BIN}
_BYTES_RE = re.compile(BYTES_PATTERN)
_NUM_UNIT_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$")
_UNIT_HELP = (
    "use B, k/K/kB/KB, M/MB, G/GB, T/TB, P/PB, E/EB (powers of 1000) "
    "or Ki/KiB, Mi/MiB, Gi/GiB, Ti/TiB, Pi/PiB, Ei/EiB (powers of 1024)"
)


def parse_quantity(value: Any, *, field: str = "quantity") -> int:
    """Bytes of a quantity: an integer, or a string such as ``"512MiB"``, ``"10Gi"``, ``"1G"``,
    ``"1.5TB"``, ``"4096"``.

    SI units (k, M, G, T, P, E, optionally followed by B) are powers of 1000; binary units (Ki, Mi,
    Gi, Ti, Pi, Ei, optionally followed by B) are powers of 1024; ``B`` or no unit means bytes. The
    result must be a whole number of bytes, >= 0.

    Raises:
        QuantityError: naming ``field`` and the accepted forms.
    """
    if isinstance(value, bool) or value is None:
        raise QuantityError(f"{field}: expected a byte quantity such as 10Gi, 512MiB, 1G or an integer, got {value!r}.")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"{field}: {value} is negative; a byte quantity is >= 0.")
        return value
    if isinstance(value, float):
        raise QuantityError(
            f"{field}: {value!r} is a floating-point number; write an integer number of bytes or a string such as \"1.5Gi\"."
        )
    if not isinstance(value, str):
        raise QuantityError(f"{field}: expected a byte quantity such as 10Gi, got {type(value).__name__}.")
    s = value
    if s != s.strip() or " " in s:
        raise QuantityError(f"{field}: {value!r} contains spaces; write the number and unit together, e.g. \"10Gi\".")
    if s.startswith("-"):
        raise QuantityError(f"{field}: {value!r} is negative; a byte quantity is >= 0.")
    if re.match(r"^[0-9.]+[eE][-+]?[0-9]+$", s):
        raise QuantityError(f"{field}: {value!r} uses exponent notation, which is not accepted; write e.g. \"1G\" or an integer.")
    m = _NUM_UNIT_RE.match(s)
    if not m:
        raise QuantityError(f"{field}: {value!r} is not a byte quantity; write a number and a unit, e.g. \"512MiB\" or \"10Gi\".")
    number, unit = m.groups()
    if unit not in UNITS or not _BYTES_RE.match(s):
        hint = ""
        if unit in ("m", "mb", "mB", "Mb"):
            hint = " (lowercase m means milli in Kubernetes quantities; bits are not accepted)"
        elif unit.lower() in {u.lower() for u in UNITS}:
            hint = " (units are case-sensitive)"
        raise QuantityError(f"{field}: unknown unit {unit!r} in {value!r}{hint}; {_UNIT_HELP}.")
    total = Fraction(number) * UNITS[unit]
    if total.denominator != 1:
        raise QuantityError(f"{field}: {value!r} is not a whole number of bytes.")
    return int(total)


def human_bytes(n: int | None) -> str | None:
    """A short human-readable size: exact binary units when exact (``"10Gi"``), else 3 significant
    digits (``"3.18Gi"``). ``parse_quantity(human_bytes(n)) == n`` for the exact forms."""
    if n is None:
        return None
    if n < 1024:
        return f"{n}B"
    for exp, unit in ((6, "Ei"), (5, "Pi"), (4, "Ti"), (3, "Gi"), (2, "Mi"), (1, "Ki")):
        scale = 1024**exp
        if n >= scale:
            if n % scale == 0:
                return f"{n // scale}{unit}"
            v = n / scale
            return f"{v:.3g}{unit}" if v < 1000 else f"{v:.0f}{unit}"
    return f"{n}B"  # pragma: no cover


_DURATION_RE = re.compile(r"([0-9]+)([smhdw])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: Any, *, field: str = "duration") -> timedelta:
    """``"30m"``, ``"24h"``, ``"7d"``, ``"1h30m"`` (units s, m, h, d, w) -> timedelta (> 0)."""
    if not isinstance(value, str) or not value or _DURATION_RE.sub("", value) != "":
        raise QuantityError(f"{field}: {value!r} is not a duration; write e.g. \"24h\", \"7d\" or \"1h30m\" (units s, m, h, d, w).")
    seconds = sum(int(n) * _DURATION_UNITS[u] for n, u in _DURATION_RE.findall(value))
    if seconds <= 0:
        raise QuantityError(f"{field}: {value!r} is zero; a window must be positive.")
    return timedelta(seconds=seconds)


def rfc3339(t: datetime) -> str:
    """Kubernetes timestamp (UTC, seconds): ``2026-11-22T10:00:00Z``."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | datetime | None) -> datetime | None:
    if s is None or isinstance(s, datetime):
        return s if s is None or s.tzinfo else s.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


# --- merge methods and their parameters -----------------------------------------------------------


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
    from mergepipe.methods.registry import METHODS as CORE_METHODS

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

#: (method, predicate on the expert count, message) — mirrors the CRD's CEL rules.
EXPERT_COUNT_RULES: dict[str, tuple[Any, str]] = {
    "slerp": (lambda n: n == 1, "slerp merges exactly 2 models: the base and one expert"),
    "nuslerp": (lambda n: n == 2, "nuslerp merges exactly 2 experts (relative to the base)"),
    "model_stock": (lambda n: n >= 2, "model_stock needs at least 3 models: the base and 2 experts"),
}

Issue = tuple[str, str]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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


def _prefix(uri: str) -> str:
    return uri.rstrip("/") + "/"


def _pydantic_issues(err: ValidationError) -> list[Issue]:
    out: list[Issue] = []
    for e in err.errors(include_url=False):
        loc = e["loc"]
        if loc and loc[0] in ("budget", "fidelity"):  # checked below with better messages
            continue
        # drop the union-branch names pydantic inserts ("str", "int", "constrained-str", ...)
        parts = [p for p in loc if not (isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith("constrained") or p.startswith("function")))]
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
    seen: set[Issue] = set()
    return [i for i in out if not (i in seen or seen.add(i))]


def validate_merge_spec(spec: Mapping[str, Any]) -> list[Issue]:
    """Problems in a ModelMerge spec, as ``(field path, message)``; empty when valid.

    Covers what the CRD schema cannot (or what a client that skipped the API server would miss):
    at most one of budget/fidelity; budget syntax and positivity; fidelity in (0, 1]; the model
    count each method needs (slerp 2, nuslerp 2 experts, model_stock >= 3 models); parameter names
    per method, global-only parameters set per expert, and the shape and range of every (possibly
    layer-wise) parameter value (density in (0, 1], gamma in [0, 1), t in [0, 1], ...); weight set
    twice for one expert; duplicate expert names or URIs; an output prefix overlapping an input.
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
        out.append(("spec.fidelity", "set at most one of spec.budget and spec.fidelity (budget caps expert reads; fidelity targets retained task-vector energy)."))
    if spec.get("budget") is not None:
        try:
            if parse_quantity(spec["budget"], field="spec.budget") < 1:
                out.append(("spec.budget", "the budget must be at least 1 byte; omit it for the default budget."))
        except QuantityError as e:
            out.append(("spec.budget", str(e).split(": ", 1)[1]))
    f = spec.get("fidelity")
    if f is not None and (not _is_number(f) or not math.isfinite(f) or not 0 < f <= 1):
        out.append(("spec.fidelity", f"fidelity must be a number in (0, 1], got {f!r}."))

    method = spec.get("method")
    experts = spec.get("experts") if isinstance(spec.get("experts"), list) else []
    if method in METHODS and method not in METHOD_PARAMS:
        out.append(("spec.method", f"method {method} is not implemented by this mergepipe version; available: {', '.join(METHOD_PARAMS)}."))
    if method in METHOD_PARAMS:
        rule = EXPERT_COUNT_RULES.get(method)
        if rule and not rule[0](len(experts)):
            out.append(("spec.experts", f"{rule[1]}; got {len(experts)} expert(s)."))
        out.extend(_params(method, spec.get("parameters"), "spec.parameters", per_expert=False))
        table = METHOD_PARAMS[method]
        names: dict[str, int] = {}
        uris: dict[str, int] = {}
        for i, ex in enumerate(experts):
            if not isinstance(ex, dict):
                continue
            epath = f"spec.experts[{i}]"
            eparams = ex.get("parameters") if isinstance(ex.get("parameters"), dict) else {}
            out.extend(_params(method, ex.get("parameters"), f"{epath}.parameters", per_expert=True))
            if ex.get("weight") is not None:
                if "weight" not in table:
                    out.append((f"{epath}.weight", f"method {method} takes no weight; remove it."))
                elif "weight" in eparams:
                    out.append((f"{epath}.weight", "weight is set twice (weight and parameters.weight); keep one."))
                elif not _is_number(ex["weight"]) or not math.isfinite(ex["weight"]):
                    out.append((f"{epath}.weight", f"weight must be a finite number, got {ex['weight']!r}."))
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
                out.append(("spec.output.uri", f"the output prefix {out_uri} overlaps the input {path} ({uri}); write the snapshot elsewhere."))
    seen: set[Issue] = set()
    return [i for i in out if not (i in seen or seen.add(i))]


def format_issues(issues: Iterable[Issue], limit: int = 10) -> str:
    """One message for a condition: ``path: message; path: message`` (at most ``limit``)."""
    issues = list(issues)
    text = "; ".join(f"{p}: {m}" for p, m in issues[:limit])
    if len(issues) > limit:
        text += f"; and {len(issues) - limit} more"
    return text


def requested_budget(spec: Mapping[str, Any], settings: Settings) -> int | None:
    """The budget a merge asks for: ``spec.budget``, else (without a fidelity target) the
    operator's default budget, else ``None`` (unbounded / fidelity-driven)."""
    if spec.get("budget") is not None:
        return parse_quantity(spec["budget"], field="spec.budget")
    if spec.get("fidelity") is None and settings.default_budget:
        return parse_quantity(settings.default_budget, field="default budget")
    return None


# --- conditions -------------------------------------------------------------------------------------

_REASON_RE = re.compile(CONDITION_REASON_PATTERN)


def get_condition(conditions: Iterable[Mapping[str, Any]] | None, type: str) -> dict[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == type:
            return dict(c)
    return None


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    type: str,
    status: str | bool,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """A new condition list with condition ``type`` set (the input is not modified).

    Per the API conventions ``lastTransitionTime`` changes only when ``status`` flips; reason,
    message and observedGeneration are updated in place. Other conditions are kept in order; a
    new type is appended.
    """
    if isinstance(status, bool):
        status = "True" if status else "False"
    if status not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, got {status!r}")
    if not _REASON_RE.match(reason or ""):
        raise ValueError(f"condition reason must be CamelCase ([A-Za-z][A-Za-z0-9_,:]*), got {reason!r}")
    new = {
        "type": type,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": rfc3339(now),
    }
    if generation is not None:
        new["observedGeneration"] = int(generation)
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions or []:
        c = dict(c)
        if c.get("type") == type:
            found = True
            if c.get("status") == status and c.get("lastTransitionTime"):
                new["lastTransitionTime"] = c["lastTransitionTime"]
            c = new
        out.append(c)
    if not found:
        out.append(new)
    return out


#: Reasons whose transition is posted as a Warning Event (the rest are Normal).
WARNING_REASONS = frozenset({Reason.INVALID_SPEC, Reason.JOB_FAILED, Reason.QUOTA_EXCEEDED}) | frozenset(
    {Reason.MANIFEST_INVALID, Reason.MANIFEST_HASH_MISMATCH, Reason.PLAN_DIGEST_MISMATCH, Reason.OUTPUT_MISMATCH,
     Reason.BUDGET_EXCEEDED, Reason.SEARCH_FAILED}
)


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the object: ``type`` Normal or Warning, a CamelCase
    ``reason`` (the condition's), and the condition's ``message``."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def transition_events(
    old: Iterable[Mapping[str, Any]] | None, new: Iterable[Mapping[str, Any]] | None
) -> list[EventSpec]:
    """The Events for the condition changes from ``old`` to ``new`` (two condition lists).

    A condition *transitions* when it is new or its ``status``, ``reason`` or
    ``observedGeneration`` changed (a message-only update, such as a running Job's pod count, is
    not an Event; a new generation reaching the same reason is). One Event per distinct reason,
    other conditions first and the summary ``Ready`` last (``QuotaAdmitted=False`` and
    ``Ready=False`` both saying ``QuotaExceeded`` give one Event, with Ready's message). Warning
    for ``status=False`` with a reason in :data:`WARNING_REASONS`, else Normal.
    """
    def key(c: Mapping[str, Any]) -> tuple[Any, Any, Any]:
        return c.get("status"), c.get("reason"), c.get("observedGeneration")

    before = {c.get("type"): c for c in old or []}
    changed = [c for c in new or [] if c.get("type") not in before or key(before[c.get("type")]) != key(c)]
    changed.sort(key=lambda c: c.get("type") == "Ready")
    by_reason: dict[str, EventSpec] = {}
    for c in changed:
        reason = str(c.get("reason") or "")
        warn = c.get("status") == "False" and reason in WARNING_REASONS
        by_reason.pop(reason, None)  # Ready (last) wins, and goes last
        by_reason[reason] = EventSpec("Warning" if warn else "Normal", reason, str(c.get("message") or "")[:1024])
    return list(by_reason.values())


def condition_current(cond: Mapping[str, Any] | None, generation: int | None) -> bool:
    """True when ``cond`` exists and was computed for ``generation``."""
    if not cond:
        return False
    og = cond.get("observedGeneration")
    return generation is None or og is None or og >= generation


# --- MergeQuota ---------------------------------------------------------------------------------

#: Ledger entries kept before the oldest charges are folded into ``status.carry``.
MAX_LEDGER = 256


@dataclass(frozen=True)
class QuotaLimits:
    expert_read_bytes: int | None
    merges: int | None
    window: timedelta | None
    enforcement: Literal["Clamp", "Reject"]
    window_text: str | None = None


def quota_limits(quota: Mapping[str, Any]) -> QuotaLimits:
    """Parsed ``spec`` of a MergeQuota (raises QuantityError on a bad spec)."""
    spec = quota.get("spec") or {}
    hard = spec.get("hard") or {}
    name = (quota.get("metadata") or {}).get("name", "?")
    b = hard.get("expertReadBytes")
    m = hard.get("merges")
    enforcement = spec.get("enforcement") or "Reject"
    if enforcement not in ("Clamp", "Reject"):
        raise QuantityError(f"MergeQuota {name}: spec.enforcement must be Clamp or Reject, got {enforcement!r}.")
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
        raise QuantityError(f"MergeQuota {name}: spec.hard.merges must be an integer >= 0, got {m!r}.")
    return QuotaLimits(
        expert_read_bytes=None if b is None else parse_quantity(b, field=f"MergeQuota {name}: spec.hard.expertReadBytes"),
        merges=m,
        window=None if not spec.get("window") else parse_duration(spec["window"], field=f"MergeQuota {name}: spec.window"),
        enforcement=enforcement,
        window_text=spec.get("window") or None,
    )


def _counts(entry: Mapping[str, Any], limits: QuotaLimits, now: datetime) -> bool:
    if entry.get("state") == "Reserved":
        return True  # in flight: counts until settled or released
    if limits.window is None:
        return True
    t = parse_time(entry.get("time"))
    return t is not None and t > now - limits.window


def _usage(status: Mapping[str, Any], limits: QuotaLimits, now: datetime) -> tuple[int, int]:
    b = m = 0
    for e in status.get("ledger") or []:
        if _counts(e, limits, now):
            b += int(e.get("bytes") or 0)
            m += 1
    carry = status.get("carry") or {}
    exp = parse_time(carry.get("expires"))
    if carry and (exp is None or exp > now):
        b += int(carry.get("expertReadBytes") or 0)
        m += int(carry.get("merges") or 0)
    return b, m


def quota_status(quota: Mapping[str, Any], now: datetime, ledger: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The quota's status recomputed at ``now``: hard (echo, in bytes), used, the ledger without
    charges that left the window, the oldest charges folded into ``carry`` past ``MAX_LEDGER``.
    Conditions and other status fields are kept."""
    limits = quota_limits(quota)
    old = dict(quota.get("status") or {})
    entries = [dict(e) for e in (old.get("ledger") or [])] if ledger is None else [dict(e) for e in ledger]
    carry = dict(old.get("carry") or {})
    exp = parse_time(carry.get("expires"))
    if carry and exp is not None and exp <= now:
        carry = {}
    kept = [e for e in entries if e.get("state") == "Reserved" or _counts(e, limits, now)]
    charged = sorted((e for e in kept if e.get("state") == "Charged"), key=lambda e: str(e.get("time")))
    excess = len(kept) - MAX_LEDGER
    fold = charged[: max(0, excess)]
    if fold:
        fold_keys = {e["key"] for e in fold}
        kept = [e for e in kept if e["key"] not in fold_keys]
        carry["expertReadBytes"] = int(carry.get("expertReadBytes") or 0) + sum(int(e["bytes"]) for e in fold)
        carry["merges"] = int(carry.get("merges") or 0) + len(fold)
        if limits.window is None:
            carry.pop("expires", None)
        else:
            last = max(parse_time(e["time"]) for e in fold) + limits.window
            prev = parse_time(carry.get("expires"))
            carry["expires"] = rfc3339(max(last, prev) if prev else last)
    new = dict(old)
    new["ledger"] = kept
    if carry:
        new["carry"] = carry
    else:
        new.pop("carry", None)
    tmp = {"ledger": kept, "carry": carry}
    b, m = _usage(tmp, limits, now)
    new["used"] = {"expertReadBytes": b, "merges": m}
    hard: dict[str, int] = {}
    if limits.expert_read_bytes is not None:
        hard["expertReadBytes"] = limits.expert_read_bytes
    if limits.merges is not None:
        hard["merges"] = limits.merges
    new["hard"] = hard
    gen = (quota.get("metadata") or {}).get("generation")
    if gen is not None:
        new["observedGeneration"] = gen
    return new


@dataclass(frozen=True)
class Admission:
    """The outcome of :func:`admit`.

    Attributes:
        allowed: the merge may proceed.
        budget: the budget it may use (``requested`` or lower when clamped; ``None`` = unbounded).
        reason: Admitted | Clamped | AlreadyAdmitted | QuotaExceeded.
        message: one line for the ModelMerge's condition.
        new_used: ``{"expertReadBytes", "merges"}`` after the reservation.
        new_status: the quota status to write (with the reservation in its ledger), or ``None``
            when nothing must be written (rejected, idempotent repeat, or no ``key``).
    """

    allowed: bool
    budget: int | None
    reason: str
    message: str
    new_used: dict[str, int]
    new_status: dict[str, Any] | None = None

    @property
    def clamped(self) -> bool:
        return self.reason == Reason.CLAMPED


def _window_text(limits: QuotaLimits) -> str:
    return f"in the last {limits.window_text}" if limits.window else "in total"


def admit(
    quota: Mapping[str, Any],
    requested_budget: int | None,
    now: datetime,
    *,
    key: str | None = None,
    merge: str = "",
) -> Admission:
    """Admit a merge asking for ``requested_budget`` expert bytes (``None``: unbounded) under
    ``quota`` (a MergeQuota object) at ``now``.

    Usage counts Reserved ledger entries (merges in flight) and Charged entries inside the rolling
    window. ``merges`` must have room for one more. With a byte limit, a request that fits is
    admitted as is; otherwise ``Clamp`` lowers the budget to what is left (refusing when nothing
    is), and ``Reject`` refuses. An admitted merge with a ``key`` gets a Reserved ledger entry in
    ``new_status``; admitting the same key again is an idempotent no-op (kopf retries handlers).

    Race-freedom is the caller's part: write ``new_status`` with the quota's ``resourceVersion``
    (a conflict means someone else changed the quota: re-read and call ``admit`` again).
    """
    limits = quota_limits(quota)
    name = (quota.get("metadata") or {}).get("name", "?")
    status = quota.get("status") or {}
    used_b, used_m = _usage(status, limits, now)
    used = {"expertReadBytes": used_b, "merges": used_m}
    if key is not None:
        for e in status.get("ledger") or []:
            if e.get("key") == key:
                budget = requested_budget
                if limits.expert_read_bytes is not None:
                    budget = int(e.get("bytes") or 0) if requested_budget is None else min(requested_budget, int(e.get("bytes") or 0))
                return Admission(True, budget, Reason.ALREADY_ADMITTED, f"already admitted by MergeQuota {name}", used, None)
    if limits.merges is not None and used_m + 1 > limits.merges:
        return Admission(
            False, None, Reason.QUOTA_EXCEEDED,
            f"MergeQuota {name}: {used_m} of {limits.merges} merges used {_window_text(limits)}; wait or raise spec.hard.merges",
            used,
        )
    reason, message = Reason.ADMITTED, f"admitted by MergeQuota {name}"
    if limits.expert_read_bytes is None:
        budget = requested_budget
    else:
        hard = limits.expert_read_bytes
        left = max(0, hard - used_b)
        used_text = f"{human_bytes(used_b)} of {human_bytes(hard)} expert reads used {_window_text(limits)}"
        if requested_budget is not None and requested_budget <= left:
            budget = requested_budget
            message = f"admitted by MergeQuota {name} ({used_text}, reserving {human_bytes(budget)})"
        elif limits.enforcement == "Clamp" and left >= 1:
            budget = left
            reason = Reason.CLAMPED
            asked = "an unbounded read" if requested_budget is None else human_bytes(requested_budget)
            message = f"budget lowered from {asked} to {human_bytes(left)} by MergeQuota {name} (Clamp; {used_text})"
        else:
            if requested_budget is None:
                why = "the merge sets no budget (unbounded expert reads); set spec.budget"
            else:
                why = f"requested {human_bytes(requested_budget)} but only {human_bytes(left)} is left"
            return Admission(
                False, None, Reason.QUOTA_EXCEEDED,
                f"MergeQuota {name} ({limits.enforcement}): {why}; {used_text}",
                used,
            )
    reserve = budget or 0
    new_used = {"expertReadBytes": used_b + reserve, "merges": used_m + 1}
    new_status = None
    if key is not None:
        ledger = [dict(e) for e in status.get("ledger") or []]
        ledger.append({"key": key, "merge": merge, "bytes": reserve, "state": "Reserved", "time": rfc3339(now)})
        new_status = quota_status(quota, now, ledger)
        new_used = dict(new_status["used"])
    return Admission(True, budget, reason, message, new_used, new_status)


def settle(quota: Mapping[str, Any], key: str, expert_read_bytes: int | None, now: datetime) -> dict[str, Any] | None:
    """Turn the reservation ``key`` into a charge of ``expert_read_bytes`` (the realized bytes from
    the manifest; ``None`` keeps the reserved amount, used when a Job failed and read an unknown
    amount). Returns the new status, or ``None`` when there is nothing to change (unknown key,
    or already charged: settling is idempotent)."""
    status = quota.get("status") or {}
    ledger = [dict(e) for e in status.get("ledger") or []]
    for e in ledger:
        if e.get("key") == key:
            if e.get("state") == "Charged":
                return None
            e["state"] = "Charged"
            if expert_read_bytes is not None:
                e["bytes"] = int(expert_read_bytes)
            e["time"] = rfc3339(now)
            return quota_status(quota, now, ledger)
    return None


def release(quota: Mapping[str, Any], key: str, now: datetime) -> dict[str, Any] | None:
    """Drop the reservation ``key`` (the merge never started a Job). ``None``: nothing to change
    (unknown key, or already charged)."""
    status = quota.get("status") or {}
    ledger = [dict(e) for e in status.get("ledger") or []]
    kept = [e for e in ledger if not (e.get("key") == key and e.get("state") == "Reserved")]
    if len(kept) == len(ledger):
        return None
    return quota_status(quota, now, kept)


def admission_key(uid: str, generation: int | None) -> str:
    """Ledger key of one merge run: one per ModelMerge generation."""
    return f"{uid}.{generation or 0}"


# --- names and the Job --------------------------------------------------------------------------

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def _retry_suffix(retry_generation: int | None) -> str:
    if retry_generation is None:
        return ""
    if isinstance(retry_generation, bool) or not isinstance(retry_generation, int) or retry_generation < 1:
        raise ValueError(f"retry generation must be a positive integer, got {retry_generation!r}")
    return f"-g{retry_generation}"


def job_name(merge_name: str, plan_digest: str, retry_generation: int | None = None) -> str:
    """Deterministic Job name: ModelMerge name + the first 10 hex of the plan digest, a DNS-1123
    label of at most 63 chars. A retry with the same plan gets the same name (409 = already there).
    ``retry_generation``: the generation that runs this plan again after an earlier generation's
    Job of it failed (:func:`choose_job`); the name gets ``-g<generation>`` so it is a new Job."""
    if not _DIGEST_RE.match(plan_digest or ""):
        raise ValueError(f"plan digest must be 64 lowercase hex characters, got {plan_digest!r}")
    return dns_label(merge_name, plan_digest[:10] + _retry_suffix(retry_generation))


@dataclass(frozen=True)
class JobChoice:
    """The outcome of :func:`choose_job`.

    Attributes:
        follow: the existing Job that runs this work for the generation (``None``: create one).
        retry_generation: when creating, the generation that retries work an earlier generation's
            Job failed at (the new Job's name gets ``-g<generation>``); ``None`` for a first Job.
    """

    follow: dict[str, Any] | None
    retry_generation: int | None = None


def _job_generation(job: Mapping[str, Any]) -> int:
    try:
        return int(((job.get("metadata") or {}).get("annotations") or {}).get(ANN_GENERATION) or 0)
    except ValueError:
        return 0


def choose_job(
    jobs: Iterable[Mapping[str, Any]],
    annotation: str,
    value: str,
    generation: int | None,
    *,
    usable: frozenset[str] = frozenset({"Running", "Succeeded"}),
) -> JobChoice:
    """Which Job does ``value`` (a plan digest, or an analysis id, in the Jobs' ``annotation``)
    for ``generation`` of a ModelMerge: follow an existing Job, or create one.

    - A Job of ``value`` whose :func:`job_outcome` state is in ``usable`` (running or complete, of
      any generation) is followed: the same plan is the same work, so a spec change that plans the
      same keeps its Job (an operator restart finds it too).
    - A Job of ``value`` that ended otherwise (failed) *for this generation or a later one* is
      followed too: its failure is this generation's outcome, until the spec changes.
    - Otherwise a Job is created; when only earlier generations' Jobs of ``value`` failed, with
      ``retry_generation=generation`` so it gets a new name (:func:`job_name`): a spec change
      after ``JobFailed`` retries instead of finding the failed Job again.

    Jobs of other values and Jobs being deleted (``metadata.deletionTimestamp``) are ignored;
    among several candidates the newest generation wins (then the name, for determinism).
    """
    gen = int(generation or 0)
    mine = [
        j for j in jobs
        if ((j.get("metadata") or {}).get("annotations") or {}).get(annotation) == value
        and not (j.get("metadata") or {}).get("deletionTimestamp")
    ]
    mine.sort(key=lambda j: (_job_generation(j), j["metadata"].get("name", "")), reverse=True)
    for j in mine:
        if job_outcome(j).state in usable:
            return JobChoice(dict(j))
    for j in mine:
        if _job_generation(j) >= gen:
            return JobChoice(dict(j))
    return JobChoice(None, gen if mine and gen >= 1 else None)


def generation_settled(status: Mapping[str, Any] | None, generation: int | None) -> bool:
    """Has ``generation`` of a ModelMerge already gone as far as reconciling takes it?

    True when ``status.observedGeneration`` is ``generation`` and the ``Ready`` reason is one only
    the Job or a spec change moves on from: ``JobRunning`` (the Job's events take over),
    ``Committed``, ``JobFailed`` and ``InvalidSpec`` (terminal *for this generation*). Any other
    generation, in particular the next one after a failure, is reconciled again: a new plan, and a
    new Job when the old one failed (:func:`choose_job`). ``QuotaExceeded``, ``Analyzing`` and
    ``Planning`` are retried within the generation."""
    status = status or {}
    ready = get_condition(status.get("conditions"), "Ready")
    return bool(
        ready is not None
        and status.get("observedGeneration") == generation
        and ready.get("reason") in (Reason.COMMITTED, Reason.JOB_RUNNING, Reason.JOB_FAILED, Reason.INVALID_SPEC)
    )


def snapshot_name(merge_name: str, manifest_hash: str) -> str:
    """Deterministic MergedSnapshot name: ModelMerge name + 12 hex of the manifest hash."""
    h = manifest_hash.removeprefix("sha256:")
    if not _DIGEST_RE.match(h):
        raise ValueError(f"manifest hash must be 64 lowercase hex characters, got {manifest_hash!r}")
    return dns_label(merge_name, h[:12])


def plan_uri(settings: Settings, namespace: str, name: str, plan_digest: str) -> str:
    """Where the operator writes the full plan (content-addressed by its digest)."""
    if not settings.plan_prefix:
        raise ValueError("the operator has no plan prefix (values: plans.prefix / MERGEPIPE_PLAN_PREFIX)")
    return f"{settings.plan_prefix.rstrip('/')}/{namespace}/{name}/{plan_digest}.json"


def plan_status(digest: str, uri: str, base_read_bytes: int, expert_read_bytes: int, output_write_bytes: int,
                retained_energy: float | None) -> dict[str, Any]:
    """A ModelMerge's ``status.plan`` (crd.PlanStatus, camelCase): the plan's digest (64 hex), the
    URI of the full plan object, its estimated bytes per role and the retained task-vector
    energy fraction in [0, 1] (``None``: unknown). Every key is present (a merge patch replaces
    each of them, so nothing of an earlier plan survives).

    Raises:
        ValueError: ``digest`` is not 64 lowercase hex characters, or a byte count is negative.
    """
    if not _DIGEST_RE.match(digest or ""):
        raise ValueError(f"plan digest must be 64 lowercase hex characters, got {digest!r}")
    sizes = {"baseReadBytes": base_read_bytes, "expertReadBytes": expert_read_bytes, "outputWriteBytes": output_write_bytes}
    for k, v in sizes.items():
        if v is None or int(v) < 0:
            raise ValueError(f"plan {k} must be a byte count >= 0, got {v!r}")
    return {
        "digest": digest,
        "uri": uri,
        "estimated": {k: int(v) for k, v in sizes.items()},
        "retainedEnergy": None if retained_energy is None else float(retained_energy),
    }


def status_plan_digest(status: Mapping[str, Any] | None) -> str | None:
    """The plan digest a ModelMerge status records (``status.plan.digest``), or ``None``."""
    plan = (status or {}).get("plan")
    return plan.get("digest") if isinstance(plan, Mapping) else None


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Controller ownerReference to a ModelMerge object (needs metadata.uid)."""
    meta = obj.get("metadata") or {}
    if not meta.get("uid") or not meta.get("name"):
        raise ValueError("the owner needs metadata.name and metadata.uid")
    return {
        "apiVersion": obj.get("apiVersion") or API_VERSION,
        "kind": obj.get("kind") or "ModelMerge",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


#: The catalog's block size the operator plans with (the core's default; the analyze Job uses it too).
ANALYZE_BLOCK_BYTES = 128 * 1024
ANN_ANALYSIS = f"{GROUP}/analysis-id"


def expert_names(spec: Mapping[str, Any]) -> list[str]:
    """Names of the experts as plans, manifests and status show them: ``name``, else
    ``expert-<index>`` (0-based, as :func:`validate_merge_spec` reports them)."""
    return [(ex.get("name") or f"expert-{i}") for i, ex in enumerate(spec.get("experts") or [])]


def merge_experts(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(name, uri)`` of every expert, URIs without the trailing slash (as the catalog keys them)."""
    return [(n, ex["uri"].rstrip("/")) for n, ex in zip(expert_names(spec), spec.get("experts") or [])]


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


def needs_pair_statistics(method: str | None) -> bool:
    """Methods (model_stock, nuslerp) whose plan needs the experts' pairwise task-vector dot
    products (the catalog's pair statistics, recorded by ``mergepipe analyze --pairs``)."""
    from mergepipe.methods.registry import METHODS as CORE_METHODS

    m = CORE_METHODS.get(method or "")
    return bool(m is not None and m.needs_gram)


def analysis_id(base_identity: str, expert_identities: Iterable[str], catalog_uri: str | None, method: str | None) -> str:
    """Content address of one analysis run: the base's and the missing experts' identity digests,
    the catalog, the block size, and (for methods that need pair statistics) the method. A changed
    checkpoint has a new identity, so it gets a new analyze Job rather than the finished one."""
    key = {
        "base": base_identity,
        "experts": sorted(set(expert_identities)),
        "catalog": (catalog_uri or "").rstrip("/"),
        "block_bytes": ANALYZE_BLOCK_BYTES,
        "pairs": method if needs_pair_statistics(method) else None,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def analyze_job_name(merge_name: str, analysis: str, retry_generation: int | None = None) -> str:
    """Deterministic analyze Job name: ModelMerge name + ``analyze-`` + 10 hex of the analysis id
    (+ ``-g<generation>`` for a retry after an earlier generation's analyze Job failed, as
    :func:`job_name`)."""
    if not _DIGEST_RE.match(analysis or ""):
        raise ValueError(f"analysis id must be 64 lowercase hex characters, got {analysis!r}")
    return dns_label(merge_name, f"analyze-{analysis[:10]}{_retry_suffix(retry_generation)}")


def analyze_args(spec: Mapping[str, Any], missing_uris: Iterable[str], catalog_uri: str) -> list[str]:
    """Arguments of the analyze Job's ``mergepipe`` command:
    ``mergepipe analyze --base B --expert E... [--pairs] --catalog C --json``.

    ``missing_uris`` are the experts the planner named (``MissingAnalysis.uris``: those without
    statistics and, for methods that need pair statistics, both experts of every missing pair).
    For model_stock and nuslerp ``--pairs`` also records the pair statistics of every two of
    them; pairs already in the catalog are not recomputed."""
    args = ["analyze", "--base", spec["base"]["uri"].rstrip("/")]
    for uri in missing_uris:
        args += ["--expert", uri.rstrip("/")]
    if needs_pair_statistics(spec.get("method")):
        args.append("--pairs")
    return args + ["--catalog", catalog_uri, "--json"]


def _worker_job(
    mm: Mapping[str, Any],
    name: str,
    component: Literal["merge", "analyze", "search", "evaluate"],
    args: list[str],
    settings: Settings,
    *,
    gpu: bool,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    env_extra: list[dict[str, Any]],
    owner: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A Job running the merger image's ``mergepipe`` CLI with the operator's security settings
    (shared by the merge and the analyze Job)."""
    meta = mm.get("metadata") or {}
    spec = mm.get("spec") or {}
    namespace = meta.get("namespace")
    res = spec.get("resources") or {}
    gpu_spec = res.get("gpu") or {}
    gpu_count = (settings.gpu_count if gpu_spec.get("count") is None else int(gpu_spec["count"])) if gpu else 0
    gpu_name = gpu_spec.get("resourceName") or settings.gpu_resource_name
    s3 = spec.get("s3") or {}
    secret = s3.get("credentialsSecretRef") or (
        {
            "name": settings.s3_secret_name,
            "accessKeyIdKey": settings.s3_access_key_id_key,
            "secretAccessKeyKey": settings.s3_secret_access_key_key,
        }
        if settings.s3_secret_name
        else None
    )
    endpoint = s3.get("endpoint") or settings.s3_endpoint
    region = s3.get("region") or settings.s3_region

    env: list[dict[str, Any]] = []
    if secret:
        def ref(var: str, key: str, optional: bool = False) -> dict[str, Any]:
            sk = {"name": secret["name"], "key": key}
            if optional:
                sk["optional"] = True
            return {"name": var, "valueFrom": {"secretKeyRef": sk}}

        env.append(ref("AWS_ACCESS_KEY_ID", secret.get("accessKeyIdKey") or "AWS_ACCESS_KEY_ID"))
        env.append(ref("AWS_SECRET_ACCESS_KEY", secret.get("secretAccessKeyKey") or "AWS_SECRET_ACCESS_KEY"))
        if secret.get("sessionTokenKey"):
            env.append(ref("AWS_SESSION_TOKEN", secret["sessionTokenKey"], optional=True))
    if endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": endpoint})
    if region:
        env.append({"name": "AWS_REGION", "value": region})
        env.append({"name": "AWS_DEFAULT_REGION", "value": region})
    env += [
        {"name": "HOME", "value": "/tmp"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    env += [dict(e) for e in env_extra]
    if gpu_count == 0:
        env.append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})

    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    cpu = res.get("cpu", settings.cpu)
    memory = res.get("memory", settings.memory)
    if cpu is not None:
        requests["cpu"] = str(cpu)
    if memory is not None:
        requests["memory"] = limits["memory"] = str(memory)
    if gpu_count > 0:
        limits[gpu_name] = str(gpu_count)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits

    tmp_volume: dict[str, Any] = {"name": "tmp", "emptyDir": {}}
    if settings.tmp_size_limit:
        tmp_volume["emptyDir"]["sizeLimit"] = settings.tmp_size_limit
    container = {
        "name": component,
        "image": spec.get("image") or settings.merger_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["mergepipe"],
        # `mergepipe execute` computes on --device (default cpu): use the GPU the pod gets
        "args": list(args) + (["--device", "cuda"] if gpu_count > 0 else []),
        "env": env,
        "resources": resources,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [tmp_volume],
    }
    if settings.job_service_account:
        pod_spec["serviceAccountName"] = settings.job_service_account
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in settings.tolerations]
    job_meta: dict[str, Any] = {
        "name": name,
        "labels": dict(labels),
        "annotations": dict(annotations),
        "ownerReferences": [dict(owner) if owner is not None else owner_reference(mm)],
    }
    if namespace:
        job_meta["namespace"] = namespace
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": job_meta,
        "spec": {
            "backoffLimit": settings.backoff_limit,
            "activeDeadlineSeconds": settings.active_deadline_seconds,
            "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
            "podFailurePolicy": {
                # evictions/preemptions of a (GPU) pod do not count towards backoffLimit
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
            },
            "template": {
                "metadata": {"labels": dict(labels), "annotations": dict(annotations)},
                "spec": pod_spec,
            },
        },
    }


def build_job(
    mm: Mapping[str, Any],
    plan_uri: str,
    plan_digest: str,
    settings: Settings,
    *,
    owner: Mapping[str, Any] | None = None,
    retry_generation: int | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that runs ``mergepipe execute <plan-uri> --out <output-uri> --json``
    (plus ``--device cuda`` when it has GPUs).

    ``mm`` is the ModelMerge object; its metadata (name, namespace, uid) gives the owner reference
    unless ``owner`` (an ownerReference dict) is passed. Per-merge overrides come from
    ``mm.spec`` (image, resources, s3), the rest from ``settings``. Security: non-root, read-only
    root filesystem with an emptyDir at /tmp, all capabilities dropped, no privilege escalation,
    seccomp RuntimeDefault, no service-account token; credentials only through ``secretKeyRef``.
    """
    meta = mm.get("metadata") or {}
    name = meta["name"]
    out_uri = ((mm.get("spec") or {}).get("output") or {}).get("uri")
    if not out_uri:
        raise ValueError("spec.output.uri is required")
    jname = job_name(name, plan_digest, retry_generation)
    labels = {
        LABEL_NAME: "mergepipe-merger",
        LABEL_COMPONENT: "merge",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_MERGE: label_value(name),
        LABEL_PLAN: plan_digest[:16],
    }
    annotations = {
        ANN_PLAN_DIGEST: plan_digest,
        ANN_PLAN_URI: plan_uri,
        ANN_MERGE: name,
        ANN_GENERATION: str(meta.get("generation") or 0),
    }
    return _worker_job(
        mm, jname, "merge", ["execute", plan_uri, "--out", out_uri, "--json"], settings, gpu=True,
        labels=labels, annotations=annotations,
        env_extra=[{"name": "MERGEPIPE_PLAN_DIGEST", "value": plan_digest}], owner=owner,
    )


def build_analyze_job(
    mm: Mapping[str, Any],
    missing_uris: Iterable[str],
    analysis: str,
    settings: Settings,
    *,
    owner: Mapping[str, Any] | None = None,
    retry_generation: int | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that records the missing experts' statistics in the catalog
    (:func:`analyze_args`), before the operator plans. Same image, security settings,
    Secret-only credentials, CPU and memory as the merge Job; never a GPU (analysis is numpy).
    Its name is deterministic (:func:`analyze_job_name`): a retry, a restarted operator or a
    second reconciliation finds the Job already there (409) instead of starting another."""
    if not settings.catalog_uri:
        raise ValueError("the operator has no catalog (values: catalog.uri / MERGEPIPE_CATALOG_URI)")
    meta = mm.get("metadata") or {}
    name = meta["name"]
    labels = {
        LABEL_NAME: "mergepipe-analyzer",
        LABEL_COMPONENT: "analyze",
        LABEL_MANAGED_BY: MANAGER,
        LABEL_MERGE: label_value(name),
    }
    annotations = {
        ANN_ANALYSIS: analysis,
        ANN_MERGE: name,
        ANN_GENERATION: str(meta.get("generation") or 0),
    }
    args = analyze_args(mm.get("spec") or {}, missing_uris, settings.catalog_uri)
    return _worker_job(
        mm, analyze_job_name(name, analysis, retry_generation), "analyze", args, settings, gpu=False,
        labels=labels, annotations=annotations, env_extra=[], owner=owner,
    )


@dataclass(frozen=True)
class JobOutcome:
    state: Literal["Running", "Succeeded", "Failed"]
    reason: str
    message: str


def job_outcome(job: Mapping[str, Any] | None, what: str = "merge Job") -> JobOutcome:
    """Summarize a Job's status (messages name it ``what``). Only the terminal ``Complete``/``Failed``
    conditions end it (in Kubernetes >= 1.31 ``SuccessCriteriaMet``/``FailureTarget`` come first,
    while pods still stop)."""
    if not job:
        return JobOutcome("Failed", "JobMissing", f"the {what} no longer exists")
    st = job.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return JobOutcome("Succeeded", "Complete", c.get("message") or f"the {what} completed")
        if c.get("type") == "Failed":
            why = c.get("reason") or "Failed"
            return JobOutcome("Failed", why, c.get("message") or f"the {what} failed ({why})")
    active, failed = int(st.get("active") or 0), int(st.get("failed") or 0)
    msg = f"{what} running ({active} active pod(s)"
    msg += f", {failed} failed attempt(s))" if failed else ")"
    return JobOutcome("Running", Reason.JOB_RUNNING, msg)


# --- snapshots ----------------------------------------------------------------------------------


def manifest_hash(raw: bytes | str) -> str:
    """SHA-256 (hex) of the manifest object's bytes as stored (as ``mergepipe.commit``)."""
    if isinstance(raw, str):
        raw = raw.encode()
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class ManifestFacts:
    """What the operator reads from a committed manifest (written by
    ``mergepipe.pipeline._build_manifest``, format ``mergepipe.manifest/v1``)::

        {"format": "mergepipe.manifest/v1", "snapshot_id": "snap-<16 hex>", "plan_digest": "<64 hex>",
         "files_prefix": "runs/<id>",                      # outputs live under <out>/<files_prefix>/
         "outputs": {"model.safetensors": {"size": int, "sha256": "<hex>"}, ...},   # or "tree_sha256"
         "io": {"expert_budget_bytes": int | null, "fidelity": float | null,
                "estimated": {"base_read_bytes", "expert_read_bytes", "output_write_bytes"},
                "realized":  {"base_read_bytes", "expert_read_bytes", "output_write_bytes", ...}},
         ...}
    """

    plan_digest: str | None
    snapshot_id: str | None
    files_prefix: str
    budget_bytes: int | None
    outputs: dict[str, dict[str, Any]]
    estimated: dict[str, int | None]
    realized: dict[str, int | None]

    @property
    def total_bytes(self) -> int:
        return sum(int(o.get("size") or 0) for o in self.outputs.values())


_ROLES = (("base_read_bytes", "baseReadBytes"), ("expert_read_bytes", "expertReadBytes"), ("output_write_bytes", "outputWriteBytes"))


def _io(d: Any) -> dict[str, int | None]:
    d = d if isinstance(d, dict) else {}
    return {camel: (int(d[snake]) if _is_number(d.get(snake)) else None) for snake, camel in _ROLES}


def manifest_facts(doc: Mapping[str, Any]) -> ManifestFacts:
    """Extract :class:`ManifestFacts` (raises ValueError naming what is wrong)."""
    if not isinstance(doc, Mapping):
        raise ValueError("the manifest is not a JSON object")
    if doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"manifest format {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    outputs = doc.get("outputs")
    if not isinstance(outputs, dict) or not outputs:
        raise ValueError("the manifest lists no outputs")
    for path, o in outputs.items():
        # the content key: SHA-256 of the file, or (shards partly written by server-side copy)
        # the tree digest over its header and per-tensor SHA-256s (mergepipe.commit.manifest)
        if not isinstance(o, dict) or not any(_DIGEST_RE.match(str(o.get(k, ""))) for k in ("sha256", "tree_sha256")):
            raise ValueError(f"output {path} has no SHA-256 or tree digest")
        if not _is_number(o.get("size")) or o["size"] < 0:
            raise ValueError(f"output {path} has no size")
    io = doc.get("io") if isinstance(doc.get("io"), dict) else {}
    budget = io.get("expert_budget_bytes")
    prefix = doc.get("files_prefix") or ""
    if not isinstance(prefix, str) or prefix.startswith("/") or ".." in prefix.split("/"):
        raise ValueError(f"files_prefix {prefix!r} is not a relative prefix")
    return ManifestFacts(
        plan_digest=doc.get("plan_digest"),
        snapshot_id=doc.get("snapshot_id"),
        files_prefix=prefix,
        budget_bytes=int(budget) if _is_number(budget) else None,
        outputs={str(k): dict(v) for k, v in outputs.items()},
        estimated=_io(io.get("estimated")),
        realized=_io(io.get("realized")),
    )


def output_path(facts: ManifestFacts, name: str) -> str:
    """Path of an output file relative to the snapshot URI."""
    return f"{facts.files_prefix.strip('/')}/{name}" if facts.files_prefix else name


def snapshot_ready(
    manifest: bytes | str | Mapping[str, Any] | None,
    expected_plan_digest: str | None,
    expected_manifest_hash: str | None,
    *,
    object_sizes: Mapping[str, int | None] | None = None,
) -> tuple[bool, str, str]:
    """Is a committed snapshot verified? ``(ready, reason, message)`` for its Ready condition.

    ``manifest`` is the manifest object as read from storage (bytes; hashed as stored), a parsed
    dict (hashed as the core serializes it), or ``None`` when no manifest exists yet. Checks: it
    parses as a ``mergepipe.manifest/v1``; its hash equals ``expected_manifest_hash`` (if given);
    its plan digest equals ``expected_plan_digest`` (if given); its ``snapshot_id`` matches the
    plan digest and output hashes; realized expert reads <= planned <= budget; and, when
    ``object_sizes`` (``{output path relative to the snapshot URI: size, or None if absent}``,
    from HEAD requests) is given, every output exists with its listed size. Output contents are
    not re-hashed here (that reads the whole snapshot; ``mergepipe verify`` does it).
    """
    if manifest is None:
        return False, Reason.MANIFEST_MISSING, "no committed manifest yet"
    if isinstance(manifest, (bytes, str)):
        h = manifest_hash(manifest)
        try:
            doc = json.loads(manifest)
        except (ValueError, UnicodeDecodeError) as e:
            return False, Reason.MANIFEST_INVALID, f"the manifest is not valid JSON: {e}"
    else:
        doc = dict(manifest)
        h = manifest_hash(_core_manifest_bytes(doc))
    if expected_manifest_hash:
        want = expected_manifest_hash.removeprefix("sha256:")
        if h != want:
            return False, Reason.MANIFEST_HASH_MISMATCH, f"manifest hash is {h[:16]}…, expected {want[:16]}…"
    try:
        facts = manifest_facts(doc)
    except ValueError as e:
        return False, Reason.MANIFEST_INVALID, str(e)
    if expected_plan_digest and facts.plan_digest != expected_plan_digest:
        return (
            False, Reason.PLAN_DIGEST_MISMATCH,
            f"the manifest's plan digest is {str(facts.plan_digest)[:16]}…, expected {expected_plan_digest[:16]}…",
        )
    if facts.snapshot_id != snapshot_id(str(facts.plan_digest or ""), facts.outputs):
        return False, Reason.MANIFEST_INVALID, "snapshot_id does not match the plan digest and the output hashes"
    rx, px = facts.realized.get("expertReadBytes"), facts.estimated.get("expertReadBytes")
    if rx is not None and px is not None and rx > px:
        return False, Reason.BUDGET_EXCEEDED, f"realized expert reads {rx} B exceed the planned {px} B"
    if rx is not None and facts.budget_bytes is not None and rx > facts.budget_bytes:
        return False, Reason.BUDGET_EXCEEDED, f"realized expert reads {rx} B exceed the budget {facts.budget_bytes} B"
    if object_sizes is not None:
        for name, o in sorted(facts.outputs.items()):
            path = output_path(facts, name)
            size = object_sizes.get(path)
            if size is None:
                return False, Reason.OUTPUT_MISMATCH, f"output {path} listed in the manifest does not exist"
            if int(size) != int(o["size"]):
                return False, Reason.OUTPUT_MISMATCH, f"output {path} has {size} B, the manifest says {o['size']} B"
    msg = f"manifest {h[:12]} verified: {len(facts.outputs)} file(s), {human_bytes(facts.total_bytes)}"
    if rx is not None:
        msg += f", {human_bytes(rx)} expert reads"
    return True, Reason.VERIFIED, msg
