"""Quality under an expert-I/O budget: how close is a budgeted merge to the full-budget one?

On the demo zoo (:mod:`mergepipe.zoo`: a small Llama pretrained offline and full fine-tunes of it
on four text domains) with K = 4 experts (one per domain, the demo's zoo) and K = 8 (two per
domain, ``ZooConfig(n_experts_per_domain=2)``), for each merge method this merges all K experts
through the public pipeline (:func:`mergepipe.pipeline.merge`, what ``mergepipe merge`` runs):

* once at unlimited budget (the reference "full" merge),
* at expert budgets of 1 %, 2 %, 5 %, 10 %, 25 %, 50 %, 75 % and 100 % of the experts' bytes,
* in fidelity mode (``--fidelity 0.9, 0.95, 0.99``),

and records per point: the expert bytes read (the storage layer's counters, from the manifest),
the plan's retained energy ``E``, the relative distance to the full merge
``‖θ_budget − θ_full‖ / ‖θ_full − θ_base‖`` (float64 sums over every floating tensor of the
committed checkpoints), the prediction ``sqrt(1 − E)`` for it (see docs/QUALITY.md) and the mean
per-token loss on each domain's held-out set (:func:`mergepipe.zoo.evaluate`) and their mean.

One command, rerunnable: zoo builds are cached (``~/.mergepipe/zoo``); snapshots, the catalog and
the eval losses (keyed by snapshot id) are cached under ``--work``, so a rerun re-merges and
re-evaluates only what is missing. Nothing is skipped: a point that fails is recorded with its
error and the script exits with status 1 after writing the results.

    python bench/quality.py     # full sweep -> docs/quality/{quality.json,*.png}, tables in docs/QUALITY.md
    python bench/quality.py --report-only docs/quality/quality.json   # tables + plots only

Method parameters (mergekit names): ties ``density=0.5`` (weight 1, normalize true: the mean of
the sign-agreeing trimmed task vectors); dare_ties ``density=0.5`` with ``weight=1/K``
(mergekit's defaults normalize false, rescale true); task_arithmetic ``weight=1/K`` (the average
task vector). ``--seed 0`` for DARE's random masks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.relpath import rel_text  # noqa: E402

BUDGETS = (1, 2, 5, 10, 25, 50, 75, 100)
FIDELITIES = (0.9, 0.95, 0.99)
METHODS = ("ties", "dare_ties", "task_arithmetic")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def method_params(method: str, k: int) -> list[str]:
    """``--param`` values used for ``method`` with ``k`` experts (see the module docstring)."""
    w = f"weight={1.0 / k:.6g}"
    return {"ties": ["density=0.5"], "dare_ties": ["density=0.5", w], "task_arithmetic": [w]}[method]


def machine_info() -> dict:
    """bench.run's machine description plus the torch version."""
    import torch

    from bench.run import machine_info as _machine

    return {**_machine(), "torch": torch.__version__}


# ------------------------------------------------------------------------------------------
# measurements


