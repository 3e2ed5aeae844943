"""Multi-objective Bayesian optimisation over the unit cube of a :class:`SearchSpace` (botorch).

Objectives are *minimised* here (losses); botorch maximises, so values are negated at the
boundary. Surrogate: one ``SingleTaskGP`` per objective (a ``ModelListGP``; RBF ARD kernel,
standardised outcomes), fitted by marginal likelihood. Acquisition:
``qLogNoisyExpectedHypervolumeImprovement`` (Daulton et al., 2021, arXiv:2105.08195; the log
form of Ament et al., 2023, arXiv:2310.20708) with ``X_pending`` = the candidates still being
evaluated, so a proposal conditions on fantasised outcomes of the in-flight ones (botorch samples
them jointly with the new point).

Proposals (:func:`propose`):

* **asynchronous, prior-guided** (mergepipe's default, after AP-BMM): the ARD lengthscale prior
  of each dimension is centred at botorch's default (Hvarfner et al., 2024, dimension-scaled
  log-normal) times the multiplier from :mod:`mergepipe.search.prior`, and the fit starts at its
  mode; one candidate is proposed with the pending set, chosen from a *candidate pool* (the local
  optima of the acquisition from several restarts plus quasi-random points) by
  ``score = acq + 0.25·gap − 0.5·proximity``: ``acq`` the min-max-normalised acquisition value,
  ``gap`` the distance of the candidate's predicted objectives (posterior mean, objectives scaled
  to the observed range) to the nearest point of the observed Pareto front or of a pending
  candidate's prediction (halved when the prediction is dominated by the front) — a reward for
  filling gaps along the frontier —, and ``proximity`` = ``max_j exp(−‖x − x_j‖²/(2h²))`` over
  evaluated, failed and pending points (``h = 0.1·√d``), a penalty against re-sampling the same
  place. This is AP-BMM's frontier-coverage reranking in spirit; the weights are ours.
* the **``rank`` prior** (AP-BMM's mapping, :func:`mergepipe.search.prior.rank_lengthscales`):
  the initial lengthscales are 0.5/1/2/5 by relevance quartile, each with a log-normal prior
  (σ = :data:`RANK_SCALE`) whose mode is that value.
* without reranking (``rerank=False``) the proposal is the acquisition's optimum.
* **synchronous batch** (the baseline): ``q`` candidates jointly (sequential greedy) with the
  same acquisition, botorch's default priors, no reranking.

botorch/torch are imported inside the functions (``mergepipe --help`` must not import torch).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

SQRT2 = math.sqrt(2.0)
SQRT3 = math.sqrt(3.0)


def torch_seed(seed: int) -> int:
    """``seed`` as a torch generator seed: torch takes at most 64 bits (it raises on larger
    values), so any non-negative integer is taken modulo 2**64 (unchanged below that)."""
    return seed % 2**64


def sobol(n: int, d: int, seed: int) -> list[list[float]]:
    """``n`` scrambled Sobol points in ``[0, 1]^d`` (the initial design)."""
    import torch
    from torch.quasirandom import SobolEngine

    return SobolEngine(d, scramble=True, seed=torch_seed(seed)).draw(n, dtype=torch.float64).tolist()


def pareto_mask(Y: Sequence[Sequence[float]]) -> list[bool]:
    """Non-dominated points of ``Y`` (``[n][m]`` values, all minimised); duplicates keep the first."""
    out = []
    for i, a in enumerate(Y):
        dom = False
        for j, b in enumerate(Y):
            if j == i:
                continue
            if all(bk <= ak for ak, bk in zip(a, b)) and (any(bk < ak for ak, bk in zip(a, b)) or j < i):
                dom = True
                break
        out.append(not dom)
    return out


def hypervolume(Y: Sequence[Sequence[float]], ref: Sequence[float]) -> float:
    """Hypervolume dominated by ``Y`` (minimised) and bounded by the reference point ``ref``
    (points not better than ``ref`` in every objective add nothing). Exact (botorch's box
    decomposition)."""
    pts = [list(map(float, y)) for y in Y if all(v < r for v, r in zip(y, ref))]
    if not pts:
        return 0.0
    import torch
    from botorch.utils.multi_objective.hypervolume import Hypervolume

    t = -torch.tensor(pts, dtype=torch.float64)
    return float(Hypervolume(-torch.tensor(list(ref), dtype=torch.float64)).compute(t))


def default_ref_point(Y: Sequence[Sequence[float]], margin: float = 0.1) -> list[float]:
    """A reference point from observed values: the worst value of each objective plus ``margin``
    of its observed range (a common heuristic when no threshold is given)."""
    m = len(Y[0])
    out = []
    for k in range(m):
        col = [y[k] for y in Y]
        lo, hi = min(col), max(col)
        out.append(hi + margin * max(hi - lo, 1e-6 * max(1.0, abs(hi))))
    return out


#: log-space σ of the ``rank`` prior's log-normal lengthscale prior (botorch's default is √3).
RANK_SCALE = 0.5


def _kernel(d: int, multipliers: Sequence[float] | None, lengthscales: Sequence[float] | None = None):
    """RBF ARD kernel (None: botorch's default). With ``multipliers`` the lengthscale prior of
    dimension i is botorch's dimension-scaled log-normal (σ = √3) shifted by
    ``log(multipliers[i])``; with ``lengthscales`` (the ``rank`` prior) a log-normal of σ =
    :data:`RANK_SCALE` whose mode is ``lengthscales[i]``. Either way the fit starts at the mode."""
    import torch
    from gpytorch.constraints import GreaterThan
    from gpytorch.kernels import RBFKernel
    from gpytorch.priors import LogNormalPrior

    if lengthscales is not None:
        scale = RANK_SCALE
        loc = torch.tensor([math.log(v) + scale**2 for v in lengthscales], dtype=torch.float64)
    elif multipliers is not None:
        scale = SQRT3
        loc = torch.tensor([SQRT2 + 0.5 * math.log(d) + math.log(m) for m in multipliers], dtype=torch.float64)
    else:
        return None
    prior = LogNormalPrior(loc=loc, scale=torch.full_like(loc, scale))
    k = RBFKernel(ard_num_dims=d, lengthscale_prior=prior, lengthscale_constraint=GreaterThan(2.5e-2, transform=None))
    k = k.to(torch.float64)
    k.lengthscale = torch.exp(loc - scale**2).view(1, d)
    return k


def fit_model(X, Y, multipliers: Sequence[float] | None = None, lengthscales: Sequence[float] | None = None):
    """Fit one GP per objective on ``X`` ``[n, d]`` (unit cube) and ``Y`` ``[n, m]`` (minimised;
    negated inside); ``multipliers``/``lengthscales``: the prior (:func:`_kernel`). Returns a
    botorch ``ModelListGP``."""
    import torch
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import ModelListGP, SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from gpytorch.mlls import ExactMarginalLogLikelihood

    X = torch.as_tensor(X, dtype=torch.float64)
    Yn = -torch.as_tensor(Y, dtype=torch.float64)
    models = []
    for k in range(Yn.shape[1]):
        gp = SingleTaskGP(
            X,
            Yn[:, k : k + 1],
            covar_module=_kernel(X.shape[1], multipliers, lengthscales),
            outcome_transform=Standardize(m=1),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fit_gpytorch_mll(
                    ExactMarginalLogLikelihood(gp.likelihood, gp), optimizer_kwargs={"options": {"maxiter": 75}}
                )
            except Exception:  # noqa: BLE001 - a failed fit keeps the prior's hyperparameters
                pass
        models.append(gp)
    return ModelListGP(*models)


MC_SAMPLES = 32


def _acqf(model, X, ref, X_pending=None):
    import torch
    from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
    from botorch.sampling.normal import SobolQMCNormalSampler

    return qLogNoisyExpectedHypervolumeImprovement(
        model=model,
        ref_point=(-torch.as_tensor(ref, dtype=torch.float64)).tolist(),
        X_baseline=torch.as_tensor(X, dtype=torch.float64),
        X_pending=X_pending,
        prune_baseline=True,
        sampler=SobolQMCNormalSampler(sample_shape=torch.Size([MC_SAMPLES])),
        cache_root=False,
    )


def propose(
    X: Sequence[Sequence[float]],
    Y: Sequence[Sequence[float]],
    ref: Sequence[float],
    *,
    pending: Sequence[Sequence[float]] = (),
    avoid: Sequence[Sequence[float]] = (),
    multipliers: Sequence[float] | None = None,
    lengthscales: Sequence[float] | None = None,
    rerank: bool = True,
    q: int = 1,
    seed: int = 0,
    restarts: int = 4,
    raw_samples: int = 64,
    pool_random: int = 64,
) -> tuple[list[list[float]], dict]:
    """Propose ``q`` new points of ``[0, 1]^d``.

    Args:
        X, Y: evaluated points ``[n][d]`` and their objective values ``[n][m]`` (minimised),
            ``n >= 2``.
        ref: reference point ``[m]`` (minimised; a worse-than-acceptable value per objective).
        pending: points being evaluated (``X_pending``: the acquisition conditions on them).
        avoid: further points to keep away from in the proximity penalty (failed candidates).
        multipliers: lengthscale multipliers of the ``scaled`` prior (None: botorch's default priors).
        lengthscales: initial lengthscales of the ``rank`` prior (overrides ``multipliers``).
        rerank: frontier-coverage reranking of the candidate pool (``q`` must be 1).
        q: batch size (``q > 1``: sequential-greedy joint batch, no reranking).
        seed: seeds torch's generator (any non-negative integer; see :func:`torch_seed`).

    Returns:
        (points ``[q][d]``, info ``{acq, gap, proximity, pool}`` of the choice, for the trace).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: threads only contend with the running evaluations
    try:
        return _propose(
            X, Y, ref, pending, avoid, multipliers, lengthscales, rerank, q, seed, restarts, raw_samples, pool_random
        )
    finally:
        torch.set_num_threads(threads)


def _propose(X, Y, ref, pending, avoid, multipliers, lengthscales, rerank, q, seed, restarts, raw_samples, pool_random):
    import torch
    from botorch.optim import optimize_acqf

    torch.manual_seed(torch_seed(seed))
    Xt = torch.as_tensor(X, dtype=torch.float64)
    d = Xt.shape[1]
    model = fit_model(X, Y, multipliers, lengthscales)
    Xp = torch.as_tensor(pending, dtype=torch.float64).view(-1, d) if len(pending) else None
    acq = _acqf(model, X, ref, Xp)
    bounds = torch.stack([torch.zeros(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64)])
    opts = {"batch_limit": 4, "maxiter": 40}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if q > 1 or not rerank:
            cand, val = optimize_acqf(
                acq, bounds, q=q, num_restarts=restarts, raw_samples=raw_samples, sequential=True, options=opts
            )
            return cand.detach().clamp(0, 1).tolist(), {"acq": float(val.sum()) if val.numel() else None}
        cand, vals = optimize_acqf(
            acq, bounds, q=1, num_restarts=restarts, raw_samples=raw_samples, return_best_only=False, options=opts
        )
        pool = torch.cat([cand.view(-1, d), torch.rand(pool_random, d, dtype=torch.float64)])
        with torch.no_grad():
            a = torch.cat([vals.view(-1), acq(pool[cand.shape[0] :].unsqueeze(1)).view(-1)])
            mean = -model.posterior(pool).mean  # [P, m] minimised
            pend_mean = -model.posterior(Xp).mean if Xp is not None else None
    a = torch.nan_to_num(a, nan=-1e9, neginf=-1e9)
    an = (a - a.min()) / (a.max() - a.min()) if float(a.max() - a.min()) > 0 else torch.zeros_like(a)
    Yt = torch.as_tensor(Y, dtype=torch.float64)
    lo, hi = Yt.min(0).values, Yt.max(0).values
    scale = (hi - lo).clamp_min(1e-9)
    front = Yt[torch.tensor(pareto_mask(Yt.tolist()))]
    fn = (front - lo) / scale
    mn = (mean - lo) / scale
    anchors = fn if pend_mean is None else torch.cat([fn, (pend_mean - lo) / scale])
    gap = torch.cdist(mn, anchors).min(1).values
    dominated = ((fn.unsqueeze(0) <= mn.unsqueeze(1)).all(-1)).any(-1)
    gap = torch.where(dominated, 0.5 * gap, gap)
    gn = gap / gap.max() if float(gap.max()) > 0 else gap
    near = (
        [Xt]
        + ([Xp] if Xp is not None else [])
        + ([torch.as_tensor(avoid, dtype=torch.float64).view(-1, d)] if len(avoid) else [])
    )
    h = 0.1 * math.sqrt(d)
    prox = torch.exp(-(torch.cdist(pool, torch.cat(near)).min(1).values ** 2) / (2 * h * h))
    score = an + 0.25 * gn - 0.5 * prox
    i = int(score.argmax())
    info = {
        "acq": round(float(a[i]), 6),
        "acq_norm": round(float(an[i]), 4),
        "gap": round(float(gn[i]), 4),
        "proximity": round(float(prox[i]), 4),
        "pool": int(pool.shape[0]),
        "from_restart": i < cand.shape[0],
    }
    return [pool[i].clamp(0, 1).tolist()], info
