"""Quality under an expert-I/O budget, judged per task: does a budgeted merge keep the full merge's gain?

Three testbeds where merging helps (see docs/QUALITY.md):

* ``zoo``: :mod:`mergepipe_zoo.zoo`, a small Llama pretrained offline on four text domains and
  one short, low-learning-rate fine-tune per domain (build gates: each expert best on its domain,
  the full task_arithmetic merge beats the base and keeps >= 30% of every expert's gain);
  quality = per-domain held-out loss;
* ``minilm``: :mod:`mergepipe_zoo.minilm`, the pretrained MiniLM encoder fully fine-tuned on
  three classification tasks with their own heads; quality = per-task accuracy.
* ``vision``: :mod:`mergepipe_zoo.vision`, a 0.49 M-parameter CNN (4-D conv weights) on
  scikit-learn's 8x8 digits, four experts fine-tuned from a task-mix base, checkpoints in bf16
  or fp32 (``--size``); quality = per-task held-out cross-entropy.

For every seed (a new testbed build per seed: other data order, other fine-tunes; DARE's masks
use the same seed) and merge method this merges all experts through the public pipeline
(:func:`mergepipe.pipeline.merge`, what ``mergepipe merge`` runs) once at unlimited budget (the
*full* merge) and at each expert budget with each planner block value (``energy``; ``fisher``
with a calibration set of training text: the zoo's documents, the MiniLM testbed's
``calibration.jsonl``), scores each snapshot with
:func:`mergepipe.evaluate.evaluate_checkpoint` (what ``mergepipe eval SNAPSHOT --testbed ...``
prints) and records per task the normalised gain NG = (q_merge − q_base)/(q_expert − q_base) and,
for budgeted merges, the kept share NG_budget/NG_full; then the worst task, and means with 95%
Student-t and bootstrap intervals over seeds (:mod:`mergepipe.metrics`).

    python bench/quality.py --testbed zoo --size tiny --seeds 0 1 2      # -> docs/quality/zoo-tiny.json
    python bench/quality.py --testbed minilm --seeds 0 1 2                 # -> docs/quality/minilm.json (development; not committed)
    python bench/quality.py --testbed vision --size bf16 --seeds 0         # -> docs/quality/vision-bf16.json (development)
    python bench/quality.py --report-only                                 # tables + plots from the JSONs

Cached: testbed builds (``~/.mergepipe``), snapshots, catalog and evaluations (keyed by snapshot
id) under ``--work``, so a rerun does only what is missing. A failed point is recorded with its
error and the script exits 1 after writing the results.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BUDGETS = (5, 10, 25, 50)
METHODS = ("task_arithmetic", "ties", "dare_ties")
TARGET_BUDGET, TARGET_KEPT = "25", 0.90
OUT = REPO / "docs" / "quality"
DOC = REPO / "docs" / "QUALITY.md"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def method_params(method: str, weight: float) -> list[str]:
    """``--param`` values of ``method``: task_arithmetic ``weight=λ`` (the testbed's recommended
    task-arithmetic scale); ties ``density=0.5`` (mergekit defaults: weight 1, normalize true:
    the mean of the sign-agreeing trimmed task vectors); dare_ties ``density=0.5 weight=λ``
    (mergekit defaults normalize false, rescale true)."""
    w = f"weight={weight:g}"
    return {"task_arithmetic": [w], "ties": ["density=0.5"], "dare_ties": ["density=0.5", w]}[method]


class Evals:
    """Per-task metrics cached in one JSON file by model identity (snapshot id or testbed name),
    safe for parallel sweeps (fcntl locks)."""

    runs = 0

    def __init__(self, path: Path, testbed: Path, per_item: bool = False, kind: str = "") -> None:
        self.path, self.testbed, self.per_item, self.kind = path, testbed, per_item, kind

    def __call__(self, key: str, folder: Path) -> dict:
        from mergepipe.evaluate import evaluate_checkpoint

        with open(str(self.path) + ".lock", "a+") as lk:
            fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
            cur = json.loads(self.path.read_text()) if self.path.exists() else {}
            if key in cur:
                return cur[key]
        if self.kind == "image-classification":  # the vision testbed scores its own CNN
            from mergepipe_zoo.vision import evaluate

            r = evaluate(folder, self.testbed, per_item=self.per_item)
        else:
            r = evaluate_checkpoint(folder, self.testbed, per_item=self.per_item)
        Evals.runs += 1
        with open(str(self.path) + ".lock", "a+") as lk:
            fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
            cur = json.loads(self.path.read_text()) if self.path.exists() else {}
            cur[key] = r
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cur, indent=1, sort_keys=True))
            tmp.replace(self.path)
        return r


def build(testbed: str, size: str, seed: int):
    """(testbed folder, base, {expert: folder}, {expert: task}, metric, recommended weight, calibration texts)."""
    if testbed == "zoo":
        from mergepipe_zoo.zoo import DOMAINS, ZooConfig, _corpora, build_zoo

        cfg = ZooConfig.tiny(seed=seed) if size == "tiny" else ZooConfig(seed=seed)
        z = build_zoo(None, cfg, log=log)
        corp = _corpora(cfg)
        cal = [doc for d in DOMAINS for doc in corp[d][0][:16]]  # training text, never the probe sets
        tb = json.loads((z.root / "testbed.json").read_text())
        return (
            z.root,
            z.base,
            z.experts,
            tb["expert_task"],
            "loss",
            tb["recommended_params"]["task_arithmetic"]["weight"],
            cal,
            cfg.key(),
        )
    if testbed == "vision":
        from mergepipe_zoo.vision import VisionConfig, build_vision

        vc = VisionConfig(seed=seed)
        v = build_vision(None, vc, log=log)
        tb = json.loads((v.root / "testbed.json").read_text())
        vbase, vexperts = v.checkpoints({"bf16": "bfloat16", "fp32": "float32"}[size])
        # no calibration set: the Fisher value needs an LM or encoder (energy only)
        return v.root, vbase, vexperts, tb["expert_task"], tb["metric"], vc.merge_weight, None, f"{vc.key()}-{size}"
    from mergepipe_zoo.minilm import MiniLMConfig, build_minilm

    cfg = MiniLMConfig(seed=seed)
    m = build_minilm(None, cfg, log=log)
    tb = json.loads((m.root / "testbed.json").read_text())
    # the testbed's own calibration set: training texts of every task, never held-out ones
    cal = [json.loads(line)["text"] for line in (m.root / tb["calibration"]).read_text().splitlines() if line.strip()]
    return (
        m.root,
        m.base,
        m.experts,
        tb["expert_task"],
        "accuracy",
        tb["recommended_params"]["task_arithmetic"]["weight"],
        cal,
        cfg.key(),
    )


def checkpoint_dtype(folder: Path) -> str:
    """The tensor dtypes of a safetensors checkpoint folder, e.g. ``"BF16"`` or ``"F32"`` (sorted,
    comma-joined when mixed), read from the files' headers (no tensor data is loaded)."""
    from safetensors import safe_open

    dts: set[str] = set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            dts.update(str(h.get_slice(k).get_dtype()) for k in h.keys())
    return ",".join(sorted(dts))


