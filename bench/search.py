"""Layer-wise vs model-level merge search on a deep zoo, 10+ seeds per arm (docs/SEARCH.md, issue 27).

Testbed ``zoo8``: the zoo of ``mergepipe_zoo`` at ``ZooConfig.deep()`` (8 decoder layers, the tiny
zoo's widths; cached in ``~/.mergepipe/zoo``): base + the ``python``, ``arithmetic`` and ``json``
experts, three objectives (next-token loss on each of the three domains, minimised). Every
candidate is a real merge (plan → execute → commit) of ``task_arithmetic`` (``normalize`` false,
its default) with one ``weight`` per expert — per layer block for the layer-wise arms, one for the
whole model for the model-level arms: **the same method, normalization and parameter**, only the
granularity differs. The zoo's held-out windows (32 per domain) are split: the **search windows**
(the first ``--search-windows``, the objectives the optimizer sees) and the **held-out windows**
(the next as many; scored in the same model load, never shown to any optimizer).

Testbed ``minilm`` (``--testbed minilm``): the MiniLM testbed of :mod:`mergepipe_zoo.minilm` (the
pretrained 6-layer MiniLM encoder, experts fully fine-tuned on ``order``/``rotate``/``match``,
``--minilm-seed`` its seed), objectives ``loss:<task>`` (cross-entropy with the task's head) on
the first ``--examples`` probe examples per task, held-out the next ``--examples``, scored by
:class:`bench.search_minilm.MiniLMObjective` (in process, tokenised once; its cost is measured
by ``bench/search_minilm.py``). Its pre-registered fresh run is registered in
docs/search/preregistration-minilm.json (``--testbed minilm --fresh``; raw results
docs/search/raw-minilm-fresh.jsonl.gz).

Arms (:data:`ARMS`; ``lw`` = layer-wise, ``--blocks`` blocks × 3 experts coordinates; ``ml`` =
model-level, 3 coordinates):

* ``lw-bo``, ``ml-bo``: asynchronous pending-aware qLogNEHVI (``mergepipe search``'s optimizer),
  prior and reranking off, 2 workers, ``--initial`` Sobol points first;
* ``lw-bo-default``: ``lw-bo`` with the CLI's defaults (``scaled`` prior, reranking);
* ``lw-random``, ``ml-random``: the same Sobol design, then uniform points;
* ``ml-grid``: the full grid with ``k = ⌈E^(1/3)⌉`` levels ``0, 1/(k−1), …, 1`` per expert weight,
  ``E`` of its points in a seed-dependent order;
* ``lw-nsga2``, ``ml-nsga2``: NSGA-II (optuna's ``NSGAIISampler``, population ``--initial``),
  sequential ask/tell;
* ``lw-cmaes``, ``ml-cmaes``: CMA-ES as ``mergekit-evolve`` runs it (pycma, ``x0`` = 1/3 per
  weight, ``sigma0`` = 1/6, pycma's default population, the objectives summed into one; see
  :func:`_cmaes`), sequential ask/tell.

Every (arm, seed) run writes every evaluated candidate (unit-cube point, search-window objectives,
held-out losses) to ``--raw`` (gzip JSON lines, the first line the run's metadata); the tables
and every figure of docs/SEARCH.md are re-derived from that file by ``bench/search_report.py``.
Runs go seed by seed (every arm of seed 0, then seed 1, ...) and a finished (arm, seed) is kept in
``<work>/runs/`` and skipped on a rerun with the same settings, so a stopped run leaves whole
seeds (``--seeds`` can be raised later).

Run (docs/SEARCH.md)::

    PYTHONPATH=. nice -n 15 .venv/bin/python -W ignore bench/search.py --work bench/.work/search
    # the zoo8 fresh run's registered amendment (docs/SEARCH.md), in a copy W1 of its work folder:
    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 nice -n 10 .venv/bin/python -W ignore bench/search.py --fresh \\
        --amendment docs/search/preregistration-zoo8-amendment1.json --work W1
    # the MiniLM testbed, a development run on a tiny budget (the catalog analysis, ~250 CPU s,
    # is done once per --work folder):
    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 nice -n 15 .venv/bin/python -W ignore bench/search.py \\
        --testbed minilm --minilm-seed 100 --seeds 1 --evaluations 4 --initial 2 --arms lw-bo,ml-bo \\
        --examples 32 --work bench/.work/search-minilm
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOMAINS = ("python", "arithmetic", "json")
OBJ = [f"loss:{d}" for d in DOMAINS]

#: arm -> (space, optimizer). ``lw``: one weight per expert per layer block; ``ml``: one weight per
#: expert for the whole model.
ARMS: dict[str, tuple[str, str]] = {
    "lw-bo": ("lw", "bo"),
    "ml-bo": ("ml", "bo"),
    "lw-bo-default": ("lw", "bo-default"),
    "ml-bo-default": ("ml", "bo-default"),
    "lw-random": ("lw", "random"),
    "ml-random": ("ml", "random"),
    "ml-grid": ("ml", "grid"),
    "lw-nsga2": ("lw", "nsga2"),
    "ml-nsga2": ("ml", "nsga2"),
    "lw-cmaes": ("lw", "cmaes"),
    "ml-cmaes": ("ml", "cmaes"),
}


def arm_space(arm: str, blocks: int) -> dict:
    """The search space of ``arm`` as :class:`mergepipe.search.runner.SearchConfig` fields
    (``method``, ``vary``, ``layer_blocks``, ``fixed``). Every arm merges with ``task_arithmetic``
    (``normalize`` false) and varies ``weight`` per expert; ``lw`` arms per layer block
    (``blocks`` blocks), ``ml`` arms once for the model (one block).

    Raises:
        KeyError: unknown arm.
    """
    space, _ = ARMS[arm]
    return {
        "method": "task_arithmetic",
        "vary": ["weight=0:1"],
        "layer_blocks": blocks if space == "lw" else 1,
        "fixed": {},
    }


def grid_design(n: int, d: int, seed: int) -> list[list[float]]:
    """``n`` points of the full grid on ``[0, 1]^d`` with ``k = ⌈n^(1/d)⌉`` levels per axis
    (``i/(k−1)``), in a ``seed``-dependent order (``random.Random(seed).shuffle``)."""
    k = 2
    while k**d < n:
        k += 1
    pts = [[]]
    for _ in range(d):
        pts = [p + [i / (k - 1)] for p in pts for i in range(k)]
    random.Random(seed).shuffle(pts)
    return pts[:n]


# ------------------------------------------------------------------------------------------------
# evaluation: search windows + held-out windows in one model load, cached per candidate
# ------------------------------------------------------------------------------------------------
class Evals:
    """Per-candidate cache and evaluator. ``metrics(path)`` returns the search-window losses
    (``loss:<domain>``) and, under ``heldout:loss:<domain>``, the held-out windows' losses
    (recorded, never an objective)."""

    domains: tuple[str, ...] = DOMAINS

    def __init__(self, zoo, work: Path, search_windows: int) -> None:
        from mergepipe.evaluate import causal_lm_windows

        self.zoo = zoo
        tb = zoo.testbed
        self.batch = tb.batch_size
        win = causal_lm_windows(tb, list(DOMAINS))
        n = min(len(w) for w in win.values())
        if n < 2 * search_windows:
            raise SystemExit(f"the zoo has {n} eval windows per domain; need 2 x {search_windows}")
        self.search = {d: w[:search_windows] for d, w in win.items()}
        self.heldout = {d: w[search_windows : 2 * search_windows] for d, w in win.items()}
        self._open_cache(work, f"{zoo.config.key()}:w{search_windows}")

    @property
    def objectives(self) -> list[str]:
        """The search's objectives: ``loss:<domain>`` per domain (minimised)."""
        return [f"loss:{d}" for d in self.domains]

    def _open_cache(self, work: Path, tag: str) -> None:
        """The per-candidate cache ``work/evals.jsonl`` of evaluations scored as ``tag``."""
        self.path, self.tag = work / "evals.jsonl", tag
        self.lock = threading.Lock()
        self.cache: dict[str, dict] = {}
        self.pending: dict[str, str] = {}  # snapshot folder -> key of a merge not yet evaluated
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    self.cache[r["key"]] = r
        self.hits = self.misses = 0

    def key(self, method: str, params: dict) -> str:
        blob = json.dumps([self.tag, method, params], sort_keys=True)
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
                key = ev.key(cfg.method, cand["params"])
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


