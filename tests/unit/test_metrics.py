"""The quality statistics' arithmetic (mergepipe.metrics) on small hand-checked inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mergepipe.metrics import bootstrap_ci, kept_share, mean_ci_t, normalised_gain, summarise, worst


def test_normalised_gain_losses_and_accuracies():
    base = {"a": 4.0, "b": 2.0}
    expert = {"a": 3.0, "b": 1.5}
    merged = {"a": 3.5, "b": 2.1}
    ng = normalised_gain(merged, base, expert)
    assert ng == pytest.approx({"a": 0.5, "b": -0.2})  # (4-3.5)/(4-3), (2-2.1)/(2-1.5)
    acc = normalised_gain({"t": 0.8}, {"t": 0.5}, {"t": 0.9}, higher_is_better=True)
    assert acc["t"] == pytest.approx(0.75)  # (0.8-0.5)/(0.9-0.5)
    # the expert itself has NG 1, the base NG 0
    assert normalised_gain(expert, base, expert) == pytest.approx({"a": 1.0, "b": 1.0})
    assert normalised_gain(base, base, expert) == pytest.approx({"a": 0.0, "b": 0.0})


def test_normalised_gain_refuses_an_expert_that_does_not_improve():
    with pytest.raises(ValueError, match="'b'"):
        normalised_gain({"b": 1.0}, {"b": 2.0}, {"b": 2.0})
    with pytest.raises(ValueError, match="does not improve"):
        normalised_gain({"t": 0.6}, {"t": 0.7}, {"t": 0.6}, higher_is_better=True)


def test_kept_share_and_worst_cannot_cancel():
    full = {"a": 0.8, "b": 0.4}
    budget = {"a": 0.9, "b": 0.1}  # mean NG 0.5 vs 0.6 full: a mean would hide task b
    ks = kept_share(budget, full)
    assert ks == pytest.approx({"a": 1.125, "b": 0.25})
    assert worst(ks) == ("b", pytest.approx(0.25))
    assert worst({"x": 1.0, "y": 1.0}) == ("x", 1.0)
    with pytest.raises(ValueError, match="'a'"):
        kept_share({"a": 0.1}, {"a": 0.0})


def test_t_interval_matches_known_quantiles():
    # t_{0.975, 2} = 4.302653, t_{0.975, 9} = 2.262157 (tables)
    m, lo, hi = mean_ci_t([1.0, 2.0, 3.0])
    assert m == 2.0
    assert hi - m == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)
    assert m - lo == pytest.approx(hi - m)
    x = np.arange(10, dtype=float)
    m, lo, hi = mean_ci_t(x)
    assert hi - m == pytest.approx(2.262157 * x.std(ddof=1) / math.sqrt(10), rel=1e-5)
    m, lo, hi = mean_ci_t([5.0])
    assert m == 5.0 and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError):
        mean_ci_t([])


def test_bootstrap_interval_is_inside_the_sample_range_and_seeded():
    v = [0.2, 0.5, 0.9]
    m, lo, hi = bootstrap_ci(v, seed=1)
    assert m == pytest.approx(np.mean(v))
    assert 0.2 <= lo <= m <= hi <= 0.9
    assert bootstrap_ci(v, seed=1) == (m, lo, hi)
    assert bootstrap_ci([3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0)
    s = summarise(v)
    assert s["n"] == 3 and s["t_lo"] < s["boot_lo"] and s["t_hi"] > s["boot_hi"]