def sweep_seed(a, seed: int, errors: list) -> dict:
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.metrics import kept_share, normalised_gain, worst
    from mergepipe.pipeline import merge
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    t0 = time.perf_counter()
    root, base, experts, task_of, metric, weight, cal_texts, key = build(a.testbed, a.size, seed)
    build_s = time.perf_counter() - t0
    wd = a.work / f"{a.testbed}-{key}"
    wd.mkdir(parents=True, exist_ok=True)
    cat = Catalog(wd / "catalog.sqlite")
    kind = json.loads((Path(root) / "testbed.json").read_text()).get("kind", "")
    ev = Evals(wd / ("evals-items.json" if a.items else "evals.json"), root, per_item=a.items, kind=kind)
    hib = metric == "accuracy"

    def q(r: dict) -> dict:
        return {t: v[metric] for t, v in r.items()}

    def items(r: dict) -> dict:
        """per task, the per-item metric (window loss / example correct), rounded: the unit a
        test-set bootstrap resamples (docs/quality/preregistration.json)"""
        return {t: [round(float(x), 5) for x in v["items"]] for t, v in r.items()} if a.items else {}

    rb = ev("base", base)
    re_ = {n: ev(f"expert:{n}", p) for n, p in experts.items()}
    base_q = q(rb)
    exp_q = {n: q(r) for n, r in re_.items()}
    own = {task_of[n]: exp_q[n][task_of[n]] for n in experts}
    # a task whose expert does not beat the base has no normalised gain: judged by the others, reported
    gains = {t: (own[t] - base_q[t]) if hib else (base_q[t] - own[t]) for t in own}
    undefined = sorted(t for t, g in gains.items() if not g > 0)
    if undefined:
        log(f"seed {seed}: expert not better than the base on {undefined}; normalised gains over the other tasks")
    cal = None
    if cal_texts is not None and "fisher" in a.values:
        cal = wd / "calibration.jsonl"
        cal.write_text("".join(json.dumps({"text": t}) + "\n" for t in cal_texts))
    res = {
        "seed": seed,
        "key": key,
        "build_s": round(build_s, 1),
        "metric": metric,
        "dtype": checkpoint_dtype(next(iter(experts.values()))),
        "base": base_q,
        "experts": exp_q,
        "expert_task": task_of,
        "weight": weight,
        "undefined_ng": undefined,
        "methods": {},
    }
    if a.items:
        res["base_items"] = items(rb)
        res["expert_items"] = {n: items(r) for n, r in re_.items()}
    ex = [(n, str(p)) for n, p in experts.items()]
    for method in a.methods:
        params = method_params(method, weight)

        def run(
            tag: str, budget=None, value="energy", method: str = method, params: list = params, sketch: str = "none"
        ) -> dict:
            t = time.perf_counter()
            r = merge(
                str(base),
                ex,
                method,
                str(wd / method / tag),
                params,
                budget=budget,
                seed=seed,
                catalog=cat,
                storage=LocalStorage(IOCounters()),
                value=value,
                calibration=str(cal) if value == "fisher" else None,
                sketch=sketch,
            )
            s = r.summary()
            rm = ev(s["snapshot_id"], Path(r.out))
            qm = q(rm)
            pt = {
                "tag": tag,
                "budget": budget,
                # the planner setting: block value, with fidelity tiers "+sign1" (sketch reads)
                "value": value if sketch == "none" else f"{value}+{sketch}",
                "sketch": sketch,
                "sketch_read_fraction": s["io"].get("planned_sketch_read_bytes", 0) / s["io"]["expert_bytes_total"],
                "snapshot_id": s["snapshot_id"],
                "quality": qm,
                "read_fraction": s["io"]["expert_read_bytes"] / s["io"]["expert_bytes_total"],
                "retained_value": s["retained_energy"],
                "merge_s": round(time.perf_counter() - t, 1),
            }
            if a.items:
                pt["items"] = items(rm)
            pt["ng"] = normalised_gain(
                {t: v for t, v in qm.items() if t not in undefined}, base_q, own, higher_is_better=hib
            )
            pt["worst_ng"] = worst(pt["ng"])
            log(
                f"seed {seed} {method} {tag}: read {pt['read_fraction']:.1%}, worst NG {pt['worst_ng'][0]} "
                f"{pt['worst_ng'][1]:+.3f}"
            )
            return pt

        try:
            full = run("full")
        except Exception as e:
            errors.append(f"seed {seed} {method} full: {type(e).__name__}: {e}")
            log(errors[-1])
            continue
        points = []
        for b in a.budgets:
            for v, sk in [(v, sk) for sk in a.sketches for v in a.values]:
                if v == "fisher" and cal is None:
                    continue
                try:
                    tag = f"{b:g}pct-{v}" + ("" if sk == "none" else f"-{sk}")
                    pt = run(tag, f"{b:g}%", v, sketch=sk)
                    if all(x > 0 for x in full["ng"].values()):
                        pt["kept"] = kept_share(pt["ng"], full["ng"])
                        pt["worst_kept"] = worst(pt["kept"])
                    points.append(pt)
                except Exception as e:
                    errors.append(f"seed {seed} {method} {b}% {v} {sk}: {type(e).__name__}: {e}")
                    log(errors[-1])
        res["methods"][method] = {"params": params, "full": full, "points": points}
    return res


