"""The one way into planning: a typed :class:`MergeRequest`, validated by the core.

Every front end builds a :class:`MergeRequest` from its own input — the command line
(``--base/--expert/--method/--param``, the ``--param`` grammar is parsed at that edge by
:func:`parse_param_args`), a mergekit YAML config (:mod:`mergepipe.config`), a Kubernetes
ModelMerge spec (the operator) and a search candidate (:mod:`mergepipe.search.space`) — and hands
it to :func:`mergepipe.pipeline.build_plan`. Parameters are structured values (a scalar, a layer
gradient ``[0.2, 0.8]``, a filter list ``[{filter: mlp, value: 0.5}, {value: 0.3}]``; see
:mod:`mergepipe.methods.params`), never strings in a front end's syntax.

:meth:`MergeRequest.resolve` is the one validator. A refused request raises
:class:`mergepipe.errors.InputError` whose ``loc`` is the field path in the request
(``("experts", 1, "parameters", "density")``) and whose message names that field as the front
end's ``where`` renders it: ``--param math:density`` (:func:`mergepipe.methods.params.cli_where`),
``merge.yml: models[1].parameters.density`` (the config loader), ``spec.experts[0].parameters.
density`` (the operator).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from mergepipe.errors import InputError
from mergepipe.limits import json_depth, short_repr
from mergepipe.methods.params import (
    Loc,
    ResolvedParams,
    Where,
    cli_where,
    param_loc,
    resolve_params,
    sub_text,
)

__all__ = [
    "BLOCK_VALUES",
    "ExpertRequest",
    "Loc",
    "MergeRequest",
    "PlanningOptions",
    "RequestOptions",
    "RunOptions",
    "ResolvedRequest",
    "Where",
    "cli_where",
    "param_loc",
    "parse_param_args",
    "sub_text",
]

#: A parameter setting as data: a number or boolean, a gradient (list of numbers), a filter list
#: (list of ``{"filter": str, "value": number or gradient}``), or one such mapping.
Setting = JsonValue


class ExpertRequest(BaseModel):
    """One expert of a merge.

    Attributes:
        name: how plans, manifests and messages name it (unique within the request).
        uri: checkpoint folder or ``s3://`` prefix (no trailing slash needed); a PEFT LoRA
            adapter folder may be marked ``lora:PATH`` (the prefix sets ``kind``).
        parameters: its own settings of the method's expert-scoped parameters (``weight``,
            ``density``, ...), overriding the merge-wide ones.
        kind: ``"lora"``: a PEFT LoRA adapter folder whose task vector is ``s·B·A``
            (:mod:`mergepipe.lora`); ``"checkpoint"``: a full checkpoint; None: detected from
            the folder (``adapter_config.json`` without ``model.safetensors``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    uri: str
    parameters: dict[str, Setting] = Field(default_factory=dict)
    kind: Literal["checkpoint", "lora"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _lora_prefix(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("uri"), str) and data["uri"].startswith("lora:"):
            data = {**data, "uri": data["uri"][len("lora:") :]}
            if data.get("kind") not in (None, "lora"):
                raise ValueError(f"uri lora:{data['uri']} marks a LoRA adapter but kind is {data['kind']!r}")
            data["kind"] = "lora"
        return data


class RequestOptions(BaseModel):
    """How the output is written and what is recorded with it.

    Attributes:
        out_dtype: safetensors dtype (``BF16``, ``F16``, ``F32``, ``F64``) of the floating output
            tensors (None: the base's).
        requested_dtype: the compute dtype a mergekit config asked for (recorded; mergepipe
            always computes in float32).
        source: the config file the request came from (``path``, ``sha256``, ``yaml``; recorded
            in the plan, not part of its digest).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    out_dtype: str | None = None
    requested_dtype: str | None = None
    source: dict[str, Any] | None = None

    def check(self, where: Where) -> None:
        """Refuse an ``out_dtype`` that is not a floating safetensors dtype mergepipe writes.

        Raises:
            InputError: ``loc`` ``("options", "out_dtype")``, naming the accepted codes (and the
                code of a torch/mergekit name such as ``float16``).
        """
        if self.out_dtype is None or self.out_dtype in OUT_DTYPES.values():
            return
        loc = ("options", "out_dtype")
        name = self.out_dtype.removeprefix("torch.") if isinstance(self.out_dtype, str) else None
        hint = f" ({self.out_dtype} is {OUT_DTYPES[name]})" if name in OUT_DTYPES else ""
        problem = f"{short_repr(self.out_dtype)} is not a safetensors dtype mergepipe writes; use one of " + (
            ", ".join(OUT_DTYPES.values()) + hint + "."
        )
        raise InputError(f"{where(loc)}: {problem}", loc=loc, problem=problem)


#: torch/mergekit names of the floating dtypes mergepipe writes -> their safetensors codes
OUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


#: the planner's block values: ``energy`` (the expert block's task-vector energy) or ``fisher``
#: (energy weighted by the base's per-block Fisher sensitivity on a calibration set)
BLOCK_VALUES = ("energy", "fisher")


class PlanningOptions(BaseModel):
    """How the planner values and reads expert blocks (part of the request; none of it is a
    method parameter).

    Attributes:
        value: the block value (:data:`BLOCK_VALUES`): ``"energy"``, or ``"fisher"`` with
            ``calibration`` (the base's per-block Fisher from the catalog, computed once at analyze
            time). None: ``"fisher"`` when a calibration set is given (it kept more of the full
            merge's gain in docs/QUALITY.md), else ``"energy"``.
        calibration: a JSON-lines calibration file (local path or ``s3://`` URI) of text the base's
            sensitivity is measured on; None: no sensitivity.
        sketch: fidelity tiers under a budget or fidelity target (``"none"``, ``"sign1"``,
            ``"sign2"``, ``"sign3"``, ``"sign3+r1"``: :mod:`mergepipe.catalog.sketch`); None: the planner's default
            (:data:`mergepipe.catalog.sketch.DEFAULT_SKETCH`).
        block_bytes: the catalog's block size in bytes, 1 B to 1 GiB (whole rows are grouped up to
            it); None: :data:`mergepipe.catalog.catalog.DEFAULT_BLOCK_BYTES` (128 KiB).
        deadline: a time target with a unit (``"60s"``, ``"2m"``): the planner picks the largest
            byte budget (at most ``budget``) whose predicted time fits
            (:func:`mergepipe.planner.cost.budget_for_deadline`); None: off.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    value: str | None = None
    calibration: str | None = None
    sketch: str | None = None
    block_bytes: int | None = None
    deadline: str | None = None

    @property
    def block_value(self) -> str:
        """The block value in force: :attr:`value`, else ``fisher`` with a calibration set, else
        ``energy``."""
        return self.value or ("fisher" if self.calibration else "energy")

    def check(self, where: Where | None = None) -> None:
        """Refuse an unknown block value or fidelity tier, ``fisher`` without a calibration set,
        and a block size outside 1 B..1 GiB.

        Args:
            where: renders a field path (``("planning", "sketch")``) in the front end's terms
                (default: command-line terms, ``--sketch``).

        Raises:
            InputError: with ``loc`` ``("planning", <field>)``.
        """
        from mergepipe.catalog.sketch import SKETCH_KINDS

        w = where or cli_where()
        if self.value is not None and self.value not in BLOCK_VALUES:
            _refuse(w, ("planning", "value"), f"{short_repr(self.value)}: use {' or '.join(map(repr, BLOCK_VALUES))}.")
        if self.value == "fisher" and not self.calibration:
            _refuse(
                w,
                ("planning", "value"),
                f"fisher needs {w(('planning', 'calibration'))} (a JSON-lines file of text the base's sensitivity "
                "is measured on).",
            )
        if self.sketch is not None and self.sketch not in SKETCH_KINDS:
            _refuse(w, ("planning", "sketch"), f"{short_repr(self.sketch)}: use one of {', '.join(SKETCH_KINDS)}.")
        bb = self.block_bytes
        if bb is not None and (isinstance(bb, bool) or not 1 <= bb <= MAX_BLOCK_BYTES):
            _refuse(
                w,
                ("planning", "block_bytes"),
                f"{short_repr(bb)}: must be a byte quantity from 1B to 1GiB (whole rows are grouped up to it), "
                "e.g. 128KiB.",
            )
        if self.deadline is not None:
            from mergepipe.planner.cost import parse_duration

            try:
                parse_duration(self.deadline, what=w(("planning", "deadline")))
            except InputError as e:
                raise InputError(str(e), loc=("planning", "deadline")) from None


class RunOptions(BaseModel):
    """How the merge runs (part of the request; none of it changes the merged bytes).

    Attributes:
        work_bytes: the engine's working-memory target in bytes (float32 working set per chunk,
            and bytes prefetched ahead), positive (the command line asks for 1 MiB or more); None:
            :data:`mergepipe.planner.planner.DEFAULT_WORK_BYTES` (256 MiB). It sets the plan's
            chunk rows, so it is part of the plan.
        workers: run the plan as this many parts in parallel processes and commit the run
            (:func:`mergepipe.parts.run_workers`); None: one process.
        resume: in one process, run resumably: a rerun after a crash keeps what the interrupted
            attempt finished (:func:`mergepipe.parts.execute_resumable`). None or False: a
            plain run.
        device: torch device of the merge arithmetic (``"cpu"``, ``"cuda"``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_bytes: int | None = None
    workers: int | None = None
    resume: bool | None = None
    device: str = "cpu"

    def check(self, where: Where | None = None) -> None:
        """Refuse a working memory below one byte and fewer than one worker (the command line
        asks for at least 1 MiB; tests and benchmarks plan with a few KiB to get many chunks).

        Raises:
            InputError: with ``loc`` ``("run", <field>)``, rendered by ``where`` (default:
                command-line terms).
        """
        w = where or cli_where()
        if self.work_bytes is not None and self.work_bytes < 1:
            _refuse(w, ("run", "work_bytes"), f"{self.work_bytes} bytes: must be positive, e.g. 256MiB.")
        if self.workers is not None and self.workers < 1:
            _refuse(w, ("run", "workers"), f"{self.workers}: must be at least 1.")


class MergeRequest(BaseModel):
    """A merge as the core plans it: base, experts, method, parameters, budget, seed, output.

    Attributes:
        base: the base checkpoint (folder or ``s3://`` prefix).
        experts: the experts, in merge order.
        method: mergekit's method name (:mod:`mergepipe.methods.registry`).
        parameters: merge-wide settings (for expert-scoped parameters: every expert's default).
        budget: expert-I/O budget: bytes (int), a byte quantity or percentage of the experts'
            total size (``"512MiB"``, ``"25%"``), or None for unlimited.
        fidelity: fraction of the full-budget retained energy to reach, in (0, 1] (None: off).
        seed: seed of the DARE/DELLA random streams.
        output: where the snapshot is committed (folder or ``s3://`` prefix); None when only
            planning.
        options: output dtype and what is recorded (:class:`RequestOptions`).
        planning: block value, calibration set, fidelity tiers and block size
            (:class:`PlanningOptions`).
        run: working memory, workers, resumability and device (:class:`RunOptions`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str
    experts: list[ExpertRequest]
    method: str = "ties"
    parameters: dict[str, Setting] = Field(default_factory=dict)
    budget: int | str | None = None
    fidelity: float | None = None
    seed: int = 0
    output: str | None = None
    options: RequestOptions = Field(default_factory=RequestOptions)
    planning: PlanningOptions = Field(default_factory=PlanningOptions)
    run: RunOptions = Field(default_factory=RunOptions)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.experts]

    def with_planning(self, **changes: Any) -> MergeRequest:
        """This request with the given :class:`PlanningOptions` fields changed (e.g.
        ``value="fisher", calibration="cal.jsonl"``); validated as a new :class:`PlanningOptions`.

        Raises:
            pydantic.ValidationError: an unknown field or a value of the wrong type.
        """
        return self.model_copy(update={"planning": PlanningOptions(**{**self.planning.model_dump(), **changes})})

    def with_run(self, **changes: Any) -> MergeRequest:
        """This request with the given :class:`RunOptions` fields changed (e.g. ``workers=2``).

        Raises:
            pydantic.ValidationError: an unknown field or a value of the wrong type.
        """
        return self.model_copy(update={"run": RunOptions(**{**self.run.model_dump(), **changes})})

    @property
    def expert_uris(self) -> list[tuple[str, str]]:
        """``(name, uri)`` of every expert."""
        return [(e.name, e.uri) for e in self.experts]

    def resolve(self, where: Where | None = None) -> ResolvedRequest:
        """Validate everything that can be checked before reading a byte: the method, the
        number and names of the experts, every parameter setting (with the precedence expert >
        merge-wide > default), the budget's syntax and the fidelity's range.

        Args:
            where: renders a field path (:data:`Loc`) in the front end's terms (default:
                command-line terms, experts by name).

        Raises:
            InputError: with ``loc`` set to the field at fault and a message naming it.
        """
        w = where or cli_where(self.names)
        seen: dict[str, int] = {}
        for i, e in enumerate(self.experts):
            if e.name in seen:
                loc = ("experts", i, "name")
                problem = (
                    f"two experts share the name {e.name!r} (experts {seen[e.name] + 1} and {i + 1}); "
                    "give them distinct names."
                )
                raise InputError(f"{w(loc)}: {problem}", loc=loc, problem=problem)
            seen[e.name] = i
        params = resolve_params(self.method, dict(self.parameters), [dict(e.parameters) for e in self.experts], where=w)
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            problem = f"{short_repr(seed)}: must be an integer from 0 to 2^63-1."
            raise InputError(f"{w(('seed',))} {problem}", loc=("seed",), problem=problem)
        f = self.fidelity
        if f is not None and not (0.0 < f <= 1.0):
            problem = f"{f} is outside (0, 1]; e.g. 0.99."
            raise InputError(f"{w(('fidelity',))}: {problem}", loc=("fidelity",), problem=problem)
        if isinstance(self.budget, str):
            try:
                parse_bytes(self.budget, total=0, what=w(("budget",)), bare=False)
            except InputError as e:
                raise InputError(str(e), loc=("budget",)) from None
        elif self.budget is not None and self.budget < 0:
            problem = f"{self.budget} is negative; give bytes like 512MiB or a percentage like 25%."
            raise InputError(f"{w(('budget',))}: {problem}", loc=("budget",), problem=problem)
        self.planning.check(w)
        if self.planning.deadline is not None and f is not None:
            problem = f"a fidelity target and {w(('planning', 'deadline'))} cannot both choose the blocks; give one."
            raise InputError(f"{w(('fidelity',))}: {problem}", loc=("fidelity",), problem=problem)
        self.run.check(w)
        self.options.check(w)
        self._check_budget_supported(params, w)
        return ResolvedRequest(self, params, w)

    def _check_budget_supported(self, params: ResolvedParams, w: Where) -> None:
        """Refuse a budget (or a fidelity below 1) for a method that needs every expert block
        (:func:`mergepipe.methods.registry.budget_refusal`) rather than silently reading all."""
        from mergepipe.methods.registry import budget_refusal, get_method

        why = budget_refusal(get_method(self.method), dict(params.globals))
        if why is None:
            return
        limited = self.budget is not None and not (
            isinstance(self.budget, str) and self.budget.strip().lower() in ("unlimited", "inf", "none", "full", "100%")
        )
        for loc, given, on in (
            (("budget",), limited, f"{short_repr(self.budget)}"),
            (("fidelity",), self.fidelity is not None and self.fidelity < 1.0, f"{self.fidelity}"),
        ):
            if given:
                problem = (
                    f"{on}: {self.method} cannot honour an expert-I/O budget or fidelity target: {why}, so it "
                    "reads every expert block with a non-zero task vector. Remove the budget (or give unlimited)."
                )
                raise InputError(f"{w(loc)} {problem}", loc=loc, problem=problem)


def _refuse(w: Where, loc: Loc, problem: str) -> None:
    """Raise the :class:`InputError` of the request field ``loc``: ``"<field> <problem>"``, the
    field rendered by the front end's ``w``."""
    raise InputError(f"{w(loc)} {problem}", loc=loc, problem=problem)


#: largest byte quantity accepted anywhere (a signed 64-bit count, as S3 and the kernel use)
MAX_BYTES = 2**63 - 1
#: largest catalog block size (bytes)
MAX_BLOCK_BYTES = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_bytes(text: str | int, *, total: int | None = None, what: str = "--budget", bare: bool = True) -> int | None:
    """Parse a byte quantity: ``1234``, ``512MiB``, ``1.5GB``, ``10Gi``, a percentage of
    ``total`` (``25%``), or ``unlimited``/``inf`` (returns None).

    Args:
        bare: accept a number without a unit as bytes. Budgets pass False: ``--budget 25``
            would otherwise mean 25 bytes where the user meant 25% (issue 24), so a budget's
            bytes need a unit (``25B``, ``512MiB``) and its share a ``%``.

    Raises:
        InputError: unparseable, negative, not finite, over 2^63-1 bytes, a percentage
            without a total, or a bare number where ``bare`` is False.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise InputError(
            f"{what} {short_repr(text)}: not a byte quantity; use e.g. 512MiB, 1.5GB, 1073741824B, 25% or unlimited."
        )
    s = str(text).strip()
    if s.lower() in ("unlimited", "inf", "none", "full"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z%]*)", s)
    if not m:
        raise InputError(
            f"{what} {short_repr(text)}: not a byte quantity; use e.g. 512MiB, 1.5GB, 1073741824B, 25% or unlimited."
        )
    num, unit = float(m.group(1)), m.group(2).lower()
    if not unit and not bare:
        raise InputError(
            f"{what} {short_repr(text)}: a number needs a unit; write {m.group(1)}% for a share of the "
            f"experts' bytes or {m.group(1)}B (or KiB, MiB, GB ...) for bytes."
        )
    if not math.isfinite(num):
        raise InputError(f"{what} {short_repr(text)}: not a finite number; use e.g. 512MiB or unlimited.")
    if unit == "%":
        if total is None:
            raise InputError(
                f"{what} {short_repr(text)}: a percentage needs the experts' total size, which is unknown here."
            )
        if num > 100:
            raise InputError(f"{what} {short_repr(text)}: a percentage above 100% is not a budget; use unlimited.")
        return int(total * num / 100.0)
    if unit not in _UNITS:
        raise InputError(
            f"{what} {short_repr(text)}: unknown unit {short_repr(m.group(2))}; use B, KiB, MiB, GiB, TiB, "
            "KB, MB, GB, TB or %."
        )
    n = num * _UNITS[unit]
    if n > MAX_BYTES:
        raise InputError(f"{what} {short_repr(text)}: larger than 2^63-1 bytes; use unlimited for no limit.")
    return int(n)


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated :class:`MergeRequest`: the request, its parameters resolved per expert
    (:class:`mergepipe.methods.params.ResolvedParams`) and the front end's field renderer."""

    request: MergeRequest
    params: ResolvedParams
    where: Where = field(repr=False, compare=False)

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def names(self) -> list[str]:
        return self.request.names

    def at(self, loc: Loc, e: InputError) -> InputError:
        """``e`` (an error about the request's field ``loc``, e.g. an unreadable expert) with its
        ``loc`` attached; the message is kept."""
        e.loc = tuple(loc)
        return e


_PARAM_RE = re.compile(r"(?:([^:=]+):)?([A-Za-z_][A-Za-z0-9_]*)=(.+)")


def _cli_value(method: str, name: str, text: str, where: str, loc: Loc) -> Any:
    """A ``--param`` value as data: JSON for lists and mappings; ``true/false/yes/no/1/0`` as a
    boolean for boolean parameters; a number where the text reads as one; otherwise the text
    (which the validator refuses, naming the parameter)."""
    import json

    from mergepipe.methods.registry import METHODS

    s = text.strip()
    if s[:1] in ("[", "{"):
        if json_depth(s) > 4:  # a gradient is depth 1, a filter list 2
            problem = (
                f"{short_repr(text)} is nested too deeply; a gradient is [0.2, 0.8], a filter list "
                '[{"filter": "mlp", "value": 0.5}, {"value": 0.3}].'
            )
            raise InputError(f"{where}: {problem}", loc=loc, problem=problem)
        try:
            return json.loads(s)
        except json.JSONDecodeError as e:
            problem = (
                f"{short_repr(text)} is not valid JSON ({e.msg}); a gradient is [0.2, 0.8], a filter list "
                '[{"filter": "mlp", "value": 0.5}, {"value": 0.3}].'
            )
            raise InputError(f"{where}: {problem}", loc=loc, problem=problem) from None
    spec = METHODS.get(method)
    p = next((q for q in spec.params if q.name == name), None) if spec else None
    if p is None:
        return text
    if p.kind == "bool" and s.lower() in ("true", "1", "yes", "false", "0", "no"):
        return s.lower() in ("true", "1", "yes")
    try:
        return float(s)  # (nan and inf too: the validator names them)
    except ValueError:
        return text


def parse_param_args(items: Sequence[str], method: str, expert_names: Sequence[str]) -> tuple[dict, list[dict]]:
    """The command line's ``--param`` values as structured settings (the CLI edge).

    Syntax: ``NAME=VALUE`` applies to the merge (and to every expert for per-expert parameters
    such as weight and density); ``EXPERT:NAME=VALUE`` applies to one expert, where ``EXPERT`` is
    the expert's name (the last path component of its URI, or the name given as
    ``--expert NAME=URI``) or its 1-based position. ``VALUE`` is a number, a boolean, or JSON: a
    gradient ``[0.2,0.8]`` or a filter list ``[{"filter":"mlp","value":0.5},{"value":1}]``.

    Returns:
        ``(merge-wide settings, one dict of settings per expert)``.

    Raises:
        InputError: malformed item, unknown expert, or a list that is not valid JSON.
    """
    glob: dict = {}
    per: list[dict] = [{} for _ in expert_names]
    where = cli_where(list(expert_names))
    for it in items:
        m = _PARAM_RE.fullmatch(it.strip())
        if not m:
            raise InputError(
                f"--param {it!r}: expected NAME=VALUE or EXPERT:NAME=VALUE (e.g. density=0.5, math:weight=0.3)."
            )
        who, name, val = m.group(1), m.group(2), m.group(3)
        if who is None:
            loc: Loc = ("parameters", name)
            glob[name] = _cli_value(method, name, val, where(loc), loc)
            continue
        if who.isdigit() and 1 <= int(who) <= len(expert_names):
            i = int(who) - 1
        elif who in expert_names:
            i = list(expert_names).index(who)
        else:
            raise InputError(
                f"--param {it!r}: no expert named {who!r}; experts are {', '.join(expert_names)} "
                f"(or 1..{len(expert_names)}).",
                loc=("experts",),
            )
        loc = ("experts", i, "parameters", name)
        per[i][name] = _cli_value(method, name, val, where(loc), loc)
    return glob, per


def request_from_args(
    base: str, experts: Sequence[tuple[str, str]], method: str, params: Sequence[str] = (), **fields: Any
) -> MergeRequest:
    """A :class:`MergeRequest` from command-line style inputs: ``experts`` as ``(name, uri)``
    pairs and ``params`` in the ``--param`` grammar (:func:`parse_param_args`); ``fields`` are
    the other request fields (``budget``, ``fidelity``, ``seed``, ``output``, ``options``)."""
    names = [n for n, _ in experts]
    glob, per = parse_param_args(params, method, names)
    # (a ``lora:`` prefix on a URI marks an adapter: ExpertRequest sets its kind)
    return MergeRequest(
        base=base,
        method=method,
        parameters=glob,
        experts=[ExpertRequest(name=n, uri=u, parameters=p) for (n, u), p in zip(experts, per)],
        **fields,
    )