class MiniLMEvals(Evals):
    """:class:`Evals` on the MiniLM testbed (:mod:`mergepipe_zoo.minilm`, 6 layers, tasks
    ``order``/``rotate``/``match``): ``loss:<task>`` on the first ``examples`` probe examples
    per task, ``heldout:loss:<task>`` on the next ``examples`` (accuracies beside them), scored
    by :class:`bench.search_minilm.MiniLMObjective` (tokenised once, weights loaded into one
    encoder, one thread)."""

    def __init__(self, bed, work: Path, examples: int) -> None:
        from bench.search_minilm import MiniLMObjective
        from mergepipe_zoo.minilm import TASKS

        self.bed, self.domains = bed, TASKS
        self.objective = MiniLMObjective(bed.root, n_search=examples, n_heldout=examples)
        self._open_cache(work, f"minilm:{bed.config.key()}:n{examples}")

    def compute(self, model_dir: Path) -> dict:
        return self.objective.metrics(Path(model_dir))


class _CachedEvaluator:
    """A runner evaluator over :class:`Evals` (in-process)."""

    timeout = None
    in_process = True

    def __init__(self, ev: Evals) -> None:
        self.ev = ev

    def metrics(self, checkpoint):
        return self.ev.metrics(checkpoint)

    def known_metrics(self):
        return list(self.ev.objectives) + [f"heldout:{o}" for o in self.ev.objectives]

    def spec(self):
        return None