# ------------------------------------------------------------------------------------------ report


def aggregate(res: dict) -> dict:
    """{method: {"full": {...}, (budget, value): {...}}}: means and CIs over seeds of the full
    merge's worst NG and of the budgeted merges' worst kept share and per-task kept share."""
    from mergepipe.metrics import summarise

    out: dict = {}
    seeds = res["seeds"]
    methods = sorted({m for s in seeds for m in s["methods"]}, key=lambda m: METHODS.index(m) if m in METHODS else 9)
    for m in methods:
        runs = [s["methods"][m] for s in seeds if m in s["methods"]]
        agg = {
            "full_worst_ng": summarise([r["full"]["worst_ng"][1] for r in runs]),
            "full_ng": {
                t: summarise([r["full"]["ng"][t] for r in runs if t in r["full"]["ng"]])
                for t in dict.fromkeys(t for r in runs for t in r["full"]["ng"])
            },
            "points": {},
        }
        keys = sorted(
            {(p["budget"], p["value"]) for r in runs for p in r["points"]},
            key=lambda k: (float(k[0].rstrip("%")), "+" in k[1], k[1]),
        )
        for b, v in keys:
            pts = [p for r in runs for p in r["points"] if p["budget"] == b and p["value"] == v]
            d = {
                "n": len(pts),
                "read_fraction": sum(p["read_fraction"] for p in pts) / len(pts),
                "sketch_read_fraction": sum(p.get("sketch_read_fraction", 0.0) for p in pts) / len(pts),
                "worst_ng": summarise([p["worst_ng"][1] for p in pts]),
            }
            kp = [p for p in pts if "kept" in p]
            if kp:
                d["worst_kept"] = summarise([p["worst_kept"][1] for p in kp])
                d["kept"] = {
                    t: summarise([p["kept"][t] for p in kp if t in p["kept"]])
                    for t in dict.fromkeys(t for p in kp for t in p["kept"])
                }
                d["kept_n"] = len(kp)
            agg["points"][f"{b}|{v}"] = d
        out[m] = agg
    return out


