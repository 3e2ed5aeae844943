"""Layer-wise merge search over seeds: ablations, baselines, held-out fronts, cost axis (docs/SEARCH.md).

Testbed: the tiny zoo (``mergepipe_zoo``, ``ZooConfig.tiny()``, cached in ``~/.mergepipe/zoo``):
a 2-layer Llama, base + the ``python`` and ``json`` experts. Every candidate is a real merge
(plan → execute → commit) scored by next-token loss on the python and json held-out sets. The
held-out windows (32 per domain) are split in two: the **search windows** (the first 16; the
objectives the optimizer sees) and the **re-evaluation windows** (the other 16; computed with
the same model load but never shown to the optimizer), so each Pareto set chosen on the search
windows is re-scored on windows not used to choose it.

Problem A (quality; items 1-4, 6 of issue 17): ``task_arithmetic``, ``weight`` per expert per
layer (2 blocks × 2 experts = 4 dimensions in [0, 1]; with ``--search-outer`` 8), objectives
loss:python and loss:json (minimised), ``--evaluations`` candidates per run (``--initial`` Sobol),
two workers. Arms:

* ``bo-none-plain``, ``bo-none-rerank``, ``bo-scaled-plain``, ``bo-scaled-rerank``,
  ``bo-rank-rerank``: asynchronous pending-aware qLogNEHVI with the prior off / ``scaled`` /
  ``rank`` (AP-BMM's 0.5/1/2/5) × frontier-coverage reranking off / on;
* ``bo-outer``: ``bo-scaled-rerank`` with the embeddings and ``lm_head`` as coordinates of
  their own (8 dimensions);
* ``sync``: synchronous batches of 2 (joint qLogNEHVI), no prior, no reranking;
* ``random``: uniform points (after the same Sobol design);
* ``grid``: model-level grids (one weight per expert for all layers) of task_arithmetic and ties
  (density 0.5), half of the evaluations each (seed-independent);
* ``model-bo``: 2-D model-level BO, ties with one ``weight`` and one ``density`` shared by both
  experts (``*:weight=0:1 *:density=0.1:1 --layer-blocks 1``);
* ``nsga2``: NSGA-II (optuna's ``NSGAIISampler``, population ``--initial``) over the same
  4 layer-wise dimensions, sequential ask/tell.

Problem B (cost; item 5): the same weights plus a ``budget`` coordinate (the candidate's
expert-I/O budget, 10-100 % of the experts' bytes, 16 KiB blocks), three objectives (both
losses and ``io:expert_read_fraction``), and a candidate-dependent evaluation latency
``fixed + full·(expert bytes read / experts' bytes)`` seconds. Arms ``async`` and ``sync`` (both
without prior and reranking, so only the dispatch differs), compared by hypervolume over wall time.

Statistics (:mod:`mergepipe.search.stats`): per arm the mean over seeds with a 95 % percentile
bootstrap interval; paired comparisons (same seeds) with the bootstrap interval of the mean
difference and a two-sided Wilcoxon signed-rank p; IGD against the union of all arms' fronts;
evaluations (A) or seconds (B) to reach a target hypervolume.

Caching: every evaluation is stored in ``<work>/evals.jsonl`` under a key of (zoo, method,
settings, budget, block size, windows), so a candidate evaluated before is not merged again;
every finished (arm, seed) run keeps its ``results.json`` and is skipped on a rerun with the same
settings. Runs go seed by seed (every arm of seed 0, then seed 1, ...), so a stopped run leaves
whole seeds.

Run (docs/SEARCH.md)::

    PYTHONPATH=. nice -n 10 .venv/bin/python -W ignore bench/search.py --work bench/.work/search

Writes ``<work>/results.json`` (every run), ``<work>/summary.md`` (the tables) and the figures
into ``--figures`` (default ``docs/search``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import threading
import time
from pathlib import Path

from bench.relpath import rel_paths_in

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = ("python", "json")
OBJ = [f"loss:{d}" for d in DOMAINS]
A_ARMS = [
    "bo-none-plain",
    "bo-none-rerank",
    "bo-scaled-plain",
    "bo-scaled-rerank",
    "bo-rank-rerank",
    "bo-outer",
    "sync",
    "random",
    "grid",
    "model-bo",
    "nsga2",
]
B_ARMS = ["async", "sync"]


# ------------------------------------------------------------------------------------------------
# evaluation: search windows + re-evaluation windows in one model load, cached per candidate
# ------------------------------------------------------------------------------------------------
class Evals:
    """Per-candidate cache and evaluator. ``metrics(path)`` returns the search-window losses
    (``loss:<domain>``) and, under ``heldout:loss:<domain>``, the re-evaluation windows' losses
    (recorded, never an objective)."""

    def __init__(self, zoo, work: Path, search_windows: int) -> None:
        from mergepipe.evaluate import causal_lm_windows

        self.zoo, self.path = zoo, work / "evals.jsonl"
        tb = zoo.testbed
        self.batch = tb.batch_size
        win = causal_lm_windows(tb, list(DOMAINS))
        n = min(len(w) for w in win.values())
        if n < 2 * search_windows:
            raise SystemExit(f"the zoo has {n} eval windows per domain; need 2 x {search_windows}")
        self.search = {d: w[:search_windows] for d, w in win.items()}
        self.heldout = {d: w[search_windows : 2 * search_windows] for d, w in win.items()}
        self.tag = f"{zoo.config.key()}:w{search_windows}"
        self.lock = threading.Lock()
        self.cache: dict[str, dict] = {}
        self.pending: dict[str, str] = {}  # snapshot folder -> key of a merge not yet evaluated
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    self.cache[r["key"]] = r
        self.hits = self.misses = 0

    def key(self, method: str, params: dict, budget, block_bytes: int) -> str:
        blob = json.dumps([self.tag, method, params, budget, block_bytes], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def compute(self, model_dir: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        from mergepipe.evaluate import _torch_settings, causal_lm_losses

        def run():
            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
            m.eval()
            a = causal_lm_losses(m, self.search, self.batch)
            b = causal_lm_losses(m, self.heldout, self.batch)
            out = {f"loss:{d}": a[d]["loss"] for d in DOMAINS}
            out.update({f"heldout:loss:{d}": b[d]["loss"] for d in DOMAINS})
            return out

        return _torch_settings(run)

    def metrics(self, path) -> dict:
        s = str(path)
        if s.startswith("cached:"):
            with self.lock:
                return dict(self.cache[s[7:]]["metrics"])
        with self.lock:
            key = self.pending.pop(s)
        m = self.compute(Path(s))
        with self.lock:
            rec = self.cache[key] | {"metrics": m}
            self.cache[key] = rec
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        shutil.rmtree(s, ignore_errors=True)  # keep the disk small: the metrics are what is kept
        return m

    def merger(self):
        from mergepipe.search.runner import LocalMerger, Merged

        ev = self

        class CachingMerger(LocalMerger):
            def merge(self, cfg, cand, out, lineage, catalog):
                key = ev.key(cfg.method, cand["params"], cand["params"].get("budget", cfg.budget), cfg.block_bytes)
                with ev.lock:
                    hit = ev.cache.get(key)
                    if hit and "metrics" in hit:
                        ev.hits += 1
                        return Merged("cached:" + key, hit["manifest_hash"], hit["expert_read_bytes"])
                    ev.misses += 1
                m = super().merge(cfg, cand, out, lineage, catalog)
                with ev.lock:
                    ev.cache[key] = {
                        "key": key,
                        "manifest_hash": m.manifest_hash,
                        "expert_read_bytes": m.expert_read_bytes,
                    }
                    ev.pending[str(m.snapshot)] = key
                return m

        return CachingMerger()


def grid_points(n: int) -> list[list[float]]:
    """``n`` points of a rectangular grid on [0, 1]^2 (model-level: two weights)."""
    a = max(2, int(n**0.5))
    b = -(-n // a)
    return [[(i + 1) / a, (j + 1) / b] for i in range(a) for j in range(b)][:n]


# ------------------------------------------------------------------------------------------------
# one run of one arm
# ------------------------------------------------------------------------------------------------
def _summarise(res: dict, state: dict) -> dict:
    """What the report needs from a runner result (+ held-out values of every done candidate)."""
    done = sorted((c for c in state["candidates"] if c["status"] == "done"), key=lambda c: c["times"]["ended"])
    return {
        "points": [c["objectives"] for c in done],
        "heldout": [[c["metrics"][f"heldout:{o}"] for o in OBJ] for c in done]
        if done and f"heldout:{OBJ[0]}" in done[0]["metrics"]
        else [],
        "io": [c["metrics"].get("io:expert_read_fraction") for c in done],
        "hv": [[h["evaluations"], h["t"], h["hv"]] for h in res["hypervolume"]],
        "wall_s": res["wall_s"],
        "failed": res["failed"],
        "idle": {w: v["idle_fraction"] for w, v in res["workers"].items()},
        "proposer_s": res.get("proposer_s", 0.0),
        "prior": state.get("prior"),
        "trace": res["trace"],
    }


def run_arm(problem: str, arm: str, seed: int, ctx: dict) -> dict:
    """Run (or load) one (problem, arm, seed); returns the :func:`_summarise` dict."""
    from mergepipe.search.optimizer import hypervolume
    from mergepipe.search.runner import SearchConfig, run_search

    a = ctx["args"]
    d = ctx["work"] / problem / arm / f"s{seed}"
    spec = {"problem": problem, "arm": arm, "seed": seed, "E": ctx["E"][problem], "I": ctx["I"][problem]}
    if problem == "B":
        spec["latency"] = a.latency
    done_file = d / "run.json"
    if done_file.exists():
        old = json.loads(done_file.read_text())
        if old.get("spec") == spec:
            return old["run"]
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    ev: Evals = ctx["evals"]
    zoo = ctx["zoo"]
    E, init = ctx["E"][problem], ctx["I"][problem]
    common = dict(
        base=str(zoo.base),
        experts=[[n, str(zoo.experts[n])] for n in DOMAINS],
        objectives=list(OBJ),
        evaluations=E,
        initial=init,
        workers=2,
        seed=seed,
        catalog=str(ctx["work"] / "catalog.sqlite"),
        method="task_arithmetic",
        vary=["weight=0:1"],
        layer_blocks=2,
        ref_point=ctx["ref"][problem],
        prior=False,
        rerank=False,
    )
    cev = _CachedEvaluator(ev)
    t0 = time.time()
    if problem == "B":
        cfg = SearchConfig(
            **{
                **common,
                "objectives": OBJ + ["io:expert_read_fraction"],
                "vary": ["weight=0:1", "budget=0.1:1"],
                "block_bytes": 16 * 1024,
                "latency": list(a.latency),
            },
            strategy="async" if arm == "async" else "sync",
        )
        out = _summarise(run_search(d / "run", cfg, cev, merger=ev.merger()), _state(d / "run"))
    elif arm == "grid":
        parts = []
        half = E // 2
        for method, fixed, n in (
            ("task_arithmetic", {}, half),
            ("ties", {"parameters": {"density": 0.5}}, E - half),
        ):
            cfg = SearchConfig(
                **{**common, "evaluations": n, "initial": n, "method": method, "layer_blocks": 1, "seed": 0},
                fixed=fixed,
                design=grid_points(n),
                strategy="random",
            )
            r = run_search(d / method, cfg, cev, merger=ev.merger())
            parts.append(_summarise(r, _state(d / method)))
        out = _concat(parts, ctx["ref"][problem])
    elif arm == "nsga2":
        out = _nsga2(seed, ctx)
    else:
        kw: dict = {}
        if arm.startswith("bo-"):
            kind = arm.split("-")[1]
            kw = dict(strategy="async")
            if arm == "bo-outer":
                kw.update(prior=True, prior_kind="scaled", rerank=True, outer=True)
            else:
                kw.update(prior=kind != "none", prior_kind="scaled" if kind == "none" else kind)
                kw["rerank"] = arm.endswith("rerank")
            if kw["prior"]:
                kw["probe"] = ctx["probe"]
        elif arm == "sync":
            kw = dict(strategy="sync")
        elif arm == "random":
            kw = dict(strategy="random")
        elif arm == "model-bo":
            kw = dict(
                strategy="async",
                method="ties",
                vary=["*:weight=0:1", "*:density=0.1:1"],
                layer_blocks=1,
            )
        else:
            raise SystemExit(f"unknown arm {arm}")
        cfg = SearchConfig(**{**common, **kw})
        out = _summarise(run_search(d / "run", cfg, cev, merger=ev.merger()), _state(d / "run"))
    out["run_s"] = round(time.time() - t0, 2)
    out["load"] = os.getloadavg()
    for sub in ("run", "task_arithmetic", "ties"):
        shutil.rmtree(d / sub / "snapshots", ignore_errors=True)
    done_file.write_text(json.dumps({"spec": spec, "run": out}))
    del hypervolume
    return out


class _CachedEvaluator:
    """A runner evaluator over :class:`Evals` (in-process)."""

    timeout = None
    in_process = True

    def __init__(self, ev: Evals) -> None:
        self.ev = ev

    def metrics(self, checkpoint):
        return self.ev.metrics(checkpoint)

    def known_metrics(self):
        return list(OBJ) + [f"heldout:{o}" for o in OBJ]

    def spec(self):
        return None


def _state(d: Path) -> dict:
    return json.loads((d / "state.json").read_text())


def _concat(parts: list[dict], ref) -> dict:
    """The grid's two halves (run one after the other) as one run."""
    from mergepipe.search.optimizer import hypervolume

    pts, held, shift, times = [], [], 0.0, []
    for p in parts:
        pts += p["points"]
        held += p["heldout"]
        times += [h[1] + shift for h in p["hv"]]
        shift += p["wall_s"]
    hv = [[k, times[k - 1], hypervolume(pts[:k], ref)] for k in range(1, len(pts) + 1)]
    return {"points": pts, "heldout": held, "io": [], "hv": hv, "wall_s": shift, "failed": 0, "idle": {}, "trace": []}


