"""Dense whole-tensor reference implementation of the registry's methods.

Written independently of the block-wise path: it loads whole tensors, finds the magnitude-trim
threshold by sorting (not from a histogram), and draws DARE masks for the whole tensor at once.
Tests compare the streaming engine's output at unlimited budget with this, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

from mergepipe.methods.registry import ResolvedParams, get_method
from mergepipe.numerics import dare_keep_mask, stream_key


def reference_min_key(delta) -> callable:
    """Return ``f(density) -> min_key`` computed by a full descending sort of the keys of
    ``delta`` (float32 torch tensor), with mergepipe's canonical tie rule."""
    import torch

    keys = delta.abs().to(torch.bfloat16).view(torch.int16).to(torch.int64).clamp(max=0x7F80)
    srt = torch.sort(keys.flatten(), descending=True).values

    def f(density: float) -> int:
        n = srt.numel()
        if density >= 1.0 or n == 0:
            return 0
        k = max(1, int(density * n))
        tau = int(srt[k - 1])
        if tau == 0:
            return 1
        above = int((srt > tau).sum())
        ties = int((srt == tau).sum())
        return tau if (above + ties - k) <= (k - above) else tau + 1

    return f


def merge_tensor_dense(name: str, base, experts: list, params: ResolvedParams, seed: int = 0):
    """Merge one whole tensor.

    Args:
        name: tensor name (keys the DARE stream).
        base: float32 torch tensor, any shape.
        experts: K float32 torch tensors of the same shape.
        params: resolved parameters.
        seed: DARE seed.

    Returns:
        float32 tensor of the base's shape.
    """
    import torch

    spec = get_method(params.method)
    g = params.globals
    row_numel = base[0].numel() if base.dim() > 1 else 1
    deltas = []
    for i, (x, ep) in enumerate(zip(experts, params.experts)):
        d = (x - base).flatten()
        dens = ep.get("density", 1.0)
        if spec.sparsify == "magnitude" and dens < 1.0:
            mk = reference_min_key(d)(dens)
            keys = d.abs().to(torch.bfloat16).view(torch.int16).to(torch.int64)
            kept = torch.where(keys >= mk, d, torch.zeros(()))
        elif spec.sparsify == "random" and dens < 1.0:
            mask = torch.from_numpy(dare_keep_mask(stream_key(seed, i, name), 0, d.numel(), dens))
            kept = torch.where(mask, d, torch.zeros(()))
        else:
            kept = d
        if g.get("rescale") and spec.sparsify != "none" and dens < 1.0:
            a = math.fsum(d.reshape(-1, row_numel).abs().sum(1, dtype=torch.float64).tolist())
            b = math.fsum(kept.reshape(-1, row_numel).abs().sum(1, dtype=torch.float64).tolist())
            if a >= 1e-8 and b >= 1e-8:
                kept = kept * (a / b)
        deltas.append(kept)
    w = [ep["weight"] for ep in params.experts]
    b = base.flatten()
    if spec.linear:
        acc = sum_in_order([d * wi for d, wi in zip(deltas, w)])
        ws = sum(w)
        if g.get("normalize", True):
            out = b + acc / (ws if abs(ws) >= 1e-8 else 1.0)
        else:
            out = b * ws + acc
    else:
        weighted = [d * wi for d, wi in zip(deltas, w)]
        if spec.consensus == "sum":
            tot = sum_in_order(weighted)
            maj = torch.where(tot >= 0, 1.0, -1.0)
            agree = [torch.sign(t) == maj for t in weighted]
            mixed = sum_in_order([torch.where(a, t, torch.zeros(())) for a, t in zip(agree, weighted)])
            div = sum_in_order([a.float() * wi for a, wi in zip(agree, w)])
            if g.get("normalize"):
                div = torch.where(div.abs() < 1e-8, torch.ones(()), div)
                mixed = mixed / div
        else:
            mixed = sum_in_order(weighted)
            if g.get("normalize"):
                ws = sum(w)
                mixed = mixed / (ws if abs(ws) >= 1e-8 else 1.0)
        lam = g.get("lambda", 1.0)
        if lam != 1.0:
            mixed = mixed * lam
        out = b + mixed
    out = torch.where(out - b == 0, b, out) if not spec.linear or g.get("normalize", True) else out
    return out.reshape(base.shape)


def sum_in_order(ts: list):
    acc = ts[0]
    for t in ts[1:]:
        acc = acc + t
    return acc


def merge_checkpoint_dense(base_dir: str, expert_dirs: list[str], params: ResolvedParams, seed: int = 0) -> dict:
    """Merge whole checkpoints in memory with the dense reference; returns ``{name: tensor}`` in
    the base dtype. For tests on small models only (loads everything)."""
    import torch
    from safetensors.torch import load_file
    import glob
    import os

    def load(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    b = load(base_dir)
    es = [load(d) for d in expert_dirs]
    res = {}
    for name, t in b.items():
        if not t.is_floating_point():
            res[name] = t
            continue
        m = merge_tensor_dense(name, t.float(), [e[name].float() for e in es], params, seed)
        res[name] = m.to(t.dtype)
    return res
