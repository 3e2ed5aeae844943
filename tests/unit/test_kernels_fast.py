"""The engine's fast formulations (magnitude trim as ``hardshrink``, TIES election without boolean
masks, tile-by-tile execution) give the same bits as the masked formulations they replace."""

import numpy as np
import pytest
import torch

from mergepipe.catalog.catalog import Catalog
from mergepipe.methods import kernels
from mergepipe.methods.kernels import ExpertTensorParams, magnitude_key_torch, magnitude_shrink_lambda, sparsify
from mergepipe.methods.registry import get_method
from mergepipe.numerics import magnitude_keys
from mergepipe.pipeline import merge
from testkit.harness import merged_tensors, same_bits


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def test_shrink_lambda_equals_key_threshold_at_every_boundary():
    """For every key m, the floats around the smallest |x| with key >= m (and around λ) are kept by
    hardshrink exactly when their key is >= m."""
    m = np.arange(1, 0x7F81, dtype=np.int64)
    lam_bits = np.array([np.float32(magnitude_shrink_lambda(int(k))).view(np.uint32) for k in m], dtype=np.int64)
    probes = np.concatenate([lam_bits + o for o in (-2, -1, 0, 1, 2)])
    probes = np.clip(probes, 0, 0x7F800000).astype(np.uint32)
    keys = np.tile(m, 5)
    for sign in (1.0, -1.0):
        x = torch.from_numpy(probes.view(np.float32).copy()) * sign
        lam = torch.from_numpy(lam_bits.astype(np.uint32).view(np.float32)).repeat(5)
        kept_shrink = x.abs() > lam  # hardshrink keeps x iff |x| > λ
        kept_key = magnitude_key_torch(x) >= torch.from_numpy(keys).to(torch.int32)
        assert torch.equal(kept_shrink, kept_key)
    assert magnitude_shrink_lambda(0) is None and magnitude_shrink_lambda(0x7F81) is None


@pytest.mark.parametrize("min_key", [1, 0x3C00, 0x3F80, 0x3F81, 0x7F7F, 0x7F80, 0x7F81, 0x8000])
def test_magnitude_sparsify_equals_masked(min_key):
    rng = np.random.default_rng(min_key)
    with np.errstate(over="ignore"):
        x = rng.standard_normal(50_000).astype(np.float32) * np.float32(10.0) ** rng.integers(-40, 39, 50_000).astype(
            np.float32
        )
    x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38, 1.0]
    d = torch.from_numpy(x)
    spec = get_method("ties")
    got = sparsify(d, spec, ExpertTensorParams(weight=1.0, density=0.5, min_key=min_key), 0, (50_000,))
    keep = torch.from_numpy(magnitude_keys(x) >= min_key)  # the canonical key (NaN: 0x7F80, kept)
    want = torch.where(keep, d, torch.zeros(()))
    assert torch.equal(_bits(got), _bits(want))


def _masked_consensus(base, deltas, weights, normalize, lam):
    """The masked formulation (mergekit 0.1.5's GeneralizedTaskArithmeticMerge, consensus sum;
    kept here as the oracle the arithmetic formulation is checked against)."""
    weighted = [d * w for d, w in zip(deltas, weights)]
    total = weighted[0]
    for t in weighted[1:]:
        total = total + t
    majority = torch.where(total >= 0, 1.0, -1.0)
    mixed = div = None
    for t, w in zip(weighted, weights):
        agree = torch.sign(t) == majority
        m = torch.where(agree, t, torch.zeros(()))
        dw = agree.float() * w
        mixed = m if mixed is None else mixed + m
        div = dw if div is None else div + dw
    if normalize:
        div = torch.where(div == 0, torch.ones(()), div)
        mixed = mixed / div
    if lam != 1.0:
        mixed = mixed * lam
    return torch.where(mixed == 0, base, base + mixed)


