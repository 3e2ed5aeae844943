"""PEFT LoRA adapters as experts: reading an adapter folder and computing its task vector.

A PEFT LoRA adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``
(factors named ``base_model.model.<module>.lora_A.weight``, shape ``(r, in_features)``, and
``...lora_B.weight``, shape ``(out_features, r)``). As an expert its task vector is, per adapted
module (Hu et al., "LoRA", 2021; PEFT's ``LoraLayer.get_delta_weight``)::

    δ = s · B · A,   s = lora_alpha / r   (rsLoRA, Kalajdzievski 2023: lora_alpha / √r)

on the module's ``<module>.weight`` tensor of the base, and 0 on every other tensor, with ``r`` and
``lora_alpha`` per module from ``rank_pattern``/``alpha_pattern`` (PEFT's matching rule:
``re.match(rf"(.*\\.)?({key})$", module)``, first key wins; matched with RE2 in linear time,
:func:`pattern_regex`).

Rows ``[r0, r1)`` of δ need only rows ``[r0, r1)`` of ``B`` and all of ``A``: the catalog
computes its block statistics one block of δ at a time, and the engine reads ``A`` and the
rows of ``B`` it merges, never a materialised δ (:func:`delta_rows`). The product is computed in
float64 with a fixed summation order over the rank (products of float32 factors are exact in
float64) and rounded once to float32, so it does not depend on how rows are chunked, on the
BLAS library or on the device: the catalog and the engine see the same δ bit for bit.

Supported: plain LoRA on 2-D weights (``nn.Linear``), rsLoRA, rank/alpha patterns, any float
factor dtype. Refused by name, before any tensor byte is read, with the fix: DoRA
(``use_dora``), ``fan_in_fan_out`` (GPT-2 ``Conv1D``), trained biases (``bias``, ``lora_bias``),
``modules_to_save``, ``trainable_token_indices``, ``layer_replication``, ``target_parameters``,
QALoRA, aLoRA, Megatron configs, embedding and convolution LoRA, and non-LoRA PEFT types.
Their effect is not a function of A and B alone (or replaces whole tensors); pre-merge such an
adapter (``PeftModel.merge_and_unload()`` + ``save_pretrained``) and merge the full checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mergepipe.errors import InputError
from mergepipe.formats.safetensors import FLOAT_DTYPES, TensorInfo
from mergepipe.limits import short_repr
from mergepipe.numerics import decode

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: largest adapter_config.json read (bytes)
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
#: the URI prefix that marks an expert as a LoRA adapter (``--expert lora:PATH``)
LORA_PREFIX = "lora:"
#: PEFT's prefix of saved adapter tensor names
SAVED_PREFIX = "base_model.model."

_PRE_MERGE = (
    "pre-merge the adapter (PeftModel.merge_and_unload() then save_pretrained()) and merge that full checkpoint"
)


def split_kind(uri: str) -> tuple[str | None, str]:
    """``("lora", PATH)`` for ``lora:PATH``, else ``(None, uri)`` (the kind is detected)."""
    if uri.startswith(LORA_PREFIX):
        return "lora", uri[len(LORA_PREFIX) :]
    return None, uri


#: longest ``rank_pattern`` / ``alpha_pattern`` key (characters)
MAX_PATTERN_CHARS = 1024
#: most keys of one ``rank_pattern`` / ``alpha_pattern``
MAX_PATTERN_KEYS = 10_000


@functools.lru_cache(maxsize=4096)
def pattern_regex(key: str):
    """PEFT's matcher of a ``rank_pattern``/``alpha_pattern`` key, ``(.*\\.)?(KEY)$`` anchored at
    the module name's start (``peft.utils.other.get_pattern_key``: ``re.match``), compiled with
    RE2 (PyPI ``google-re2``), whose matching time is linear in the module name whatever the
    key: a crafted key such as ``(.+.+)+X`` cannot hang a merge or the operator's plan. RE2
    refuses what a finite automaton cannot match (backreferences, lookaround); its compiled
    program is bounded to 8 MiB (``max_mem``).

    Raises:
        ValueError: the key is not an RE2 pattern (the message says why).
    """
    import re2  # type: ignore[import-untyped]

    opts = re2.Options()
    opts.log_errors = False  # (the error is ours to report, on one line)
    try:
        return re2.compile(rf"(.*\.)?({key})$", options=opts)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(
            f"{why}; mergepipe matches patterns with RE2 in linear time: no backreferences or lookaround"
        ) from None


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT ``adapter_config.json`` that define a LoRA task vector.

    Attributes:
        r: default rank.
        lora_alpha: default alpha.
        use_rslora: scale ``alpha/√r`` instead of ``alpha/r``.
        rank_pattern, alpha_pattern: per-module rank / alpha overrides (PEFT's key matching).
        base_model_name_or_path: the base the adapter was trained on (as recorded; checked by
            tensor shapes, named in messages).
        target_modules: as recorded (informational; the saved factors are authoritative).
        raw: the whole JSON object.
        raw_text: the file's text (kept in the catalog: a cached registration re-parses it).
        sha256: SHA-256 of the file's bytes (part of the expert's identity: the scale lives here).
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None
    target_modules: Any = None
    raw: dict = field(default_factory=dict, repr=False)
    raw_text: str = field(default="", repr=False)
    sha256: str = ""

    def _pattern(self, pattern: Mapping[str, Any], module: str) -> Any:
        for key in pattern:  # peft.utils.other.get_pattern_key, with RE2 (linear time)
            if pattern_regex(key).match(module):
                return pattern[key]
        return None

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """``(r, alpha)`` of ``module`` (its key in the model, e.g. ``model.layers.0.mlp.up_proj``)."""
        r = self._pattern(self.rank_pattern, module)
        a = self._pattern(self.alpha_pattern, module)
        return int(self.r if r is None else r), float(self.lora_alpha if a is None else a)

    def scale(self, module: str) -> float:
        """The scale ``s`` of ``module``'s ``δ = s·B·A`` (``alpha/r``; rsLoRA ``alpha/√r``)."""
        r, a = self.rank_alpha(module)
        return a / math.sqrt(r) if self.use_rslora else a / r

    def summary(self) -> dict:
        """What plans and manifests record about the adapter."""
        return {
            "format": "peft-lora",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "base_model_name_or_path": self.base_model_name_or_path,
            "config_sha256": self.sha256,
        }


