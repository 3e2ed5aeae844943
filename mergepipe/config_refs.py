"""Model references of a mergekit config: how ``models[].model``, ``base_model`` and slice
sources name a checkpoint (a folder, an ``s3://`` URI, a ``stack://`` view, or mergekit's
``model+adapter`` / ``{model: ..., lora: ...}`` LoRA forms), and what mergepipe refuses.

A module of its own so that the config loader (:mod:`mergepipe.config`) and the passes it
calls (:mod:`mergepipe.slices`, :mod:`mergepipe.vocab_config`) share it without an import circle.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from mergepipe.errors import InputError
from mergepipe.limits import short_repr
from mergepipe.storage.base import local_path

__all__ = ["ModelEntry", "model_ref", "model_uri"]


class ModelEntry(BaseModel):
    """One entry of a config's ``models`` list: a model reference and its parameters."""

    model_config = ConfigDict(extra="forbid")

    model: Any
    parameters: dict[str, Any] | None = None


def model_ref(ref: Any, where: str) -> tuple[str, str | None]:
    """A model reference of the config as ``(model URI, LoRA adapter URI or None)``: mergekit's
    ``model+adapter`` string or ``{model: ..., lora: ...}`` mapping names a PEFT LoRA adapter on
    a model; anything else is :func:`model_uri`."""
    if isinstance(ref, dict) and ref.get("lora") is not None:
        lora = ref["lora"]
        if isinstance(lora, dict):
            if set(lora) - {"path"}:
                raise InputError(f"{where}.lora: {_REF_REFUSAL['revision']}")
            lora = lora.get("path")
        rest = {k: v for k, v in ref.items() if k != "lora"}
        return model_uri(rest, where), model_uri(lora, f"{where}.lora")
    if isinstance(ref, str) and "+" in ref:
        m, a = ref.strip().split("+", 1)
        return model_uri(m, where), model_uri(a, where)
    return model_uri(ref, where), None


def model_uri(ref: Any, where: str) -> str:
    """A model reference of the config as a URI, refusing what mergepipe cannot read."""
    if isinstance(ref, dict):
        extra = set(ref) - {"model", "path"}
        for k in ("lora", "revision", "override_architecture"):
            if ref.get(k) is not None:
                raise InputError(f"{where}.{k}: {_REF_REFUSAL[k]}")
        if extra - {"lora", "revision", "override_architecture"}:
            raise InputError(f"{where}: unknown key(s) {', '.join(sorted(extra))}; a model is a folder or s3:// URI.")
        inner = ref.get("model", ref.get("path"))
        if isinstance(inner, dict):
            return model_uri(inner, f"{where}.model")
        ref = inner
    if not isinstance(ref, str) or not ref.strip():
        raise InputError(f"{where}: must be a checkpoint folder or s3:// URI, got {short_repr(ref)}.")
    ref = ref.strip()
    if "+" in ref:
        raise InputError(f"{where}: {ref!r} is a mergekit model+LoRA reference; {_REF_REFUSAL['lora']}")
    if "@" in ref:
        raise InputError(f"{where}: {ref!r} is a mergekit model@revision reference; {_REF_REFUSAL['revision']}")
    if local_path(ref) is None:  # an s3:// prefix or a stacked view: read through storage
        return ref.rstrip("/")
    if not os.path.isdir(ref):
        raise InputError(
            f"{where}: {ref!r} is not a folder (relative paths are resolved from the current "
            "directory, as mergekit does); mergepipe reads local folders and s3:// URIs, not "
            "Hugging Face Hub names — download the model first."
        )
    return os.path.normpath(os.path.abspath(ref))


_REF_REFUSAL = {
    "lora": "a LoRA adapter is an expert, not a base or a part of one: list it under models as "
    "<base_model>+<adapter folder> (or merge it into a full checkpoint first).",
    "revision": "revisions are not supported; mergepipe reads local folders and s3:// URIs — check out the revision "
    "and reference its folder.",
    "override_architecture": "override_architecture is not supported; mergepipe merges tensors by name.",
}
