"""Dense whole-tensor reference implementation of the registry's methods.

Written independently of the block-wise path: it loads whole tensors, finds the magnitude
thresholds (TIES trim: sorted keys for bf16 inputs, sorted float32 magnitudes for float16/float32
inputs; breadcrumbs window) by sorting (not from a histogram), ranks DELLA's
magnitudes with a whole-tensor torch sort, draws DARE/DELLA masks for the whole tensor at once,
and computes the whole-tensor statistics of slerp, nuslerp and model_stock from the whole
tensors (not from the catalog). It shares with the engine only the definitions: the random
streams, the canonical sums (:func:`mergepipe.numerics.segment_dots` + ``fsum``), the scalar
coefficient formulas, and the parameter resolution (:mod:`mergepipe.methods.params`). Tests
compare the streaming engine's output at unlimited budget with this, bit for bit.
"""

from __future__ import annotations

import math

from mergepipe.methods.params import ResolvedParams, TensorParams, layer_count, layer_t
from mergepipe.methods.registry import get_method
from mergepipe.numerics import (
    N_KEYS,
    dare_keep_mask,
    exact_total,
    model_stock_t,
    nuslerp_coefficients,
    nuslerp_coefficients_rows,
    segment_dots,
    slerp_coefficients,
    stream_key,
    uniform53,
)


def _keys(delta):
    import torch

    return delta.abs().to(torch.bfloat16).view(torch.int16).to(torch.int64).clamp(max=0x7F80)


def reference_min_key(delta) -> callable:
    """Return ``f(density) -> min_key`` computed by a full descending sort of the keys of
    ``delta`` (float32 torch tensor), with mergepipe's canonical tie rule."""
    import torch

    srt = torch.sort(_keys(delta).flatten(), descending=True).values

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


def reference_outlier_window(delta, density: float, gamma: float) -> tuple[int, int]:
    """Breadcrumbs' keep window ``[lo, hi)`` of keys, from a full sort: mergekit 0.1.5 keeps the
    ascending sorted positions ``[n_bot, n_bot + target)``; each boundary key's ties are kept
    (low end) or dropped (high end) all together, whichever lands at least as near the count."""
    import torch

    srt = torch.sort(_keys(delta).flatten(), descending=True).values
    n = srt.numel()
    if density >= 1.0 or n == 0:
        return 0, N_KEYS
    target = int(density * n)
    if target == 0:
        return N_KEYS, N_KEYS
    n_top = int(gamma * n)
    n_bot = max(0, n - target - n_top)

    def top_set_min(k: int) -> int:  # smallest key of the canonical "k largest" set
        tau = int(srt[k - 1])
        above = int((srt > tau).sum())
        ties = int((srt == tau).sum())
        return tau if (above + ties - k) <= (k - above) else tau + 1

    k_top = n - n_bot - target
    hi = N_KEYS if k_top <= 0 else top_set_min(k_top)
    lo = 0 if n_bot == 0 else top_set_min(n - n_bot)
    return lo, hi


def reference_della_mask(delta, shape, density: float, epsilon: float, key: int):
    """DELLA's keep mask for a whole tensor: stable ranks of the magnitude keys along dim 1 (a
    1-D tensor as one row), probabilities in float32 as mergekit, the counter-based stream."""
    import torch

    k = _keys(delta)
    if len(shape) < 2:
        k3 = k.reshape(1, -1, 1)
    else:
        k3 = k.reshape(shape[0], shape[1], -1)
    n = k3.shape[1]
    order = torch.sort(k3, dim=1, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(n).reshape(1, n, 1).expand_as(order).contiguous())
    if n > 1:
        rn = ranks.to(torch.float32) / torch.tensor(n - 1, dtype=torch.float32)
    else:
        rn = torch.full(ranks.shape, 0.5, dtype=torch.float32)
    p = torch.tensor(density - epsilon, dtype=torch.float32) + (rn * torch.tensor(2.0)) * torch.tensor(
        epsilon, dtype=torch.float32
    )
    u = torch.from_numpy(uniform53(key, 0, delta.numel()))
    return u < p.flatten().to(torch.float64) * float(2**53)


def _row_total(a, b, width: int) -> float:
    return exact_total(segment_dots(a.numpy(), b.numpy(), width))


