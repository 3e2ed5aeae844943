"""The comparison logic of the mergekit parity harness (bench/compare_outputs.py, bench/parity.py)
on known cases; no mergekit needed."""

import math

import pytest
import torch

from bench.compare_outputs import tensor_metrics, ulp_distance, ulp_of
from bench.parity import tie_flags


def _next(x: float, dtype, steps: int = 1) -> torch.Tensor:
    """The value ``steps`` representable values above ``x`` in ``dtype`` (x > 0)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    t = torch.tensor([x], dtype=dtype).view(bits)
    return (t + steps).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ulp_distance_known_cases(dtype):
    one = torch.tensor([1.0], dtype=dtype)
    assert int(ulp_distance(one, one)) == 0
    assert int(ulp_distance(one, _next(1.0, dtype))) == 1
    assert int(ulp_distance(_next(1.0, dtype, 3), one)) == 3  # symmetric
    assert int(ulp_distance(torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype))) == 0
    tiny = _next(0.0, dtype)  # smallest positive subnormal
    assert int(ulp_distance(tiny, -tiny)) == 2  # across zero: -tiny, ±0, tiny
    # 1 and 2 are one binade apart: 2**mantissa_bits values in between
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    assert int(ulp_distance(one, torch.tensor([2.0], dtype=dtype))) == 2**mant
    # 1 vs -1: all positive values below 1 twice (0x3F80 for bf16)
    pattern = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00, torch.float32: 0x3F800000}[dtype]
    assert int(ulp_distance(one, -one)) == 2 * pattern
    # a rounding step of the spacing at 1 is 1 ulp at scale 1
    assert float(ulp_of(torch.tensor([1.0], dtype=torch.float64), dtype)) == 2.0**-mant
    assert float(ulp_of(torch.tensor([3.0], dtype=torch.float64), dtype)) == 2.0 ** (1 - mant)


def test_ulp_distance_bf16_matches_float32_rounding_steps():
    x = torch.tensor([0.1, -3.5, 1e-3, 1e30], dtype=torch.float32).to(torch.bfloat16)
    y = _next(0.1, torch.bfloat16, 5)
    assert int(ulp_distance(x[:1], y)) == 5
    with pytest.raises(ValueError):
        ulp_distance(x.float(), x)


def test_tensor_metrics_counts_cosine_and_exclusion():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=g).to(torch.bfloat16)
    x = (base.float() + 0.01 * torch.randn(1000, generator=g)).to(torch.bfloat16)
    yv = x.clone().view(torch.int16)
    yv[:10] += 1  # 10 elements one ulp away (same sign: patterns of nonzero values)
    yv[10] = -yv[10]  # one element far away (negated bit pattern: another value entirely)
    y = yv.view(torch.bfloat16)
    r = tensor_metrics(x, y, base=base)
    assert r["elements"] == 1000 and r["differ"] == 11 and r["over_1ulp"] == 1
    assert r["frac_differ"] == pytest.approx(0.011)
    assert r["max_ulps"] == int(ulp_distance(x[10:11], y[10:11]))
    assert r["max_abs_diff"] == pytest.approx(float((x[10].float() - y[10].float()).abs()))
    xd, yd = x.double().numpy(), y.double().numpy()
    assert r["cosine"] == pytest.approx(float(xd @ yd) / float((xd @ xd) ** 0.5 * (yd @ yd) ** 0.5), abs=1e-12)
    assert r["cosine"] < 1.0
    assert r["tv_cosine"] < r["cosine"]
    ex = torch.zeros(1000, dtype=torch.bool)
    ex[10] = True
    r2 = tensor_metrics(x, y, base=base, exclude=ex)
    assert r2["excluded"] == 1 and r2["excluded_differ"] == 1
    assert r2["max_ulps_outside"] == 1 and r2["over_1ulp_outside"] == 0
    assert r2["max_ulps_at_scale_outside"] <= 1.0
    same = tensor_metrics(x, x.clone(), base=base)
    assert same["differ"] == 0 and same["max_ulps"] == 0 and same["cosine"] == pytest.approx(1.0)
    assert same["tv_cosine"] == pytest.approx(1.0) and same["tv_norm_ratio"] == 1.0


def test_near_zero_output_ulps_at_input_scale():
    """An output that cancels to ~0 is many output ulps away after one input-scale rounding step;
    at the inputs' scale it is one step."""
    base = torch.tensor([1.0], dtype=torch.bfloat16)
    x = torch.tensor([2.0**-20], dtype=torch.bfloat16)
    y = torch.tensor([2.0**-8], dtype=torch.bfloat16)  # ~half a bf16 ulp at 1 (the base's scale)
    r = tensor_metrics(x, y, base=base)
    assert r["max_ulps"] == 12 * 2**7  # twelve binades of 128 values each
    assert r["max_ulps_at_scale"] == pytest.approx(0.5 - 2.0**-13)


def test_tie_flags_marks_only_groups_a_cut_splits():
    # magnitudes with bf16 keys: four of 0.5, three of 0.25, two of 0.125, one of 0
    d = torch.tensor([0.5] * 4 + [-0.25] * 3 + [0.125] * 2 + [0.0])
    # k = 5 largest: the cut falls inside the 0.25 group -> those three are flagged
    f = tie_flags(d, "magnitude", 0.5)
    assert f.tolist() == [False] * 4 + [True] * 3 + [False] * 3
    # k = 4: the cut falls between groups -> nothing is ambiguous
    assert not tie_flags(d, "magnitude", 0.4).any()
    # k = 8 of 10: the cut splits the 0.125 group
    assert tie_flags(d, "magnitude", 0.8).tolist() == [False] * 7 + [True] * 2 + [False]
    # a group of zeros is never flagged (δ = 0 contributes nothing)
    z = torch.tensor([0.5, 0.0, 0.0, 0.0])
    assert not tie_flags(z, "magnitude", 0.5).any()
    # breadcrumbs: keep ascending positions [n_bot, n_bot + target): n = 10, density 0.5 -> target 5,
    # gamma 0.1 -> n_top 1, n_bot 4: cuts at 4 (inside 0.125/0.25? ascending: 0, .125, .125, .25, .25,
    # .25, .5, .5, .5, .5) -> position 3|4 splits the 0.25 group, position 8|9 splits the 0.5 group
    f = tie_flags(d, "outliers", 0.5, gamma=0.1)
    assert f.tolist() == [True] * 7 + [False] * 3
    # float32 magnitudes that round to one bf16 key form one group
    e = torch.tensor([1.0, 1.0 + 2**-12, 1.0 + 2**-11, 2.0])
    assert tie_flags(e, "magnitude", 0.5).tolist() == [True, True, True, False]
    # exact (fp32 TIES): only exactly equal magnitudes are a group; distinct ones never tie
    assert not tie_flags(e, "magnitude", 0.5, exact=True).any()
    x = torch.tensor([3.0, 2.0, -2.0, 2.0, 1.0 + 2**-12, 1.0])
    assert tie_flags(x, "magnitude", 0.5, exact=True).tolist() == [False, True, True, True, False, False]
    assert math.isfinite(float(ulp_of(torch.tensor([0.0], dtype=torch.float64), torch.bfloat16)))
