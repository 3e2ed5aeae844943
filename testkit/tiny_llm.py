"""A real (tiny, randomly initialised) transformers Llama with a real BPE tokenizer, for tests that
need what a language model checkpoint holds (``config.json``, ``tokenizer.json``, decoder layers):
the base's Fisher sensitivity, the search's activation prior, calibration sets on Kubernetes.

torch, transformers and tokenizers are imported when called, so a test module can skip first.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def bpe_tokenizer(text: Sequence[str], vocab_size: int = 300) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``text``, with ``<pad>``, ``<s>``,
    ``</s>`` as ids 0, 1, 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return tok


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` of 2 layers, hidden 32, intermediate 64, 2 heads, vocab 300, 64
    positions, untied embeddings, pad/bos/eos 0/1/2 (``overrides`` replace any field)."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = {
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 0,
    }
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama_family(root: Path, text: Sequence[str], scales: Sequence[tuple[str, float]]) -> tuple[dict, Any, Any]:
    """Save a base and experts under ``root/<name>``: each is the same randomly initialised
    :func:`tiny_llama_config` Llama (``torch.manual_seed(0)``) plus ``scale`` times Gaussian noise
    on every parameter (scale 0: the base itself), in shards of at most 40 KB, with the
    :func:`bpe_tokenizer` of ``text`` as ``tokenizer.json``.

    Returns:
        (``{name: folder}``, the unperturbed model, the tokenizer).
    """
    import torch
    from transformers import LlamaForCausalLM

    tok = bpe_tokenizer(text)
    cfg = tiny_llama_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    paths = {}
    for name, scale in scales:
        m = LlamaForCausalLM(cfg)
        m.load_state_dict(model.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * torch.randn_like(p))
        d = Path(root) / name
        m.save_pretrained(d, max_shard_size="40KB")
        tok.save(str(d / "tokenizer.json"))
        paths[name] = d
    return paths, model, tok
