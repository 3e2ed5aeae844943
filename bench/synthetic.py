"""Synthetic checkpoints shaped like real models, for I/O benchmarks.

``qwen3_0_6b_shapes()`` reproduces the tensor names and shapes of Qwen3-0.6B (28 layers, hidden
1024, intermediate 3072, 16 query / 8 key-value heads of 128, vocab 151936, tied embeddings):
596M parameters, 1.19 GB in bf16. ``make_family`` writes a base and K experts in the Hugging Face
sharded layout whose task vectors look like fine-tuning deltas: low-rank plus sparse plus small
dense noise, with a scale that varies by layer (later layers move more), and a few tensors
(norms, some attention blocks) nearly untouched. Generation streams tensor by tensor, so memory
stays at a few tensors; it is deterministic for a given seed.

Usage::

    python bench/synthetic.py OUT_DIR --experts 4 [--shape qwen3-0.6b|tiny] [--shard-size 500MB]
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import zlib
from pathlib import Path

import numpy as np

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # run as a script, or imported as `synthetic` with bench/ on the path
    sys.path.insert(0, _REPO)

from testkit.synth import llama_like_shapes  # noqa: E402


def qwen3_0_6b_shapes() -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's tensor names and shapes (see the module docstring)."""
    return llama_like_shapes(1024, 3072, 28, 151936, lm_head=False, heads=16, kv_heads=8, head_dim=128, qk_norm=True)


def tiny_shapes() -> dict[str, tuple[int, ...]]:
    return llama_like_shapes(hidden=256, inter=688, layers=4, vocab=4096, lm_head=True)


def llama_110m_shapes() -> dict[str, tuple[int, ...]]:
    """A 110M-parameter Llama (hidden 768, intermediate 2048, 12 layers, 12 heads of 64, vocab
    32000, tied embeddings): 109.5M parameters, 219 MB in bf16 -- the fixture of issue 23."""
    return llama_like_shapes(hidden=768, inter=2048, layers=12, vocab=32000, lm_head=False)


LLAMA_110M_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}


def llama_14m_shapes() -> dict[str, tuple[int, ...]]:
    """A 14M-parameter Llama (hidden 384, intermediate 1024, 6 layers, 6 heads of 64, vocab 8000,
    tied embeddings): 13.7M parameters, 27 MB in bf16 -- issue 23's table on a loaded machine,
    where the 110M fixture's analysis does not fit the time."""
    return llama_like_shapes(hidden=384, inter=1024, layers=6, vocab=8000, lm_head=False)


LLAMA_14M_CONFIG = dict(
    LLAMA_110M_CONFIG,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=6,
    vocab_size=8000,
)

SHAPES = {
    "qwen3-0.6b": qwen3_0_6b_shapes,
    "tiny": tiny_shapes,
    "llama-110m": llama_110m_shapes,
    "llama-14m": llama_14m_shapes,
}

QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
}


def _to_bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, round to nearest even."""
    b = x.astype(np.float32).view(np.uint32)
    r = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return r.tobytes()


def _from_bf16(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def _layer(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1


def _write_shards(folder: Path, names: list[str], shapes: dict, tensor_bytes, shard_bytes: int) -> None:
    """Write shards + index; ``tensor_bytes(name)`` yields each tensor's bf16 bytes once, in order."""
    folder.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        nb = math.prod(shapes[n]) * 2
        if groups[-1] and size + nb > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nb
    wm = {}
    total = 0
    for gi, g in enumerate(groups):
        fn = f"model-{gi + 1:05d}-of-{len(groups):05d}.safetensors"
        hdr: dict = {"__metadata__": {"format": "pt"}}
        pos = 0
        for n in g:
            nb = math.prod(shapes[n]) * 2
            hdr[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [pos, pos + nb]}
            pos += nb
        js = json.dumps(hdr, separators=(",", ":")).encode()
        js += b" " * ((8 - (len(js) + 8) % 8) % 8)
        with open(folder / fn, "wb") as f:
            f.write(struct.pack("<Q", len(js)) + js)
            for n in g:
                f.write(tensor_bytes(n))
                wm[n] = fn
                total += math.prod(shapes[n]) * 2
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2)
    )


def make_family(
    out: Path, n_experts: int, shape: str = "qwen3-0.6b", shard_bytes: int = 500_000_000, seed: int = 0
) -> tuple[Path, list[Path]]:
    """Write ``out/base`` and ``out/expert{i}``; returns their paths. Skips folders that exist."""
    out = Path(out)
    shapes = SHAPES[shape]()
    names = list(shapes)
    n_layers = max(_layer(n) for n in names) + 1
    base_dir = out / "base"

    def base_tensor(n: str) -> np.ndarray:
        rng = np.random.default_rng([seed, zlib.crc32(n.encode())])
        shp = shapes[n]
        if len(shp) == 1:
            return (1.0 + 0.05 * rng.standard_normal(shp, dtype=np.float32)).astype(np.float32)
        return (0.02 * rng.standard_normal(shp, dtype=np.float32)).astype(np.float32)

    if not (base_dir / "model.safetensors.index.json").exists():
        _write_shards(base_dir, names, shapes, lambda n: _to_bf16_bytes(base_tensor(n)), shard_bytes)
        if shape == "qwen3-0.6b":
            (base_dir / "config.json").write_text(json.dumps(QWEN3_CONFIG, indent=2))
        elif shape in ("llama-110m", "llama-14m"):
            cfg = LLAMA_110M_CONFIG if shape == "llama-110m" else LLAMA_14M_CONFIG
            (base_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        else:
            (base_dir / "config.json").write_text(
                json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
            )
    experts = []
    for e in range(n_experts):
        d = out / f"expert{e}"
        experts.append(d)
        if (d / "model.safetensors.index.json").exists():
            continue

        def expert_tensor(n: str, e=e) -> bytes:
            rng = np.random.default_rng([seed + 1000 + e, zlib.crc32(n.encode())])
            b = _from_bf16(_to_bf16_bytes(base_tensor(n)))
            shp = shapes[n]
            li = _layer(n)
            depth = (li + 1) / n_layers if li >= 0 else 0.5
            scale = 0.002 * (0.3 + depth) * (1.5 if "mlp" in n else 1.0)
            if len(shp) == 1:
                dlt = scale * 0.1 * rng.standard_normal(shp, dtype=np.float32)
            else:
                r = 8
                u = rng.standard_normal((shp[0], r), dtype=np.float32)
                v = rng.standard_normal((r, shp[1]), dtype=np.float32)
                dlt = (scale / r) * (u @ v)
                k = max(1, int(0.002 * dlt.size))
                idx = rng.integers(0, dlt.size, k)
                dlt.reshape(-1)[idx] += 10 * scale * rng.standard_normal(k, dtype=np.float32)
                dlt += 0.1 * scale * rng.standard_normal(shp, dtype=np.float32)
            return _to_bf16_bytes(b.reshape(shp) + dlt)

        _write_shards(d, names, shapes, expert_tensor, shard_bytes)
        (d / "config.json").write_text((base_dir / "config.json").read_text())
    return base_dir, experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--shard-size", type=int, default=500_000_000, help="bytes per shard")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    b, es = make_family(a.out, a.experts, a.shape, a.shard_size, a.seed)
    print(json.dumps({"base": str(b), "experts": [str(e) for e in es]}))


if __name__ == "__main__":
    main()
