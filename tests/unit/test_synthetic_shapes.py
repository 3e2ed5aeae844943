"""The benchmarks' synthetic layouts come from one source (testkit.synth.llama_like_shapes) and
stay what the committed benchmark figures were measured on."""

import hashlib
import json
import math

from bench import synthetic, synthetic_catalog
from testkit.synth import llama_like_shapes

#: sha256 (first 16 hex digits) of each layout's ``[(name, shape), ...]`` as JSON, and its
#: parameter count: the layouts docs/BENCHMARKS.md's fixtures were generated from
PINNED = {
    "qwen3-0.6b": ("acd003411894e40f", 596_049_920),
    "tiny": ("5df7e44b8f595834", 5_261_568),
    "llama-110m": ("df2fe66672631e86", 109_529_856),
    "llama-14m": ("9b553e872964b37d", 13_693_824),
}


def _digest(shapes: dict) -> str:
    return hashlib.sha256(json.dumps(list(shapes.items())).encode()).hexdigest()[:16]


def test_benchmark_layouts_are_pinned():
    for name, (digest, params) in PINNED.items():
        shapes = synthetic.SHAPES[name]()
        assert (_digest(shapes), sum(math.prod(s) for s in shapes.values())) == (digest, params), name
    assert _digest(synthetic_catalog.llama_7b_shapes()) == "d3ba1ddcf1043bd8"
    assert synthetic_catalog.SHAPES["llama-110m"]() == synthetic.llama_110m_shapes()


def test_grouped_query_attention_and_qk_norm_shapes():
    s = llama_like_shapes(64, 96, 1, 50, lm_head=False, heads=4, kv_heads=2, head_dim=8, qk_norm=True)
    p = "model.layers.0.self_attn."
    assert s[p + "q_proj.weight"] == (32, 64) and s[p + "k_proj.weight"] == (16, 64) == s[p + "v_proj.weight"]
    assert s[p + "o_proj.weight"] == (64, 32) and s[p + "q_norm.weight"] == (8,) == s[p + "k_norm.weight"]
    assert "lm_head.weight" not in s and list(s)[-1] == "model.norm.weight"
    mha = llama_like_shapes(64, 96, 1, 50)
    assert mha[p + "k_proj.weight"] == (64, 64) and list(mha)[-1] == "lm_head.weight"
    cfg = synthetic.QWEN3_CONFIG
    q = synthetic.qwen3_0_6b_shapes()["model.layers.0.self_attn.q_proj.weight"]
    assert q == (cfg["num_attention_heads"] * cfg["head_dim"], cfg["hidden_size"])