def _nsga2(seed: int, ctx: dict) -> dict:
    """NSGA-II (optuna's NSGAIISampler) over the 4 layer-wise weights, sequential ask/tell."""
    import optuna

    from mergepipe.catalog.objectstore import open_catalog
    from mergepipe.search.optimizer import hypervolume
    from mergepipe.search.runner import SearchConfig
    from mergepipe.search.space import parse_vary, space_for_base

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    zoo, ev = ctx["zoo"], ctx["evals"]
    E, init = ctx["E"]["A"], ctx["I"]["A"]
    cfg = SearchConfig(
        base=str(zoo.base),
        experts=[[n, str(zoo.experts[n])] for n in DOMAINS],
        method="task_arithmetic",
        vary=["weight=0:1"],
        objectives=list(OBJ),
        evaluations=E,
        initial=init,
        layer_blocks=2,
        seed=seed,
        catalog=str(ctx["work"] / "catalog.sqlite"),
    )
    from safetensors import safe_open

    names = []
    for f in sorted(zoo.base.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    space = space_for_base(names, cfg.method, list(DOMAINS), parse_vary(cfg.vary), 2)
    cat = open_catalog(cfg.catalog)
    merger = ev.merger()
    study = optuna.create_study(
        directions=["minimize", "minimize"],
        sampler=optuna.samplers.NSGAIISampler(population_size=init, seed=seed),
    )
    pts, held, hv, t0 = [], [], [], time.time()
    out = ctx["work"] / "A" / "nsga2" / f"s{seed}"
    for i in range(E):
        trial = study.ask()
        x = [trial.suggest_float(f"x{j}", 0.0, 1.0) for j in range(space.d)]
        m = merger.merge(cfg, {"id": i, "params": space.to_params(x)}, out, {}, cat)
        r = ev.metrics(m.snapshot if m.snapshot.startswith("cached:") else Path(m.snapshot))
        y = [r[o] for o in OBJ]
        study.tell(trial, y)
        pts.append(y)
        held.append([r[f"heldout:{o}"] for o in OBJ])
        hv.append([i + 1, round(time.time() - t0, 3), hypervolume(pts, ctx["ref"]["A"])])
    return {
        "points": pts,
        "heldout": held,
        "io": [],
        "hv": hv,
        "wall_s": time.time() - t0,
        "failed": 0,
        "idle": {},
        "trace": [],
    }


def probe_texts() -> list[str]:
    """Probe text for the activation prior, from outside the zoo's data: this repository's
    Python source and a small JSON document (the zoo's domains include python and json)."""
    py = (ROOT / "mergepipe" / "search" / "runner.py").read_text()[:6000]
    js = json.dumps(
        {
            "experts": [
                {"name": n, "weight": w, "id": i}
                for i, (n, w) in enumerate([("py", 0.1), ("json", 0.5), ("prose", 0.9)])
            ]
        }
    )
    return [py, js * 8]


# ------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / ".work" / "search")
    ap.add_argument("--figures", type=Path, default=ROOT / "docs" / "search")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--evaluations", type=int, default=12, help="problem A: candidates per run")
    ap.add_argument("--initial", type=int, default=5, help="problem A: Sobol design points (NSGA-II population)")
    ap.add_argument("--cost-evaluations", type=int, default=10, help="problem B: candidates per run")
    ap.add_argument("--cost-initial", type=int, default=4)
    ap.add_argument("--latency", type=float, nargs=2, default=[0.5, 6.0], metavar=("FIXED_S", "FULL_S"))
    ap.add_argument("--search-windows", type=int, default=16, help="windows per domain the search sees")
    ap.add_argument("--arms", default=",".join(A_ARMS))
    ap.add_argument("--cost-arms", default=",".join(B_ARMS))
    ap.add_argument("--report-only", action="store_true", help="tables and figures from <work>/results.json")
    ap.add_argument(
        "--partial",
        action="store_true",
        help="tables and figures from the finished runs of a run still going (whole seeds only)",
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        report(json.loads((args.work / "results.json").read_text()), args.work, args.figures)
        return
    if args.partial:
        partial(args)
        return

    from mergepipe_zoo import ZooConfig, build_zoo
    from mergepipe_zoo.zoo import ZOO_FORMAT

    t_start = time.time()
    load0 = os.getloadavg()
    zcfg = ZooConfig.tiny()
    zoo = build_zoo(config=zcfg, log=print)
    ev = Evals(zoo, args.work, args.search_windows)
    ref_metrics = {"base": ev.compute(zoo.base)} | {n: ev.compute(zoo.experts[n]) for n in DOMAINS}
    worse = [max(ref_metrics[n][o] for n in DOMAINS) for o in OBJ]
    ctx = {
        "args": args,
        "work": args.work,
        "zoo": zoo,
        "evals": ev,
        "probe": probe_texts(),
        "E": {"A": args.evaluations, "B": args.cost_evaluations},
        "I": {"A": args.initial, "B": args.cost_initial},
        "ref": {"A": worse, "B": worse + [1.1]},
    }
    runs: dict = {"A": {}, "B": {}}
    a_arms = [x for x in args.arms.split(",") if x]
    b_arms = [x for x in args.cost_arms.split(",") if x]
    for seed in range(args.seeds):  # seed by seed: a stopped run leaves whole seeds of every arm
        for arm in a_arms:
            if arm == "grid" and seed > 0:  # seed-independent
                runs["A"][arm].append(runs["A"][arm][0])
                continue
            r = run_arm("A", arm, seed, ctx)
            runs["A"].setdefault(arm, []).append(r)
            print(
                f"A {arm} s{seed}: hv {r['hv'][-1][2]:.4f} in {r['run_s']:.0f} s (load {r['load'][0]:.1f})", flush=True
            )
        for arm in b_arms:
            r = run_arm("B", arm, seed, ctx)
            runs["B"].setdefault(arm, []).append(r)
            print(f"B {arm} s{seed}: hv {r['hv'][-1][2]:.4f} wall {r['wall_s']:.0f} s", flush=True)
    import botorch
    import torch

    res = {
        "command": "PYTHONPATH=. nice -n 10 .venv/bin/python -W ignore bench/search.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("report_only",) and not isinstance(v, bool)
        ),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "botorch": botorch.__version__,
            "load_start": load0,
            "load_end": os.getloadavg(),
        },
        "zoo": {"key": zcfg.key(), "format": ZOO_FORMAT, "seed": zcfg.seed, "config": "ZooConfig.tiny()"},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "reference": {"metrics": ref_metrics, "ref_point": ctx["ref"]},
        "cache": {"hits": ev.hits, "misses": ev.misses},
        "total_s": round(time.time() - t_start, 1),
        "runs": runs,
    }
    res = rel_paths_in(res)
    (args.work / "results.json").write_text(json.dumps(res))
    report(res, args.work, args.figures)