#: PEFT LoRA fields whose non-empty value makes the saved factors something other than a plain
#: ``s·B·A`` task vector: field -> why (the refusal names the field and the fix)
_REFUSED_FIELDS = {
    "use_dora": "DoRA's magnitude vector rescales whole columns of W + BA, so its task vector is not s·B·A",
    "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2 Conv1D weights stored transposed) are not supported",
    "lora_bias": "a trained lora_B bias is not part of the weight's task vector",
    "use_qalora": "QALoRA adapters pool the input and are not supported",
    "modules_to_save": "modules_to_save replace whole tensors (not a low-rank task vector)",
    "trainable_token_indices": "trainable tokens replace embedding rows (not a low-rank task vector)",
    "layer_replication": "layer_replication changes the model's layer structure",
    "target_parameters": "LoRA on nn.Parameter targets is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies only after its invocation tokens",
    "megatron_config": "Megatron-parallel LoRA layers are not supported",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA) factors are not plain B·A products",
    "arrow_config": "Arrow routes between several adapters at inference time",
    "kasa_config": "KaSA adds a singular-value vector between B and A",
    "monteclora_config": "MonteCLoRA samples its factors",
}


def parse_adapter_config(raw: bytes, source: str) -> AdapterConfig:
    """Parse and check ``adapter_config.json`` bytes (``source``: its URI, for messages).

    Raises:
        InputError: not JSON, not a LoRA adapter, a field mergepipe does not support (named,
            with the fix), or a malformed ``r``/``lora_alpha``/pattern.
    """
    try:
        text = raw.decode("utf-8")
        d = json.loads(text)
    except (ValueError, RecursionError):
        raise InputError(f"{source}: not valid JSON; a PEFT adapter folder has a JSON adapter_config.json.") from None
    if not isinstance(d, dict):
        raise InputError(f"{source}: must be a JSON object (PEFT's LoraConfig).")
    _refuse_unsupported(d, source)
    r, alpha = d.get("r"), d.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise InputError(f"{source}: r: {short_repr(r)} must be a positive integer (the LoRA rank).")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(f"{source}: lora_alpha: {short_repr(alpha)} must be a finite number.")
    pats = {k: _parse_pattern(d, k, kind, source) for k, kind in (("rank_pattern", "rank"), ("alpha_pattern", "alpha"))}
    rs = d.get("use_rslora", False)
    if not isinstance(rs, bool):
        raise InputError(f"{source}: use_rslora: must be true or false.")
    bm = d.get("base_model_name_or_path")
    return AdapterConfig(
        r=r,
        lora_alpha=float(alpha),
        use_rslora=rs,
        rank_pattern=pats["rank_pattern"],
        alpha_pattern=pats["alpha_pattern"],
        base_model_name_or_path=bm if isinstance(bm, str) else None,
        target_modules=d.get("target_modules"),
        raw=d,
        raw_text=text,
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def _refuse_unsupported(d: dict, source: str) -> None:
    """Refuse (``InputError`` naming the field and the fix) an adapter that is not plain LoRA:
    another ``peft_type``, a :data:`_REFUSED_FIELDS` field set, an initialisation relative to a
    modified base (PiSSA, OLoRA, CorDA, LoftQ), trained biases."""
    pt = d.get("peft_type", "LORA")
    if pt != "LORA":
        raise InputError(
            f"{source}: peft_type: {short_repr(pt)} is not supported; mergepipe reads LoRA adapters "
            f"(peft_type LORA) — {_PRE_MERGE}."
        )
    for k, why in _REFUSED_FIELDS.items():
        v = d.get(k)
        if v not in (None, False, [], {}, ""):
            raise InputError(f"{source}: {k}: {short_repr(v)}: {why}; {_PRE_MERGE}.")
    init = d.get("init_lora_weights")
    if isinstance(init, str) and init.lower().split("_")[0] in ("pissa", "olora", "corda", "loftq"):
        raise InputError(
            f"{source}: init_lora_weights: {init!r}: this initialisation subtracts the initial B·A from the base "
            "weights, so the saved factors are relative to a modified base; save the adapter with "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...) to convert it to plain LoRA, "
            f"or {_PRE_MERGE}."
        )
    bias = d.get("bias", "none")
    if bias not in (None, "none"):
        raise InputError(
            f"{source}: bias: {short_repr(bias)}: trained biases are not part of the LoRA task vector; "
            f"use bias='none' or {_PRE_MERGE}."
        )