# ------------------------------------------------------------------------------------------------
# one run of one arm
# ------------------------------------------------------------------------------------------------
def _cands_from_state(d: Path, objs: list[str]) -> list[dict]:
    """Every successful candidate of a runner state, in completion order, as raw records."""
    st = json.loads((d / "state.json").read_text())
    done = sorted((c for c in st["candidates"] if c["status"] == "done"), key=lambda c: c["times"]["ended"])
    return [_raw(c["x"], c["metrics"], objs) for c in done]


def _raw(x, m: dict, objs: list[str]) -> dict:
    """One candidate's raw record: unit-cube point ``x``, search objectives ``y``, held-out
    losses ``h`` and, where the evaluator scores them (MiniLM), held-out accuracies ``ha``."""
    out = {
        "x": [round(float(v), 6) for v in x],
        "y": [m[o] for o in objs],
        "h": [m[f"heldout:{o}"] for o in objs],
    }
    acc = [f"heldout:acc:{o.split(':', 1)[1]}" for o in objs]
    if all(a in m for a in acc):
        out["ha"] = [m[a] for a in acc]
    return out


def run_arm(arm: str, seed: int, ctx: dict) -> dict:
    """Run (or load) one (arm, seed); returns ``{"arm", "seed", "run_s", "load", "failed",
    "cands": [{"x", "y", "h"}]}`` (candidates in completion order)."""
    from mergepipe.search.runner import SearchConfig, run_search

    a = ctx["args"]
    d = ctx["work"] / "runs" / arm / f"s{seed}"
    spec = {"arm": arm, "seed": seed, "E": a.evaluations, "I": a.initial, "blocks": a.blocks, "tag": ctx["evals"].tag}
    done_file = d / "run.json"
    if done_file.exists():
        old = json.loads(done_file.read_text())
        if old.get("spec") == spec:
            return old["run"]
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    ev: Evals = ctx["evals"]
    space, opt = ARMS[arm]
    cfg_kw = dict(
        base=str(ctx["base"]),
        experts=[[n, str(ctx["experts"][n])] for n in ev.domains],
        objectives=list(ev.objectives),
        evaluations=a.evaluations,
        initial=a.initial,
        workers=2,
        seed=seed,
        catalog=str(ctx["work"] / "catalog.sqlite"),
        ref_point=ctx["ref"],
        prior=False,
        rerank=False,
        **arm_space(arm, a.blocks),
    )
    t0, load0 = time.time(), os.getloadavg()
    failed = 0
    if opt == "nsga2":
        cands = _nsga2(SearchConfig(**cfg_kw), seed, ctx, d)
    elif opt == "cmaes":
        cands = _cmaes(SearchConfig(**cfg_kw), seed, ctx, d)
    else:
        if opt == "bo":
            cfg_kw["strategy"] = "async"
        elif opt == "bo-default":
            cfg_kw.update(strategy="async", prior=True, prior_kind="scaled", rerank=True)
        elif opt == "random":
            cfg_kw["strategy"] = "random"
        elif opt == "grid":
            dim = len(ev.domains) * cfg_kw["layer_blocks"]
            cfg_kw.update(strategy="random", initial=a.evaluations, design=grid_design(a.evaluations, dim, seed))
        else:
            raise SystemExit(f"unknown arm {arm}")
        res = run_search(d / "run", SearchConfig(**cfg_kw), _CachedEvaluator(ev), merger=ev.merger())
        failed = res["failed"]
        cands = _cands_from_state(d / "run", ev.objectives)
    out = {
        "arm": arm,
        "seed": seed,
        **({"prereg": a.prereg_commit} if getattr(a, "prereg_commit", None) else {}),
        **({"amendment": a.amendment_commit} if getattr(a, "amendment_commit", None) else {}),
        **({"code": ctx["code"]} if ctx.get("code") else {}),
        "run_s": round(time.time() - t0, 2),
        "load": [round(x, 2) for x in load0],
        "failed": failed,
        "cands": cands,
    }
    shutil.rmtree(d / "run" / "snapshots", ignore_errors=True)
    done_file.write_text(json.dumps({"spec": spec, "run": out}))
    return out