def partial(args) -> None:
    """Report the seeds whose every arm has finished (reads ``run.json`` files; recomputes the
    reference losses, three evaluations)."""
    from mergepipe_zoo import ZooConfig, build_zoo
    from mergepipe_zoo.zoo import ZOO_FORMAT

    zcfg = ZooConfig.tiny()
    zoo = build_zoo(config=zcfg)
    ev = Evals(zoo, Path("/nonexistent"), args.search_windows)
    ref_metrics = {"base": ev.compute(zoo.base)} | {n: ev.compute(zoo.experts[n]) for n in DOMAINS}
    worse = [max(ref_metrics[n][o] for n in DOMAINS) for o in OBJ]
    runs: dict = {"A": {}, "B": {}}
    arms = {"A": [x for x in args.arms.split(",") if x], "B": [x for x in args.cost_arms.split(",") if x]}
    for seed in range(args.seeds):
        got = {}
        for prob, names in arms.items():
            for arm in names:
                f = args.work / prob / arm / f"s{0 if arm == 'grid' else seed}" / "run.json"
                if not f.exists():
                    break
                got[(prob, arm)] = json.loads(f.read_text())["run"]
        if len(got) < sum(len(v) for v in arms.values()):
            break
        for (prob, arm), r in got.items():
            runs[prob].setdefault(arm, []).append(r)
    res = {
        "machine": {"load_start": None, "load_end": os.getloadavg()},
        "zoo": {"key": zcfg.key(), "format": ZOO_FORMAT, "seed": zcfg.seed},
        "reference": {"metrics": ref_metrics, "ref_point": {"A": worse, "B": worse + [1.1]}},
        "cache": {"hits": None, "misses": None},
        "total_s": 0.0,
        "runs": runs,
    }
    report(res, args.work, args.figures)


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _hv_at(run: dict, k: int) -> float:
    v = 0.0
    for e, _, h in run["hv"]:
        if e <= k:
            v = h
    return v


