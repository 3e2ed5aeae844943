"""mergekit 0.1.5's newer merge methods, transcribed from its source for the tests.

Each function follows ``mergekit/merge_methods/<name>.py`` of mergekit 0.1.5 (LGPL-3.0) step by
step on whole tensors, in the dtype it is given (float32 here, as mergekit with ``dtype:
float32``), with the same torch operations, so that tests can compare mergepipe's block-wise
engine with what mergekit computes without installing mergekit. Only what the tests use: one
tensor at a time, the base first, then the experts in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def multislerp(base, experts, weights, normalize_weights=True, eps=1e-8):
    """``multislerp.py``: barycentric interpolation of the task vectors on the sphere."""
    if len(experts) == 1:
        return experts[0]
    tensors = torch.stack(experts, dim=0) - base
    flat = tensors.view(tensors.shape[0], -1)
    w = torch.tensor(weights, dtype=tensors.dtype)
    if normalize_weights:
        w = w / w.sum()
    norms = torch.norm(flat, dim=-1, keepdim=True)
    unit = flat / (norms + eps)
    mean = (unit * w.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps:
        if tensors.shape[0] == 2:
            return (tensors[0] * w[0] + tensors[1] * w[1]).view(tensors.shape[1:]) + base
        raise ValueError("zero weighted sum")
    mean = mean / mean_norm
    dots = (unit * mean).sum(-1, keepdim=True)
    tangent = unit - dots * mean
    tr = (tangent * w.view(-1, 1)).sum(0)
    tn = torch.norm(tr) + eps
    res = mean * torch.cos(tn) + tr * (torch.sin(tn) / tn)
    res = res * (norms.squeeze(-1) * w).sum()
    return res.view(tensors.shape[1:]) + base


def karcher(tensors, max_iter=10, tol=1e-5):
    """``karcher.py``: equal-weight Karcher mean of all input tensors on the unit sphere."""
    if len(tensors) == 1:
        return tensors[0]
    alphas = [1.0 / len(tensors)] * len(tensors)
    dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms, units = [], []
    for t in tensors:
        n = torch.linalg.vector_norm(t.to(dtype))
        norms.append(n)
        units.append(torch.zeros_like(t) if n.item() == 0.0 else (t / n).to(t.dtype))
    valid = [i for i, n in enumerate(norms) if n.item() > tol]
    if not valid:
        return sum(t * 0 for t in tensors)
    va = [alphas[i] for i in valid]
    s = sum(va)
    na = [a / s for a in va]
    vu = [units[i] for i in valid]
    mean = torch.zeros_like(vu[0])
    for a, u in zip(na, vu):
        mean += a * u
    mn = torch.linalg.vector_norm(mean.to(dtype))
    mean = vu[0].clone() if mn.item() < tol else (mean / mn).to(mean.dtype)
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for a, u in zip(na, vu):
            dot = torch.clamp(torch.dot(mean.flatten(), u.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue
            tangent += a * (theta / torch.sin(theta)) * (u - dot * mean)
        tnorm = torch.linalg.vector_norm(tangent.to(dtype))
        if tnorm.item() < tol:
            break
        mean = (torch.cos(tnorm) * mean + torch.sin(tnorm) * (tangent / tnorm)).to(mean.dtype)
        un = torch.linalg.vector_norm(mean.to(dtype))
        if un.item() > tol:
            mean = (mean / un).to(mean.dtype)
    scale = sum(a * n for a, n in zip(alphas, norms))
    return scale * mean


def _sign_mask(delta):
    """``generalized_task_arithmetic.get_mask(method="sum")``."""
    sign = delta.sign().to(delta.dtype)
    majority = (delta.sum(dim=0) >= 0).to(delta.dtype) * 2 - 1
    return sign == majority


def sce(base, experts, select_topk=1.0):
    """``sce.py``: variance top-k mask, TIES sign election, energy weights."""
    tvs = torch.stack([t - base for t in experts], dim=0)
    if select_topk < 1:
        var = torch.var(tvs, dim=0, unbiased=False)
        k = int(torch.count_nonzero(var) * select_topk)
        mask = torch.zeros_like(var)
        if k:
            _, idx = torch.topk(var.abs().view(-1), k=k, largest=True)
            mask.view(-1)[idx] = 1
        tvs = tvs * mask.unsqueeze(0)
    erase = _sign_mask(tvs)
    w = tvs.square().reshape(tvs.shape[0], -1).mean(dim=1)
    ws = torch.sum(w).item()
    w = torch.ones_like(w) / w.shape[0] if abs(ws) < 1e-6 else w / ws
    while w.dim() < tvs.dim():
        w = w.unsqueeze(-1)
    ew = w * erase
    merged = (tvs * ew).sum(dim=0)
    return base + merged / torch.sum(ew, dim=0).clamp(min=1e-6)


def nearswap(base, expert, t):
    """``nearswap.py``."""
    absdiff = torch.abs(base - expert)
    weight = (t / absdiff.clamp(min=1e-6)).clamp(min=0, max=1)
    return weight * expert + (1 - weight) * base


def _ram_vectors(experts, base, epsilon):
    tv = torch.stack([t - base for t in experts], dim=0).view(len(experts), -1)
    nz = tv.abs() > epsilon
    counts = nz.sum(dim=0, keepdim=True)
    return tv, nz, counts, counts > 1, counts == 1


def ram(base, experts, epsilon=1e-5):
    """``ram.py: ram_merge``."""
    tv, nz, counts, overlap, unique = _ram_vectors(experts, base, epsilon)
    z = tv * nz
    merged = ((z * unique) + (z * overlap / counts.clamp(min=1))).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def ramplus_tl(base, experts, r=0.1, alpha=0.2, epsilon=1e-5):
    """``ram.py: ramplus_tl_merge``."""
    tv, nz, counts, overlap, unique = _ram_vectors(experts, base, epsilon)
    shared = (nz & overlap).sum(dim=1)
    uniq = (nz & unique).sum(dim=1)
    rho = shared / uniq.clamp(min=epsilon)
    lam = 1 + r * rho.clamp(min=0, max=alpha)
    z = tv * nz
    merged = ((z * unique * lam.unsqueeze(-1)) + (z * overlap / counts.clamp(min=1))).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def arcee_fusion(base, expert):
    """``arcee_fusion.py`` with exact quantiles (mergekit samples 10⁶ entries of larger tensors)."""
    diff = (expert - base).abs()
    p = F.softmax(expert, dim=-1) + 1e-8
    q = F.softmax(base, dim=-1) + 1e-8
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    imp = diff * kl
    s, _ = torch.sort(imp.reshape(-1))
    q1, med, q3 = s[(torch.tensor([0.25, 0.5, 0.75]) * (s.numel() - 1)).long()]
    mask = (imp >= med + 1.5 * (q3 - q1)).float()
    return base + (expert - base) * mask