def _search_space(cfg, ctx: dict):
    """The :class:`mergepipe.search.space.SearchSpace` of ``cfg`` on the testbed's base (its
    layer count read from the base's safetensors names)."""
    from safetensors import safe_open

    from mergepipe.methods.params import layer_count
    from mergepipe.search.space import SearchSpace, parse_vary

    names: list[str] = []
    for f in sorted(Path(ctx["base"]).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    ev: Evals = ctx["evals"]
    return SearchSpace(cfg.method, list(ev.domains), parse_vary(cfg.vary), layer_count(names), cfg.layer_blocks, {})


def _evaluate(cfg, x: list[float], i: int, space, merger, cat, ctx: dict, d: Path) -> dict:
    """Merge unit-cube point ``x`` (candidate ``i``) through the caching merger and score it."""
    ev: Evals = ctx["evals"]
    m = merger.merge(cfg, {"id": i, "params": space.to_params(x)}, d, {}, cat)
    return ev.metrics(m.snapshot if str(m.snapshot).startswith("cached:") else Path(m.snapshot))


def _nsga2(cfg, seed: int, ctx: dict, d: Path) -> list[dict]:
    """NSGA-II (optuna's ``NSGAIISampler``, population ``cfg.initial``) over the arm's unit cube,
    sequential ask/tell; every candidate a real merge through the caching merger."""
    import optuna

    from mergepipe.catalog.objectstore import open_catalog

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ev: Evals = ctx["evals"]
    space = _search_space(cfg, ctx)
    cat = open_catalog(cfg.catalog)
    merger = ev.merger()
    study = optuna.create_study(
        directions=["minimize"] * len(ev.objectives),
        sampler=optuna.samplers.NSGAIISampler(population_size=cfg.initial, seed=seed),
    )
    out = []
    for i in range(cfg.evaluations):
        trial = study.ask()
        x = [trial.suggest_float(f"x{j}", 0.0, 1.0) for j in range(space.d)]
        r = _evaluate(cfg, x, i, space, merger, cat, ctx, d)
        study.tell(trial, [r[o] for o in ev.objectives])
        out.append(_raw(x, r, ev.objectives))
    return out


#: mergekit-evolve's CMA-ES settings (mergekit/scripts/evolve.py, mergekit/evo/genome.py):
#: ``sigma0`` (its ``--sigma0`` default) and the initial weight ``1 / n_models`` (``x0`` of
#: ``ModelGenome.initial_genotype`` without ``random_init``).
CMAES_SIGMA0 = 1 / 6


def cmaes_strategy(d: int, n_experts: int, seed: int):
    """The ``cma.CMAEvolutionStrategy`` mergekit-evolve starts (pycma; ``cma.fmin2`` with a
    ``parallel_objective`` is its ask/tell loop): ``x0`` = ``1 / n_experts`` in each of the
    ``d`` coordinates, ``sigma0`` = :data:`CMAES_SIGMA0`, pycma's default population
    ``4 + ⌊3 ln d⌋`` (mergekit sets none), no bounds. Seeded (``seed``) and drawing its normal
    samples from its own ``numpy.random.RandomState(seed)``, so a run is reproducible whatever
    else in the process uses numpy's global generator (mergekit leaves pycma's time-based seed).

    Raises:
        ImportError: pycma is not installed (``pip install 'mergepipe[bench]'``).
    """
    import cma
    import numpy as np

    rs = np.random.RandomState(seed)
    return cma.CMAEvolutionStrategy(
        [1.0 / n_experts] * d, CMAES_SIGMA0, {"seed": seed, "randn": rs.randn, "verbose": -9}
    )


def cmaes_point(g) -> list[float]:
    """A CMA-ES genotype ``g`` (``d`` floats, unbounded) as the point of the unit cube that is
    merged: ``|g|`` as mergekit-evolve takes weights (``allow_negative_weights`` false), capped at
    1, the top of the registered weight range ``0:1`` (mergekit has no upper cap; from ``x0`` =
    1/3 with ``sigma0`` = 1/6 a weight above 1 is a 4-sigma draw)."""
    return [min(abs(float(v)), 1.0) for v in g]


def _cmaes(cfg, seed: int, ctx: dict, d: Path) -> list[dict]:
    """CMA-ES as ``mergekit-evolve`` runs it (:func:`cmaes_strategy`) over the arm's weights:
    each generation's asks are merged (:func:`cmaes_point`) and scored in order, the fitness is
    the **sum of the objectives** (mergekit-evolve's scalarisation: the tasks' metrics times their
    weights, default 1, summed; here losses, minimised, so no sign flip) and told back. The run
    stops at ``cfg.evaluations`` candidates: the last generation is cut there and never told
    (mergekit's ``maxfevals`` stops after a whole generation; the cut keeps every arm's budget
    equal). Every candidate a real merge through the caching merger."""
    from mergepipe.catalog.objectstore import open_catalog

    ev: Evals = ctx["evals"]
    space = _search_space(cfg, ctx)
    cat = open_catalog(cfg.catalog)
    merger = ev.merger()
    es = cmaes_strategy(space.d, len(ev.domains), seed)
    out: list[dict] = []
    while len(out) < cfg.evaluations:
        gen = es.ask()
        fit = []
        for g in gen[: cfg.evaluations - len(out)]:
            x = cmaes_point(g)
            r = _evaluate(cfg, x, len(out), space, merger, cat, ctx, d)
            fit.append(sum(r[o] for o in ev.objectives))
            out.append(_raw(x, r, ev.objectives))
        if len(fit) == len(gen):
            es.tell(gen, fit)
    return out


# ------------------------------------------------------------------------------------------------
#: testbed -> its pre-registration (committed before its fresh run; never edited afterwards)
PREREGS: dict[str, Path] = {
    "zoo8": ROOT / "docs" / "search" / "preregistration.json",
    "minilm": ROOT / "docs" / "search" / "preregistration-minilm.json",
}


def _git(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True)


def _part_arg(spec: str) -> str:
    """``--part``'s argparse type: ``K/N`` with ``1 <= K <= N`` (a bad value exits 2, naming it).

    Raises:
        argparse.ArgumentTypeError: not ``K/N`` with ``1 <= K <= N``.
    """
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{spec!r}: K must be in 1..N")
    return spec


def _part(spec: str, seeds: list[int]) -> list[int]:
    """The ``K``-th of ``N`` contiguous chunks of ``seeds`` for ``--part K/N`` (1-based; the
    first chunks one longer when ``N`` does not divide the count).

    Raises:
        SystemExit: not ``K/N`` with ``1 <= K <= N`` (:func:`_part_arg`).
    """
    try:
        k, n = (int(v) for v in _part_arg(spec).split("/"))
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"--part {e}") from None
    q, r = divmod(len(seeds), n)
    start = (k - 1) * q + min(k - 1, r)
    return seeds[start : start + q + (1 if k <= r else 0)]