def reference_topk_mask(delta, density: float):
    """Exact top-k of ``|delta|`` (float32 torch, bfloat16/float16/float32 inputs), by a full descending
    sort of the float32 magnitudes: ``k = max(1, int(density·n))``, ``v`` the k-th largest, ``A``
    the count above it and ``T`` the count equal to it; keep ``|δ| > v`` and the entries equal to
    ``v`` when ``A + T − k <= k − A`` (the canonical tie rule on exactly equal values). With
    ``v = 0`` every non-zero entry is kept. Returns a bool mask of ``delta``'s shape."""
    import torch

    a = delta.abs()
    n = a.numel()
    if density >= 1.0 or n == 0:
        return torch.ones_like(a, dtype=torch.bool)
    k = max(1, int(density * n))
    v = torch.sort(a.flatten(), descending=True).values[k - 1]
    if float(v) == 0.0:
        return a > 0
    above = int((a > v).sum())
    ties = int((a == v).sum())
    return a >= v if above + ties - k <= k - above else a > v


def reference_outlier_mask(delta, density: float, gamma: float):
    """Breadcrumbs on bfloat16/float16/float32 inputs: mergekit 0.1.5's ascending sorted positions
    ``[n_bot, n_bot + target)`` of the exact float32 magnitudes, each cut decided by the canonical
    tie rule on exactly equal values: keep the top ``n − n_bot`` set minus the top
    ``n − n_bot − target`` set. Returns a bool mask of ``delta``'s shape."""
    import torch

    a = delta.abs()
    n = a.numel()
    if density >= 1.0 or n == 0:
        return torch.ones_like(a, dtype=torch.bool)
    target = int(density * n)
    if target == 0:
        return torch.zeros_like(a, dtype=torch.bool)
    n_bot = max(0, n - target - int(gamma * n))
    srt = torch.sort(a.flatten(), descending=True).values

    def top(k: int):
        if k <= 0:
            return torch.zeros_like(a, dtype=torch.bool)
        if k >= n:
            return torch.ones_like(a, dtype=torch.bool)
        v = srt[k - 1]
        above = int((a > v).sum())
        ties = int((a == v).sum())
        return a >= v if above + ties - k <= k - above else a > v

    return top(n - n_bot) & ~top(n - n_bot - target)