def _ci(s: dict, pct: bool = True) -> str:
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:+.2f}")
    if s["n"] < 2:
        return f(s["mean"])
    return f"{f(s['mean'])} [{f(s['t_lo'])}, {f(s['t_hi'])}]"


def tables_md(res: dict) -> str:
    agg = aggregate(res)
    seeds = res["seeds"]
    tasks = list(seeds[0]["base"])
    metric = seeds[0]["metric"]
    fmt = (lambda x: f"{x:.3f}") if metric == "loss" else (lambda x: f"{100 * x:.1f}%")
    L = [
        f"Command: `{res['command']}`; wall {res['wall_s']:.0f} s ({res['evaluations_run']} evaluations run, the "
        f"rest cached); machine: {res['machine']}; load average {res['loadavg_start']} at start, "
        f"{res['loadavg_end']} at end. Seeds {[s['seed'] for s in seeds]}; intervals: 95% Student-t over seeds.\n",
        f"**Base and experts** ({metric} per task; seed by seed):\n",
        "| seed | model | " + " | ".join(tasks) + " |",
        "|---|---|" + "---:|" * len(tasks),
    ]
    for s in seeds:
        L.append(f"| {s['seed']} | base | " + " | ".join(fmt(s["base"][t]) for t in tasks) + " |")
        for n, qv in s["experts"].items():
            L.append(
                f"| {s['seed']} | expert {n} | "
                + " | ".join(("**" + fmt(qv[t]) + "**") if s["expert_task"][n] == t else fmt(qv[t]) for t in tasks)
                + " |"
            )
    und = [f"seed {s['seed']}: {', '.join(s['undefined_ng'])}" for s in seeds if s.get("undefined_ng")]
    if und:
        L += [
            "",
            "Tasks whose expert did not beat the base (no normalised gain; the worst task is taken over the "
            "others): " + "; ".join(und) + ".",
        ]
    errs = res.get("errors") or []
    if errs:
        L += ["", "Failed points: " + "; ".join(f"`{e}`" for e in errs)]
    L += [
        "",
        "**Full merges** (unlimited budget): normalised gain per task, mean over seeds [95% CI]:\n",
        "| method | params | " + " | ".join(tasks) + " | worst task |",
        "|---|---|" + "---:|" * (len(tasks) + 1),
    ]
    for m, a in agg.items():
        params = " ".join(seeds[0]["methods"][m]["params"])
        L.append(
            f"| {m} | `{params}` | "
            + " | ".join(_ci(a["full_ng"][t], False) if t in a["full_ng"] else "n/a" for t in tasks)
            + f" | {_ci(a['full_worst_ng'], False)} |"
        )
    L += [
        "",
        "**Budgeted merges**: share of the full merge's normalised gain kept on the worst task "
        "(mean over seeds [95% CI]); per task the mean kept share; expert bytes read (of the experts' bytes; "
        "in parentheses the part read from sketches, charged to the same budget). Value `X+signK`: block value X "
        "with fidelity tiers (up to K sign planes per block):\n",
        "| method | budget | value | read (sketches) | worst-task kept share | "
        + " | ".join(f"kept {t}" for t in tasks)
        + " | worst NG |",
        "|---|---|---|---:|---:|" + "---:|" * (len(tasks) + 1),
    ]
    for m, a in agg.items():
        for k, d in a["points"].items():
            b, v = k.split("|")
            kept = _ci(d["worst_kept"]) if "worst_kept" in d else "n/a (full NG <= 0)"
            per = [f"{100 * d['kept'][t]['mean']:.0f}%" if t in d.get("kept", {}) else "-" for t in tasks]
            L.append(
                f"| {m} | {b} | {v} | {100 * d['read_fraction']:.1f}% ({100 * d['sketch_read_fraction']:.1f}%) | {kept} | "
                + " | ".join(per)
                + f" | {_ci(d['worst_ng'], False)} |"
            )
    L += [
        "",
        f"**Target** (at {TARGET_BUDGET}% of expert bytes the budgeted merge keeps >= {TARGET_KEPT:.0%} of the "
        "full merge's normalised gain on its worst task, mean over seeds):\n",
        "| method | value | mean worst-task kept share | met |",
        "|---|---|---:|---|",
    ]
    for m, a in agg.items():
        for k, d in a["points"].items():
            b, v = k.split("|")
            if b == f"{TARGET_BUDGET}%" and "worst_kept" in d:
                L.append(
                    f"| {m} | {v} | {100 * d['worst_kept']['mean']:.1f}% | "
                    f"{'yes' if d['worst_kept']['mean'] >= TARGET_KEPT else 'no'} |"
                )
    return "\n".join(L)


