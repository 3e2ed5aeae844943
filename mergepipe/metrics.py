"""Quality metrics of a merge that cannot cancel across tasks.

A mean loss over tasks hides a merge that helps one task and hurts another. These statistics are
per task and then summarised by the *worst* task:

* **normalised gain** of a merged model on task ``t`` (Ilharco et al., "Editing models with task
  arithmetic", ICLR 2023, normalised accuracy; Yadav et al., TIES-Merging, NeurIPS 2023)::

      NG_t = (q_merge,t − q_base,t) / (q_expert,t − q_base,t)

  with ``q`` a quality where higher is better (accuracy) — for a loss ``L`` the same formula with
  ``q = −L``, i.e. ``(L_base − L_merge) / (L_base − L_expert)``. 1 means the merge does as well as
  the task's expert, 0 as well as the base, negative worse than the base;
* **kept share** of a budgeted merge: ``NG_budget,t / NG_full,t``, the share of the full-budget
  merge's gain on task ``t`` that the budgeted merge keeps (1 = all of it);
* the worst task of either (``min`` over tasks), and means with confidence intervals over seeds
  (Student-t interval of the mean, and a percentile bootstrap).

numpy only; inputs are plain ``{task: float}`` dicts or arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "bootstrap_ci",
    "kept_share",
    "mean_ci_t",
    "normalised_gain",
    "summarise",
    "worst",
]


def normalised_gain(
    merged: Mapping[str, float],
    base: Mapping[str, float],
    expert: Mapping[str, float],
    *,
    higher_is_better: bool = False,
) -> dict[str, float]:
    """Per-task normalised gain ``(q_merge − q_base) / (q_expert − q_base)``.

    Args:
        merged, base, expert: ``{task: value}``; ``expert[t]`` is task ``t``'s own expert's value on
            ``t``. Losses by default (lower is better); accuracies with ``higher_is_better=True``.
            The formula is the same either way (the sign of numerator and denominator flips
            together), so the flag only documents intent and checks the expert improves.

    Returns:
        ``{task: NG}`` for every task in ``merged``.

    Raises:
        KeyError: a task of ``merged`` is missing from ``base`` or ``expert``.
        ValueError: on some task the expert does not improve on the base (the gain is undefined
            or negative), naming the task and the two values.
    """
    out = {}
    for t, m in merged.items():
        b, e = float(base[t]), float(expert[t])
        den = (e - b) if higher_is_better else (b - e)
        if not den > 0:
            raise ValueError(
                f"task {t!r}: the expert ({e:.6g}) does not improve on the base ({b:.6g}); "
                "the normalised gain is undefined"
            )
        num = (float(m) - b) if higher_is_better else (b - float(m))
        out[t] = num / den
    return out


def kept_share(ng_budget: Mapping[str, float], ng_full: Mapping[str, float]) -> dict[str, float]:
    """Per-task share of the full merge's normalised gain a budgeted merge keeps:
    ``NG_budget,t / NG_full,t``.

    Raises:
        ValueError: the full merge has no positive gain on a task (the share is undefined there:
            judge that task by its NG instead), naming the task.
    """
    out = {}
    for t, g in ng_budget.items():
        f = float(ng_full[t])
        if not f > 0:
            raise ValueError(f"task {t!r}: the full merge's normalised gain is {f:.6g} <= 0; a kept share is undefined")
        out[t] = float(g) / f
    return out


def worst(per_task: Mapping[str, float]) -> tuple[str, float]:
    """``(task, value)`` of the smallest value (ties: the first task in sorted order)."""
    if not per_task:
        raise ValueError("no tasks")
    t = min(sorted(per_task), key=lambda k: per_task[k])
    return t, float(per_task[t])


def _t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF, computed via
    the regularised incomplete beta function by continued fraction; exact to ~1e-10)."""

    def betacf(a: float, b: float, x: float) -> float:
        qab, qap, qam = a + b, a + 1.0, a - 1.0
        c, d = 1.0, 1.0 - qab * x / qap
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        h = d
        for m in range(1, 300):
            m2 = 2 * m
            aa = m * (b - m) * x / ((qam + m2) * (a + m2))
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
            c = 1.0 + aa / c if abs(1.0 + aa / c) > 1e-300 else 1e-300
            h *= d * c
            aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
            c = 1.0 + aa / c if abs(1.0 + aa / c) > 1e-300 else 1e-300
            de = d * c
            h *= de
            if abs(de - 1.0) < 1e-15:
                break
        return h

    def ibeta(a: float, b: float, x: float) -> float:
        if x <= 0:
            return 0.0
        if x >= 1:
            return 1.0
        lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
        if x < (a + 1) / (a + b + 2):
            return math.exp(lbt) * betacf(a, b, x) / a
        return 1.0 - math.exp(lbt) * betacf(b, a, 1 - x) / b

    def cdf(t: float) -> float:
        x = df / (df + t * t)
        tail = 0.5 * ibeta(df / 2.0, 0.5, x)
        return 1.0 - tail if t > 0 else tail

    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_ci_t(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t confidence interval of the mean: ``(mean, lo, hi)`` with
    ``mean ± t_{(1+level)/2, n−1} · s / √n`` (``s`` the sample standard deviation, ``ddof=1``).

    One value gives ``(v, nan, nan)`` (no interval from one seed).

    Raises:
        ValueError: no values, or ``level`` outside (0, 1).
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level {level} is outside (0, 1)")
    m = float(x.mean())
    if x.size == 1:
        return m, math.nan, math.nan
    half = _t_quantile((1 + level) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, m - half, m + half


def bootstrap_ci(
    values: Sequence[float], level: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap interval of the mean: ``(mean, lo, hi)``; ``n_boot``
    resamples with replacement (numpy ``default_rng(seed)``), interval = the ``(1 − level)/2``
    and ``(1 + level)/2`` quantiles of the resampled means. With few seeds (3) the bootstrap
    interval is too narrow (it cannot exceed the sample's range); the t interval is the
    conservative one.

    Raises:
        ValueError: no values.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(x.mean()), float(lo), float(hi)


def summarise(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """``{"mean", "t_lo", "t_hi", "boot_lo", "boot_hi", "n"}`` of per-seed values."""
    m, tl, th = mean_ci_t(values, level)
    _, bl, bh = bootstrap_ci(values, level)
    return {"mean": m, "t_lo": tl, "t_hi": th, "boot_lo": bl, "boot_hi": bh, "n": len(values)}