def merge_tensor_dense(
    name: str,
    base,
    experts: list,
    params: ResolvedParams | TensorParams,
    seed: int = 0,
    t: float = 0.0,
    method: str | None = None,
    exact: bool = False,
):
    """Merge one whole tensor.

    Args:
        name: tensor name (keys the random streams and the filter settings).
        base: float32 torch tensor, any shape.
        experts: K float32 torch tensors of the same shape.
        params: resolved settings (evaluated here for ``name`` at layer position ``t``) or the
            tensor's concrete values (then ``method`` names the method).
        seed: DARE / DELLA seed.
        exact: the inputs are bfloat16/float16/float32 (mergepipe's rule for every stored float
            dtype but float64/float8): TIES trims by exact top-k of the float32
            magnitudes (:func:`reference_topk_mask`), breadcrumbs by the exact window
            (:func:`reference_outlier_mask`), instead of by magnitude keys.

    Returns:
        float32 tensor of the base's shape.
    """
    import torch

    if isinstance(params, ResolvedParams):
        method = params.method
        params = params.for_tensor(name, t)
    spec = get_method(method)
    g = params.globals
    eps = params.experts
    shape = tuple(base.shape)
    row_numel = base[0].numel() if base.dim() > 1 else 1
    b = base.flatten()
    ds = [(x - base).flatten() for x in experts]
    K = len(experts)
    width = int(shape[-1]) if len(shape) > 1 else b.numel()

    if spec.kind == "slerp":
        if g["t"] == 0.0:
            return base.clone()
        e = experts[0].flatten()
        ca, cb = slerp_coefficients(
            g["t"], _row_total(b, b, row_numel), _row_total(e, e, row_numel), _row_total(b, e, row_numel)
        )
        return (b * ca + e * cb).reshape(shape)
    if spec.kind == "model_stock":
        avg = sum_in_order(ds) / K
        if g.get("filter_wise"):
            sq = [segment_dots(d.numpy(), d.numpy(), width) for d in ds]
            dots = {
                (i, j): segment_dots(ds[i].numpy(), ds[j].numpy(), width) for i in range(K) for j in range(i + 1, K)
            }
            tt = torch.from_numpy(model_stock_t(K, sq, dots))
            mixed = (avg.reshape(-1, width) * tt[:, None]).reshape(-1)
        else:
            sq = [_row_total(d, d, row_numel) for d in ds]
            dots = {(i, j): _row_total(ds[i], ds[j], row_numel) for i in range(K) for j in range(i + 1, K)}
            mixed = avg * float(model_stock_t(K, sq, dots))
        return torch.where(mixed == 0, b, b + mixed).reshape(shape)
    if spec.kind == "nuslerp":
        w0, w1 = eps[0]["weight"], eps[1]["weight"]
        tt = 0.5 if abs(w0 + w1) < 1e-6 else w1 / (w0 + w1)
        d0, d1 = ds
        if g.get("nuslerp_flatten", True):
            a, bb, s = nuslerp_coefficients(
                tt, _row_total(d0, d0, row_numel), _row_total(d1, d1, row_numel), _row_total(d0, d1, row_numel)
            )
            mixed = (d0 * a + d1 * bb) / s
        else:
            x0, x1 = d0.numpy(), d1.numpy()
            c = torch.from_numpy(
                nuslerp_coefficients_rows(
                    tt, segment_dots(x0, x0, width), segment_dots(x1, x1, width), segment_dots(x0, x1, width)
                )
            )
            mixed = ((d0.reshape(-1, width) * c[:, 0:1] + d1.reshape(-1, width) * c[:, 1:2]) / c[:, 2:3]).reshape(-1)
        return torch.where(mixed == 0, b, b + mixed).reshape(shape)

    deltas = []
    for i, (d, ep) in enumerate(zip(ds, eps)):
        dens = ep.get("density", 1.0)
        if spec.sparsify == "magnitude" and dens < 1.0 and exact:
            kept = torch.where(reference_topk_mask(d, dens), d, torch.zeros(()))
        elif spec.sparsify == "magnitude" and dens < 1.0:
            mk = reference_min_key(d)(dens)
            kept = torch.where(_keys(d) >= mk, d, torch.zeros(()))
        elif spec.sparsify == "outliers" and dens < 1.0 and exact:
            kept = torch.where(reference_outlier_mask(d, dens, ep["gamma"]), d, torch.zeros(()))
        elif spec.sparsify == "outliers" and dens < 1.0:
            lo, hi = reference_outlier_window(d, dens, ep["gamma"])
            k = _keys(d)
            kept = torch.where((k >= lo) & (k < hi), d, torch.zeros(()))
        elif spec.sparsify == "della" and dens < 1.0:
            mask = reference_della_mask(d, shape, dens, ep["epsilon"], stream_key(seed, i, name))
            kept = torch.where(mask, d, torch.zeros(()))
        elif spec.sparsify == "random" and dens < 1.0:
            mask = torch.from_numpy(dare_keep_mask(stream_key(seed, i, name), 0, d.numel(), dens))
            kept = torch.where(mask, d, torch.zeros(()))
        else:
            kept = d
        if g.get("rescale") and spec.sparsify != "none" and dens < 1.0:
            a = math.fsum(d.reshape(-1, row_numel).abs().sum(1, dtype=torch.float64).tolist())
            bsum = math.fsum(kept.reshape(-1, row_numel).abs().sum(1, dtype=torch.float64).tolist())
            if a >= 1e-7 and bsum >= 1e-7:  # mergekit's rescale eps
                kept = kept * (a / bsum)
        deltas.append(kept)
    w = [ep["weight"] for ep in eps]
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
                div = torch.where(div == 0, torch.ones(()), div)  # mergekit: divisor == 0 -> 1
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


def merge_checkpoint_dense(
    base_dir: str, expert_dirs: list[str], params: ResolvedParams, seed: int = 0, out_dtype=None
) -> dict:
    """Merge whole checkpoints in memory with the dense reference; returns ``{name: tensor}`` in
    the base dtype (floating tensors in ``out_dtype`` when given, a torch dtype). Layer-wise
    settings are evaluated per tensor with mergekit's layer positions. For tests on small
    models only (loads everything)."""
    import glob
    import os

    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    b = load(base_dir)
    es = [load(d) for d in expert_dirs]
    n_layers = layer_count(b)
    res = {}
    for name, t in b.items():
        if not t.is_floating_point():
            res[name] = t
            continue
        import torch

        m = merge_tensor_dense(
            name,
            t.float(),
            [e[name].float() for e in es],
            params,
            seed,
            t=layer_t(name, n_layers),
            exact=t.dtype in (torch.bfloat16, torch.float16, torch.float32),
        )
        res[name] = m.to(out_dtype or t.dtype)
    return res