@pytest.mark.parametrize(
    "weights,normalize,lam",
    [
        ([1.0, 1.0], True, 1.0),
        ([1.0, 1.0, 1.0], True, 1.0),
        ([0.3, 1.7, 1.0, 0.5], True, 1.3),
        ([1.0, -0.5, 2.0], False, 0.7),
        ([1.0], True, 1.0),
        ([1e-8, 1.0], True, 1.0),
        ([1e-45, 1.0], True, 1.0),
        ([1.0, -1.0, 0.5], True, 1.0),
        ([1e-50, 1.0], True, 1.0),
    ],
)
def test_arithmetic_consensus_equals_masked(weights, normalize, lam):
    rng = np.random.default_rng(len(weights))
    n = 200_000
    base = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    base[:1000] = -0.0
    deltas = []
    for i in range(len(weights)):
        d = rng.standard_normal(n).astype(np.float32)
        d[rng.random(n) < 0.5] = 0.0  # pruned entries
        d[:500] = 0.0
        d[500:600] = -0.0
        d[600:700] = [1.0, -1.0][i % 2]  # exact cancellations: Σt = 0 elects +
        deltas.append(torch.from_numpy(d))
    g = {"normalize": normalize, "lambda": lam}
    got = kernels.combine(base, deltas, weights, get_method("ties"), g)
    consumed = kernels.combine(base, [d.clone() for d in deltas], weights, get_method("ties"), g, consume=True)
    want = _masked_consensus(base, deltas, weights, normalize, lam)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(consumed), _bits(want))


def test_consensus_with_non_finite_task_vectors_takes_the_masked_path():
    base = torch.tensor([1.0, 2.0, -0.0, 4.0])
    d0 = torch.tensor([float("nan"), 1.0, 0.0, float("inf")])
    d1 = torch.tensor([-1.0, 2.0, -0.0, float("-inf")])
    got = kernels.combine(base, [d0, d1], [1.0, 1.0], get_method("ties"), {"normalize": True})
    want = _masked_consensus(base, [d0, d1], [1.0, 1.0], True, 1.0)
    assert torch.equal(_bits(got), _bits(want))


TILED = [
    ("ties", ["density=0.5"]),
    ("ties", ["density=0.3", "expert1:weight=0.4", "lambda=1.2"]),
    ("task_arithmetic", ["expert1:weight=-0.5"]),
    ("breadcrumbs_ties", ["density=0.6"]),
    ("dare_ties", ["density=0.5", "rescale=false"]),
    ("linear", []),
]


@pytest.mark.parametrize("method,params", TILED, ids=[m + "-" + "-".join(p) for m, p in TILED])
@pytest.mark.parametrize("budget", [None, "35%"])
def test_tiled_execution_equals_whole_chunk(family, tmp_path, monkeypatch, method, params, budget):
    """Tiles that do not divide rows or blocks, at full and partial budget (partial: experts
    cover only some rows of a chunk), give the bytes of the whole-chunk path."""
    from mergepipe.engine import chunk

    base, experts = family
    ex = [(e.name, str(e)) for e in experts]
    cat = Catalog(tmp_path / "c.sqlite")
    kw = dict(catalog=cat, block_bytes=4096, seed=5, budget=budget)
    monkeypatch.setattr(chunk, "TILE_ELEMS", 1000)
    tiled = merge(str(base), ex, method, str(tmp_path / "tiled"), params, **kw)
    assert any(chunk._elementwise(t, get_method(method)) for t in tiled.plan.tensors if not t.copy_base)
    monkeypatch.setattr(chunk, "_elementwise", lambda tp, spec: False)
    whole = merge(str(base), ex, method, str(tmp_path / "whole"), params, **kw)
    a, b = merged_tensors(tiled.out), merged_tensors(whole.out)
    assert set(a) == set(b)
    assert all(same_bits(a[n], b[n]) for n in a)
    if budget:
        assert tiled.manifest["io"]["realized"]["expert_read_bytes"] < sum(
            f.stat().st_size for e in experts for f in e.glob("*.safetensors")
        )
