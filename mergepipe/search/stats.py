"""Statistics for comparing search strategies over seeds (bench/search.py, docs/SEARCH.md).

* :func:`igd` — inverted generational distance of a front to a reference front (Coello & Reyes
  Sierra, 2004): the mean, over the reference points, of the Euclidean distance to the nearest
  point of the front, in objective space scaled per objective (lower is better; 0 = the front
  covers the reference front). Used with the union of every strategy's fronts as reference, as a
  coverage metric beside hypervolume.
* :func:`bootstrap_ci` — percentile bootstrap interval of a mean (Efron & Tibshirani, 1993).
* :func:`paired_test` — two strategies run with the same seeds: mean difference, its Student t
  interval and percentile bootstrap interval, the standardised effect ``d_z`` (mean / sd of the
  paired differences; Cohen 1988), the two-sided Wilcoxon signed-rank test
  (``scipy.stats.wilcoxon``, exact for small samples without ties) and the paired t test.
* :func:`holm` — Holm's step-down adjustment of a family of p values (Holm, 1979): controls the
  family-wise error rate at ``α`` when every adjusted p is compared with ``α``.
* :func:`time_to_target` — the first time (or evaluation count) at which a hypervolume trace
  reaches a target.

Pure numpy except :func:`paired_test` (scipy, installed with botorch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def igd(
    front: Sequence[Sequence[float]], reference: Sequence[Sequence[float]], scale: Sequence[float] | None = None
) -> float:
    """Inverted generational distance of ``front`` to ``reference`` (both ``[n][m]``, minimised).

    Args:
        front: the approximation (e.g. a strategy's Pareto points).
        reference: the reference front (e.g. the non-dominated points of all strategies).
        scale: per-objective divisor (e.g. the reference front's range); None: unscaled.

    Returns:
        ``mean_r min_f ‖(f − r)/scale‖₂``; ``inf`` when ``front`` is empty.

    Raises:
        ValueError: empty reference, or mismatched numbers of objectives.
    """
    R = np.asarray(reference, dtype=np.float64)
    if R.ndim != 2 or len(R) == 0:
        raise ValueError("igd: the reference front is empty")
    if len(front) == 0:
        return math.inf
    F = np.asarray(front, dtype=np.float64)
    if F.shape[1] != R.shape[1]:
        raise ValueError(f"igd: front has {F.shape[1]} objectives, reference {R.shape[1]}")
    s = np.ones(R.shape[1]) if scale is None else np.maximum(np.asarray(scale, dtype=np.float64), 1e-12)
    d = np.linalg.norm((R[:, None, :] - F[None, :, :]) / s, axis=-1)  # [|R|, |F|]
    return float(d.min(axis=1).mean())


def bootstrap_ci(
    values: Sequence[float], *, n_boot: int = 10000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of ``values`` and its percentile bootstrap interval.

    Args:
        values: one value per seed (``n >= 1``).
        n_boot: bootstrap resamples (with replacement, ``n`` draws each).
        level: interval coverage (0.95: the 2.5th and 97.5th percentiles of the resampled means).
        seed: numpy generator seed (the interval is reproducible).

    Returns:
        ``(mean, low, high)``; with one value, ``(v, v, v)``.

    Raises:
        ValueError: no values.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci: no values")
    if x.size == 1:
        v = float(x[0])
        return v, v, v
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    a = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def paired_test(a: Sequence[float], b: Sequence[float], *, n_boot: int = 10000, seed: int = 0) -> dict:
    """Compare two strategies over the same seeds (``a[i]``, ``b[i]``: seed ``i``).

    Returns:
        ``{n, mean_diff, ci: [low, high] (percentile bootstrap of the mean of a − b), t_ci: [low,
        high] (Student t, n − 1 degrees of freedom), dz (mean / sample sd of a − b; 0 when the sd
        is 0), wins (a > b), losses, ties, p (two-sided Wilcoxon signed-rank; zero differences
        dropped; 1.0 when every difference is 0), t_p (two-sided paired t test; 1.0 when the sd is
        0)}``. With n = 1 the intervals are the point.

    Raises:
        ValueError: different lengths or no pairs.
    """
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"paired_test: need two equally long non-empty samples, got {x.size} and {y.size}")
    d = x - y
    mean, lo, hi = bootstrap_ci(d.tolist(), n_boot=n_boot, seed=seed)
    nz = d[d != 0]
    if nz.size == 0:
        p = 1.0
    else:
        from scipy.stats import wilcoxon

        p = float(wilcoxon(nz, alternative="two-sided").pvalue)
    sd = float(d.std(ddof=1)) if d.size > 1 else 0.0
    if sd > 0:
        from scipy.stats import t as student

        half = float(student.ppf(0.975, d.size - 1)) * sd / math.sqrt(d.size)
        t_ci = [float(d.mean()) - half, float(d.mean()) + half]
        t_p = float(2 * student.sf(abs(float(d.mean()) / (sd / math.sqrt(d.size))), d.size - 1))
    else:
        t_ci, t_p = [float(d.mean())] * 2, 1.0
    return {
        "n": int(d.size),
        "mean_diff": mean,
        "ci": [lo, hi],
        "t_ci": t_ci,
        "dz": float(d.mean()) / sd if sd > 0 else 0.0,
        "t_p": t_p,
        "wins": int((d > 0).sum()),
        "losses": int((d < 0).sum()),
        "ties": int((d == 0).sum()),
        "p": p,
    }


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p values (Holm, 1979), in the input order.

    With ``p_(1) <= ... <= p_(m)`` sorted, ``adj_(i) = max_{j <= i} min(1, (m − j + 1)·p_(j))``;
    rejecting every hypothesis with ``adj <= α`` controls the family-wise error rate at ``α``
    (any dependence between the tests).

    Raises:
        ValueError: a p value outside [0, 1].
    """
    ps = [float(p) for p in pvalues]
    if any(not (0.0 <= p <= 1.0) for p in ps):
        raise ValueError(f"holm: p values must be in [0, 1], got {ps}")
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    out = [0.0] * m
    run = 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (m - rank) * ps[i]))
        out[i] = run
    return out


def time_to_target(trace: Sequence[tuple[float, float]], target: float) -> float | None:
    """First ``t`` of ``trace`` (``(t, hv)`` pairs in increasing ``t``) with ``hv >= target``;
    None when never reached."""
    for t, hv in trace:
        if hv >= target:
            return float(t)
    return None
