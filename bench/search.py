"""Layer-wise merge search on the demo zoo: async prior-guided BO vs baselines (docs/SEARCH.md).

Same problem for every strategy: base + the ``python`` and ``json`` experts of the demo zoo,
task_arithmetic with ``weight`` per expert per layer block (4 blocks of the 4 layers: 8
dimensions in [0, 1]), objectives = eval loss on the python and json held-out sets (first
``--eval-batches`` batches of 16 windows), minimised; same number of evaluations; two workers, the
second slowed by ``--slow-delay`` seconds per evaluation (a slower GPU); the same reference point
for every hypervolume: per objective the worse of the two experts' losses (a merge counts when it
beats the weaker expert on both domains).

Strategies:

* ``async-prior`` (ours): asynchronous, pending-aware qLogNEHVI, discrepancy prior (catalog +
  activations on a probe text from outside the zoo: this repository's own source and JSON) and
  frontier-coverage reranking;
* ``async-noprior`` (ablation): the same asynchronous loop without the prior and the reranking
  (botorch's default lengthscale priors, the acquisition's optimum);
* ``sync-batch``: synchronous batches of 2 (joint qLogNEHVI), botorch's default priors, no
  reranking;
* ``random``: uniform random points, asynchronous dispatch;
* ``grid``: model-level grids (one weight per expert for all layers) of task_arithmetic
  (half of the budget) and ties (density 0.5, the other half), asynchronous dispatch.

Run (about 8 minutes per seed on the loaded 2-core machine)::

    PYTHONPATH=. .venv/bin/python bench/search.py --out bench/.work/search

Writes ``results.json`` (everything), ``summary.md`` (the tables of docs/SEARCH.md) and
``fronts.png``, ``trace.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import time
from pathlib import Path

from bench.relpath import rel_paths_in

ROOT = Path(__file__).resolve().parent.parent


def probe_texts() -> list[str]:
    """Probe text for the activation prior, from outside the zoo's data: this repository's
    Python source and a JSON file (the zoo's domains include python and json)."""
    py = (ROOT / "mergepipe" / "search" / "runner.py").read_text()[:6000]
    js = json.dumps(
        {
            "experts": [
                {"name": n, "weight": w, "tags": ["a", "b"], "id": i}
                for i, (n, w) in enumerate(itertools.product(["py", "json", "prose"], [0.1, 0.5]))
            ]
        }
    )
    return [py, js * 8]


def grid_points(n: int) -> list[list[float]]:
    """``n`` points of a rectangular grid on [0, 1]^2 (model-level: two weights)."""
    a = max(2, int(n**0.5))
    b = -(-n // a)
    pts = [[(i + 1) / a, (j + 1) / b] for i in range(a) for j in range(b)]
    return pts[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / ".work" / "search")
    ap.add_argument("--evaluations", type=int, default=24)
    ap.add_argument("--initial", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--slow-delay", type=float, default=8.0)
    ap.add_argument("--strategies", default="async-prior,sync-batch,random,grid")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-only", action="store_true", help="Re-plot from --out/results.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        report(json.loads((args.out / "results.json").read_text()), args.out)
        return

    from mergepipe.search.evaluators import ZooEvaluator
    from mergepipe.search.runner import SearchConfig, run_search
    from mergepipe_zoo import build_zoo

    zoo = build_zoo()
    ev = ZooEvaluator(["python", "json"], max_batches=args.eval_batches)
    t0 = time.time()
    base_loss = ev.metrics(zoo.base)
    expert_loss = {n: ev.metrics(zoo.experts[n]) for n in ("python", "json")}
    # reference point: per objective the worse of the two experts (a merge counts when it beats the
    # weaker expert on both domains); the same for every strategy
    ref = [max(v["loss:python"] for v in expert_loss.values()), max(v["loss:json"] for v in expert_loss.values())]
    experts = [["python", str(zoo.experts["python"])], ["json", str(zoo.experts["json"])]]
    common = dict(
        base=str(zoo.base),
        experts=experts,
        objectives=["loss:python", "loss:json"],
        evaluations=args.evaluations,
        workers=2,
        seed=args.seed,
        ref_point=ref,
        worker_delays=[0.0, args.slow_delay],
        catalog=str(args.out / "catalog.sqlite"),
    )
    runs = {}
    load = {}
    for strat in args.strategies.split(","):
        load[strat] = os.getloadavg()
        print(f"== {strat} (load {load[strat]})", flush=True)
        if strat == "grid":
            half = args.evaluations // 2
            parts = []
            grid = (("task_arithmetic", {}, half), ("ties", {"parameters": {"density": 0.5}}, args.evaluations - half))
            for method, fixed, n in grid:
                d = args.out / f"grid-{method}"
                shutil.rmtree(d, ignore_errors=True)
                pts = grid_points(n)
                cfg = SearchConfig(
                    **{**common, "evaluations": n},
                    method=method,
                    fixed=fixed,
                    vary=["weight=0:1"],
                    layer_blocks=1,
                    initial=n,
                    design=pts,
                    strategy="random",
                    prior=False,
                )
                parts.append(run_search(d, cfg, ev, log=print))
            runs[strat] = merge_runs(parts, ref)
            continue
        d = args.out / strat
        shutil.rmtree(d, ignore_errors=True)
        kind = {"async-prior": "async", "async-noprior": "async", "sync-batch": "sync", "random": "random"}[strat]
        prior = strat == "async-prior"
        cfg = SearchConfig(
            **common,
            method="task_arithmetic",
            vary=["weight=0:1"],
            layer_blocks=4,
            initial=args.initial,
            strategy=kind,
            prior=prior,
            probe=probe_texts() if prior else None,
        )
        runs[strat] = run_search(d, cfg, ev, log=print)
    out = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_before": load},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "reference": {"base": base_loss, "experts": expert_loss, "ref_point": ref},
        "total_s": round(time.time() - t0, 1),
        "runs": runs,
    }
    import torch

    out["machine"]["torch"] = torch.__version__
    out = rel_paths_in(out)
    (args.out / "results.json").write_text(json.dumps(out, indent=1))
    report(out, args.out)


def merge_runs(parts: list[dict], ref) -> dict:
    """The grid's two halves (run one after the other) as one run: evaluations concatenated,
    times of the second shifted by the first's wall time, hypervolume recomputed."""
    from mergepipe.search.optimizer import hypervolume, pareto_mask

    trace, shift = [], 0.0
    by_end, times = [], []
    workers: dict = {}
    for p in parts:
        by_end += p["points"]
        times += [h["t"] + shift for h in p["hypervolume"]]
        for e in p["trace"]:
            trace.append({**e, "t0": e["t0"] + shift, "t1": e["t1"] + shift})
        for k, w in p["workers"].items():
            acc = workers.setdefault(k, {"jobs": 0, "busy_s": 0.0, "wait_s": 0.0, "propose_s": 0.0})
            for f in ("jobs", "busy_s", "wait_s", "propose_s"):
                acc[f] += w[f]
        shift += p["wall_s"]
    wall = shift
    for w in workers.values():
        w["idle_fraction"] = round(1 - w["busy_s"] / wall, 4)
    hv = [{"evaluations": k, "t": times[k - 1], "hv": hypervolume(by_end[:k], ref)} for k in range(1, len(by_end) + 1)]
    mask = pareto_mask(by_end)
    return {
        "strategy": "grid",
        "evaluations": len(by_end),
        "failed": sum(p["failed"] for p in parts),
        "hypervolume": hv,
        "workers": workers,
        "wall_s": round(wall, 3),
        "trace": trace,
        "points": by_end,
        "pareto_points": [o for o, m in zip(by_end, mask) if m],
        "pareto": [q for p in parts for q in p["pareto"]],
    }


def hv_at_time(run: dict, t: float) -> float:
    best = 0.0
    for h in run["hypervolume"]:
        if h["t"] is not None and h["t"] <= t:
            best = max(best, h["hv"])
    return best


def report(res: dict, out: Path) -> None:
    """summary.md, fronts.png and trace.png from the results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    ref = res["reference"]["ref_point"]
    t_all = sorted(
        {
            round(min(r["wall_s"] for r in runs.values())),
            round(min([r["wall_s"] for n, r in runs.items() if n.startswith(("async", "sync"))] or [0])),
        }
        - {0}
    )
    n_eq = [k for k in (8, 16, 24, 32) if all(r["evaluations"] >= k for r in runs.values())]
    lines = [
        "| strategy | evaluations (failed) | "
        + " | ".join(f"HV @ {k} evals" for k in n_eq)
        + "".join(f" | HV @ {t} s" for t in t_all)
        + " | wall s | idle fraction w0 / w1 | Pareto points |",
        "|---|---|" + "---|" * (len(n_eq) + len(t_all)) + "---|---|---|",
    ]
    for name, r in runs.items():
        hv = {h["evaluations"]: h["hv"] for h in r["hypervolume"]}
        idle = " / ".join(f"{r['workers'][w]['idle_fraction']:.2f}" for w in sorted(r["workers"]))
        npar = len(r.get("pareto_points") or r["pareto"])
        lines.append(
            f"| {name} | {r['evaluations']} ({r['failed']}) | "
            + " | ".join(f"{hv.get(k, 0):.4f}" for k in n_eq)
            + "".join(f" | {hv_at_time(r, t):.4f}" for t in t_all)
            + f" | {r['wall_s']:.0f} | {idle} | {npar} |"
        )
    b, e = res["reference"]["base"], res["reference"]["experts"]
    head = [
        f"Reference point (worse expert per objective): loss:python {ref[0]:.4f}, loss:json {ref[1]:.4f}; "
        f"base {b['loss:python']:.4f} / {b['loss:json']:.4f}; python expert {e['python']['loss:python']:.4f} / {e['python']['loss:json']:.4f}, "
        f"json expert {e['json']['loss:python']:.4f} / {e['json']['loss:json']:.4f}. "
        f"Total benchmark time {res['total_s']:.0f} s.",
        "",
    ]
    (out / "summary.md").write_text("\n".join(head + lines) + "\n")
    print("\n".join(head + lines))

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {"async-prior": "C3", "async-noprior": "C1", "sync-batch": "C0", "random": "C7", "grid": "C2"}
    for name, r in runs.items():
        pts = r["points"]
        from mergepipe.search.optimizer import pareto_mask

        ax[0].scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.4, color=colors.get(name))
        fr = sorted(p for p, m in zip(pts, pareto_mask(pts)) if m)
        ax[0].step([p[0] for p in fr], [p[1] for p in fr], where="post", color=colors.get(name), label=name)
        ax[1].plot(
            [h["evaluations"] for h in r["hypervolume"]],
            [h["hv"] for h in r["hypervolume"]],
            color=colors.get(name),
            label=name,
        )
        ax[2].step(
            [0] + [h["t"] for h in r["hypervolume"]],
            [0] + [h["hv"] for h in r["hypervolume"]],
            where="post",
            color=colors.get(name),
            label=name,
        )
    ax[0].scatter([ref[0]], [ref[1]], marker="x", color="k", label="reference point")
    ax[0].scatter([b["loss:python"]], [b["loss:json"]], marker="o", color="k", label="base")
    for n, m in (("python", "^"), ("json", "s")):
        ax[0].scatter([e[n]["loss:python"]], [e[n]["loss:json"]], marker=m, color="k", label=f"{n} expert")
    ax[0].set_xlabel("eval loss python (nats/token)")
    ax[0].set_ylabel("eval loss json (nats/token)")
    ax[0].set_title("evaluated merges and Pareto fronts")
    ax[0].legend(fontsize=7)
    ax[1].set_xlabel("evaluations")
    ax[1].set_ylabel("hypervolume")
    ax[1].set_title("hypervolume vs evaluations")
    ax[2].set_xlabel("wall time (s)")
    ax[2].set_title("hypervolume vs wall time")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fronts.png", dpi=110)

    show = [n for n in ("async-prior", "sync-batch") if n in runs]
    fig, axs = plt.subplots(len(show), 1, figsize=(12, 1.6 * len(show) + 0.8), squeeze=False)
    kc = {"merge": "C1", "eval": "C2", "propose": "C3", "wait": "C7", "barrier": "C0"}
    for ax_, name in zip(axs[:, 0], show):
        for e in runs[name]["trace"]:
            ax_.barh(e["worker"], e["t1"] - e["t0"], left=e["t0"], color=kc[e["kind"]], height=0.6)
        ax_.set_yticks([-1, 0, 1], ["proposer", "worker 0", "worker 1 (slow)"])
        ax_.set_title(
            f"{name}: merge (orange), eval (green), propose (red), barrier wait (blue), wait for proposer (grey)",
            fontsize=9,
        )
    axs[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out / "trace.png", dpi=110)


if __name__ == "__main__":
    main()