def _preregistered(args) -> list[tuple[list[int], list[str]]]:
    """Apply the testbed's pre-registration (:data:`PREREGS`) to ``args`` (budget, blocks, and
    search windows for ``zoo8``; testbed seed and examples for ``minilm``) and return the passes
    ``[(seeds, arms), ...]`` it registers (``--part K/N``: this process's chunk of the seeds);
    records the commit that holds it in ``args.prereg_commit`` (written into every run, so
    ``--collect`` can name it).

    Raises:
        SystemExit: the file has uncommitted changes or is not committed (a pre-registration is
            committed before the fresh run), names another testbed, or names an unknown arm.
    """
    path = PREREGS[args.testbed]
    rel, commit = _committed(path, "commit the pre-registration before the fresh run")
    pr = json.loads(path.read_text())
    if pr["testbed"]["name"] != args.testbed:
        raise SystemExit(f"{rel}: registers testbed {pr['testbed']['name']!r}, not {args.testbed!r}")
    args.evaluations = int(pr["budget"]["evaluations"])
    args.initial = int(pr["budget"]["initial"])
    args.blocks = int(pr["layer_blocks"])
    if args.testbed == "minilm":
        args.minilm_seed = int(pr["testbed"]["minilm_seed"])
        args.examples = int(pr["testbed"]["examples"])
    else:
        args.search_windows = int(pr["testbed"]["search_windows"])
    args.prereg_commit = commit
    seeds = [int(s) for s in pr["fresh_seeds"]]
    if args.part:
        seeds = _part(args.part, seeds)
    arms = list(pr["arms"])
    for x in arms:
        if x not in ARMS:
            raise SystemExit(f"{rel}: unknown arm {x!r}; arms: {', '.join(ARMS)}")
    if "passes" in pr:  # registered explicitly (minilm: one seed-major pass of every arm)
        return [(seeds, list(p)) for p in pr["passes"]]
    nsga = [a for a in arms if ARMS[a][1] == "nsga2"]  # zoo8: the main arms, then NSGA-II
    passes = [(seeds, [a for a in arms if a not in nsga]), (seeds, nsga)]
    if getattr(args, "amendment", None):
        passes = _amended(args, commit)
    return passes


def _committed(path: Path, fix: str) -> tuple[str, str]:
    """:func:`bench.record.committed` in this checkout (:data:`ROOT`)."""
    from bench.record import committed

    return committed(path, fix, ROOT)