def _parse_pattern(d: dict, k: str, kind: str, source: str) -> dict:
    """``d[k]`` (``rank_pattern``/``alpha_pattern``, absent: empty), checked: at most
    :data:`MAX_PATTERN_KEYS` keys, each a valid pattern of at most :data:`MAX_PATTERN_CHARS`
    characters mapped to a positive integer rank or a finite alpha (``kind``).

    Raises:
        InputError: naming ``k`` (and the key) and what is wrong.
    """
    p = d.get(k) or {}
    if not isinstance(p, dict):
        raise InputError(f"{source}: {k}: must be a mapping of module-name patterns to {kind}s.")
    if len(p) > MAX_PATTERN_KEYS:  # before compiling any: the work a crafted file can cause stays bounded
        raise InputError(f"{source}: {k}: {len(p)} keys, over the limit of {MAX_PATTERN_KEYS}.")
    for pk, pv in p.items():
        ok = (
            isinstance(pv, int) and not isinstance(pv, bool) and pv > 0
            if kind == "rank"
            else isinstance(pv, (int, float)) and not isinstance(pv, bool) and math.isfinite(pv)
        )
        if not ok:
            raise InputError(f"{source}: {k}.{pk}: {short_repr(pv)} is not a valid {kind}.")
        if not isinstance(pk, str) or len(pk) > MAX_PATTERN_CHARS:
            raise InputError(
                f"{source}: {k}: key {short_repr(pk)} is longer than {MAX_PATTERN_CHARS} characters; "
                "keys are module names or short patterns."
            )
        try:
            pattern_regex(pk)
        except ValueError as e:
            raise InputError(f"{source}: {k}: key {short_repr(pk)} is not a valid pattern ({e}).") from None
    return dict(p)