def plot(res: dict, out: Path, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(res)
    fig, axes = plt.subplots(1, len(agg), figsize=(5 * len(agg), 3.8), squeeze=False)
    for ax, (m, a) in zip(axes[0], agg.items()):
        labels = sorted({k.split("|")[1] for k in a["points"]}, key=lambda x: ("+" in x, x))
        for v in labels:
            style = ("o" if v.startswith("energy") else "s") + ("-" if "+" in v else ":")
            ks = [
                (float(k.split("|")[0].rstrip("%")), d)
                for k, d in a["points"].items()
                if k.endswith("|" + v) and "worst_kept" in d
            ]
            if not ks:
                continue
            xs = [x for x, _ in ks]
            ys = [100 * d["worst_kept"]["mean"] for _, d in ks]
            lo = [
                100 * (d["worst_kept"]["mean"] - d["worst_kept"]["t_lo"]) if d["worst_kept"]["n"] > 1 else 0
                for _, d in ks
            ]
            hi = [
                100 * (d["worst_kept"]["t_hi"] - d["worst_kept"]["mean"]) if d["worst_kept"]["n"] > 1 else 0
                for _, d in ks
            ]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, capsize=3, label=f"value {v}")
        ax.axhline(100 * TARGET_KEPT, color="gray", ls=":", lw=1)
        ax.axvline(float(TARGET_BUDGET), color="k", lw=0.5)
        from matplotlib.ticker import NullLocator

        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks([5, 10, 25, 50])
        ax.set_xticklabels(["5", "10", "25", "50"])
        ax.set_xlabel("expert budget (% of the experts' bytes)")
        ax.set_ylabel("worst-task share of the full merge's gain (%)")
        ax.set_title(
            m
            if any("worst_kept" in d for d in a["points"].values())
            else f"{m}: full merge not better than the base on some task (share undefined)",
            fontsize=9,
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def report(results: list[tuple[str, dict]], doc: Path) -> None:
    text = []
    for label, res in results:
        png = plot(res, OUT, f"{label}.png")
        text.append(f"### {label}\n\n![{label}](quality/{png})\n\n" + tables_md(res) + "\n")
    begin, end = "<!-- quality tables: begin (generated by bench/quality.py) -->", "<!-- quality tables: end -->"
    body = begin + "\n" + "\n".join(text) + end
    cur = doc.read_text() if doc.exists() else ""
    if begin in cur and end in cur:
        doc.write_text(cur.split(begin, 1)[0] + body + cur.split(end, 1)[1])
    else:
        (OUT / "tables.md").write_text(body + "\n")
    log(f"report written ({', '.join(label for label, _ in results)})")


PREREG = OUT / "preregistration.json"


def testbed_label(testbed: str, size: str) -> str:
    """The testbed's name in docs/quality/preregistration.json and in ``fresh-<label>.json``:
    ``zoo-<size>`` for the zoo, ``vision-<dtype>`` (``bf16``/``fp32``) for the vision testbed, the
    testbed's name otherwise (``minilm``)."""
    return f"{testbed}-{size}" if testbed in ("zoo", "vision") else testbed


def _preregistered(a) -> str:
    """Apply docs/quality/preregistration.json to ``a`` (seeds, methods, budgets, settings,
    per-item metrics); returns the commit that holds it.

    The testbed's entry may override the registered ``settings``, ``budgets_pct`` and
    ``primary_setting`` (an amendment that reduces a testbed's grid). ``--seeds`` (e.g. one
    cache-filling ``--no-report`` process per seed, or a report over the seeds that finished)
    must name registered fresh or replacement seeds of the testbed, ``--methods`` registered
    methods; the raw results hold the registration (its seeds and methods) beside the ones run,
    and the report shows both.

    Raises:
        SystemExit: the file has uncommitted changes (a pre-registration is committed before
            the fresh run), names no fresh seeds for this testbed, or ``--seeds``/``--methods``
            name an unregistered seed/method.
    """
    from bench.record import committed

    rel, commit = committed(PREREG, "commit the pre-registration before the fresh run", REPO)
    pr = json.loads(PREREG.read_text())
    label = testbed_label(a.testbed, a.size)
    tb = pr["testbeds"].get(label)
    if not tb:
        sys.exit(f"{rel}: no fresh seeds for testbed {label}; add them (and commit) first.")
    registered = list(tb["fresh_seeds"]) + list(tb.get("replacement_seeds", []))
    if a.seeds is None:
        a.seeds = list(tb["fresh_seeds"])
    elif set(a.seeds) - set(registered):
        sys.exit(f"--seeds {a.seeds}: not registered for {label} in {rel} (fresh/replacement seeds {registered})")
    if a.methods is None:
        a.methods = list(pr["methods"])
    elif set(a.methods) - set(pr["methods"]):
        sys.exit(f"--methods {a.methods}: not registered in {rel} (methods {list(pr['methods'])})")
    else:  # a report over the methods every seed finished: registered order, the rest named as not run
        a.methods = [m for m in pr["methods"] if m in a.methods]
    a.budgets = [float(b) for b in tb.get("budgets_pct", pr["budgets_pct"])]
    settings = tb.get("settings", pr["settings"])
    a.values = sorted({v for v, _ in settings})
    a.sketches = sorted({k for _, k in settings})
    a.items = True
    return commit


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--testbed", choices=("zoo", "minilm", "vision"), default="zoo")
    ap.add_argument(
        "--size",
        choices=("tiny", "demo", "bf16", "fp32"),
        default=None,
        help="zoo: tiny (default; ZooConfig.tiny()) or demo (ZooConfig()); vision: the checkpoints' dtype, "
        "bf16 (default) or fp32 (the same trained weights, rounded or not)",
    )
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="default 0 1 2; with --fresh the registered fresh seeds"
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="default all three; with --fresh a subset of the registered methods (e.g. the ones whose seeds finished)",
    )
    ap.add_argument(
        "--budgets", type=float, nargs="+", default=list(BUDGETS), help="expert budgets in %% of the experts' bytes"
    )
    ap.add_argument("--values", nargs="+", default=["energy", "fisher"], choices=("energy", "fisher"))
    ap.add_argument(
        "--sketches",
        nargs="+",
        default=["none", "sign1", "sign3"],
        choices=("none", "sign1", "sign2", "sign3", "sign3+r1"),
        help="fidelity tiers: none (read or skip a block) and/or signK (a block may be merged from the first "
        "k <= K sign planes of its sketch); sign3+r1 adds the rank-1 tier (factors + one residual plane)",
    )
    ap.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "quality")
    ap.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads (1 when one process per seed runs at once)"
    )
    ap.add_argument("--report-only", action="store_true", help="tables and plots from docs/quality/*.json")
    ap.add_argument(
        "--items",
        action="store_true",
        help="record each task's per-item metric (probe windows / examples) for test-set bootstrap intervals",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="the pre-registered report run: seeds, methods, budgets and settings from docs/quality/"
        "preregistration.json (committed, unchanged), per-item metrics, raw results to "
        "docs/quality/fresh-<testbed>.json (bench/quality_report.py derives the tables)",
    )
    ap.add_argument(
        "--no-report",
        action="store_true",
        help="only fill the caches (e.g. one process per seed); a later run over all seeds reports",
    )
    a = ap.parse_args(argv)
    sizes = {"zoo": ("tiny", "demo"), "vision": ("bf16", "fp32"), "minilm": (None,)}[a.testbed]
    if a.size is None:
        a.size = sizes[0]
    elif a.size not in sizes:
        ap.error(f"--size {a.size}: not a size of the {a.testbed} testbed ({', '.join(map(str, sizes))})")
    OUT.mkdir(parents=True, exist_ok=True)
    prereg_commit = None
    if a.fresh:
        prereg_commit = _preregistered(a)
    else:
        a.seeds = [0, 1, 2] if a.seeds is None else a.seeds
        a.methods = list(METHODS) if a.methods is None else a.methods
    if a.report_only:
        results = [
            (p.stem, json.loads(p.read_text()))
            for p in sorted(OUT.glob("*.json"))
            if p.stem.startswith(("zoo-", "minilm", "vision-"))
        ]
        report(results, DOC)
        return
    import torch

    from bench.run import machine_info

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    errors: list[str] = []
    mi = machine_info()
    res = {
        "command": "python bench/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{mi['cpu_model']}, nproc {mi['nproc']}, {mi['mem_total']}, Python {mi['python']}, "
        f"torch {torch.__version__} (shared)",
        "loadavg_start": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "testbed": a.testbed,
        "size": a.size,
        "seeds": [],
    }
    a.budgets = [b for b in a.budgets]
    for s in a.seeds:
        try:
            res["seeds"].append(sweep_seed(a, s, errors))
        except Exception as e:  # e.g. a zoo build whose gates fail: recorded, the other seeds still run
            errors.append(f"seed {s}: {type(e).__name__}: {e}")
            log(errors[-1])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["evaluations_run"] = Evals.runs
    res["loadavg_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    res["errors"] = errors
    if a.fresh and not a.no_report:
        import subprocess

        res["preregistration_commit"] = prereg_commit
        res["code_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        res["preregistration"] = json.loads(PREREG.read_text())
        res["testbed_label"] = testbed_label(a.testbed, a.size)
        out = OUT / f"fresh-{testbed_label(a.testbed, a.size)}.json"
        out.write_text(json.dumps(res, separators=(",", ":")) + "\n")
        log(f"raw results: {out}; tables: python bench/quality_report.py --write")
        sys.exit(1 if errors else 0)
    if a.no_report:
        log(f"caches filled in {res['wall_s']:.0f} s; {len(errors)} error(s): {errors}")
        sys.exit(1 if errors else 0)
    label = testbed_label(a.testbed, a.size)
    (OUT / f"{label}.json").write_text(json.dumps(res, indent=1) + "\n")
    results = [
        (p.stem, json.loads(p.read_text()))
        for p in sorted(OUT.glob("*.json"))
        if p.stem.startswith(("zoo-", "minilm", "vision-"))
    ]
    report(results, DOC)
    log(f"done in {res['wall_s']:.0f} s")
    if errors:
        log(f"{len(errors)} point(s) FAILED:\n  " + "\n  ".join(errors))
        sys.exit(1)


if __name__ == "__main__":
    main()