def load_floats(folder: Path) -> dict:
    """Every floating tensor of a safetensors checkpoint folder, as float64 torch tensors."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if t.dtype.is_floating_point:
                    out[name] = t.to(torch.float64)
    if not out:
        raise FileNotFoundError(f"{folder}: no floating tensors in *.safetensors")
    return out


def sq_dist(a: dict, b: dict) -> float:
    """``‖a − b‖²`` over all tensors (float64; same names and shapes required)."""
    if a.keys() != b.keys():
        raise ValueError(f"tensor names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    return math.fsum(float(((a[n] - b[n]) ** 2).sum()) for n in a)


class Evals:
    """Per-domain eval losses cached in JSON files by model identity (snapshot id or zoo name).

    Safe for sweeps running as parallel processes (e.g. one per ``--methods``): a model is
    evaluated under a per-key ``fcntl`` lock (a second process waits and reuses the result) and
    each file is updated read-modify-write under its own lock. ``also`` are further cache files
    consulted (read-only) before evaluating."""

    runs = 0  # evaluations actually run by this process (not served from a cache)

    def __init__(self, path: Path, zoo, also: tuple[Path, ...] = ()) -> None:
        self.path, self.zoo, self.also = path, zoo, also
        self.locks = path.parent / ".locks"
        self.locks.mkdir(exist_ok=True)

    def _load(self) -> dict:
        out = {}
        for p in (*self.also, self.path):
            if p.exists():
                out.update(json.loads(p.read_text()))
        return out

    def __call__(self, key: str, folder: Path) -> dict:
        import fcntl

        from mergepipe.zoo import evaluate

        with open(self.locks / f"{key}.lock", "a+") as lk:
            fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
            cached = self._load()
            if key in cached:
                return cached[key]
            loss = evaluate(folder, self.zoo)
            Evals.runs += 1
            with open(self.locks / f"{self.path.name}.lock", "a+") as fl:
                fcntl.flock(fl.fileno(), fcntl.LOCK_EX)
                cur = json.loads(self.path.read_text()) if self.path.exists() else {}
                cur[key] = loss
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(cur, indent=1, sort_keys=True))
                tmp.replace(self.path)
            return loss


def mean(d: dict) -> float:
    return sum(d.values()) / len(d)


def sweep_k(k: int, methods, budgets, fidelities, work: Path, zoo_root: Path | None, errors: list) -> dict:
    """All points for one zoo size; see the module docstring."""
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from mergepipe.zoo import ZooConfig, build_zoo

    if k % 4:
        raise SystemExit(f"--k {k}: the zoo has 4 domains; K must be a multiple of 4")
    cfg = ZooConfig(n_experts_per_domain=k // 4)
    t0 = time.perf_counter()
    zoo = build_zoo(zoo_root, cfg, log=log)
    zoo_s = time.perf_counter() - t0
    log(f"K={k}: zoo {cfg.key()} ready in {zoo_s:.1f} s")
    wd = work / cfg.key()
    wd.mkdir(parents=True, exist_ok=True)
    cat = Catalog(wd / "catalog.sqlite")
    ev = Evals(wd / "evals.json", zoo)
    experts = [(n, str(p)) for n, p in zoo.experts.items()]
    res_k: dict = {"zoo_key": cfg.key(), "zoo_build_s": round(zoo_s, 1), "experts": [n for n, _ in experts],
                   "base": ev(f"zoo:{cfg.key()}:base", zoo.base), "expert_losses": {}, "methods": {}}
    for n, p in zoo.experts.items():
        res_k["expert_losses"][n] = ev(f"zoo:{cfg.key()}:{n}", p)
    base_t = load_floats(zoo.base)

    for method in methods:
        params = method_params(method, k)
        ev_m = Evals(wd / f"evals-{method}.json", zoo, also=(wd / "evals.json",))

        def run(tag: str, budget=None, fidelity=None, method=method, params=params) -> tuple[dict, Path]:
            out = wd / method / tag
            t = time.perf_counter()
            r = merge(str(zoo.base), experts, method, str(out), params, budget=budget, fidelity=fidelity,
                      seed=0, catalog=cat, storage=LocalStorage(IOCounters()))
            s = r.summary()
            pt = {
                "tag": tag, "budget": budget, "fidelity": fidelity, "snapshot_id": s["snapshot_id"],
                "expert_budget_bytes": s["io"]["expert_budget_bytes"],
                "expert_read_bytes": s["io"]["expert_read_bytes"],
                "planned_expert_read_bytes": s["io"]["planned_expert_read_bytes"],
                "expert_bytes_total": s["io"]["expert_bytes_total"],
                "retained_energy": s["retained_energy"],
                "merge_wall_s": s["wall_s"], "already_committed": s["already_committed"],
                "tensors_merged": sum(1 for tp in r.plan.tensors if tp.experts),
            }
            pt["read_fraction"] = pt["expert_read_bytes"] / pt["expert_bytes_total"]
            log(f"K={k} {method} {tag}: read {pt['read_fraction']:.2%} of expert bytes, "
                f"E={pt['retained_energy']:.4f} ({time.perf_counter() - t:.1f} s)")
            return pt, Path(r.out)

        try:
            full, full_dir = run("full")
        except Exception as e:  # recorded and reported; the method's other points need the full merge
            errors.append(f"K={k} {method} full: {type(e).__name__}: {e}")
            log(errors[-1])
            continue
        full_t = load_floats(full_dir)
        den = sq_dist(full_t, base_t)
        full["losses"] = ev_m(full["snapshot_id"], full_dir)
        full["mean_loss"] = mean(full["losses"])
        full["rel_distance"], full["predicted_distance"] = 0.0, 0.0
        full["task_vector_norm"] = math.sqrt(den)
        points = []
        specs = [(f"{b}pct", f"{b}%", None) for b in budgets] + [(f"fid{f:g}", None, f) for f in fidelities]
        for tag, budget, fidelity in specs:
            try:
                pt, d = run(tag, budget, fidelity)
                t = load_floats(d)
                pt["rel_distance"] = math.sqrt(sq_dist(t, full_t) / den) if den > 0 else 0.0
                pt["predicted_distance"] = math.sqrt(max(0.0, 1.0 - pt["retained_energy"]))
                pt["losses"] = ev_m(pt["snapshot_id"], d)
                pt["mean_loss"] = mean(pt["losses"])
                pt["mean_loss_rel_to_full"] = pt["mean_loss"] / full["mean_loss"] - 1.0
                points.append(pt)
                del t
            except Exception as e:
                errors.append(f"K={k} {method} {tag}: {type(e).__name__}: {e}")
                log(errors[-1])
        res_k["methods"][method] = {"params": params, "full": full, "points": points}
    return res_k


# ------------------------------------------------------------------------------------------
# report


def summary_md(res: dict, at: str = "25%") -> str:
    """One row per (K, method): the point at expert budget ``at`` against the full merge."""
    lines = [f"| K | method | expert read at {at} budget | retained E | rel. distance | √(1−E) | "
             "mean loss full | mean loss at budget | Δ vs full | within ±1% | at most +1% |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for k, rk in res["by_k"].items():
        for method, rm in rk["methods"].items():
            for p in rm["points"]:
                if p["budget"] == at:
                    d = p["mean_loss_rel_to_full"]
                    lines.append(
                        f"| {k} | {method} | {p['read_fraction']:.2%} | {p['retained_energy']:.4f} | "
                        f"{p['rel_distance']:.4f} | {p['predicted_distance']:.4f} | {rm['full']['mean_loss']:.4f} | "
                        f"{p['mean_loss']:.4f} | {d:+.2%} | {'yes' if abs(d) <= 0.01 else 'no'} | "
                        f"{'yes' if d <= 0.01 else 'no'} |")
    return "\n".join(lines)


def tables_md(res: dict) -> str:
    """Markdown tables of a results dict: per K the base and experts, then per method every
    budget and fidelity point."""
    lines = []
    for k, rk in res["by_k"].items():
        doms = list(rk["base"])
        lines.append(f"### K = {k} experts (zoo `{rk['zoo_key']}`)\n")
        lines.append("| model | " + " | ".join(doms) + " | mean |")
        lines.append("|---|" + "---:|" * (len(doms) + 1))
        rows = [("base", rk["base"])] + [(f"expert {n}", v) for n, v in rk["expert_losses"].items()]
        for name, losses in rows:
            lines.append(f"| {name} | " + " | ".join(f"{losses[d]:.3f}" for d in doms) + f" | {mean(losses):.3f} |")
        lines.append("")
        for method, rm in rk["methods"].items():
            f = rm["full"]
            lines.append(f"**{method}** (`{' '.join('--param ' + p for p in rm['params'])}`), full merge: "
                         f"reads {f['expert_read_bytes'] / 2**20:.2f} MiB of {f['expert_bytes_total'] / 2**20:.2f} MiB, "
                         f"mean loss {f['mean_loss']:.4f}\n")
            lines.append("| budget | expert read | retained E | rel. distance | √(1−E) | "
                         + " | ".join(doms) + " | mean | Δ mean vs full |")
            lines.append("|---|---:|---:|---:|---:|" + "---:|" * (len(doms) + 2))
            for p in rm["points"]:
                lab = p["budget"] if p["budget"] else f"fidelity {p['fidelity']:g}"
                lines.append(
                    f"| {lab} | {p['read_fraction']:.2%} | {p['retained_energy']:.4f} | {p['rel_distance']:.4f} | "
                    f"{p['predicted_distance']:.4f} | " + " | ".join(f"{p['losses'][d]:.3f}" for d in doms)
                    + f" | {p['mean_loss']:.4f} | {p['mean_loss_rel_to_full']:+.2%} |")
            lines.append("")
    return "\n".join(lines)


def plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(res["by_k"])
    colors = {"ties": "C0", "dare_ties": "C1", "task_arithmetic": "C2"}
    files = []

    def xticks(ax):
        from matplotlib.ticker import FixedLocator, NullLocator

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator([1, 2, 5, 10, 25, 50, 100]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels(["1", "2", "5", "10", "25", "50", "100"])

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    def budget_points(rm):
        return [p for p in rm["points"] if p["budget"]]

    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.2), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rk = res["by_k"][k]
        for method, rm in rk["methods"].items():
            pts = budget_points(rm)
            c = colors.get(method)
            ax.plot([100 * p["read_fraction"] for p in pts], [p["mean_loss"] for p in pts], "o-", color=c,
                    label=f"{method}")
            ax.axhline(rm["full"]["mean_loss"], color=c, ls=":", lw=1)
            ax.axhspan(rm["full"]["mean_loss"] * 0.99, rm["full"]["mean_loss"] * 1.01, color=c, alpha=0.08)
        ax.axhline(mean(rk["base"]), color="gray", ls="--", lw=1, label="base model")
        ax.axvline(25, color="k", lw=0.5)
        xticks(ax)
        ax.set_xlabel("expert bytes read (% of the experts' bytes)")
        ax.set_ylabel("mean per-domain eval loss (nats/token)")
        ax.set_title(f"K = {k}: dotted = full-budget merge, band = ±1%")
        ax.legend(fontsize=8)
    save(fig, "loss_vs_budget.png")

    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.2), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for method, rm in res["by_k"][k]["methods"].items():
            pts = [p for p in budget_points(rm) if p["rel_distance"] > 0 or p["predicted_distance"] > 0]
            c = colors.get(method)
            ax.plot([100 * p["read_fraction"] for p in pts], [p["rel_distance"] for p in pts], "o-", color=c,
                    label=f"{method} measured")
            ax.plot([100 * p["read_fraction"] for p in pts], [p["predicted_distance"] for p in pts], "x--", color=c,
                    lw=1, label=f"{method} √(1−E)")
        xticks(ax)
        ax.set_xlabel("expert bytes read (% of the experts' bytes)")
        ax.set_ylabel("‖θ_budget − θ_full‖ / ‖θ_full − θ_base‖")
        ax.set_title(f"K = {k}: relative distance to the full-budget merge")
        ax.legend(fontsize=7)
    save(fig, "distance_vs_budget.png")

    fig, ax = plt.subplots(figsize=(5.5, 5))
    hi = 0.0
    for k in ks:
        for method, rm in res["by_k"][k]["methods"].items():
            pts = rm["points"]
            xs = [p["predicted_distance"] for p in pts]
            ys = [p["rel_distance"] for p in pts]
            hi = max([hi, *xs, *ys])
            ax.scatter(xs, ys, color=colors.get(method), marker="o" if k == ks[0] else "^", s=22,
                       label=f"{method}, K={k}")
    ax.plot([0, hi], [0, hi], "k-", lw=0.6, label="measured = √(1−E)")
    ax.set_xlabel("√(1 − retained energy E) from the plan")
    ax.set_ylabel("measured relative distance to the full merge")
    ax.set_title("planner estimate vs measurement (budget + fidelity points)")
    ax.legend(fontsize=7)
    save(fig, "distance_vs_energy.png")
    return files


BEGIN, END = "<!-- quality tables: begin (generated by bench/quality.py) -->", "<!-- quality tables: end -->"


def report(res: dict, out: Path, doc: Path | None) -> None:
    """Plots into ``out``; tables into ``doc`` between the BEGIN/END markers (or, without a
    ``doc`` or markers in it, into ``out/tables.md``)."""
    files = plots(res, out)
    cached = (f" ({res['merges_run']} of {res['merges_total']} merges and {res['evaluations_run']} evaluations run, "
              "the rest served from the caches)") if "merges_run" in res else ""
    text = (f"Sweep: `{res['command']}`, wall {res['wall_s']:.0f} s{cached}, load average "
            f"{' '.join(res['machine']['loadavg_start'])} at start, {' '.join(res['loadavg_end'])} at end.\n\n"
            + summary_md(res) + "\n\n" + tables_md(res))
    if doc is not None and doc.exists() and BEGIN in (cur := doc.read_text()) and END in cur:
        head, rest = cur.split(BEGIN, 1)
        doc.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
        where = doc
    else:
        where = out / "tables.md"
        where.write_text(BEGIN + "\n" + text + "\n" + END + "\n")
    log(f"wrote tables to {where} and {', '.join(files)} to {out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8], help="expert counts (multiples of 4)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), help="expert budgets in %% of the experts' bytes")
    ap.add_argument("--fidelities", type=float, nargs="*", default=list(FIDELITIES))
    ap.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "quality",
                    help="snapshots, catalog and eval cache (reused by reruns)")
    ap.add_argument("--zoo-root", type=Path, default=None, help="zoo cache [default: ~/.mergepipe/zoo]")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "quality",
                    help="folder for quality.json and the PNG plots")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "QUALITY.md",
                    help="markdown file whose generated-tables section is replaced (tables.md in --out otherwise)")
    ap.add_argument("--report-only", type=Path, default=None, metavar="RESULTS_JSON",
                    help="only rebuild the tables and the plots from a quality.json")
    a = ap.parse_args(argv)
    if a.report_only:
        res = json.loads(a.report_only.read_text())
        a.out.mkdir(parents=True, exist_ok=True)
        report(res, a.out, a.doc)
        return
    import torch

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    errors: list[str] = []
    res = {"command": rel_text("python bench/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)),
           "machine": machine_info(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "by_k": {}}
    for k in a.k:
        res["by_k"][str(k)] = sweep_k(k, a.methods, [f"{b:g}" for b in a.budgets], a.fidelities, a.work,
                                      a.zoo_root, errors)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["evaluations_run"] = Evals.runs
    res["merges_run"] = sum(1 for rk in res["by_k"].values() for rm in rk["methods"].values()
                            for p in [rm["full"], *rm["points"]] if not p["already_committed"])
    res["merges_total"] = sum(1 + len(rm["points"]) for rk in res["by_k"].values() for rm in rk["methods"].values())
    res["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    res["errors"] = errors
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "quality.json").write_text(json.dumps(res, indent=1) + "\n")
    report(res, a.out, a.doc)
    log(f"sweep done in {res['wall_s']:.1f} s")
    if errors:
        log(f"{len(errors)} point(s) FAILED:\n  " + "\n  ".join(errors))
        sys.exit(1)


if __name__ == "__main__":
    main()