@dataclass(frozen=True)
class LoraModule:
    """One adapted module of a LoRA expert, mapped onto a base tensor.

    Attributes:
        module: the module's key in the model (``model.layers.0.self_attn.q_proj``).
        target: the base tensor it changes (``model.layers.0.self_attn.q_proj.weight``), shape
            ``(out_features, in_features)``.
        a, b: the factor tensors in ``adapter_model.safetensors``: A ``(r, in_features)``,
            B ``(out_features, r)``.
        scale: ``s`` of ``δ = s·B·A``.
    """

    module: str
    target: str
    a: TensorInfo
    b: TensorInfo
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def adapter_modules(config: AdapterConfig, tensors: Mapping[str, TensorInfo], source: str) -> dict[str, tuple]:
    """``{module key: (A info, B info)}`` of an adapter's saved tensors, checked.

    Raises:
        InputError: a tensor that is not a LoRA factor (embedding or convolution LoRA, DoRA
            magnitudes, biases, saved modules), a factor without its pair, a factor that is
            not 2-D floating point, or ranks that disagree with the config.
    """
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for name, ti in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight", name)
        if m is None:
            what = (
                "embedding LoRA (lora_embedding_A/B)"
                if "lora_embedding_" in name
                else "a DoRA magnitude vector"
                if "lora_magnitude_vector" in name
                else "not a LoRA factor (lora_A.weight / lora_B.weight)"
            )
            raise InputError(
                f"{source}: tensor {short_repr(name)} is {what}; mergepipe reads plain LoRA — {_PRE_MERGE}."
            )
        if ti.dtype not in FLOAT_DTYPES or len(ti.shape) != 2:
            raise InputError(
                f"{source}: tensor {name!r} is {ti.dtype}{list(ti.shape)}; LoRA factors of linear layers are "
                f"2-D floating point (convolution LoRA is not supported — {_PRE_MERGE})."
            )
        ab = pairs.setdefault(m.group(1), {})
        if m.group(2) in ab:  # the same module with and without the base_model.model. prefix
            raise InputError(
                f"{source}: tensors {short_repr(ab[m.group(2)].name)} and {short_repr(name)} are both "
                f"lora_{m.group(2)} of module {short_repr(m.group(1))}; an adapter holds each factor once: "
                "remove one of them (re-save the adapter with save_pretrained())."
            )
        ab[m.group(2)] = ti
    if not pairs:
        raise InputError(f"{source}: the adapter holds no LoRA factors (lora_A.weight / lora_B.weight).")
    out = {}
    for mod, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            miss = "lora_B" if "A" in ab else "lora_A"
            raise InputError(f"{source}: module {mod!r} has no {miss}.weight; the adapter is incomplete.")
        a, b = ab["A"], ab["B"]
        r, _ = config.rank_alpha(mod)
        if a.shape[0] != b.shape[1] or a.shape[0] != r:
            raise InputError(
                f"{source}: module {mod!r}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but the config's "
                f"rank for it is r={r} (r / rank_pattern); the adapter and its adapter_config.json disagree."
            )
        out[mod] = (a, b)
    return out


