"""Merged vocabularies: mergekit's ``tokenizer_source`` / ``tokenizer:`` block and ``chat_template``.

mergekit 0.1.5 (``tokenizer/build.py``, ``tokenizer/embed.py``) builds an output tokenizer —
the base's (``base``), another model's (a model reference), or the ``union`` of every input
model's vocabulary (the base's tokenizer plus, in model order, each model's tokens it lacks, then
their added tokens) plus the tokens named under ``tokenizer.tokens`` — and, for each input model,
a permutation of the output token ids to that model's ids (``-1`` where the model lacks the token
or its id is not below the model's ``vocab_size``). Each model's vocabulary tensors
(``embed_tokens``, ``lm_head``) are then re-indexed to the output vocabulary before the merge:
row ``t`` is the model's own row of token ``t`` when it has it (and the token is not ``force``d),
else the token's default row: the one model that has it (the donor), else the base's row when
the base has it, else the mean of the rows of the models that have it, else zero; a ``tokens``
entry sets the source explicitly (a model's row of the token, ``{kind: model_token, model,
token | token_id}`` or ``{kind: zero}``). ``pad_to_multiple_of`` pads the vocabulary with rows
equal to the mean of each model's rows. The output ``config.json`` gets the new ``vocab_size``
and the output tokenizer is saved with ``save_pretrained`` (with the chat template set).

mergepipe does the same with views (:mod:`mergepipe.stack`): each model becomes a checkpoint
whose vocabulary tensors are its rows in output order (runs of its own rows, donor rows read
from the donor, computed rows — means, padding — computed once when the view is built, in float32
and rounded to the tensor's dtype). The catalog and the planner then see models of one shape: an
expert with added tokens is merged like any other, its extra rows budgeted as blocks (a token
only it has is its row in every view, a zero task vector). Local folders only (transformers
loads the tokenizers).

``chat_template``: ``auto`` (the most common template among the input models), an inline Jinja
template, or the name of one of mergekit's templates (``chatml``, ``llama3``, ``alpaca``,
``mistral``, ``exaone``) when mergekit is installed to read it from.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.errors import InputError

#: the files ``save_pretrained`` writes for a tokenizer that mergepipe carries to the output
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
)


def _files_dir() -> Path:
    from mergepipe.catalog.catalog import default_home

    return default_home() / "stacks" / "files"


_FILES: dict[str, bytes] = {}


def store_file(data: bytes) -> str:
    """Keep ``data`` (a tokenizer file) content-addressed in this process and under
    ``$MERGEPIPE_HOME/stacks/files/``; returns its SHA-256."""
    h = hashlib.sha256(data).hexdigest()
    _FILES[h] = data
    try:
        d = _files_dir()
        d.mkdir(parents=True, exist_ok=True)
        p = d / h
        if not p.exists():
            tmp = p.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(p)
    except OSError:
        pass
    return h


def tokenizer_file_bytes(digest: str) -> bytes:
    """The bytes stored under ``digest`` by :func:`store_file` (content checked).

    Raises:
        InputError: unknown digest, or the stored file does not match it.
    """
    data = _FILES.get(digest)
    if data is None:
        p = _files_dir() / digest
        try:
            data = p.read_bytes()
        except OSError:
            raise InputError(f"{p}: a merged tokenizer file is missing; re-plan from the mergekit config.") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise InputError(f"{p}: content does not match its name; delete it and re-plan.")
        _FILES[digest] = data
    return data


def is_vocab_tensor(name: str) -> bool:
    """A tensor indexed by token id on axis 0 (``embed_tokens``, ``lm_head``, ``wte``)."""
    return "embed_tokens" in name or name.startswith("lm_head") or ".lm_head." in name or name.endswith("wte.weight")


@dataclass
class VocabPlan:
    """What a tokenizer setting does to each model.

    Attributes:
        vocab_size: rows of the output vocabulary tensors (padded).
        rows: model URI -> its row runs (see :class:`mergepipe.stack.StackSpec`).
        files: output tokenizer file name -> content digest.
        summary: for the plan's record: source, vocabulary size, added tokens, per-model missing rows.
    """

    vocab_size: int
    rows: dict[str, list]
    files: dict[str, str]
    summary: dict = field(default_factory=dict)


def _vocab_size(folder: str) -> int | None:
    try:
        cfg = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    if v is None and isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        v = cfg["text_config"].get("vocab_size")
    return int(v) if isinstance(v, int) else None


def _load_tokenizer(folder: str, where: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, use_fast=True)
    except Exception as e:  # transformers raises many kinds
        why = " ".join(str(e).split())[:300]  # (one line: transformers' messages span several)
        raise InputError(
            f"{where}: cannot load the tokenizer of {folder} ({type(e).__name__}: {why}); a merged vocabulary "
            "needs each model's tokenizer files (tokenizer.json)."
        ) from None


def _union(base_tok, toks: list[tuple[str, Any]]):
    """mergekit 0.1.5 ``build_union_tokenizer``: the base tokenizer plus every model's tokens it
    lacks (in model order, ids below the model's vocab_size), then their added tokens."""
    out_added: dict[str, Any] = {}
    out_vocab: dict[str, int] = {}
    for uri, tok in toks:
        vs = _vocab_size(uri) or tok.vocab_size
        added = tok.added_tokens_decoder
        added_contents = {i.content for i in added.values()}
        for t, idx in tok.get_vocab().items():
            if idx >= vs or t in added_contents:
                continue
            if t not in out_vocab:
                out_vocab[t] = len(out_vocab)
        for idx, info in added.items():
            if idx >= vs or info.content in out_added:
                continue
            out_added[info.content] = info
    with tempfile.TemporaryDirectory() as d:
        base_tok.save_pretrained(d)
        import transformers

        res = transformers.AutoTokenizer.from_pretrained(d, use_fast=True)
    base_vocab = base_tok.get_vocab()
    for t in out_vocab:
        if t not in out_added and t not in base_vocab:
            res.add_tokens(t)
    for info in out_added.values():
        res.add_tokens(info)
    return res


def _chat_template(value: str, toks: list[tuple[str, Any]], where: str) -> str | None:
    if value == "auto":
        ts = []
        for _, t in toks:
            tpl = t.chat_template
            if isinstance(tpl, dict):
                tpl = tpl.get("default")
            if tpl:
                ts.append(tpl.strip())
        return Counter(ts).most_common(1)[0][0] if ts else None
    if len(value) < 256 and "\n" not in value and "{" not in value:
        try:
            import importlib.resources

            from mergekit._data import chat_templates  # type: ignore[import-untyped,unused-ignore]

            t = importlib.resources.files(chat_templates).joinpath(value + ".jinja")
            if t.is_file():
                return t.read_text()
        except ImportError:
            pass
        raise InputError(
            f"{where}: {value!r} is not a template mergepipe can read: give auto, an inline Jinja template, or a "
            "mergekit template name (chatml, llama3, alpaca, mistral, exaone) with mergekit installed."
        )
    if len(value) < 20 or "{" not in value:
        raise InputError(f"{where}: not a chat template (an inline Jinja template has '{{' and 20+ characters).")
    return value


def tokenizer_files(tok, chat_template: str | None) -> dict[str, str]:
    """``save_pretrained`` of ``tok`` (with ``chat_template`` set when given): file name -> the
    digest :func:`store_file` keeps it under (the files in :data:`TOKENIZER_FILES` only)."""
    if chat_template is not None:
        tok.chat_template = chat_template
    out = {}
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        for f in TOKENIZER_FILES:
            p = os.path.join(d, f)
            if os.path.exists(p):
                out[f] = store_file(Path(p).read_bytes())
    return out


def plan_vocab(
    p: str,
    base: str,
    models: list[str],
    source: Any,
    tokens: dict | None,
    pad_to_multiple_of: int | None,
    chat_template: str | None,
    resolve_ref,
) -> VocabPlan:
    """The output vocabulary and each model's row runs for config file ``p``.

    Args:
        base: the base (or the first model): its tokenizer is the default and the union's start.
        models: every input model, base included, in config order.
        source: ``"base"``, ``"union"`` or a model URI.
        tokens: the ``tokenizer.tokens`` mapping (validated here).
        resolve_ref: maps a model reference of the config to its URI (messages name the key).

    Raises:
        InputError: a tokenizer that does not load, an invalid token source, an S3 model.
    """
    where = f"{p}: tokenizer"
    toks = _load_tokenizers(base, models, where)
    tok_of = dict(toks)
    base_tok = tok_of[base]
    if source == "base":
        out = base_tok
    elif source == "union":
        out = _union(base_tok, toks)
    else:
        out = tok_of.get(source) or _load_tokenizer(source, where)
    tokens = dict(tokens or {})
    existing = set(out.get_vocab())
    for t in tokens:
        if t not in existing:
            out.add_tokens(t)
            existing.add(t)
    vocab = out.get_vocab()
    V = len(vocab)
    Vp = V
    if pad_to_multiple_of:
        if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
            raise InputError(f"{where}.pad_to_multiple_of: must be a positive integer, got {pad_to_multiple_of!r}.")
        Vp = -(-V // pad_to_multiple_of) * pad_to_multiple_of
    perms = {u: _permutation(u, tok_of[u], vocab) for u in models}
    cfgs = _token_sources(tokens, where, perms, tok_of, resolve_ref)
    defaults = _default_rows(vocab, models, base, perms, cfgs, where)
    forced = {vocab[t] for t, c in cfgs.items() if c[2]}
    rows: dict[str, list] = {}
    missing: dict[str, int] = {}
    for u in models:
        rows[u], missing[u] = _row_runs(u, V, Vp, perms[u], defaults, forced)
    tpl = _chat_template(chat_template, toks, f"{p}: chat_template") if chat_template else None
    files = tokenizer_files(out, tpl)
    added = sorted(t for t in vocab if t not in base_tok.get_vocab())
    summary = {
        "source": source,
        "vocab_size": Vp,
        "tokens": V,
        "added_to_base": added[:50],
        "rows_not_own": {os.path.basename(u.rstrip("/")): n for u, n in missing.items()},
        "chat_template": None if tpl is None else hashlib.sha256(tpl.encode()).hexdigest()[:16],
    }
    return VocabPlan(Vp, rows, files, summary)


def _load_tokenizers(base: str, models: list[str], where: str) -> list[tuple[str, Any]]:
    """``(uri, tokenizer)`` of the base then every other model, in config order.

    Raises:
        InputError: a model not in a local folder (transformers loads those), a tokenizer that does not load.
    """
    from mergepipe.storage.base import local_path

    for u in [base, *models]:
        if local_path(u) is None:
            raise InputError(
                f"{where}: {u} is not a local folder (it is on S3 or a stacked view); building a merged "
                "tokenizer loads each model's tokenizer with transformers from a local folder — download it first."
            )
    return [(u, _load_tokenizer(u, where)) for u in [base, *[m for m in models if m != base]]]


def _permutation(u: str, tok: Any, vocab: dict[str, int]) -> list[int]:
    """For each output token id, model ``u``'s row of that token, or -1 (absent, or at or past
    the model's embedding rows)."""
    mv = tok.get_vocab()
    vs = _vocab_size(u) or len(mv)
    perm = [-1] * len(vocab)
    for t, i in vocab.items():
        j = mv.get(t, -1)
        perm[i] = j if 0 <= j < vs else -1
    return perm


def _token_sources(
    tokens: dict, where: str, perms: dict[str, list[int]], tok_of: dict[str, Any], resolve_ref
) -> dict[str, tuple[str, Any, bool]]:
    """The ``tokenizer.tokens`` entries (mergekit's ``assign_embedding_sources``), validated:
    token -> ``(kind, arg, force)``, kind ``auto`` | ``zero`` | ``model_token`` (arg
    ``(uri, row)``) | ``model`` (arg the uri).

    Raises:
        InputError: a malformed entry or a source that is not an input model (naming the key).
    """
    cfgs: dict[str, tuple[str, Any, bool]] = {}
    for t, c in tokens.items():
        w = f"{where}.tokens[{t!r}]"
        c = c or {}
        if not isinstance(c, dict) or set(c) - {"source", "force"}:
            raise InputError(f"{w}: an entry is {{source: <model> | {{kind: model_token|zero, ...}}, force: bool}}.")
        force = bool(c.get("force", False))
        s = c.get("source")
        if s is None:
            cfgs[t] = ("auto", None, force)
        elif isinstance(s, dict) and s.get("kind") == "zero":
            cfgs[t] = ("zero", None, force)
        elif isinstance(s, dict) and s.get("kind") == "model_token":
            m = resolve_ref(s.get("model"), f"{w}.source.model")
            if m not in perms:
                raise InputError(f"{w}.source.model: {m} is not an input model of the merge.")
            if (s.get("token") is None) == (s.get("token_id") is None):
                raise InputError(f"{w}.source: give exactly one of token or token_id.")
            if s.get("token_id") is not None:
                idx = int(s["token_id"])
            else:
                mv = tok_of[m].get_vocab()
                if s["token"] not in mv:
                    raise InputError(f"{w}.source.token: {s['token']!r} is not in {m}'s vocabulary.")
                idx = mv[s["token"]]
            cfgs[t] = ("model_token", (m, idx), force)
        else:
            m = resolve_ref(s, f"{w}.source")
            if m not in perms:
                raise InputError(f"{w}.source: {m} is not an input model of the merge.")
            cfgs[t] = ("model", m, force)
    return cfgs


def _default_rows(
    vocab: dict[str, int],
    models: list[str],
    base: str,
    perms: dict[str, list[int]],
    cfgs: dict[str, tuple[str, Any, bool]],
    where: str,
) -> dict[int, tuple]:
    """The row a model lacking token id ``i`` gets: the configured source, else the only model
    having it, zero when none has it, the base's row, or the mean of the models having it.
    Tokens every model has (and not forced) get none.

    Raises:
        InputError: a token's configured source model lacks that token.
    """
    defaults: dict[int, tuple] = {}
    for t, i in vocab.items():
        have = [u for u in models if perms[u][i] >= 0]
        c = cfgs.get(t)
        if c is not None and c[0] != "auto":
            if c[0] == "zero":
                defaults[i] = ("zero",)
            elif c[0] == "model_token":
                defaults[i] = ("row", c[1][0], c[1][1])
            else:
                m = c[1]
                if perms[m][i] < 0:
                    raise InputError(f"{where}.tokens[{t!r}].source: {m} has no token {t!r}.")
                defaults[i] = ("row", m, perms[m][i])
            continue
        if len(have) == len(models) and not (c and c[2]):
            continue
        if len(have) == 1:
            defaults[i] = ("row", have[0], perms[have[0]][i])
        elif not have:
            defaults[i] = ("zero",)
        elif base in models and perms[base][i] >= 0:
            defaults[i] = ("row", base, perms[base][i])
        else:
            defaults[i] = ("mean", [[u, perms[u][i]] for u in have])
    return defaults


def _row_runs(
    u: str, V: int, Vp: int, perm: list[int], defaults: dict[int, tuple], forced: set[int]
) -> tuple[list, int]:
    """Model ``u``'s output rows ``0..Vp-1`` as runs (``["rows", src, start, n]``, ``["zero",
    n]``, ``["mean", [[src, row], ...]]``, a final ``["padmean", Vp - V]``), and how many of the
    ``V`` token rows are not its own."""
    runs: list = []
    miss = 0
    for i in range(V):
        r: tuple
        if perm[i] >= 0 and i not in forced:
            r = ("rows", u, perm[i])
        elif i in defaults:
            r = defaults[i]
            miss += 1
        else:
            r = ("zero",)
            miss += 1
        if r[0] == "rows" or r[0] == "row":
            src, idx = r[1], r[2]
            last = runs[-1] if runs else None
            if last and last[0] == "rows" and last[1] == src and last[2] + last[3] == idx:
                last[3] += 1
            else:
                runs.append(["rows", src, idx, 1])
        elif r[0] == "zero":
            if runs and runs[-1][0] == "zero":
                runs[-1][1] += 1
            else:
                runs.append(["zero", 1])
        else:
            runs.append(["mean", r[1]])
    if Vp > V:
        runs.append(["padmean", Vp - V])
    return runs, miss