def _hv_at_time(run: dict, t: float) -> float:
    v = 0.0
    for _, tt, h in run["hv"]:
        if tt <= t:
            v = max(v, h)
    return v


def _front(pts):
    from mergepipe.search.optimizer import pareto_mask

    return [p for p, m in zip(pts, pareto_mask(pts)) if m] if pts else []


def _med(tt: dict, nd: int) -> str:
    return "—" if tt["median"] is None else f"{tt['median']:.{nd}f}"


def _fmt(m, lo, hi, nd=4):
    return f"{m:.{nd}f} [{lo:.{nd}f}, {hi:.{nd}f}]"


def normalise(res: dict) -> None:
    """Hypervolumes as fractions of the box between the reference point and the ideal point
    (each expert's loss on its own domain; 0 expert bytes), in place, once."""
    if res.get("hv_normalised"):
        return
    rm = res["reference"]["metrics"]
    refA = res["reference"]["ref_point"]["A"]
    ideal = [rm[d][f"loss:{d}"] for d in DOMAINS]
    box = (refA[0] - ideal[0]) * (refA[1] - ideal[1])
    res["reference"]["box"] = {"A": box, "B": box * res["reference"]["ref_point"]["B"][2]}
    for prob in ("A", "B"):
        for runs in res["runs"][prob].values():
            seen = set()
            for r in runs:
                if id(r) in seen:  # the grid's one run is listed once per seed
                    continue
                seen.add(id(r))
                r["hv"] = [[e, t, h / res["reference"]["box"][prob]] for e, t, h in r["hv"]]
    res["hv_normalised"] = True


