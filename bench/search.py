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
by ``bench/search_minilm.py``). Development runs only: no pre-registration names it yet, so
``--fresh`` and ``--collect`` refuse it.

Arms (:data:`ARMS`; ``lw`` = layer-wise, ``--blocks`` blocks × 3 experts coordinates; ``ml`` =
model-level, 3 coordinates):

* ``lw-bo``, ``ml-bo``: asynchronous pending-aware qLogNEHVI (``mergepipe search``'s optimizer),
  prior and reranking off, 2 workers, ``--initial`` Sobol points first;
* ``lw-bo-default``: ``lw-bo`` with the CLI's defaults (``scaled`` prior, reranking);
* ``lw-random``, ``ml-random``: the same Sobol design, then uniform points;
* ``ml-grid``: the full grid with ``k = ⌈E^(1/3)⌉`` levels ``0, 1/(k−1), …, 1`` per expert weight,
  ``E`` of its points in a seed-dependent order;
* ``lw-nsga2``, ``ml-nsga2``: NSGA-II (optuna's ``NSGAIISampler``, population ``--initial``),
  sequential ask/tell.

Every (arm, seed) run writes every evaluated candidate (unit-cube point, search-window objectives,
held-out losses) to ``--raw`` (gzip JSON lines, the first line the run's metadata); the tables
and every figure of docs/SEARCH.md are re-derived from that file by ``bench/search_report.py``.
Runs go seed by seed (every arm of seed 0, then seed 1, ...) and a finished (arm, seed) is kept in
``<work>/runs/`` and skipped on a rerun with the same settings, so a stopped run leaves whole
seeds (``--seeds`` can be raised later).

Run (docs/SEARCH.md)::

    PYTHONPATH=. nice -n 15 .venv/bin/python -W ignore bench/search.py --work bench/.work/search
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
    return {
        "x": [round(float(v), 6) for v in x],
        "y": [m[o] for o in objs],
        "h": [m[f"heldout:{o}"] for o in objs],
    }


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
        "run_s": round(time.time() - t0, 2),
        "load": [round(x, 2) for x in load0],
        "failed": failed,
        "cands": cands,
    }
    shutil.rmtree(d / "run" / "snapshots", ignore_errors=True)
    done_file.write_text(json.dumps({"spec": spec, "run": out}))
    return out


def _nsga2(cfg, seed: int, ctx: dict, d: Path) -> list[dict]:
    """NSGA-II (optuna's ``NSGAIISampler``, population ``cfg.initial``) over the arm's unit cube,
    sequential ask/tell; every candidate a real merge through the caching merger."""
    import optuna
    from safetensors import safe_open

    from mergepipe.catalog.objectstore import open_catalog
    from mergepipe.search.space import SearchSpace, parse_vary

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names: list[str] = []
    for f in sorted(Path(ctx["base"]).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names += list(h.keys())
    from mergepipe.methods.params import layer_count

    ev: Evals = ctx["evals"]
    space = SearchSpace(cfg.method, list(ev.domains), parse_vary(cfg.vary), layer_count(names), cfg.layer_blocks, {})
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
        m = merger.merge(cfg, {"id": i, "params": space.to_params(x)}, d, {}, cat)
        r = ev.metrics(m.snapshot if str(m.snapshot).startswith("cached:") else Path(m.snapshot))
        study.tell(trial, [r[o] for o in ev.objectives])
        out.append(_raw(x, r, ev.objectives))
    return out


# ------------------------------------------------------------------------------------------------
PREREG = ROOT / "docs" / "search" / "preregistration.json"


def _preregistered(args) -> list[tuple[list[int], list[str]]]:
    """Apply docs/search/preregistration.json to ``args`` (budget, blocks, search windows) and
    return the passes ``[(seeds, arms), ...]`` it registers; records the commit that holds it in
    ``args.prereg_commit`` (written into every run's spec, so ``--collect`` can name it).

    Raises:
        SystemExit: the file has uncommitted changes or is not committed (a pre-registration is
            committed before the fresh run), or names an unknown arm.
    """
    import subprocess

    rel = str(PREREG.relative_to(ROOT))
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", rel], capture_output=True, text=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%H", "--", rel], capture_output=True, text=True
    ).stdout.strip()
    if dirty.returncode or dirty.stdout.strip() or not commit:
        raise SystemExit(f"{rel}: not committed (or changed since); commit the pre-registration before the fresh run.")
    pr = json.loads(PREREG.read_text())
    args.evaluations = int(pr["budget"]["evaluations"])
    args.initial = int(pr["budget"]["initial"])
    args.blocks = int(pr["layer_blocks"])
    args.search_windows = int(pr["testbed"]["search_windows"])
    args.prereg_commit = commit
    seeds = [int(s) for s in pr["fresh_seeds"]]
    arms = list(pr["arms"])
    nsga = [a for a in arms if ARMS[a][1] == "nsga2"]
    return [(seeds, [a for a in arms if a not in nsga]), (seeds, nsga)]


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
    ap.add_argument("--raw", type=Path, default=ROOT / "docs" / "search" / "raw-zoo8-fresh.jsonl.gz")
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
        help="zoo8 (the 8-layer zoo) or minilm (the 6-layer MiniLM encoder, 3 tasks; development runs only "
        "so far: --fresh and --collect are zoo8's)",
    )
    ap.add_argument("--minilm-seed", type=int, default=0, help="minilm: seed of the testbed (MiniLMConfig.seed)")
    ap.add_argument("--examples", type=int, default=128, help="minilm: search (and held-out) examples per task")
    ap.add_argument("--arms", default=",".join(a for a in ARMS if a != "lw-bo-default"))
    ap.add_argument("--deadline", type=float, default=0.0, help="do not start a run after this Unix time")
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="the pre-registered fresh run: seeds, arms, budget and blocks from docs/search/preregistration.json "
        "(committed, unchanged); pass 1 the main arms, pass 2 NSGA-II",
    )
    ap.add_argument(
        "--collect",
        type=Path,
        nargs="+",
        help="write --raw from the finished (arm, seed) runs of these work folders and stop",
    )
    args = ap.parse_args(argv)
    if args.testbed != "zoo8" and (args.collect or args.fresh):
        raise SystemExit(f"--testbed {args.testbed}: --fresh and --collect are registered for zoo8 only.")
    if args.collect:
        collect(args.collect, args.raw, args.search_windows)
        return
    passes = [(list(range(args.seed_start, args.seed_start + args.seeds)), [x for x in args.arms.split(",") if x])]
    if args.fresh:
        passes = _preregistered(args)
    args.work.mkdir(parents=True, exist_ok=True)

    ev, base, experts = _testbed(args)
    ref_metrics = {"base": ev.compute(base)} | {n: ev.compute(experts[n]) for n in ev.domains}
    ref = [max(ref_metrics[n][o] for n in ev.domains) for o in ev.objectives]
    ctx = {"args": args, "work": args.work, "base": base, "experts": experts, "evals": ev, "ref": ref}
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


