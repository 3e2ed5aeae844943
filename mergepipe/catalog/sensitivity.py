"""Per-block sensitivity of a base model: the diagonal empirical Fisher on a calibration set.

The planner's default block value is task-vector energy ``w²·Σδ²`` (a weight-space proxy). A
direction the loss does not care about costs nothing to drop, one it is sensitive to costs a
lot; to second order the loss change of dropping ``δ`` from a block is ``½ Σ F ⊙ δ²`` with ``F``
the Fisher information, whose diagonal is estimated by the *empirical Fisher* (mean squared
per-sequence gradient of the base's loss; Kirkpatrick et al., "Overcoming catastrophic
forgetting", PNAS 2017, eq. 3; Matena & Raffel, "Merging models with Fisher-weighted averaging",
NeurIPS 2022). The catalog records, once per (base, calibration set, block size), the block mean
``F̄_b = mean over the block's entries of F``; the planner's ``fisher`` value is
``F̄_b · w² · kept_energy_b``, a block-level approximation of ``Σ_b F ⊙ (wδ)²`` (exact when F is
constant inside a block).

Calibration set: a JSON-lines file of ``{"text": ...}`` documents, tokenized with the base's own
tokenizer (``tokenizer.json`` next to its shards); its identity (SHA-256 of the file's bytes and
the two settings below) is part of the catalog key. The model is built from the base's
``config.json`` and its tensors read through the storage layer, so S3 bases work the same as
local ones. Two kinds of base are understood (:func:`model_kind`):

* **causal LMs** (``architectures`` ``*ForCausalLM``): the documents are joined with the EOS token
  and cut into ``seq_len``-token sequences (at most ``max_sequences``); the loss is the sequence's
  mean next-token cross-entropy, so ``F`` is the diagonal *empirical* Fisher of the language model;
* **encoders** (``architectures`` ``*Model``, e.g. ``BertModel``: a sentence encoder without a
  task head, what task-arithmetic papers merge): one sequence per document (the tokenizer's own
  special tokens, truncated to ``seq_len``; at most ``max_sequences``). An encoder has no labels
  to take an empirical Fisher of, and its task heads are not part of the checkpoint, so the
  statistic is the Fisher of its output, the mean-pooled last hidden state ``e(x)`` (the
  representation every task head reads), under a unit-variance Gaussian observation model
  ``y ~ N(e(x), I)``: ``F = E_x E_y[g²]`` with ``g = ∇_θ ½‖y − e(x)‖² = −J(x)ᵀε``, i.e. the
  diagonal of ``E_x[J(x)ᵀJ(x)]``, how much a weight change moves the embedding. It is estimated
  by Monte Carlo with one sampled ``ε ~ N(0, I)`` per sequence (deterministic: seeded by the
  calibration digest), the sampled-label Fisher of Kirkpatrick et al. and of Matena & Raffel
  applied to the Gaussian output of a representation model (cf. the output-sensitivity Fisher
  of Amari, "Natural gradient works efficiently in learning", Neural Computation 1998). Blocks
  the loss does not touch (BERT's ``pooler``, unused by mean pooling; embedding rows of tokens
  the text lacks) get ``F = 0``, and the planner reads them last.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mergepipe.errors import InputError

if TYPE_CHECKING:
    import torch

    from mergepipe.formats.safetensors import TensorInfo

DEFAULT_SEQ_LEN = 128
DEFAULT_MAX_SEQUENCES = 32
VALUE_KINDS = ("energy", "fisher")


@dataclass(frozen=True)
class Calibration:
    """A calibration set, identified by content.

    Attributes:
        uri: where the JSON-lines file is (local path or ``s3://``; read through the storage).
        digest: SHA-256 of ``{"sha256": file bytes, "seq_len", "max_sequences", "kind"}``.
        texts: the documents, in file order.
        seq_len: tokens per calibration sequence.
        max_sequences: sequences used (the first ones).
    """

    uri: str
    digest: str
    texts: tuple[str, ...]
    seq_len: int = DEFAULT_SEQ_LEN
    max_sequences: int = DEFAULT_MAX_SEQUENCES


def load_calibration(
    storage, uri: str, seq_len: int = DEFAULT_SEQ_LEN, max_sequences: int = DEFAULT_MAX_SEQUENCES
) -> Calibration:
    """Read and identify a calibration file.

    Raises:
        InputError: missing file, a line that is not a JSON object with a string ``text``, no
            documents, or ``seq_len < 8`` / ``max_sequences < 1``.
    """
    if seq_len < 8 or max_sequences < 1:
        raise InputError(f"--calibration: seq_len {seq_len} must be >= 8 and max_sequences {max_sequences} >= 1.")
    try:
        raw = storage.read_object(uri, "catalog")
    except Exception as e:  # storage errors name the object
        raise InputError(f"--calibration {uri}: cannot read it ({e}).") from None
    texts = []
    for i, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise InputError(f"--calibration {uri}: line {i} is not a JSON object with a string 'text'.")
        texts.append(obj["text"])
    if not texts:
        raise InputError(f'--calibration {uri}: no documents (one {{"text": ...}} object per line).')
    digest = hashlib.sha256(
        json.dumps(
            {
                "sha256": hashlib.sha256(raw).hexdigest(),
                "seq_len": seq_len,
                "max_sequences": max_sequences,
                "kind": "fisher",
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    return Calibration(uri=uri, digest=digest, texts=tuple(texts), seq_len=seq_len, max_sequences=max_sequences)


def model_kind(config) -> str:
    """``"causal-lm"`` or ``"encoder"`` for a transformers config: ``architectures`` naming a
    ``*ForCausalLM``/``*LMHeadModel`` class is a causal LM; one naming a bare ``*Model`` class
    (``BertModel``, ``XLMRobertaModel``, ...) is an encoder; no ``architectures``: a causal LM (the
    zoo's and most merge candidates' kind).

    Raises:
        InputError: any other architecture (a classification or seq2seq head): the statistic
            is defined for these two kinds only.
    """
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal-lm"
    if all(a.endswith("Model") and not a.endswith("PreTrainedModel") for a in archs):
        return "encoder"
    raise InputError(
        f"config.json architectures {archs}: the Fisher statistic is defined for causal LMs (*ForCausalLM) "
        "and bare encoders (*Model, e.g. BertModel); use --value energy for this base."
    )


def _build_model(storage, base):
    """The base as a float32 torch model (a causal LM, or for an encoder the bare ``AutoModel``),
    built from its config.json with its tensors read through ``storage``; its tokenizer
    (``tokenizers.Tokenizer``), config and kind (:func:`model_kind`)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from mergepipe.formats.safetensors import FLOAT_DTYPES
    from mergepipe.numerics import decode

    try:
        cfg_bytes = storage.read_object(storage.join(base.uri, "config.json"), "base")
        tok_bytes = storage.read_object(storage.join(base.uri, "tokenizer.json"), "base")
    except Exception as e:
        raise InputError(
            f"{base.uri}: the Fisher statistic needs the base's config.json and tokenizer.json ({e})."
        ) from None
    from mergepipe.storage.local import write_new_file

    with tempfile.TemporaryDirectory() as d:
        write_new_file(Path(d, "config.json"), cfg_bytes, what="config copy", fsync=False)
        config = AutoConfig.from_pretrained(d, local_files_only=True)
    kind = model_kind(config)
    auto = AutoModelForCausalLM if kind == "causal-lm" else AutoModel
    model = auto.from_config(config, dtype=torch.float32)
    params = dict(model.named_parameters())
    state = {}
    for name, t in base.layout.tensors.items():
        if name not in params or t.dtype not in FLOAT_DTYPES:
            continue
        raw = storage.read_range(storage.join(base.uri, t.file), t.start, t.end, "base")
        state[name] = torch.from_numpy(decode(raw, t.dtype).reshape(t.shape).copy())
    # an encoder's pooler is not used by the mean-pooled output: it may be absent
    missing = [n for n in params if n not in state and not (kind == "encoder" and n.startswith("pooler."))]
    if missing:
        raise InputError(
            f"{base.uri}: parameters {missing[:3]} of the model built from config.json are not in the "
            f"checkpoint; the Fisher statistic needs a transformers {kind} checkpoint."
        )
    model.load_state_dict(state, strict=False)
    tok = Tokenizer.from_str(tok_bytes.decode("utf-8"))
    return model, tok, config, kind


def compute_fisher(
    storage, base, calibration: Calibration, block_bytes: int, device: str | None = None
) -> dict[str, np.ndarray]:
    """``{tensor: float64[n_blocks]}``: block means of the base's diagonal Fisher.

    ``F = (1/N) Σ_n g_n²`` over the ``N`` calibration sequences, one backward pass per sequence,
    accumulated in float64, with ``g_n`` (module docstring): for a causal LM the gradient of
    sequence ``n``'s mean next-token cross-entropy (empirical Fisher); for an encoder
    ``J_nᵀε_n``, the gradient of ``ε_n · e_n`` with ``e_n`` the mean-pooled last hidden state and
    ``ε_n ~ N(0, I)`` (Monte-Carlo Fisher of the Gaussian output). Each tensor's ``F`` is averaged
    over the rows of every block (the catalog's block grid for ``block_bytes``). Runs in float32
    on ``device`` (``"cuda"`` on a GPU worker; default CPU, with 1 thread there), the sums in
    float64.

    Raises:
        InputError: ``device`` is not available, neither a causal LM nor an encoder checkpoint, no tokenizer, or too little
            calibration text.
    """
    import torch

    try:
        dev = torch.device(device or "cpu")
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise InputError(f"--device {device}: not available here ({e}); use --device cpu.") from None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok, config, kind = _build_model(storage, base)
        model.to(dev)
        if kind == "causal-lm":
            seqs, probes = _causal_sequences(tok, config, calibration, dev), None
        else:
            seqs, probes = _encoder_sequences(tok, config, calibration, dev)
        model.train(False)
        params = {k: p for k, p in model.named_parameters() if k in base.layout.tensors}
        acc = _squared_gradients(model, params, seqs, probes, dev)
        return {k: _block_means(base.layout.tensors[k], f / len(seqs), block_bytes) for k, f in acc.items()}
    finally:
        torch.set_num_threads(threads)


def _causal_sequences(tok: Any, config: Any, calibration: Calibration, dev: torch.device) -> list[torch.Tensor]:
    """The calibration documents joined with the EOS token and cut into ``seq_len``-token
    sequences (the first ``max_sequences``), each int64 ``(1, seq_len)`` on ``dev``.

    Raises:
        InputError: fewer than ``seq_len`` tokens of text.
    """
    import torch

    L = calibration.seq_len
    eos_id = getattr(config, "eos_token_id", None)
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    ids: list[int] = []
    for enc in tok.encode_batch(list(calibration.texts), add_special_tokens=False):
        ids.extend(enc.ids)
        if eos_id is not None:
            ids.append(int(eos_id))
    n = min(len(ids) // L, calibration.max_sequences)
    if n == 0:
        raise InputError(f"--calibration {calibration.uri}: fewer than seq_len={L} tokens of text.")
    return [torch.tensor(ids[i * L : (i + 1) * L], dtype=torch.long, device=dev).view(1, L) for i in range(n)]


def _encoder_sequences(
    tok: Any, config: Any, calibration: Calibration, dev: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One sequence per calibration document (the tokenizer's special tokens, truncated to
    ``seq_len``; the first ``max_sequences``), each int64 ``(1, tokens)`` on ``dev``, and one
    float32 ``(hidden_size,)`` Gaussian probe per sequence (seeded by the calibration digest).

    Raises:
        InputError: no document gives a token.
    """
    import torch

    L = calibration.seq_len
    tok.no_padding()
    tok.enable_truncation(max_length=min(L, int(getattr(config, "max_position_embeddings", L))))
    encs = [e.ids for e in tok.encode_batch(list(calibration.texts), add_special_tokens=True) if e.ids]
    seqs = [torch.tensor(e, dtype=torch.long, device=dev).view(1, -1) for e in encs[: calibration.max_sequences]]
    n = len(seqs)
    if n == 0:
        raise InputError(f"--calibration {calibration.uri}: no document gives a token.")
    g = torch.Generator().manual_seed(int(calibration.digest[:15], 16))
    probes = torch.randn(n, int(config.hidden_size), generator=g, dtype=torch.float32).to(dev)
    return seqs, probes


def _squared_gradients(
    model: Any,
    params: dict[str, torch.Tensor],
    seqs: list[torch.Tensor],
    probes: torch.Tensor | None,
    dev: torch.device,
) -> dict[str, torch.Tensor]:
    """``{tensor: float64 Σ_n g_n²}`` over the sequences, one backward pass each: ``g_n`` the
    gradient of the causal LM's loss on sequence ``n`` (``probes`` None), else of ``ε_n · e_n``
    with ``e_n`` the encoder's mean-pooled last hidden state and ``ε_n = probes[n]``."""
    import torch

    acc = {k: torch.zeros(p.shape, dtype=torch.float64, device=dev) for k, p in params.items()}
    for i, x in enumerate(seqs):
        model.zero_grad(set_to_none=True)
        if probes is None:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        else:
            emb = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0].mean(dim=0)
            loss = (emb * probes[i]).sum()
        loss.backward()
        for k, p in params.items():
            if p.grad is not None:
                acc[k] += p.grad.detach().double() ** 2
    return acc


def _block_means(bt: TensorInfo, f: torch.Tensor, block_bytes: int) -> np.ndarray:
    """float64 ``(n_blocks,)``: the mean of the Fisher ``f`` (the tensor's shape, float64) over
    the entries of each block of the catalog's grid for ``block_bytes`` (whole rows per block)."""
    from mergepipe.formats.safetensors import rows_per_block

    f = f.cpu()
    f = f.reshape(bt.rows, -1) if bt.rows else f.reshape(1, -1)
    rpb = rows_per_block(bt, block_bytes)
    per_row = f.sum(dim=1).numpy()
    nb = max(1, -(-bt.rows // rpb))
    sums = np.add.reduceat(per_row, np.arange(0, len(per_row), rpb))[:nb]
    counts = np.minimum((np.arange(nb) + 1) * rpb, bt.rows) - np.arange(nb) * rpb
    return sums / (np.maximum(counts, 1) * f.shape[1])


def fisher_to_bytes(f: dict[str, np.ndarray]) -> bytes:
    """``{tensor: float64[n_blocks]}`` as ``.npz`` bytes: arrays ``t<i>`` and the tensor names as
    UTF-8 JSON in a uint8 array ``names_json`` (no object arrays: reading needs no pickle)."""
    buf = io.BytesIO()
    arrays: dict[str, Any] = {f"t{i}": np.asarray(v, dtype=np.float64) for i, v in enumerate(f.values())}
    names = np.frombuffer(json.dumps(list(f)).encode(), dtype=np.uint8)
    np.savez(buf, **arrays, names_json=names)
    return buf.getvalue()


def fisher_from_bytes(data: bytes, source: str = "sensitivity") -> dict[str, np.ndarray]:
    """Parse :func:`fisher_to_bytes` output, read back from the catalog (untrusted: loaded
    without pickle, every array checked to be a 1-D float64 vector).

    Raises:
        InputError: naming ``source``: not such a blob (truncated, other bytes, or written by a
            mergepipe before 2026-11 with pickled names); re-run analyze with the calibration.
    """
    try:
        z = np.load(io.BytesIO(data), allow_pickle=False)
        names = json.loads(bytes(z["names_json"]).decode())
        out = {str(n): z[f"t{i}"] for i, n in enumerate(names)}
        if not all(isinstance(n, str) for n in names) or any(
            v.ndim != 1 or v.dtype != np.float64 for v in out.values()
        ):
            raise ValueError("arrays of the wrong kind")
    except Exception as e:
        raise InputError(
            f"{source}: not a sensitivity blob of this mergepipe ({type(e).__name__}); delete it and re-run "
            "`mergepipe analyze --calibration ...` to recompute it."
        ) from None
    return out
