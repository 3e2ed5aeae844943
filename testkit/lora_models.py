"""Real PEFT LoRA adapters for tests, made offline with the ``peft`` package.

* :func:`zoo_base`: the demo zoo's model architecture (``mergepipe_zoo.zoo``, tiny size: a
  2-layer Llama, 0.2 M parameters), seeded random weights, saved like the zoo saves its
  checkpoints (bf16, sharded safetensors + index).
* :func:`train_adapter`: a LoRA adapter made by ``peft.get_peft_model`` on that base (or on
  MiniLM), trained a few SGD steps on random tokens (so A and B are both trained, not
  PEFT's zero-B initialisation), saved with ``save_pretrained`` (``adapter_config.json`` +
  ``adapter_model.safetensors``).
* :func:`premerge`: the same adapter merged into a full checkpoint with PEFT's
  ``merge_and_unload()`` in the base's dtype — what mergekit's ``model+lora`` does, and what a
  LoRA expert is compared with.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def zoo_base(folder: Path, seed: int = 0) -> Path:
    """The tiny zoo's Llama architecture with seeded weights, saved as the zoo does (bf16, >= 2
    shards + index)."""
    import torch
    from transformers import LlamaForCausalLM

    from mergepipe_zoo.zoo import ZooConfig, _llama_config

    cfg = ZooConfig.tiny()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(cfg)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=cfg.max_shard_size)
    return folder


def _load(base: Path, dtype=None):
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(base)
    cls = AutoModelForCausalLM if cfg.model_type == "llama" else AutoModel
    return cls.from_pretrained(base, dtype=dtype or torch.float32)


def train_adapter(base: Path, out: Path, *, seed: int = 0, steps: int = 4, **lora: Any) -> Path:
    """A PEFT LoRA adapter of ``base`` trained ``steps`` SGD steps on random tokens.

    ``lora`` are ``peft.LoraConfig`` fields (``r``, ``lora_alpha``, ``target_modules``,
    ``use_rslora``, ``rank_pattern``, ...). Factors are kept in float32 (PEFT's default
    ``autocast_adapter_dtype``), B initialised randomly (``init_lora_weights=False``) so the
    task vector is not tiny after a few steps.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = _load(base)
    cfg = LoraConfig(lora_dropout=0.0, init_lora_weights=False, **lora)
    pm = get_peft_model(model, cfg)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.05)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, vocab, (4, 16), generator=g)
        out_ = pm(input_ids=ids)
        h = out_.logits if hasattr(out_, "logits") else out_.last_hidden_state
        loss = h.float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    pm.save_pretrained(out)
    return out


def premerge(base: Path, adapter: Path, out: Path) -> Path:
    """``PeftModel.from_pretrained(base in its own dtype, adapter).merge_and_unload()``, saved as
    a full checkpoint with the base's sharding and side files."""
    import json

    import torch
    from peft import PeftModel

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        json.loads((base / "config.json").read_text()).get("dtype")
        or json.loads((base / "config.json").read_text()).get("torch_dtype"),
        torch.float32,
    )
    model = _load(base, dtype)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    sharded = (base / "model.safetensors.index.json").exists()
    merged.save_pretrained(out, max_shard_size="200KB" if sharded else "10GB")
    if not sharded:  # exactly the base's tensor names (transformers adds/drops buffers and heads)
        from safetensors.torch import load_file, save_file

        bt = load_file(str(base / "model.safetensors"))
        sd = merged.state_dict()
        save_file(
            {k: (sd[k] if k in sd else v).detach().contiguous() for k, v in bt.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
    for f in base.iterdir():  # tokenizer files etc., as the base has them
        if f.is_file() and not f.name.endswith(".safetensors") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def lora_factors(adapter: Path) -> dict[str, Any]:
    """The adapter's saved tensors by name (torch)."""
    from safetensors.torch import load_file

    return load_file(str(adapter / "adapter_model.safetensors"))
