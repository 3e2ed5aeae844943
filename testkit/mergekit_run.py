"""Run the same mergekit config through mergekit 0.1.5 (a test-only dependency, run as a
subprocess; tests skip without it) and mergepipe, on tiny real Llama checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from mergepipe.config import merge_from_config
from testkit.harness import merged_tensors


def tiny_llama_family4(root, dtype):
    """``{"base", "a", "b"}`` folders: a 4-layer :func:`testkit.tiny_llm.tiny_llama_config` Llama in
    ``dtype`` (seed 0) and two copies perturbed by 0.02 and 0.03 times Gaussian noise, saved in
    40 KB shards with a BPE ``tokenizer.json``."""
    from transformers import LlamaForCausalLM

    from testkit.tiny_llm import bpe_tokenizer, tiny_llama_config

    tok = bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20)
    cfg = tiny_llama_config(num_hidden_layers=4)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to(dtype)
    out = {}
    for name, scale in (("base", 0.0), ("a", 0.02), ("b", 0.03)):
        m = LlamaForCausalLM(cfg).to(dtype)
        m.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * torch.randn_like(p))
        m.save_pretrained(root / name, max_shard_size="40KB")
        tok.save(str(root / name / "tokenizer.json"))
        out[name] = str(root / name)
    return out


def _write(tmp_path, cfg, name="merge.yml"):
    """``cfg`` as YAML at ``tmp_path/name``."""
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _mergekit(cfg_path, out):
    """Run mergekit 0.1.5's ``mergekit-yaml`` on ``cfg_path`` into ``out`` (skips the test when
    mergekit is not installed) and return its tensors."""
    pytest.importorskip("mergekit")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mergekit.scripts.run_yaml import main; main()",
            str(cfg_path),
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return merged_tensors(out)


def _ours(tmp_path, cfg_path, out, **kw):
    """mergepipe's merge of ``cfg_path`` into ``out`` (catalog under ``tmp_path``): (result, tensors)."""
    from mergepipe.catalog.catalog import Catalog

    res = merge_from_config(cfg_path, str(out), catalog=Catalog(tmp_path / "cat.db"), **kw)
    return res, merged_tensors(out)
