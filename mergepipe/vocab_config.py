"""A mergekit config's tokenizer settings applied to its models: each model (the base included)
becomes a view whose vocabulary tensors follow the output vocabulary (:mod:`mergepipe.vocab`)."""

from __future__ import annotations

from typing import Any

from mergepipe.errors import InputError


def _setting(cfg: Any, p: str) -> tuple[Any, dict | None, int | None]:
    """``(source, tokens, pad_to_multiple_of)`` of the config (mergekit: the ``tokenizer:`` block
    and ``tokenizer_source`` are exclusive; the block's source defaults to ``union``)."""
    if cfg.tokenizer is not None:
        if cfg.tokenizer_source is not None:
            raise InputError(f"{p}: tokenizer_source: give either tokenizer_source or a tokenizer: block, not both.")
        extra = set(cfg.tokenizer) - {"source", "tokens", "pad_to_multiple_of"}
        if extra:
            raise InputError(
                f"{p}: tokenizer.{sorted(extra)[0]}: unknown key; the block has source, tokens, pad_to_multiple_of."
            )
        tokens = cfg.tokenizer.get("tokens")
        if tokens is not None and not isinstance(tokens, dict):
            raise InputError(f"{p}: tokenizer.tokens: a mapping of token -> {{source, force}}.")
        return cfg.tokenizer.get("source", "union"), tokens, cfg.tokenizer.get("pad_to_multiple_of")
    return cfg.tokenizer_source if cfg.tokenizer_source is not None else "base", None, None


def _uris(cfg: Any, p: str) -> tuple[str, list[str]]:
    from mergepipe.config_refs import model_ref as _model_ref, model_uri as _model_uri

    base = _model_uri(cfg.base_model if cfg.base_model is not None else cfg.models[0].model, f"{p}: base_model")
    models = []
    for j, m in enumerate(cfg.models):
        u, adapter = _model_ref(m.model, f"{p}: models[{j}].model")
        if adapter is not None:
            raise InputError(
                f"{p}: models[{j}].model: a LoRA adapter expert with a merged tokenizer is not supported; merge the "
                "adapter into a checkpoint first."
            )
        models.append(u)
    if base not in models:
        models.append(base)  # mergekit references base_model too
    return base, models


def vocab_shapes_differ(cfg: Any, p: str) -> bool:
    """Whether some model's vocabulary tensors have another shape than the base's (headers only)."""
    from mergepipe.formats.safetensors import load_layout
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage
    from mergepipe.vocab import is_vocab_tensor

    st = open_storage(None, IOCounters())
    base, models = _uris(cfg, p)

    def shapes(u: str) -> dict:
        return {n: t.shape for n, t in load_layout(st, u, role="catalog").tensors.items() if is_vocab_tensor(n)}

    b = shapes(base)
    return any(shapes(u) != b for u in models if u != base)


def base_has_tokenizer(cfg: Any, p: str) -> bool:
    """Whether the base (or first model) is a local folder with a ``tokenizer.json``."""
    import os

    base, _ = _uris(cfg, p)
    return os.path.isfile(os.path.join(base, "tokenizer.json"))


def apply_vocab(
    cfg: Any, p: str, skip_identity: bool = False
) -> tuple[Any, dict[str, str], dict[str, dict], dict | None]:
    """``cfg`` with every model replaced by its vocabulary view, the views' names, their specs
    (for the plan's record) and the vocabulary summary. ``skip_identity``: when every model's
    vocabulary rows are already its own in output order (no view needed), ``cfg`` unchanged
    (the base's tokenizer files are copied as they are).

    Raises:
        InputError: see :func:`mergepipe.vocab.plan_vocab`; a base or model that is not a checkpoint.
    """
    from mergepipe.config_refs import model_uri as _model_uri
    from mergepipe.formats.safetensors import load_layout
    from mergepipe.planner.plan import EXTRA_FILES
    from mergepipe.slices import _n_layers
    from mergepipe.stack import StackSpec, register_view
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage
    from mergepipe.vocab import is_vocab_tensor, plan_vocab

    source, tokens, pad = _setting(cfg, p)
    base, models = _uris(cfg, p)
    if source not in ("base", "union"):
        ref = source[len("model:") :] if isinstance(source, str) and source.startswith("model:") else source
        source = _model_uri(ref, f"{p}: tokenizer source")
    vp = plan_vocab(p, base, models, source, tokens, pad, cfg.chat_template, lambda r, w: _model_uri(r, f"{p}: {w}"))
    st = open_storage(None, IOCounters())
    if skip_identity and not cfg.chat_template:
        rows_of = {
            u: {t.shape[0] for n, t in load_layout(st, u, role="catalog").tensors.items() if is_vocab_tensor(n)}
            for u in models
        }
        if all(vp.rows[u] == [["rows", u, 0, vp.vocab_size]] and rows_of[u] <= {vp.vocab_size} for u in models):
            return cfg, {}, {}, None
    view_of: dict[str, str] = {}
    names: dict[str, str] = {}
    stacks: dict[str, dict] = {}
    for u in models:
        vt = [n for n in load_layout(st, u, role="catalog").tensors if is_vocab_tensor(n)]
        vocab = {"tensors": vt, "rows": vp.rows[u], "vocab_size": vp.vocab_size}
        if u == base:
            vocab["files"] = vp.files
        spec = StackSpec(u, u, ((u, 0, _n_layers(st, u)),), u, vocab)
        v = register_view(st, spec, list(EXTRA_FILES))
        view_of[u] = v.uri
        names[v.uri] = u.rstrip("/").rsplit("/", 1)[-1] or u
        stacks[v.uri] = {"spec": spec.to_json(), "layers": [[u, 0, spec.n_layers]]}
    from mergepipe.config_refs import ModelEntry as _ModelEntry, model_ref as _model_ref

    new_models = [_ModelEntry(model=view_of[_model_ref(m.model, "")[0]], parameters=m.parameters) for m in cfg.models]
    update: dict[str, Any] = {"models": new_models}
    if cfg.base_model is not None:
        update["base_model"] = view_of[base]
    return cfg.model_copy(update=update), names, stacks, vp.summary
