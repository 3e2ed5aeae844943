"""Synthetic Hugging Face-layout checkpoints for tests (real safetensors files, sharded)."""

from __future__ import annotations

import json
from pathlib import Path


def llama_like_shapes(
    hidden: int = 64,
    inter: int = 160,
    layers: int = 2,
    vocab: int = 256,
    *,
    lm_head: bool = True,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    qk_norm: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Llama-layout decoder, in checkpoint order: the one source of
    the test suite's and the benchmarks' synthetic layouts (``bench/synthetic.py``,
    ``bench/synthetic_catalog.py``).

    Args:
        hidden, inter, layers, vocab: hidden size, MLP intermediate size, decoder layers,
            vocabulary size.
        lm_head: an untied ``lm_head.weight`` (vocab x hidden) at the end; False: tied embeddings.
        heads, kv_heads, head_dim: grouped-query attention (q: heads·head_dim rows, k and v:
            kv_heads·head_dim rows); None: multi-head attention of width ``hidden``.
        qk_norm: per-head ``q_norm``/``k_norm`` weights (head_dim) after ``o_proj`` (Qwen3).

    Returns:
        ``{tensor name: shape}`` (1-D norms, 2-D ``(out, in)`` matrices).
    """
    hd = head_dim or (hidden // heads if heads else hidden)
    q_rows = heads * hd if heads else hidden
    kv_rows = (kv_heads or heads) * hd if heads else hidden
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if lm_head:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def save_checkpoint(folder: Path, tensors: dict, n_shards: int = 2, extra_files: bool = True) -> Path:
    """Write ``tensors`` ({name: torch tensor}) as ``n_shards`` safetensors shards + index."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if n_shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // n_shards)
        wm = {}
        total = 0
        for s in range(n_shards):
            part = names[s * per : (s + 1) * per]
            fn = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(folder / fn), metadata={"format": "pt"})
            for n in part:
                wm[n] = fn
                total += tensors[n].numel() * tensors[n].element_size()
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2)
        )
    if extra_files:
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
        (folder / "tokenizer_config.json").write_text("{}")
    return folder


def make_family(
    root: Path,
    n_experts: int = 3,
    seed: int = 0,
    dtype: str = "bfloat16",
    n_shards: int = 2,
    shapes: dict | None = None,
    sparse_frac: float = 0.02,
) -> tuple[Path, list[Path]]:
    """A base and experts whose task vectors are low-rank + sparse + noise, varying by layer
    (like fine-tuning deltas)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shapes = shapes or llama_like_shapes()
    dt = getattr(torch, dtype)
    base = {}
    for n, shp in shapes.items():
        if len(shp) == 1:
            base[n] = (1.0 + 0.02 * torch.randn(shp, generator=g)).to(dt)
        else:
            base[n] = (0.05 * torch.randn(shp, generator=g)).to(dt)
    bdir = save_checkpoint(Path(root) / "base", base, n_shards)
    edirs = []
    for e in range(n_experts):
        ex = {}
        for li, (n, shp) in enumerate(shapes.items()):
            b = base[n].float()
            scale = 0.002 * (1 + (li % 5))
            if len(shp) == 1:
                d = scale * torch.randn(shp, generator=g)
            else:
                r = 4
                d = scale * (torch.randn(shp[0], r, generator=g) @ torch.randn(r, shp[1], generator=g)) / r
                mask = torch.rand(shp, generator=g) < sparse_frac
                d = d + mask * (0.05 * torch.randn(shp, generator=g))
                d = d + 0.0005 * torch.randn(shp, generator=g)
            ex[n] = (b + d).to(dt)
        edirs.append(save_checkpoint(Path(root) / f"expert{e}", ex, n_shards))
    return bdir, edirs