def map_modules(
    config: AdapterConfig,
    factors: Mapping[str, tuple],
    base_tensors: Mapping[str, TensorInfo],
    adapter_uri: str,
    base_uri: str,
) -> dict[str, LoraModule]:
    """``{base tensor name: LoraModule}``: each adapted module onto the base tensor it changes.

    A module ``M`` maps to the base tensor ``M.weight``, or else to the only base tensor whose
    name ends with ``.M.weight`` (a base saved with a wrapper prefix such as ``model.``), or,
    when the adapter was made on a wrapper model (``bert.encoder...`` for a base saved as
    ``encoder...``), to ``M.weight`` less leading components.

    Raises:
        InputError: a module with no base tensor, or whose shape does not match
            ``(B rows, A columns)`` — the adapter was made for another base (its
            ``base_model_name_or_path`` is named).
    """
    hint = f" (the adapter records base_model_name_or_path={config.base_model_name_or_path!r})"
    out: dict[str, LoraModule] = {}
    for mod, (a, b) in factors.items():
        cand = f"{mod}.weight"
        target = cand if cand in base_tensors else None
        if target is None:
            ends = [n for n in base_tensors if n.endswith("." + cand)]
            if len(ends) == 1:
                target = ends[0]
        if target is None:
            parts = mod.split(".")
            for k in range(1, len(parts)):
                c = ".".join(parts[k:]) + ".weight"
                if c in base_tensors:
                    target = c
                    break
        if target is None:
            raise InputError(
                f"{adapter_uri}: module {mod!r} has no tensor {cand!r} in the base ({base_uri}){hint}; "
                "merge the adapter onto the base it was trained on."
            )
        bt = base_tensors[target]
        want = (b.shape[0], a.shape[1])
        if tuple(bt.shape) != want or bt.dtype not in FLOAT_DTYPES:
            raise InputError(
                f"{adapter_uri}: module {mod!r}: B·A is {list(want)} but the base's {target!r} is "
                f"{bt.dtype}{list(bt.shape)}{hint}; merge the adapter onto the base it was trained on."
            )
        if target in out:
            raise InputError(f"{adapter_uri}: modules {out[target].module!r} and {mod!r} both map to {target!r}.")
        out[target] = LoraModule(mod, target, a, b, float(config.scale(mod)))
    return out


def delta_rows(a: np.ndarray, b_rows: np.ndarray, scale: float) -> np.ndarray:
    """Rows of ``δ = scale · B · A`` as float32.

    Args:
        a: ``(r, in)`` A, float32 (or float64).
        b_rows: ``(rows, r)`` the rows of B wanted.
        scale: the module's scale.

    Returns:
        float32 ``(rows, in)``: the float64 sum over the rank in index order (each product of
        float32 factors exact in float64), times ``scale``, rounded once to float32. Row ``i``
        depends only on ``b_rows[i]`` and ``a``, so any chunking of the rows gives the same bits.
    """
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b_rows, dtype=np.float64)
    acc = np.zeros((b64.shape[0], a64.shape[1]), dtype=np.float64)
    for k in range(a64.shape[0]):
        acc += b64[:, k : k + 1] * a64[k]
    acc *= scale
    return acc.astype(np.float32)


def delta_from_bytes(mod_a_dtype: str, a_raw, b_dtype: str, b_raw, rank: int, scale: float) -> np.ndarray:
    """:func:`delta_rows` from the raw little-endian factor bytes (``a_raw``: all of A,
    ``b_raw``: the wanted rows of B); returns float32 ``(rows, in)``."""
    a = decode(a_raw, mod_a_dtype).reshape(rank, -1)
    b = decode(b_raw, b_dtype).reshape(-1, rank)
    return delta_rows(a, b, scale)
