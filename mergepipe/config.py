"""mergekit YAML configs: ``mergepipe merge --config merge.yml --out DIR``.

Accepted (mergekit 0.1.5 ``MergeConfiguration`` keys):

* ``models``: a list of ``{model: <folder or s3:// URI>, parameters: {...}}``; an entry naming
  the ``base_model`` is the base (mergekit lists it there too) and carries no parameters (except with ``linear``);
* ``base_model`` (required, except for ``linear``, ``karcher``, ``passthrough`` and ``multislerp``,
  whose config without it interpolates the raw weights, the first model being the origin:
  mergepipe merges task vectors against a base);
* ``merge_method: linear`` keeps mergekit's meaning, Σ wᵢθᵢ / Σ wᵢ over *every* input model:
  mergekit adds ``base_model`` (when given) to the averaged inputs with its own ``weight``, and
  without ``base_model`` averages the listed models. mergepipe computes the same average as task
  vectors against ``base_model`` (or, without one, the first listed model), the origin taking part
  as a zero task vector with its weight: θ₀ + Σ wᵢ(θᵢ − θ₀) / Σ wᵢ = Σ wᵢθᵢ / Σ wᵢ. The origin's
  zero task vector is never read (the catalog shows it is zero). ``normalize: false`` (mergekit's
  Σ wᵢθᵢ, not a task-vector merge) is refused: use ``task_arithmetic`` for θ_base + Σ wᵢδᵢ;
* ``merge_method`` (mergekit's names, see :mod:`mergepipe.methods.registry`);
* ``parameters``: merge-wide parameters; any parameter may be a scalar, a gradient or a filter
  list (:mod:`mergepipe.methods.params`);
* ``dtype``: mergekit's compute dtype. mergepipe always computes in float32 (exact for every
  input dtype up to float32); the value is accepted, recorded in the plan and the manifest, and
  — as in mergekit, where results stay in ``dtype`` — it is the output dtype unless
  ``out_dtype`` is given;
* ``out_dtype``: dtype of the floating output tensors (and ``config.json``'s ``torch_dtype``);
* ``tokenizer_source`` (``base``, ``union``, a model), the ``tokenizer:`` block and
  ``chat_template``: a merged vocabulary (:mod:`mergepipe.vocab`, :mod:`mergepipe.vocab_config`).

mergepipe's own keys: ``budget`` (``512MiB``, ``25%``, bytes), ``fidelity`` (0–1], ``seed``.

``slices`` (mergekit's layer ranges: frankenmerges, depth up-scaling, merged slices with
per-slice parameters) compile into a merge over stacked views (:mod:`mergepipe.slices`).

Refused with a message naming the key (never silently ignored): ``modules``,
``model@revision`` references (and their mapping forms), Hugging Face Hub names (only local
folders and ``s3://`` URIs are read), and any unknown key. ``<base_model>+<adapter folder>`` (or
``{model: <base_model>, lora: <adapter folder>}``) names a PEFT LoRA adapter expert
(:mod:`mergepipe.lora`): its task vector is ``s·B·A`` on the base; an adapter on any other model
is refused.
Every message starts with the config path and the key path.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mergepipe.config_refs import ModelEntry as _ModelEntry, model_ref as _model_ref, model_uri as _model_uri
from mergepipe.errors import InputError
from mergepipe.limits import MAX_YAML_BYTES, load_yaml, read_file, short_repr
from mergepipe.request import (
    OUT_DTYPES,
    ExpertRequest,
    Loc,
    MergeRequest,
    RequestOptions,
    Where,
    param_loc,
    sub_text,
)

#: mergekit dtype names (``mergekit.common.dtype_from_name``) -> safetensors dtypes.
DTYPE_NAMES = OUT_DTYPES


def dtype_code(name: Any, where: str) -> str:
    """safetensors dtype of a mergekit dtype name (``bfloat16``, ``torch.float16``, ...)."""
    if not isinstance(name, str):
        raise InputError(f"{where}: must be one of {', '.join(DTYPE_NAMES)}, got {short_repr(name)}.")
    n = name[len("torch.") :] if name.startswith("torch.") else name
    if n not in DTYPE_NAMES:
        raise InputError(f"{where}: {name!r} is not a dtype mergepipe writes; use one of {', '.join(DTYPE_NAMES)}.")
    return DTYPE_NAMES[n]


class _SliceSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Any
    layer_range: tuple[int, int]
    parameters: dict[str, Any] | None = None


class _Slice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: list[_SliceSource]
    base_model: Any = None
    parameters: dict[str, Any] | None = None
    residual_weight: float | None = None


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[_ModelEntry] | None = None
    slices: list[_Slice] | None = None
    merge_method: str
    base_model: Any = None
    parameters: dict[str, Any] | None = None
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: Any = None
    tokenizer: dict[str, Any] | None = None
    chat_template: str | None = None
    # mergepipe's own keys
    budget: str | int | None = None
    fidelity: float | None = None
    seed: int | None = None


#: mergekit-multi configs (several YAML documents, each with a name) are refused with this reason
MULTI_STAGE = (
    "a mergekit-multi config (several named merges in one file) is not one merge; run it with "
    "`mergepipe multi-merge CONFIG --intermediate-dir DIR --out OUT`"
)
REFUSED = {
    "name": MULTI_STAGE.replace("a mergekit-multi config", "name: marks a mergekit-multi stage; a multi-stage config"),
    # (mergepipe.multistage removes each stage's name before loading it as one merge)
    "modules": "mergekit modules (multi-module architectures) are not supported by mergepipe; use models:",
}


@dataclass
class LoadedConfig:
    """A validated mergekit config: the :class:`mergepipe.request.MergeRequest` it describes and
    how its fields are named in the file (``where``: ``merge.yml: models[1].parameters.density``).

    Attributes:
        path: the config file as given.
        request: the merge request (no ``output``; the command line gives it).
        where: renders a request field path in the config's terms, for messages.
        resolved: the validated parameters (:class:`mergepipe.methods.params.ResolvedParams`).
    """

    path: str
    request: MergeRequest
    where: Where
    resolved: Any

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def base(self) -> str:
        return self.request.base

    @property
    def experts(self) -> list[tuple[str, str]]:
        return self.request.expert_uris

    @property
    def dtype(self) -> str | None:
        return self.request.options.requested_dtype

    @property
    def out_dtype(self) -> str | None:
        return self.request.options.out_dtype

    @property
    def budget(self) -> str | int | None:
        return self.request.budget

    @property
    def fidelity(self) -> float | None:
        return self.request.fidelity

    @property
    def seed(self) -> int:
        return self.request.seed

    @property
    def source(self) -> dict:
        return dict(self.request.options.source or {})

    def with_overrides(self, *, output: str | None = None, budget=None, fidelity=None, seed=None) -> MergeRequest:
        """The request with ``output`` set and ``budget``/``fidelity``/``seed`` given on the
        command line overriding the config's keys (None: keep the config's)."""
        upd: dict[str, Any] = {"output": output}
        for k, v in (("budget", budget), ("fidelity", fidelity), ("seed", seed)):
            if v is not None:
                upd[k] = v
        return self.request.model_copy(update=upd)


def _pydantic_message(path: str, e: ValidationError) -> str:
    msgs = []
    for err in e.errors(include_url=False):
        loc = ""
        for p in err["loc"]:
            loc += f"[{p}]" if isinstance(p, int) else (f".{p}" if loc else str(p))
        t = err["type"]
        if t == "extra_forbidden":
            msg = (
                "unknown key; mergepipe reads mergekit's models, slices, base_model, merge_method, parameters, dtype, "
                "out_dtype, tokenizer_source, tokenizer, chat_template and its own budget, fidelity, seed"
            )
        elif t == "missing":
            msg = "required key is missing"
        else:
            msg = err["msg"]
        msgs.append(f"{path}: {loc or '<top>'}: {msg}.")
    return " ".join(msgs[:3])


def _read_config(p: str) -> tuple[str, _Config]:
    """The config file ``p``'s text and its validated top-level keys.

    Raises:
        InputError: unreadable, not UTF-8, not one YAML mapping, a refused or unknown key.
    """
    try:
        text = read_file(p, MAX_YAML_BYTES, "config").decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{p}: the config is not UTF-8 text.") from None
    try:
        raw = load_yaml(text, p)  # size-capped, aliases bounded (no alias bombs)
    except InputError as e:
        if "single document" in str(e) or "found another document" in str(e):
            raise InputError(f"{p}: {MULTI_STAGE}") from None
        raise
    if not isinstance(raw, dict):
        raise InputError(f"{p}: a mergekit config is a mapping with models, base_model, merge_method, ...")
    for k, why in REFUSED.items():
        if raw.get(k) is not None:
            raise InputError(f"{p}: {k}: {why}.")
    try:
        return text, _Config.model_validate(raw)
    except ValidationError as e:
        raise InputError(_pydantic_message(p, e)) from None


def _compile_views(cfg: _Config, p: str) -> tuple[_Config, dict[str, str], dict[str, dict], Any]:
    """Rewrite ``slices:`` and a merged vocabulary into a plain ``models:`` config.

    Returns ``(cfg, names, stacks, vocab_summary)``: the rewritten config, expert names by URI,
    the stacked views (:mod:`mergepipe.slices`, :mod:`mergepipe.vocab_config`) and the merged
    vocabulary's summary (None without one).
    """
    names: dict[str, str] = {}
    stacks: dict[str, dict] = {}
    if cfg.slices is not None:
        if cfg.models is not None:
            raise InputError(f"{p}: slices: give either models or slices (mergekit takes exactly one of them).")
        from mergepipe.slices import compile_slices

        sc = compile_slices(cfg, p)
        cfg = cfg.model_copy(
            update={
                "slices": None,
                "models": [_ModelEntry(model=u, parameters=ps) for u, ps in sc.models],
                "base_model": sc.base,
                "parameters": sc.parameters,
            }
        )
        names, stacks = sc.names, sc.stacks
    vocab_summary = None
    if cfg.tokenizer is not None or cfg.chat_template is not None or cfg.tokenizer_source not in (None, "base"):
        if stacks:
            raise InputError(
                f"{p}: tokenizer: a merged vocabulary together with slices is not supported yet; merge the slices "
                "first (tokenizer_source: base) or use models:."
            )
        from mergepipe.vocab_config import apply_vocab

        cfg, vnames, vstacks, vocab_summary = apply_vocab(cfg, p)
        names.update(vnames)
        stacks.update(vstacks)
    elif cfg.tokenizer_source == "base" and cfg.models:
        from mergepipe.vocab_config import apply_vocab, base_has_tokenizer, vocab_shapes_differ

        # as mergekit: the models' vocabulary tensors follow the base tokenizer (experts with added
        # tokens cropped, unused padding rows dropped) — when the base has a tokenizer to follow
        if base_has_tokenizer(cfg, p) or vocab_shapes_differ(cfg, p):
            cfg, vnames, vstacks, vocab_summary = apply_vocab(cfg, p, skip_identity=True)
            names.update(vnames)
            stacks.update(vstacks)
    return cfg, names, stacks, vocab_summary


@dataclass(frozen=True)
class _Shape:
    """How a method treats its input models (mergekit's semantics)."""

    linear: bool  # Σ wᵢθᵢ / Σ wᵢ over every input, base_model included
    averaged: bool  # the base (or first model) takes part as a zero task vector with its weight
    passthrough: bool  # exactly one input model, copied (scaled)


def _method_shape(cfg: _Config, p: str) -> _Shape:
    """The method's treatment of its inputs, after checking the models it is given fit it.

    Raises:
        InputError: no models, passthrough with more than one, a missing base_model where the
            method needs one, or ``linear`` with ``normalize`` other than true.
    """
    if not cfg.models:
        raise InputError(f"{p}: models: required (a non-empty list of {{model: <folder or s3:// URI>, parameters}}).")
    linear = cfg.merge_method == "linear"
    # mergekit averages every input model, base_model included, in linear and karcher (its
    # karcher ignores which model is the base): the base takes part as a zero task vector
    averaged = linear or cfg.merge_method == "karcher"
    # mergekit's multislerp without base_model interpolates the models' raw weights: the first model is
    # the origin (a zero task vector) and takes part with its own weight, as in karcher
    averaged = averaged or (cfg.merge_method == "multislerp" and cfg.base_model is None)
    passthrough = cfg.merge_method == "passthrough"
    if passthrough and len(cfg.models) != 1:
        raise InputError(
            f"{p}: models: passthrough takes exactly one model (mergekit: at most one input), got "
            f"{len(cfg.models)}; for a frankenmerge list layer ranges under slices:, one source per slice."
        )
    if cfg.base_model is None and not (averaged or passthrough):
        raise InputError(
            f"{p}: base_model: required; mergepipe merges task vectors (expert − base) against a base "
            "model, so give the experts' common base."
        )
    if linear:
        norm = (cfg.parameters or {}).get("normalize", True)
        if norm is not True:
            raise InputError(
                f"{p}: parameters.normalize: mergekit's linear with normalize: false computes Σ wᵢθᵢ, "
                "which is not a merge of task vectors; use merge_method: task_arithmetic (θ_base + "
                "Σ wᵢ(θᵢ − θ_base)) or remove normalize."
            )
    return _Shape(linear=linear, averaged=averaged, passthrough=passthrough)


@dataclass
class _Inputs:
    """The merge's experts, parallel lists in request order, and the merge-wide parameters."""

    experts: list[tuple[str, str]]  # (name, uri)
    kinds: list[Literal["lora"] | None]
    params: list[dict]
    model_index: list[int]  # the models[] entry of each expert (len(models): the added base)
    global_params: dict
    own_params: set[str]  # passthrough: the parameters its one model entry gave


def _collect_inputs(cfg: _Config, p: str, base: str, names: dict[str, str], shape: _Shape) -> _Inputs:
    """The experts named by ``models:`` (the base entry dropped or, when averaged, kept), with
    mergekit's implicit base input appended for averaging methods.

    Raises:
        InputError: an adapter on a model other than the base, the base listed twice or with
            parameters, two experts with the same folder name, linear without every weight.
    """
    assert cfg.models
    ins = _Inputs([], [], [], [], dict(cfg.parameters or {}), set())
    base_listed = False
    if shape.passthrough and _model_uri(cfg.models[0].model, f"{p}: models[0].model") != base:
        raise InputError(
            f"{p}: base_model: passthrough takes one model and mergekit adds base_model as a second input; "
            "remove base_model or make it the model listed."
        )
    for j, m in enumerate(cfg.models):
        w = f"{p}: models[{j}]"
        uri, adapter = _model_ref(m.model, f"{w}.model")
        if adapter is not None:
            # mergekit's model+lora: the adapter on that model. mergepipe merges it as the task
            # vector s·B·A against the merge's base, so the model must be that base.
            if uri != base:
                raise InputError(
                    f"{w}.model: the LoRA adapter {adapter!r} is given on {uri!r}, which is not the merge's "
                    f"base_model {base!r}; mergepipe merges an adapter as its task vector s·B·A on the base "
                    "— write <base_model>+<adapter>, or merge the adapter into its model first and list that folder."
                )
            uri = adapter
        elif uri == base:
            if base_listed:
                raise InputError(f"{w}.model: the base {uri!r} is listed twice; list it once.")
            base_listed = True
            if shape.passthrough:  # the one input: its parameters (scale) are the merge's
                ins.global_params = {**ins.global_params, **dict(m.parameters or {})}
                ins.own_params = set(m.parameters or {})
                continue
            if not shape.averaged:
                if m.parameters:
                    raise InputError(
                        f"{w}.parameters: parameters on the base model are not used by mergepipe (the "
                        "base is the reference the task vectors are taken from; mergekit ignores them "
                        "too for task-arithmetic methods) — remove them."
                    )
                continue
        name = names.get(uri) or uri.rstrip("/").rsplit("/", 1)[-1] or uri
        if any(name == n for n, _ in ins.experts):
            prev = next(i for i, (n, _) in zip(ins.model_index, ins.experts) if n == name)
            raise InputError(
                f"{w}.model: {uri!r} has the same name {name!r} as models[{prev}]; experts are named by "
                "their folder's last component, so give them distinct folder names."
            )
        _add(ins, name, uri, "lora" if adapter is not None else None, dict(m.parameters or {}), j)
    if shape.averaged and not base_listed:  # mergekit: "Base model specified but not in input models - adding"
        name = base.rstrip("/").rsplit("/", 1)[-1] or base
        if any(name == n for n, _ in ins.experts):
            raise InputError(
                f"{p}: base_model: {base!r} has the same folder name {name!r} as an expert; experts are "
                "named by their folder's last component, so give them distinct folder names."
            )
        _add(ins, name, base, None, {}, len(cfg.models))  # messages about it name models[<n>], the base_model entry
    if shape.linear:
        _check_linear_weights(cfg, p, ins)
    return ins


def _add(ins: _Inputs, name: str, uri: str, kind: Literal["lora"] | None, params: dict, j: int) -> None:
    """Append one expert to the parallel lists of ``ins``."""
    ins.experts.append((name, uri))
    ins.kinds.append(kind)
    ins.params.append(params)
    ins.model_index.append(j)


def _check_linear_weights(cfg: _Config, p: str, ins: _Inputs) -> None:
    """mergekit's linear needs a weight for every input model (or a merge-wide one)."""
    n_models = len(cfg.models or ())
    gw = "weight" in (cfg.parameters or {})
    missing = [ins.model_index[i] for i, ep in enumerate(ins.params) if "weight" not in ep and not gw]
    if missing:
        which = ", ".join("base_model" if j == n_models else f"models[{j}]" for j in missing)
        raise InputError(
            f"{p}: {which}: parameters.weight: required by mergekit's linear for every input model "
            "(base_model included: mergekit averages it in); give each model a weight or set "
            "parameters.weight."
        )


def _dtypes(cfg: _Config, p: str) -> tuple[str | None, str | None]:
    """``(dtype, out_dtype)``: the requested compute dtype's torch name (``bfloat16``) and the
    output's safetensors code (``BF16``; mergekit's results stay in ``dtype`` unless
    ``out_dtype`` says otherwise); None when not given."""
    dtype = out = None
    if cfg.dtype is not None:
        dtype_code(cfg.dtype, f"{p}: dtype")
        dtype = cfg.dtype[len("torch.") :] if cfg.dtype.startswith("torch.") else cfg.dtype
    if cfg.out_dtype is not None:
        out = dtype_code(cfg.out_dtype, f"{p}: out_dtype")
    elif dtype is not None:
        out = DTYPE_NAMES[dtype]
    return dtype, out


def _where_in(p: str, cfg: _Config, ins: _Inputs) -> Where:
    """A renderer of request field paths in the config's terms (``merge.yml: models[1].parameters.density``)."""
    n_models = len(cfg.models or ())  # expert_params' extra entry (linear's base) names models[n_models]
    model_index, own_params = ins.model_index, ins.own_params

    def where(loc: Loc) -> str:
        """A request field in the config's terms."""
        pl = param_loc(loc)
        if pl is not None:
            i, name, rest = pl
            key = f"parameters.{name}{sub_text(rest)}"
            if i is None:
                return f"{p}: models[0].{key}" if name in own_params else f"{p}: {key}"
            if model_index[i] == n_models:
                return f"{p}: base_model (averaged in by {cfg.merge_method}): {key}"
            return f"{p}: models[{model_index[i]}].{key}"
        if loc and loc[0] == "experts":
            return f"{p}: models[{model_index[loc[1]]}].model" if len(loc) > 1 else f"{p}: models"
        head = loc[0] if loc else ""
        if head in ("planning", "run"):  # not keys of a config: the request's field (the CLI names its option)
            return ".".join(map(str, loc[:2]))
        return f"{p}: " + {"method": "merge_method", "base": "base_model"}.get(head, str(head))

    return where


def _source(p: str, text: str, stacks: dict[str, dict], vocab_summary: Any) -> dict[str, Any]:
    """The provenance recorded in the plan and manifest: the config's path, digest and text,
    with the stacked views and merged vocabulary it compiled into."""
    source: dict[str, Any] = {
        "path": os.path.abspath(p),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "yaml": text,
    }
    if stacks:  # the stacked views the slices were compiled into (mergepipe.slices)
        source["stacks"] = stacks
    if vocab_summary is not None:  # the merged vocabulary (mergepipe.vocab)
        source["vocab"] = vocab_summary
    return source


def load_config(path: str | os.PathLike) -> LoadedConfig:
    """Read and validate a mergekit YAML config.

    Steps: read and validate the keys; compile slices and a merged vocabulary into models;
    check the models fit the method; collect the experts; build and resolve the request.

    Raises:
        InputError: unreadable file, invalid YAML, an unsupported or unknown key, a bad model
            reference, method, parameter, dtype or own key — the message starts with the
            config path and the key path.
    """
    p = str(path)
    text, cfg = _read_config(p)
    cfg, names, stacks, vocab_summary = _compile_views(cfg, p)
    shape = _method_shape(cfg, p)
    assert cfg.models
    # linear: every input model is averaged (mergekit adds base_model to the inputs); the origin
    # (base_model, or the first model) takes part as a zero task vector with its own weight.
    base_ref = cfg.base_model if cfg.base_model is not None else cfg.models[0].model
    base = _model_uri(base_ref, f"{p}: base_model" if cfg.base_model is not None else f"{p}: models[0].model")
    ins = _collect_inputs(cfg, p, base, names, shape)
    dtype, out = _dtypes(cfg, p)
    if cfg.seed is not None and cfg.seed < 0:
        raise InputError(f"{p}: seed: must be a non-negative integer, got {cfg.seed}.")
    where = _where_in(p, cfg, ins)
    request = MergeRequest(
        base=base,
        method=cfg.merge_method,
        parameters=ins.global_params,
        experts=[
            ExpertRequest(name=n, uri=u, parameters=ep, kind=k)
            for (n, u), ep, k in zip(ins.experts, ins.params, ins.kinds, strict=True)
        ],
        budget=cfg.budget,
        fidelity=cfg.fidelity,
        seed=cfg.seed or 0,
        options=RequestOptions(out_dtype=out, requested_dtype=dtype, source=_source(p, text, stacks, vocab_summary)),
    )
    resolved = request.resolve(where)
    return LoadedConfig(path=p, request=request, where=where, resolved=resolved.params)


def merge_from_config(path: str | os.PathLike, out: str, *, budget=None, fidelity=None, seed=None, **kw):
    """Load ``path`` and run :func:`mergepipe.pipeline.merge_request` into ``out``;
    ``budget``/``fidelity``/``seed`` given here override the config's own keys; ``kw`` are
    planning and run options (:func:`mergepipe.pipeline.with_options`: ``block_bytes``,
    ``device``, ...) and ``merge_request``'s own arguments (``catalog``, ``storage``, ...)."""
    from mergepipe.pipeline import merge_request, with_options

    c = load_config(path)
    req, kw = with_options(c.with_overrides(output=out, budget=budget, fidelity=fidelity, seed=seed), **kw)
    return merge_request(req, where=c.where, **kw)
