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
tokenizer (``tokenizer.json`` next to its shards), joined with the EOS token and cut into
``seq_len``-token sequences (at most ``max_sequences``); its identity (SHA-256 of the file's bytes
and these two settings) is part of the catalog key. Causal language models only (the loss is
next-token cross-entropy); the model is built from the base's ``config.json`` and its tensors
read through the storage layer, so S3 bases work the same as local ones.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mergepipe.errors import InputError

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


def _build_model(storage, base):
    """The base as a float32 torch causal LM, built from its config.json and its tensors read
    through ``storage``; and its tokenizer (``tokenizers.Tokenizer``)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from mergepipe.formats.safetensors import FLOAT_DTYPES
    from mergepipe.numerics import decode

    try:
        cfg_bytes = storage.read_object(storage.join(base.uri, "config.json"), "base")
        tok_bytes = storage.read_object(storage.join(base.uri, "tokenizer.json"), "base")
    except Exception as e:
        raise InputError(
            f"{base.uri}: the Fisher statistic needs the base's config.json and tokenizer.json ({e})."
        ) from None
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_bytes(cfg_bytes)
        config = AutoConfig.from_pretrained(d, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = dict(model.named_parameters())
    state = {}
    for name, t in base.layout.tensors.items():
        if name not in params or t.dtype not in FLOAT_DTYPES:
            continue
        raw = storage.read_range(storage.join(base.uri, t.file), t.start, t.end, "base")
        state[name] = torch.from_numpy(decode(raw, t.dtype).reshape(t.shape).copy())
    missing = [n for n in params if n not in state]
    if missing:
        raise InputError(
            f"{base.uri}: parameters {missing[:3]} of the model built from config.json are not in the "
            "checkpoint; the Fisher statistic needs a transformers causal LM checkpoint."
        )
    model.load_state_dict(state, strict=False)
    tok = Tokenizer.from_str(tok_bytes.decode("utf-8"))
    return model, tok, config


def compute_fisher(storage, base, calibration: Calibration, block_bytes: int) -> dict[str, np.ndarray]:
    """``{tensor: float64[n_blocks]}``: block means of the base's diagonal empirical Fisher.

    ``F = (1/N) Σ_n g_n²`` over the ``N`` calibration sequences, ``g_n`` the gradient of sequence
    ``n``'s mean next-token cross-entropy (one backward pass per sequence), accumulated in float64;
    each tensor's ``F`` is averaged over the rows of every block (the catalog's block grid for
    ``block_bytes``). Runs on CPU in float32 with 1 thread.

    Raises:
        InputError: not a causal LM checkpoint, no tokenizer, or too little calibration text.
    """
    import torch

    from mergepipe.formats.safetensors import rows_per_block

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok, config = _build_model(storage, base)
        eos_id = getattr(config, "eos_token_id", None)
        if isinstance(eos_id, list):
            eos_id = eos_id[0]
        ids: list[int] = []
        for enc in tok.encode_batch(list(calibration.texts), add_special_tokens=False):
            ids.extend(enc.ids)
            if eos_id is not None:
                ids.append(int(eos_id))
        L = calibration.seq_len
        n = min(len(ids) // L, calibration.max_sequences)
        if n == 0:
            raise InputError(f"--calibration {calibration.uri}: fewer than seq_len={L} tokens of text.")
        seqs = torch.tensor(ids[: n * L], dtype=torch.long).view(n, L)
        model.train(False)
        params = {k: p for k, p in model.named_parameters() if k in base.layout.tensors}
        acc = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in params.items()}
        for i in range(n):
            model.zero_grad(set_to_none=True)
            x = seqs[i : i + 1]
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            for k, p in params.items():
                if p.grad is not None:
                    acc[k] += p.grad.detach().double() ** 2
        out = {}
        for k, f in acc.items():
            bt = base.layout.tensors[k]
            f = (f / n).reshape(bt.rows, -1) if bt.rows else f.reshape(1, -1)
            rpb = rows_per_block(bt, block_bytes)
            per_row = f.sum(dim=1).numpy()
            nb = max(1, -(-bt.rows // rpb))
            sums = np.add.reduceat(per_row, np.arange(0, len(per_row), rpb))[:nb]
            counts = np.minimum((np.arange(nb) + 1) * rpb, bt.rows) - np.arange(nb) * rpb
            out[k] = sums / (np.maximum(counts, 1) * f.shape[1])
        return out
    finally:
        torch.set_num_threads(threads)


def fisher_to_bytes(f: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    arrays: dict[str, Any] = {f"t{i}": v for i, v in enumerate(f.values())}
    np.savez(buf, **arrays, names=np.array(list(f), dtype=object))
    return buf.getvalue()


def fisher_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    z = np.load(io.BytesIO(data), allow_pickle=True)
    return {str(n): z[f"t{i}"] for i, n in enumerate(z["names"])}