def _amendment(args, path: Path, registered: str) -> tuple[str, str, dict]:
    """(relative path, commit, content) of the amendment ``path`` to the testbed's registration
    committed at ``registered``, validated.

    Raises:
        SystemExit: not committed (or changed since), not JSON, amends another file or commit,
            names another testbed or an unknown arm, or has no passes.
    """
    rel, commit = _committed(path, "commit the amendment before its runs")
    try:
        am = json.loads(path.read_text())
        amends, passes = am["amends"], am["passes"]
        plan = [([int(s) for s in p["seeds"]], [str(a) for a in p["arms"]]) for p in passes]
        family = [tuple(c) for c in am["family"]["comparisons"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(
            f"{rel}: not an amendment ({type(e).__name__}: {e}); see docs/search/*amendment*.json"
        ) from None
    reg_rel = str(PREREGS[args.testbed].relative_to(ROOT))
    if amends.get("file") != reg_rel or amends.get("commit") != registered:
        raise SystemExit(
            f"{rel}: amends {amends.get('file')}@{amends.get('commit')}; --testbed {args.testbed}'s registration "
            f"is {reg_rel}@{registered}"
        )
    for x in [a for _, arms in plan for a in arms] + [a for c in family for a in c]:
        if x not in ARMS:
            raise SystemExit(f"{rel}: unknown arm {x!r}; arms: {', '.join(ARMS)}")
    if not plan:
        raise SystemExit(f"{rel}: passes: no runs registered")
    return rel, commit, am


def _amended(args, registered: str) -> list[tuple[list[int], list[str]]]:
    """The passes of ``args.amendment`` (run at the registered settings ``_preregistered`` set);
    records its commit in ``args.amendment_commit`` (written into its runs beside ``prereg``).

    Raises:
        SystemExit: see :func:`_amendment`; ``--part`` (an amendment runs in one process).
    """
    if args.part:
        raise SystemExit("--part splits a registration's seeds; an amendment runs its passes in one process")
    _, args.amendment_commit, am = _amendment(args, args.amendment, registered)
    return [([int(s) for s in p["seeds"]], list(p["arms"])) for p in am["passes"]]


TESTBEDS = ("zoo8", "minilm")


def _testbed(args) -> tuple[Evals, Path, dict[str, Path]]:
    """The evaluator, base and experts (by domain) of ``args.testbed`` (built once, cached)."""
    if args.testbed == "minilm":
        from mergepipe_zoo.minilm import MiniLMConfig, build_minilm

        bed = build_minilm(config=MiniLMConfig(seed=args.minilm_seed), log=print)
        return MiniLMEvals(bed, args.work, args.examples), bed.base, dict(bed.experts)
    from mergepipe_zoo import ZooConfig, build_zoo

    zoo = build_zoo(config=ZooConfig.deep(), log=print)
    return Evals(zoo, args.work, args.search_windows), zoo.base, {n: zoo.experts[n] for n in DOMAINS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / ".work" / "search")
    ap.add_argument("--raw", type=Path, help="raw results to write (default docs/search/raw-<testbed>-fresh.jsonl.gz)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--seed-start", type=int, default=0, help="first seed (split the seeds over processes)")
    ap.add_argument("--evaluations", type=int, default=12, help="candidates per run (AP-BMM: 8 + 40)")
    ap.add_argument("--initial", type=int, default=6, help="Sobol design points (NSGA-II population)")
    ap.add_argument("--blocks", type=int, default=4, help="layer blocks of the layer-wise arms")
    ap.add_argument("--search-windows", type=int, default=16, help="windows per domain the search sees")
    ap.add_argument(
        "--testbed",
        choices=TESTBEDS,
        default="zoo8",
        help="zoo8 (the 8-layer zoo) or minilm (the pretrained 6-layer MiniLM encoder, 3 tasks)",
    )
    ap.add_argument("--minilm-seed", type=int, default=0, help="minilm: seed of the testbed (MiniLMConfig.seed)")
    ap.add_argument("--examples", type=int, default=128, help="minilm: search (and held-out) examples per task")
    ap.add_argument("--arms", default=",".join(a for a in ARMS if a != "lw-bo-default"))
    ap.add_argument("--deadline", type=float, default=0.0, help="do not start a run after this Unix time")
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="the pre-registered fresh run: seeds, arms, budget and blocks from the testbed's pre-registration "
        "(docs/search/preregistration.json, preregistration-minilm.json; committed, unchanged); pass 1 the main "
        "arms, pass 2 NSGA-II",
    )
    ap.add_argument(
        "--part",
        type=_part_arg,
        help="with --fresh: K/N, this process runs the K-th of N contiguous chunks of the seeds",
    )
    ap.add_argument(
        "--amendment",
        type=Path,
        help="with --fresh: run the passes of this committed amendment to the testbed's pre-registration (at the "
        "registered settings) instead of the registered passes; with --collect: collect its runs and the registered "
        "runs its comparisons need (e.g. docs/search/preregistration-zoo8-amendment1.json)",
    )
    ap.add_argument(
        "--collect",
        type=Path,
        nargs="+",
        help="write --raw from the finished (arm, seed) runs of these work folders and stop",
    )
    args = ap.parse_args(argv)
    if args.amendment and not (args.fresh or args.collect):
        raise SystemExit("--amendment goes with --fresh (run it) or --collect (collect its runs)")
    if args.amendment:
        args.amendment = args.amendment if args.amendment.is_absolute() else Path.cwd() / args.amendment
    if args.raw is None and args.amendment:
        stem = args.amendment.stem.removeprefix("preregistration-")
        args.raw = ROOT / "docs" / "search" / f"raw-{stem}.jsonl.gz"
    if args.raw is None:
        args.raw = ROOT / "docs" / "search" / f"raw-{args.testbed}-fresh.jsonl.gz"
    if args.part and not args.fresh:
        ap.error("--part splits the registered seeds of --fresh; without it use --seed-start/--seeds")
    if args.collect:
        collect(args.collect, args.raw, args)
        return
    passes = [(list(range(args.seed_start, args.seed_start + args.seeds)), [x for x in args.arms.split(",") if x])]
    if args.fresh:
        passes = _preregistered(args)
    args.work.mkdir(parents=True, exist_ok=True)

    ev, base, experts = _testbed(args)
    ref_metrics = _reference(args.work, ev.tag, lambda: (ev, base, experts))
    ref = [max(ref_metrics[n][o] for n in ev.domains) for o in ev.objectives]
    from bench.record import git_rev

    ctx = {
        "args": args,
        "work": args.work,
        "base": base,
        "experts": experts,
        "evals": ev,
        "ref": ref,
        "code": git_rev(),
    }
    for _, arms in passes:
        for x in arms:
            if x not in ARMS:
                raise SystemExit(f"--arms: unknown arm {x!r}; arms: {', '.join(ARMS)}")
    for seeds, arms in passes:
        for seed in seeds:  # seed by seed: a stopped run leaves whole seeds, then whole arms
            for arm in arms:
                if args.deadline and time.time() > args.deadline:
                    print(f"deadline: not starting {arm} s{seed}", flush=True)
                    break
                r = run_arm(arm, seed, ctx)
                print(
                    f"{arm} s{seed}: {len(r['cands'])} cands in {r['run_s']:.0f} s (load {r['load'][0]:.1f})",
                    flush=True,
                )
    print(f"done; python bench/search.py --collect {args.work} ... --raw {args.raw}", flush=True)


def _reference(work: Path, tag: str, testbed) -> dict:
    """The base's and every expert's metrics on the testbed (deterministic), cached in
    ``work/reference.json`` under the evaluator's ``tag`` (so a collection does not score them
    again); ``testbed()`` gives ``(evaluator, base, experts)`` and is called only on a miss."""
    cached = work / "reference.json"
    if cached.exists():
        rec = json.loads(cached.read_text())
        if rec.get("tag") == tag:
            return rec["metrics"]
    ev, base, experts = testbed()
    metrics = {"base": ev.compute(base)} | {n: ev.compute(experts[n]) for n in ev.domains}
    cached.write_text(json.dumps({"tag": ev.tag, "metrics": metrics}))
    return metrics


def _testbed_meta(args) -> tuple[str, dict]:
    """(expected evaluation tag, the raw file's testbed fields) of ``args``'s
    testbed, without building it (the tag names the testbed's cache key and the split; MiniLM's
    layer count is read from the cached testbed's ``base/config.json``, the encoder merged).

    Raises:
        SystemExit: MiniLM's cached base config is missing or unreadable.
    """
    if args.testbed == "minilm":
        from mergepipe_zoo.minilm import FORMAT, TASKS, MiniLMConfig, default_root

        cfg = MiniLMConfig(seed=args.minilm_seed)
        base_cfg = default_root() / cfg.key() / "base" / "config.json"  # the encoder the runs merged
        try:
            layers = int(json.loads(base_cfg.read_text())["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(
                f"--collect: {base_cfg}: cannot read the testbed's layer count ({e}); build the testbed "
                f"(--testbed minilm --minilm-seed {args.minilm_seed}) or point MERGEPIPE_HOME at its cache"
            ) from None
        fields = {
            "testbed": "minilm",
            "examples": args.examples,
            "domains": list(TASKS),
            "objectives": [f"loss:{t}" for t in TASKS],
            "minilm": {"key": cfg.key(), "format": FORMAT, "seed": cfg.seed, "layers": layers},
        }
        return f"minilm:{cfg.key()}:n{args.examples}", fields
    from mergepipe_zoo import ZooConfig
    from mergepipe_zoo.zoo import ZOO_FORMAT

    zcfg = ZooConfig.deep()
    fields = {
        "testbed": "zoo8",
        "search_windows": args.search_windows,
        "domains": list(DOMAINS),
        "objectives": OBJ,
        "zoo": {"key": zcfg.key(), "format": ZOO_FORMAT, "config": "ZooConfig.deep()", "layers": zcfg.num_layers},
    }
    return f"{zcfg.key()}:w{args.search_windows}", fields


def collect(works: list[Path], raw: Path, args) -> None:
    """Write the raw results file from every finished (arm, seed) run in ``works`` (one or more
    processes of ``bench/search.py`` over their own seeds, same settings; a process stopped
    mid-seed leaves its finished arms). First line the metadata: the testbed, the base's and
    experts' metrics (``works[0]/reference.json`` as the run wrote it, else evaluated again:
    deterministic), the arms in :data:`ARMS` order, per arm its seeds, wall time from the first
    run's start to the last run's end, the load average at the first run's start and now; then
    every run. ``args`` names the testbed (``--testbed``, ``--minilm-seed``, ``--examples``,
    ``--search-windows``; a fresh run's values are its pre-registration's).

    With ``args.amendment`` (a committed amendment to the testbed's registration): the runs made
    under it (``amendment`` = its commit) and the registered runs (``prereg`` = the registered
    commit, no ``amendment``) of the arms its family compares; every other run is left out. The
    metadata then hold the amendment as committed (``amendment_commit``, ``amendment``), per arm
    the registered seeds reused (``registered_seeds``), and wall time, run-time sum and start load
    of the amendment's own runs.

    Raises:
        SystemExit: the folders ran different settings, another testbed or split than ``args``
            names, or runs of different pre-registrations.
    """
    found = []
    for w in works:
        for f in sorted(w.glob("runs/*/s*/run.json")):
            d = json.loads(f.read_text())
            found.append((d, (f.stat().st_mtime - d["run"]["run_s"], f.stat().st_mtime, d["run"]["load"])))
    amend: dict = {}
    if getattr(args, "amendment", None):
        registered = _git("log", "-1", "--format=%H", "--", str(PREREGS[args.testbed].relative_to(ROOT))).stdout
        rel, acommit, am = _amendment(args, args.amendment, registered.strip())
        compared = {a for c in am["family"]["comparisons"] for a in c}
        found = [
            (d, sp)
            for d, sp in found
            if d["run"].get("amendment") == acommit
            or (
                "amendment" not in d["run"]
                and d["run"].get("prereg") == registered.strip()
                and d["run"]["arm"] in compared
            )
        ]
        amend = {"amendment_file": rel, "amendment_commit": acommit, "amendment": am}
    runs = [d["run"] for d, _ in found]
    specs = {(d["spec"]["E"], d["spec"]["I"], d["spec"]["blocks"], d["spec"]["tag"]) for d, _ in found}
    own = [sp for d, sp in found if not amend or d["run"].get("amendment") == amend["amendment_commit"]]
    spans = own or [sp for _, sp in found]
    if len(specs) != 1:
        raise SystemExit(f"--collect: the work folders ran different settings (or none): {sorted(specs)}")
    E, n0, blocks, tag = specs.pop()
    commits = {r.get("prereg") for r in runs}
    if len(commits) != 1:
        raise SystemExit(
            f"--collect: runs of different pre-registrations (or none and some): {sorted(map(str, commits))}"
        )
    commit = commits.pop()
    prereg = {}
    if commit:  # the registered protocol as committed, so the report applies the registered family
        rel = str(PREREGS[args.testbed].relative_to(ROOT))
        shown = _git("show", f"{commit}:{rel}")
        if shown.returncode:
            raise SystemExit(f"--collect: cannot read {rel} at the runs' commit {commit}: {shown.stderr.strip()}")
        prereg = {"preregistration_commit": commit, "preregistration": json.loads(shown.stdout)}
        tb = prereg["preregistration"]["testbed"]
        if args.testbed == "minilm":
            args.minilm_seed, args.examples = int(tb["minilm_seed"]), int(tb["examples"])
        else:
            args.search_windows = int(tb["search_windows"])
    want, fields = _testbed_meta(args)
    if want != tag:
        raise SystemExit(
            f"--collect: the runs were scored as {tag}; --testbed {args.testbed} with these options gives {want}"
        )
    args.work = works[0]
    ref_metrics = _reference(works[0], tag, lambda: _testbed(args))
    import botorch
    import torch

    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    runs.sort(key=lambda r: (r["seed"], arms.index(r["arm"])))
    first = min(spans)
    codes = sorted({r["code"] for r in runs if r.get("code")})
    seeds = {a: sorted(r["seed"] for r in runs if r["arm"] == a) for a in arms}
    if amend:
        reused = {a: sorted(r["seed"] for r in runs if r["arm"] == a and "amendment" not in r) for a in arms}
        amend["registered_seeds"] = {a: s for a, s in reused.items() if s}
    meta = {
        "testbed": fields.pop("testbed"),
        "phase": "amendment" if amend else "fresh" if commit else "development",
        **prereg,
        **amend,
        "arms": arms,
        "seeds": seeds,
        "evaluations": E,
        "initial": n0,
        "blocks": blocks,
        **fields,
        **({"code": codes} if codes else {}),
        "reference": {"metrics": ref_metrics},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "botorch": botorch.__version__,
            "load_start": first[2],
            "load_end": [round(x, 2) for x in os.getloadavg()],
        },
        "processes": len(works),
        "total_s": round(max(e for _, e, _ in spans) - first[0], 1),
        "run_s_sum": round(sum(r["run_s"] for r in runs if not amend or "amendment" in r), 1),
    }
    raw.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(raw, "wb", compresslevel=9, mtime=0) as f:
        f.write((json.dumps(meta) + "\n").encode())
        for r in runs:
            f.write((json.dumps(r) + "\n").encode())
    print(f"wrote {raw} ({raw.stat().st_size} bytes, {len(runs)} runs); python bench/search_report.py --write")


if __name__ == "__main__":
    main()