def collect(works: list[Path], raw: Path, search_windows: int) -> None:
    """Write the raw results file from every finished (arm, seed) run in ``works`` (one or more
    processes of ``bench/search.py`` over their own seeds, same settings; a process stopped
    mid-seed leaves its finished arms). First line the metadata: the base's and experts' losses
    (evaluated again here, once per ``works[0]``: deterministic), the arms in :data:`ARMS`
    order, per arm its seeds, wall time from the first run's start to
    the last run's end, the load average at the first run's start and now; then every run."""
    from mergepipe_zoo import ZooConfig, build_zoo
    from mergepipe_zoo.zoo import ZOO_FORMAT

    runs, specs, spans = [], set(), []
    for w in works:
        for f in sorted(w.glob("runs/*/s*/run.json")):
            d = json.loads(f.read_text())
            runs.append(d["run"])
            specs.add((d["spec"]["E"], d["spec"]["I"], d["spec"]["blocks"], d["spec"]["tag"]))
            spans.append((f.stat().st_mtime - d["run"]["run_s"], f.stat().st_mtime, d["run"]["load"]))
    if len(specs) != 1:
        raise SystemExit(f"--collect: the work folders ran different settings: {sorted(specs)}")
    E, n0, blocks, tag = specs.pop()
    zcfg = ZooConfig.deep()
    zoo = build_zoo(config=zcfg)
    ev = Evals(zoo, Path("/nonexistent"), search_windows)
    if ev.tag != tag:
        raise SystemExit(f"--collect: the runs were scored as {tag}, this zoo/--search-windows gives {ev.tag}")
    cached = works[0] / "reference.json"  # deterministic; evaluated once per collection folder
    if cached.exists() and json.loads(cached.read_text()).get("tag") == tag:
        ref_metrics = json.loads(cached.read_text())["metrics"]
    else:
        ref_metrics = {"base": ev.compute(zoo.base)} | {n: ev.compute(zoo.experts[n]) for n in DOMAINS}
        cached.write_text(json.dumps({"tag": tag, "metrics": ref_metrics}))
    import botorch
    import torch

    commits = {r.get("prereg") for r in runs}
    if len(commits) != 1:
        raise SystemExit(
            f"--collect: runs of different pre-registrations (or none and some): {sorted(map(str, commits))}"
        )
    commit = commits.pop()
    prereg = {}
    if commit:  # the registered protocol as committed, so the report applies the registered family
        import subprocess

        rel = str(PREREG.relative_to(ROOT))
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{rel}"], capture_output=True, text=True)
        if shown.returncode:
            raise SystemExit(f"--collect: cannot read {rel} at the runs' commit {commit}: {shown.stderr.strip()}")
        prereg = {"preregistration_commit": commit, "preregistration": json.loads(shown.stdout)}
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    runs.sort(key=lambda r: (r["seed"], arms.index(r["arm"])))
    first = min(spans)
    meta = {
        "testbed": "zoo8",
        "phase": "fresh" if commit else "development",
        **prereg,
        "arms": arms,
        "seeds": {a: sorted(r["seed"] for r in runs if r["arm"] == a) for a in arms},
        "evaluations": E,
        "initial": n0,
        "blocks": blocks,
        "search_windows": search_windows,
        "domains": list(DOMAINS),
        "objectives": OBJ,
        "zoo": {"key": zcfg.key(), "format": ZOO_FORMAT, "config": "ZooConfig.deep()", "layers": zcfg.num_layers},
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
        "run_s_sum": round(sum(r["run_s"] for r in runs), 1),
    }
    raw.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(raw, "wb", compresslevel=9, mtime=0) as f:
        f.write((json.dumps(meta) + "\n").encode())
        for r in runs:
            f.write((json.dumps(r) + "\n").encode())
    print(f"wrote {raw} ({raw.stat().st_size} bytes, {len(runs)} runs); python bench/search_report.py --write")


if __name__ == "__main__":
    main()