def analyse(res: dict) -> dict:
    """Per-arm statistics and paired comparisons (the numbers docs/SEARCH.md quotes)."""
    from mergepipe.search.optimizer import hypervolume, pareto_mask
    from mergepipe.search.stats import bootstrap_ci, igd, paired_test, time_to_target

    normalise(res)

    out: dict = {"A": {}, "B": {}, "pairs": {}, "pairs_b": {}}
    A = res["runs"]["A"]
    refA = res["reference"]["ref_point"]["A"]
    rm = res["reference"]["metrics"]
    held_ref = [max(rm[n][f"heldout:{o}"] for n in DOMAINS) for o in OBJ]
    held_ideal = [rm[d][f"heldout:loss:{d}"] for d in DOMAINS]
    held_box = (held_ref[0] - held_ideal[0]) * (held_ref[1] - held_ideal[1])
    union = _front([p for runs in A.values() for r in runs for p in r["points"]])
    lo = [min(p[k] for p in union) for k in range(2)]
    hi = [max(p[k] for p in union) for k in range(2)]
    scale = [max(h - lw, 1e-9) for lw, h in zip(lo, hi)]
    target = statistics.mean(r["hv"][-1][2] for r in A["grid"]) if "grid" in A else None
    per: dict = {}
    for arm, runs in A.items():
        fin = [r["hv"][-1][2] for r in runs]
        held = []
        for r in runs:
            mask = pareto_mask(r["points"])
            held.append(hypervolume([h for h, m in zip(r["heldout"], mask) if m], held_ref) / held_box)
        ig = [igd(_front(r["points"]), union, scale) for r in runs]
        tt = [time_to_target([(e, h) for e, _, h in r["hv"]], target) if target else None for r in runs]
        per[arm] = {"final": fin, "heldout": held, "igd": ig}
        E = max(r["hv"][-1][0] for r in runs)
        mid = [_hv_at(r, E // 2) for r in runs]
        reached = [t for t in tt if t is not None]
        out["A"][arm] = {
            "n": len(runs),
            "hv_mid": bootstrap_ci(mid),
            "hv": bootstrap_ci(fin),
            "heldout_hv": bootstrap_ci(held),
            "igd": bootstrap_ci(ig),
            "to_target": {"reached": len(reached), "median": statistics.median(reached) if reached else None},
            "pareto": statistics.mean(len(_front(r["points"])) for r in runs),
            "run_s": statistics.mean(r.get("run_s", r["wall_s"]) for r in runs),
            "failed": sum(r["failed"] for r in runs),
            "E": E,
        }
    out["meta"] = {"target": target, "held_ref": held_ref, "union_size": len(union)}
    pairs = [
        ("bo-scaled-plain", "bo-none-plain", "prior (scaled), reranking off"),
        ("bo-scaled-rerank", "bo-none-rerank", "prior (scaled), reranking on"),
        ("bo-rank-rerank", "bo-none-rerank", "prior (rank), reranking on"),
        ("bo-rank-rerank", "bo-scaled-rerank", "rank vs scaled prior, reranking on"),
        ("bo-none-rerank", "bo-none-plain", "reranking, no prior"),
        ("bo-scaled-rerank", "bo-scaled-plain", "reranking, scaled prior"),
        ("bo-outer", "bo-scaled-rerank", "lm_head/embeddings coordinates"),
        ("bo-none-plain", "sync", "async vs sync, equal evaluations"),
        ("bo-none-plain", "random", "layer-wise BO vs random"),
        ("bo-none-plain", "grid", "layer-wise BO vs model-level grid"),
        ("bo-none-plain", "model-bo", "layer-wise BO vs 2-D model-level BO"),
        ("bo-none-plain", "nsga2", "layer-wise BO vs NSGA-II"),
        ("bo-scaled-rerank", "bo-none-plain", "today's default vs plain BO"),
    ]
    for a, b, what in pairs:
        if a in per and b in per:
            n = min(len(per[a]["final"]), len(per[b]["final"]))
            out["pairs"][f"{a} − {b}"] = {
                "what": what,
                "hv": paired_test(per[a]["final"][:n], per[b]["final"][:n]),
                "heldout_hv": paired_test(per[a]["heldout"][:n], per[b]["heldout"][:n]),
                "igd": paired_test(per[a]["igd"][:n], per[b]["igd"][:n]),
            }
    B = res["runs"]["B"]
    if B:
        refB = res["reference"]["ref_point"]["B"]
        walls = [r["wall_s"] for runs in B.values() for r in runs]
        grid_t = [round(x, 1) for x in (min(walls) * f for f in (0.25, 0.5, 0.75, 1.0))]
        finals = [r["hv"][-1][2] for runs in B.values() for r in runs]
        tgt = 0.9 * statistics.mean(finals)
        out["meta"]["B_times"] = grid_t
        out["meta"]["B_target"] = tgt
        perB = {}
        for arm, runs in B.items():
            at = {t: [_hv_at_time(r, t) for r in runs] for t in grid_t}
            ttt = [time_to_target([(tt, h) for _, tt, h in r["hv"]], tgt) for r in runs]
            reached = [t for t in ttt if t is not None]
            perB[arm] = at
            out["B"][arm] = {
                "n": len(runs),
                "hv": bootstrap_ci([r["hv"][-1][2] for r in runs]),
                "at": {str(t): bootstrap_ci(v) for t, v in at.items()},
                "wall": bootstrap_ci([r["wall_s"] for r in runs]),
                "to_target": {"reached": len(reached), "median": statistics.median(reached) if reached else None},
                "idle": bootstrap_ci([statistics.mean(r["idle"].values()) for r in runs]),
                "pareto": statistics.mean(len(_front(r["points"])) for r in runs),
            }
        if "async" in perB and "sync" in perB:
            for t in grid_t:
                out["pairs_b"][str(t)] = paired_test(perB["async"][t], perB["sync"][t])
            out["pairs_b"]["final"] = paired_test(
                [r["hv"][-1][2] for r in B["async"]], [r["hv"][-1][2] for r in B["sync"]]
            )
        del refB
    del refA
    return out


def report(res: dict, work: Path, figures: Path) -> None:
    """summary.md (tables), analysis.json and the figures."""
    an = analyse(res)
    (work / "analysis.json").write_text(json.dumps(an, indent=1))
    L = []
    m = res["reference"]["metrics"]
    L.append(
        f"Zoo {res['zoo']['key']} (format {res['zoo']['format']}, seed {res['zoo']['seed']}). Search windows: "
        f"base {m['base']['loss:python']:.4f}/{m['base']['loss:json']:.4f}, python expert "
        f"{m['python']['loss:python']:.4f}/{m['python']['loss:json']:.4f}, json expert "
        f"{m['json']['loss:python']:.4f}/{m['json']['loss:json']:.4f}; reference point A {res['reference']['ref_point']['A']}; "
        f"held-out reference {an['meta']['held_ref']}. Total {res['total_s']:.0f} s; cache hits {res['cache']['hits']}, "
        f"merges {res['cache']['misses']}; load {res['machine']['load_start']} -> {res['machine']['load_end']}."
    )
    L.append("")
    E = max(v["E"] for v in an["A"].values())
    L.append(
        f"| arm | seeds | HV @ {E // 2} evals | HV @ {E} evals | held-out HV of the Pareto set | IGD to union front | evals to grid's HV (reached) | Pareto pts | s/run |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for arm, v in an["A"].items():
        tt = v["to_target"]
        L.append(
            f"| {arm} | {v['n']} | {_fmt(*v['hv_mid'])} | {_fmt(*v['hv'])} | {_fmt(*v['heldout_hv'])} | {_fmt(*v['igd'], nd=3)} | "
            f"{_med(tt, 0)} ({tt['reached']}/{v['n']}) | {v['pareto']:.1f} | {v['run_s']:.0f} |"
        )
    L.append("")
    L.append(
        "| comparison (A − B, same seeds) | what | ΔHV [95% CI] | W/L | p | Δ held-out HV [95% CI] | p | ΔIGD [95% CI] | p |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for k, v in an["pairs"].items():
        h, o, g = v["hv"], v["heldout_hv"], v["igd"]
        L.append(
            f"| {k} | {v['what']} | {h['mean_diff']:+.4f} [{h['ci'][0]:+.4f}, {h['ci'][1]:+.4f}] | {h['wins']}/{h['losses']} | {h['p']:.3f} | "
            f"{o['mean_diff']:+.4f} [{o['ci'][0]:+.4f}, {o['ci'][1]:+.4f}] | {o['p']:.3f} | "
            f"{g['mean_diff']:+.3f} [{g['ci'][0]:+.3f}, {g['ci'][1]:+.3f}] | {g['p']:.3f} |"
        )
    if an["B"]:
        ts = an["meta"]["B_times"]
        L.append("")
        L.append(
            "| cost problem arm | seeds | "
            + " | ".join(f"HV @ {t} s" for t in ts)
            + " | HV final | wall s | s to 90% of mean final HV (reached) | idle fraction | Pareto pts |"
        )
        L.append("|---|---|" + "---|" * (len(ts) + 5))
        for arm, v in an["B"].items():
            tt = v["to_target"]
            L.append(
                f"| {arm} | {v['n']} | "
                + " | ".join(_fmt(*v["at"][str(t)]) for t in ts)
                + f" | {_fmt(*v['hv'])} | {_fmt(*v['wall'], nd=1)} | {_med(tt, 1)} ({tt['reached']}/{v['n']}) | "
                f"{_fmt(*v['idle'], nd=2)} | {v['pareto']:.1f} |"
            )
        L.append("")
        L.append("| async − sync at | ΔHV [95% CI] | W/L | p |")
        L.append("|---|---|---|---|")
        for t, h in an["pairs_b"].items():
            L.append(
                f"| {t} s | {h['mean_diff']:+.4f} [{h['ci'][0]:+.4f}, {h['ci'][1]:+.4f}] | {h['wins']}/{h['losses']} | {h['p']:.3f} |"
            )
    text = "\n".join(L) + "\n"
    (work / "summary.md").write_text(text)
    print(text)
    plots(res, an, figures)


def plots(res: dict, an: dict, figures: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mergepipe.search.stats import bootstrap_ci

    figures.mkdir(parents=True, exist_ok=True)
    A = res["runs"]["A"]
    cmap = plt.get_cmap("tab20")
    colors = {a: cmap(i % 20) for i, a in enumerate(A)}
    fig, ax = plt.subplots(1, 3, figsize=(17, 5))
    for arm, runs in A.items():
        E = max(r["hv"][-1][0] for r in runs)
        ks = list(range(1, E + 1))
        ci = [bootstrap_ci([_hv_at(r, k) for r in runs], n_boot=2000) for k in ks]
        ax[0].plot(ks, [c[0] for c in ci], color=colors[arm], label=arm)
        ax[0].fill_between(ks, [c[1] for c in ci], [c[2] for c in ci], color=colors[arm], alpha=0.12)
    ax[0].set_xlabel("evaluations")
    ax[0].set_ylabel("hypervolume (search windows)")
    ax[0].set_title("problem A: mean hypervolume, 95% bootstrap band")
    ax[0].legend(fontsize=7)
    names = list(an["A"])
    for i, arm in enumerate(names):
        v = an["A"][arm]
        fin = [r["hv"][-1][2] for r in A[arm]]
        held_m, held_lo, held_hi = v["heldout_hv"]
        ax[1].scatter([i - 0.12] * len(fin), fin, s=9, color=colors[arm], alpha=0.5)
        m, lo, hi = v["hv"]
        ax[1].errorbar([i - 0.12], [m], yerr=[[m - lo], [hi - m]], fmt="o", color=colors[arm], capsize=3)
        ax[1].errorbar(
            [i + 0.12], [held_m], yerr=[[held_m - held_lo], [held_hi - held_m]], fmt="s", color="k", capsize=3, ms=4
        )
    ax[1].set_xticks(range(len(names)), names, rotation=55, ha="right", fontsize=8)
    ax[1].set_ylabel("hypervolume")
    ax[1].set_title("final HV per seed (dots), mean + 95% CI; black: held-out HV of the Pareto set")
    for arm in ("bo-none-plain", "bo-scaled-rerank", "grid", "model-bo", "nsga2", "random"):
        if arm in A:
            fr = sorted(_front(A[arm][0]["points"]))
            ax[2].step([p[0] for p in fr], [p[1] for p in fr], where="post", color=colors[arm], label=arm)
    m = res["reference"]["metrics"]
    for n, mk in (("base", "o"), ("python", "^"), ("json", "s")):
        ax[2].scatter([m[n]["loss:python"]], [m[n]["loss:json"]], marker=mk, color="k", label=f"{n}")
    ax[2].set_xlabel("loss python (nats/token)")
    ax[2].set_ylabel("loss json (nats/token)")
    ax[2].set_title("Pareto fronts, seed 0 (search windows)")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figures / "quality.png", dpi=100)
    plt.close(fig)

    B = res["runs"]["B"]
    if B:
        fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
        tmax = max(r["wall_s"] for runs in B.values() for r in runs)
        ts = [tmax * i / 60 for i in range(61)]
        for i, (arm, runs) in enumerate(B.items()):
            ci = [bootstrap_ci([_hv_at_time(r, t) for r in runs], n_boot=2000) for t in ts]
            ax[0].plot(ts, [c[0] for c in ci], color=f"C{i}", label=arm)
            ax[0].fill_between(ts, [c[1] for c in ci], [c[2] for c in ci], color=f"C{i}", alpha=0.15)
        ax[0].set_xlabel("wall time (s)")
        ax[0].set_ylabel("hypervolume (losses × expert-read fraction)")
        ax[0].set_title("problem B: candidate-dependent latency; mean, 95% band")
        ax[0].legend()
        kc = {"merge": "C1", "eval": "C2", "propose": "C3", "wait": "C7", "barrier": "C0"}
        for j, arm in enumerate(("async", "sync")):
            if arm not in B:
                continue
            for e in B[arm][0]["trace"]:
                ax[1].barh(e["worker"] + 3.2 * j, e["t1"] - e["t0"], left=e["t0"], color=kc[e["kind"]], height=0.6)
        ax[1].set_yticks(
            [-1, 0, 1, 2.2, 3.2, 4.2], ["async proposer", "async w0", "async w1", "sync proposer", "sync w0", "sync w1"]
        )
        ax[1].set_xlabel("seconds (seed 0)")
        ax[1].set_title(
            "merge (orange), eval incl. latency (green), propose (red), barrier (blue), wait (grey)", fontsize=8
        )
        fig.tight_layout()
        fig.savefig(figures / "cost.png", dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()
