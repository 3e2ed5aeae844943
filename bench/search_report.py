"""Every figure of docs/SEARCH.md's measurement, re-derived from the committed raw results.

Input: ``docs/search/raw-<label>.jsonl.gz`` written by ``bench/search.py`` (first line: the
run's metadata with the base's and experts' losses; then one line per (arm, seed) with every
evaluated candidate: unit-cube point ``x``, search-window (or search-example) losses ``y``, held-out losses ``h``, in
completion order). Output: the Markdown between ``<!-- search-report:<label>:begin -->`` and
``<!-- search-report:<label>:end -->`` in docs/SEARCH.md (labels ``zoo8-dev``: the development run,
``zoo8-fresh``: the pre-registered fresh run, docs/search/preregistration.json; ``zoo8-amendment1``:
its registered amendment, docs/search/preregistration-zoo8-amendment1.json, with its own family;
``minilm-fresh``: the MiniLM testbed's pre-registered fresh run, docs/search/preregistration-minilm.json,
whose candidates also carry held-out accuracies ``ha``); and the block
``minilm-cost`` from ``docs/search/minilm-eval-cost.json`` (``bench/search_minilm.py``'s timings;
:func:`minilm_cost` re-derives the per-evaluation cost and the projection from them).

Definitions (stated in the output too):

* hypervolume (HV) of a run after ``k`` evaluations: the exact hypervolume of the first ``k``
  candidates' search-window losses (:func:`mergepipe.search.optimizer.hypervolume`), reference
  point = per objective the worst expert, divided by the box between that point and the ideal
  point (each expert on its own domain): 1.0 = one merge as good as every expert on its domain;
* held-out HV: the Pareto set chosen on the search windows, scored by its held-out losses, with
  the held-out reference and ideal points;
* paired comparisons (same seeds): mean difference with Student t and percentile bootstrap 95 %
  intervals, ``d_z``, wins/losses, two-sided exact Wilcoxon signed-rank p and Holm's adjustment
  over the family :data:`FAMILY` × {HV, held-out HV} (:func:`mergepipe.search.stats.holm`); in a
  pre-registered run the registered family, fixed in advance (a comparison that did not run
  counts with p = 1), and the primary endpoint :data:`PRIMARY` stated.

Usage::

    python bench/search_report.py            # print the blocks
    python bench/search_report.py --write    # rewrite them in docs/SEARCH.md
    python bench/search_report.py --check    # exit 1 when docs/SEARCH.md differs (CI: tests/unit/test_search_report.py)
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report_block  # noqa: E402

DOC = ROOT / "docs" / "SEARCH.md"
RAW = ROOT / "docs" / "search"

#: The family of paired comparisons (first − second, what it tests) Holm's correction runs over,
#: each on the final HV and on the held-out HV.
FAMILY: list[tuple[str, str, str]] = [
    ("lw-bo", "ml-bo", "layer-wise vs model-level, same BO"),
    ("lw-random", "ml-random", "layer-wise vs model-level, random"),
    ("lw-nsga2", "ml-nsga2", "layer-wise vs model-level, NSGA-II"),
    ("lw-bo", "ml-grid", "layer-wise BO vs model-level grid"),
    ("lw-bo", "lw-random", "BO vs random, layer-wise"),
    ("ml-bo", "ml-random", "BO vs random, model-level"),
    ("lw-bo", "lw-nsga2", "BO vs NSGA-II, layer-wise"),
    ("ml-bo", "ml-nsga2", "BO vs NSGA-II, model-level"),
    ("ml-bo-default", "ml-bo", "CLI defaults (prior + reranking) vs plain BO, model-level"),
    ("lw-cmaes", "ml-cmaes", "layer-wise vs model-level, CMA-ES"),
    ("lw-bo", "lw-cmaes", "BO vs CMA-ES, layer-wise"),
    ("ml-bo", "ml-cmaes", "BO vs CMA-ES, model-level"),
]


#: The pre-registered primary endpoint (docs/search/preregistration.json, ``primary_endpoint``): the
#: held-out HV of the first arm minus the second.
PRIMARY = ("lw-bo", "ml-bo")


def load(path: Path) -> tuple[dict, list[dict]]:
    """(metadata, runs) of a raw results file; raises ValueError on a malformed file."""
    with gzip.open(path, "rt") as f:
        lines = [json.loads(x) for x in f if x.strip()]
    if not lines or "testbed" not in lines[0]:
        raise ValueError(f"{path}: the first line must be the run's metadata (a 'testbed' key)")
    meta, runs = lines[0], lines[1:]
    m = len(meta["objectives"])
    for r in runs:
        for c in r["cands"]:
            if len(c["y"]) != m or len(c["h"]) != m:
                raise ValueError(f"{path}: {r['arm']} seed {r['seed']}: a candidate without {m} objectives")
    return meta, runs


def _boxes(meta: dict) -> dict:
    rm = meta["reference"]["metrics"]
    doms = meta["domains"]
    out = {}
    for kind, pre in (("search", ""), ("heldout", "heldout:")):
        ref = [max(rm[n][f"{pre}loss:{d}"] for n in doms) for d in doms]
        ideal = [rm[d][f"{pre}loss:{d}"] for d in doms]
        box = 1.0
        for d, r, i in zip(doms, ref, ideal):
            if r <= i:
                raise ValueError(
                    f"{kind} {pre}loss:{d}: the {d} expert is the worst expert on its own task ({i:.6g} >= every "
                    f"other expert's); the HV box between the worst expert and the ideal point is empty, so this "
                    f"testbed cannot be reported normalised"
                )
            box *= r - i
        out[kind] = {"ref": ref, "ideal": ideal, "box": box}
    return out


def analyse(meta: dict, runs: list[dict]) -> dict:
    """Per-arm values per seed and statistics, and the paired comparisons (see the module doc)."""
    from mergepipe.search.optimizer import hypervolume, pareto_mask
    from mergepipe.search.stats import bootstrap_ci, holm, paired_test

    bx = _boxes(meta)
    E, n0 = meta["evaluations"], meta["initial"]
    per: dict[str, dict[str, list]] = {}
    for r in sorted(runs, key=lambda r: (meta["arms"].index(r["arm"]), r["seed"])):
        ys = [c["y"] for c in r["cands"]]
        hs = [c["h"] for c in r["cands"]]
        mask = pareto_mask(ys)
        v = per.setdefault(r["arm"], {k: [] for k in ("seed", "hv_I", "hv_E", "held", "acc", "pareto", "n", "run_s")})
        if all("ha" in c for c in r["cands"]):  # held-out accuracies (MiniLM): best worst-task one on the front
            v["acc"].append(max(min(c["ha"]) for c, k in zip(r["cands"], mask) if k))
        v["seed"].append(r["seed"])
        v["hv_I"].append(hypervolume(ys[:n0], bx["search"]["ref"]) / bx["search"]["box"])
        v["hv_E"].append(hypervolume(ys, bx["search"]["ref"]) / bx["search"]["box"])
        v["held"].append(hypervolume([h for h, k in zip(hs, mask) if k], bx["heldout"]["ref"]) / bx["heldout"]["box"])
        v["pareto"].append(sum(mask))
        v["n"].append(len(ys))
        v["run_s"].append(r["run_s"])
    arms = {}
    for arm, v in per.items():
        arms[arm] = {
            "seeds": len(v["seed"]),
            "evals": min(v["n"]),
            "hv_I": bootstrap_ci(v["hv_I"]),
            "hv_E": bootstrap_ci(v["hv_E"]),
            "held": bootstrap_ci(v["held"]),
            "held_min": min(v["held"]),
            **({"acc": bootstrap_ci(v["acc"]), "acc_min": min(v["acc"])} if len(v["acc"]) == len(v["seed"]) else {}),
            "pareto": statistics.mean(v["pareto"]),
            "run_s": statistics.mean(v["run_s"]),
        }
    pairs = []
    # A pre-registered run fixes its family in advance: a comparison that did not run stays in it
    # with p = 1 (reported "not run"). Otherwise the family is the comparisons the data contain.
    prereg = meta.get("amendment") or meta.get("preregistration")  # an amendment registers its own family
    fixed = {tuple(c) for c in prereg["family"]["comparisons"]} if prereg else None
    for a, b, what in FAMILY:
        if fixed is not None and (a, b) not in fixed:
            continue
        common = sorted(set(per.get(a, {"seed": []})["seed"]) & set(per.get(b, {"seed": []})["seed"]))
        if len(common) < 2:  # paired: the seeds both ran
            if fixed is not None:
                pairs.append({"a": a, "b": b, "what": what, "hv": _not_run(len(common)), "held": _not_run(len(common))})
            continue

        def on(arm: str, key: str, common=common) -> list[float]:
            return [per[arm][key][per[arm]["seed"].index(sd)] for sd in common]

        pairs.append(
            {
                "a": a,
                "b": b,
                "what": what,
                "hv": paired_test(on(a, "hv_E"), on(b, "hv_E")),
                "held": paired_test(on(a, "held"), on(b, "held")),
            }
        )
    adj = holm([p[k]["p"] for p in pairs for k in ("hv", "held")])
    for i, p in enumerate(pairs):
        p["hv"]["holm"], p["held"]["holm"] = adj[2 * i], adj[2 * i + 1]
    return {"boxes": bx, "arms": arms, "pairs": pairs, "family": 2 * len(pairs), "E": E, "I": n0, "runs": runs}


def _not_run(n: int) -> dict:
    """A pre-registered comparison without two paired seeds: in Holm's family with p = 1."""
    nan = float("nan")
    return {"n": n, "mean_diff": nan, "t_ci": (nan, nan), "ci": (nan, nan), "dz": nan, "wins": 0, "losses": 0, "p": 1.0}


def _ci(m: float, lo: float, hi: float) -> str:
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def render(meta: dict, an: dict) -> str:
    """The Markdown block of one testbed (deterministic: bootstrap seeds are fixed)."""
    rm = meta["reference"]["metrics"]
    doms = meta["domains"]
    mc = meta["machine"]
    L = []
    amend = meta.get("amendment")
    if amend:
        reused = meta["registered_seeds"]
        own = [r for r in an["runs"] if "amendment" in r]
        L.append(
            f"Amendment `{meta['amendment_file']}` (commit `{meta['amendment_commit'][:7]}`) to the registration "
            f"(commit `{meta['preregistration_commit'][:7]}`), registered before its runs, run after the registered "
            f"deadline: {len(own)} runs of it ("
            + ", ".join(
                f"{a} {_seeds([r['seed'] for r in own if r['arm'] == a])}"
                for a in meta["arms"]
                if any(r["arm"] == a for r in own)
            )
            + "), and the registered runs its comparisons need, reused as the registered run wrote them ("
            + ", ".join(f"{a} {_seeds(s)}" for a, s in reused.items())
            + "). Wall, run times and start load below are the amendment's runs'."
        )
        L.append("")
    run_line = (
        f"{len(an['runs'])} runs ({sum(len(r['cands']) for r in an['runs'])} evaluated candidates) in "
        f"{meta.get('processes', 1)} process{'es' if meta.get('processes', 1) != 1 else ''}, "
        f"{meta['total_s']:.0f} s wall (sum of the runs' times {meta.get('run_s_sum', meta['total_s']):.0f} s); "
        f"load average {mc['load_start'][0]:.1f} at the start, {mc['load_end'][0]:.1f} at the end "
        f"({mc['cpus']} cores, Python {mc['python']}, torch {mc['torch']}, botorch {mc['botorch']})."
    )
    minilm = meta["testbed"] == "minilm"
    if minilm:
        tb = meta["minilm"]
        L.append(
            f"Testbed `minilm`: the pretrained MiniLM encoder (sentence-transformers/all-MiniLM-L6-v2, "
            f"{tb['layers']} layers) and its experts fully fine-tuned on {', '.join(doms)} (testbed seed "
            f"{tb['seed']}, key `{tb['key']}`, format {tb['format']}); layer-wise arms {meta['blocks']} blocks × "
            f"{len(doms)} experts = {meta['blocks'] * len(doms)} coordinates, model-level {len(doms)}. "
            f"{meta['evaluations']} evaluations ({meta['initial']} initial) per run; {meta['examples']} search + "
            f"{meta['examples']} held-out examples per task. " + run_line
        )
        caption = (
            "Cross-entropy of each task's head (nats per example) on the search / held-out examples, and the "
            "held-out accuracy:"
        )
    else:
        L.append(
            f"Testbed `{meta['testbed']}`: zoo {meta['zoo']['config']} (key `{meta['zoo']['key']}`, format "
            f"{meta['zoo']['format']}, {meta['zoo']['layers']} layers), experts {', '.join(doms)}; layer-wise arms "
            f"{meta['blocks']} blocks × {len(doms)} experts = {meta['blocks'] * len(doms)} coordinates, model-level "
            f"{len(doms)}. {meta['evaluations']} evaluations ({meta['initial']} initial) per run; "
            f"{meta['search_windows']} search + {meta['search_windows']} held-out windows per domain. " + run_line
        )
        caption = "Losses (nats/token) on the search windows / held-out windows:"

    def cell(m: dict, d: str) -> str:
        """Search / held-out loss of model metrics ``m`` on domain ``d`` (and, MiniLM, held-out accuracy)."""
        acc = f" ({100 * m[f'heldout:acc:{d}']:.1f}%)" if minilm else ""
        return f"{m[f'loss:{d}']:.4f} / {m[f'heldout:loss:{d}']:.4f}{acc}"

    L += ["", caption, "", "| model | " + " | ".join(doms) + " |", "|---|" + "---|" * len(doms)]
    for n in ["base", *doms]:
        L.append(f"| {n} | " + " | ".join(cell(rm[n], d) for d in doms) + " |")
    L.append("")
    E, n0 = an["E"], an["I"]
    L.append(
        "Per arm: mean over seeds [95 % percentile bootstrap interval] and the worst seed; HV normalised (1.0 = every expert's "
        "loss on its own domain at once)."
    )
    L.append("")
    if minilm:
        L.append(
            "Worst-task held-out accuracy: of the Pareto set's points, the best minimum over the tasks of the "
            "held-out accuracy (the point a user who needs every task would deploy)."
        )
        L.append("")
    acc_h = " worst-task held-out acc. |" if minilm else ""
    L.append(
        f"| arm | seeds | evals | HV @ {n0} | HV @ {E} | held-out HV of the Pareto set | held-out HV, worst seed |"
        f"{acc_h} Pareto pts | s/run |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|" + ("---|" if minilm else ""))
    for arm, v in an["arms"].items():
        acc = ""
        if minilm:
            acc = f" {100 * v['acc'][0]:.1f}% [{100 * v['acc'][1]:.1f}, {100 * v['acc'][2]:.1f}], worst seed {100 * v['acc_min']:.1f}% |"
        L.append(
            f"| {arm} | {v['seeds']} | {v['evals']} | {_ci(*v['hv_I'])} | {_ci(*v['hv_E'])} | {_ci(*v['held'])} | "
            f"{v['held_min']:.3f} |{acc} {v['pareto']:.1f} | {v['run_s']:.0f} |"
        )
    L.append("")
    L.append(
        f"Paired comparisons (first − second arm, same seeds; positive favours the first): mean difference "
        f"with its t and bootstrap 95 % intervals, d_z, wins/losses, exact two-sided Wilcoxon p and Holm-adjusted "
        f"p over the family of these {an['family']} tests ({an['family'] // 2} comparisons × {{HV @ {E}, held-out HV}})."
    )
    L.append("")
    L.append("| comparison | what | seeds | metric | Δ | t 95% CI | bootstrap 95% CI | d_z | W/L | p | Holm p |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in an["pairs"]:
        for k, name in (("hv", f"HV @ {E}"), ("held", "held-out HV")):
            t = p[k]
            if t["n"] < 2:
                L.append(
                    f"| {p['a']} − {p['b']} | {p['what']} | {t['n']} | {name} | not run | | | | | 1 | {t['holm']:.4f} |"
                )
                continue
            L.append(
                f"| {p['a']} − {p['b']} | {p['what']} | {t['n']} | {name} | {t['mean_diff']:+.4f} | "
                f"[{t['t_ci'][0]:+.4f}, {t['t_ci'][1]:+.4f}] | [{t['ci'][0]:+.4f}, {t['ci'][1]:+.4f}] | "
                f"{t['dz']:+.2f} | {t['wins']}/{t['losses']} | {t['p']:.4f} | {t['holm']:.4f} |"
            )
    sig = [
        f"{p['a']} − {p['b']} ({'HV' if k == 'hv' else 'held-out HV'}, {p[k]['mean_diff']:+.4f})"
        for p in an["pairs"]
        for k in ("hv", "held")
        if p[k]["holm"] <= 0.05
    ]
    L.append("")
    L.append("Significant after Holm at 0.05: " + ("; ".join(sig) if sig else "none") + ".")
    prereg = meta.get("preregistration")
    if amend:
        L.append("")
        L.append(
            "Exploratory, not registered and not tested: per arm, the run's candidate with the lowest **sum** of "
            "the search-window losses (CMA-ES's own fitness, as mergekit-evolve scalarises), mean over seeds "
            "[95 % percentile bootstrap interval] of that sum and of the same candidate's held-out sum (nats/token "
            "summed over the domains; the best single expert: "
            + ", ".join(f"{_sum_loss(rm[d], doms, ''):.4f} / {_sum_loss(rm[d], doms, 'heldout:'):.4f}" for d in doms)
            + f" for {', '.join(doms)}):"
        )
        L.append("")
        L.append("| arm | best summed search loss | its held-out sum |")
        L.append("|---|---|---|")
        from mergepipe.search.stats import bootstrap_ci

        for arm in an["arms"]:
            best = [min(r["cands"], key=lambda c: sum(c["y"])) for r in an["runs"] if r["arm"] == arm]
            ys = bootstrap_ci([sum(c["y"]) for c in best])
            hs = bootstrap_ci([sum(c["h"]) for c in best])
            L.append(f"| {arm} | {ys[0]:.4f} [{ys[1]:.4f}, {ys[2]:.4f}] | {hs[0]:.4f} [{hs[1]:.4f}, {hs[2]:.4f}] |")
        L.append("")
        L.append(
            f"The amendment's family ({an['family']} tests, Holm) is its own: the registered family, its Holm "
            f"correction and its primary endpoint ({' − '.join(PRIMARY)}, held-out HV) are unchanged."
        )
    elif prereg:
        a, b = PRIMARY
        t = next((p["held"] for p in an["pairs"] if (p["a"], p["b"]) == (a, b)), None)
        L.append("")
        if t is None or t["n"] < 2:
            L.append(f"Primary endpoint (pre-registered): held-out HV of {a} − {b}: not run.")
        else:
            L.append(
                f"Primary endpoint (pre-registered, commit `{meta['preregistration_commit'][:7]}`): held-out HV of "
                f"{a} − {b} over {t['n']} fresh seeds: {t['mean_diff']:+.4f} [t 95% CI {t['t_ci'][0]:+.4f}, "
                f"{t['t_ci'][1]:+.4f}], {t['wins']}/{t['losses']} wins/losses, Wilcoxon p {t['p']:.4f}, Holm p "
                f"{t['holm']:.4f}: {'significant' if t['holm'] <= 0.05 else 'not significant'} at 0.05."
            )
    return "\n".join(L)


def _sum_loss(m: dict, doms: list[str], pre: str) -> float:
    """Sum over ``doms`` of ``m[f"{pre}loss:{d}"]`` (nats/token)."""
    return sum(m[f"{pre}loss:{d}"] for d in doms)


def _seeds(seeds: list[int]) -> str:
    """``seeds`` as ``a–b`` when contiguous, else comma-separated (``s`` prefix)."""
    xs = sorted(seeds)
    if len(xs) > 1 and xs == list(range(xs[0], xs[-1] + 1)):
        return f"s{xs[0]}–{xs[-1]}"
    return "s" + ", ".join(map(str, xs))


def blocks(raw_dir: Path = RAW) -> dict[str, str]:
    """label -> rendered block, for every ``raw-<label>.jsonl.gz`` in ``raw_dir`` (the label names
    the block's markers, e.g. ``zoo8-dev``, ``zoo8-fresh``)."""
    out = {}
    for p in sorted(raw_dir.glob("raw-*.jsonl.gz")):
        meta, runs = load(p)
        out[p.name[len("raw-") : -len(".jsonl.gz")]] = render(meta, analyse(meta, runs))
    return out


def _markers(tb: str) -> tuple[str, str]:
    return f"<!-- search-report:{tb}:begin -->", f"<!-- search-report:{tb}:end -->"


#: the MiniLM cost measurement of ``bench/search_minilm.py`` (timings only), rendered by :func:`minilm_cost`
MINILM_COST = "minilm-eval-cost.json"


def _rng(xs: list[float], nd: int) -> str:
    """``lo–hi`` of ``xs`` with ``nd`` decimals (one value when they round alike)."""
    lo, hi = f"{min(xs):.{nd}f}", f"{max(xs):.{nd}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def minilm_cost(cost: dict) -> str:
    """docs/SEARCH.md's MiniLM cost paragraphs, every figure re-derived from ``cost`` (the JSON
    ``bench/search_minilm.py --out`` writes): the table from the raw timings, the per-evaluation,
    per-proposal and per-run figures recomputed from the candidates and proposals.

    Raises:
        ValueError: the file's own ``projection`` disagrees with the re-derivation (it was edited,
            or written by another version of the script).
    """
    from bench.search_minilm import binomial_se, wilson_interval

    cands, props, chk, pj = cost["candidates"], cost["proposals"], cost["check"], cost["projection"]
    d_lw = cost["space_dims"]
    lw = [p for p in props if p["d"] == d_lw]
    n, n_eval, bo = chk["examples_per_task"], pj["evaluations_per_run"], pj["evaluations_per_run"] - 8
    derived = {}
    for key, suf, pkey in (("wall", "s", "seconds"), ("cpu", "cpu_s", "cpu_s")):
        per_eval = sum(c[f"merge_{suf}"] + c[f"score_{suf}"] for c in cands) / len(cands)
        per_prop = sum(p[pkey] for p in lw) / len(lw)
        per_run = n_eval * per_eval + bo * per_prop
        derived[key] = {
            "per_evaluation_s": round(per_eval, 1),
            "per_proposal_s_layerwise": round(per_prop, 1),
            "per_run_s": round(per_run, 0),
            "all_arms_hours": round(per_run * pj["runs"] * pj["arms"] / 3600, 1),
            "two_arms_hours": round(per_run * pj["runs"] * 2 / 3600, 1),
        }
        if derived[key] != pj[key]:
            raise ValueError(f"{MINILM_COST}: projection.{key} {pj[key]} != re-derived {derived[key]}")
    se = 100 * binomial_se(0.8, n)
    wl, wh = (100 * v for v in wilson_interval(round(0.8 * n), n))
    if [round(se, 2), [round(wl, 1), round(wh, 1)]] != [pj["binomial_se_points_at_p0.8"], pj["wilson95_at_p0.8"]]:
        raise ValueError(f"{MINILM_COST}: the binomial figures differ from their re-derivation")
    loads = [*cost["load_start"], *cost["load_end"], *chk["load"]]
    loads += [x for r in cands + props for x in r["load"]]
    widths = cost["seq_len"]["batch_widths"]
    c, w = derived["cpu"], derived["wall"]
    per_example = (chk["reference_cpu_s"] / n) / (chk["objective_cpu_s"] / (2 * n))
    share = 2 * n / cost["testbed"]["eval_examples"]
    scored = "half" if share == 0.5 else f"{share:.0%} of"
    obs = " / ".join(str(p["n"]) for p in lw)
    props_cpu = [p["cpu_s"] for p in lw]
    L = [
        "**A cheaper MiniLM objective, measured** (`bench/search_minilm.py`, `MiniLMObjective`): the same",
        "scores (per-task loss and accuracy of the task's head on the mean-pooled encoder), computed in",
        "the search's process: examples tokenised once into length-sorted batches (widths "
        f"{min(widths)}–{max(widths)} tokens at",
        f"the testbed's `max_length` {cost['seq_len']['max_length']}, kept: `rotate` is decided by where a sentence "
        "ends), one encoder",
        f"skeleton whose weights are loaded from each snapshot, one torch thread, `inference_mode`; {n}",
        f"search + {n} held-out examples per task instead of {cost['testbed']['eval_examples']} (an accuracy near "
        f"0.8 on {n} examples has",
        f"binomial standard error {se:.1f} points, Wilson 95% interval {wl:.1f}–{wh:.1f}%; the objectives are the",
        "per-task losses, accuracies recorded beside them); the merge in process (the runner's",
        f"`LocalMerger`), not a CLI process. Checked against `mergepipe eval` on the same 3 × {n} examples:",
        "identical per-example correctness, losses within 1e-4 (also `tests/unit/test_search_minilm.py`).",
        "Measured with `PYTHONPATH=. nice -n 15 python -W ignore bench/search_minilm.py --seed "
        f"{cost['testbed']['seed']}` on this",
        f"2-core/24 GiB machine at load average {min(loads):.0f}–{max(loads):.0f} (8 sessions), raw figures in",
        f"`docs/search/{MINILM_COST}` (timings only; wall and the process's CPU seconds; this block is",
        "rendered from it by `bench/search_report.py`, which re-derives the projection):",
        "",
        "| step | wall s | CPU s |",
        "|---|---|---|",
        "| catalog analysis of the 3 experts (once per testbed and catalog) | "
        f"{cost['catalog_analysis']['s']:.0f} | {cost['catalog_analysis']['cpu_s']:.0f} |",
        f"| objective set-up (tokenise, heads, skeleton; once) | {cost['objective_setup']['s']:.0f} | "
        f"{cost['objective_setup']['cpu_s']:.1f} |",
        f"| a 3-expert `task_arithmetic` merge, {d_lw} coordinates, in process ({len(cands)} candidates) | "
        f"{_rng([x['merge_s'] for x in cands], 1)} | {_rng([x['merge_cpu_s'] for x in cands], 1)} |",
        f"| scoring 3 tasks × ({n} + {n}) examples ({len(cands)} candidates) | "
        f"{_rng([x['score_s'] for x in cands], 0)} | {_rng([x['score_cpu_s'] for x in cands], 1)} |",
        f"| BO proposal, {d_lw} dimensions, {obs} observations | {_rng([p['seconds'] for p in lw], 0)} | "
        f"{_rng(props_cpu, 1)} |",
        f"| side by side on one checkpoint: `mergepipe eval` on 3 × {n} / the objective on 3 × ({n} + {n}) | "
        f"{chk['reference_s']:.0f} / {chk['objective_s']:.0f} | {chk['reference_cpu_s']:.1f} / "
        f"{chk['objective_cpu_s']:.1f} |",
        "",
        f"Per evaluation **{c['per_evaluation_s']} CPU s** ({w['per_evaluation_s']:.0f} s wall at that load): per "
        "example, model load included, the objective is "
        f"~{per_example:.1f}× cheaper than `mergepipe eval` ({chk['objective_cpu_s']:.1f}",
        f"CPU s for {6 * n} examples against {chk['reference_cpu_s']:.1f} for {3 * n}), and it scores "
        f"{scored} the testbed's examples with the merge in",
        f"process. A MiniLM run at AP-BMM's budget — {pj['runs']} runs per",
        f"arm, 8 + {bo} evaluations, {d_lw} layer-wise coordinates — is {n_eval} × {c['per_evaluation_s']} + {bo} × "
        f"{c['per_proposal_s_layerwise']} ≈ **{c['per_run_s']:.0f} CPU s per",
        f"run**: **{c['two_arms_hours']} CPU hours for two arms** (`lw-bo`, `ml-bo`) and "
        f"**{c['all_arms_hours']:.0f} CPU hours for {pj['arms']} arms**, i.e.",
        f"~{c['two_arms_hours'] / 2:.0f} h / ~{c['all_arms_hours'] / 2:.0f} h on this machine idle with one process "
        f"per core, but **{w['two_arms_hours']:.0f} h / {w['all_arms_hours']:.0f} h wall** for one",
        "`nice -n 15` process at the load measured (the machine shared by 8 sessions).",
    ]
    return "\n".join(L)


def doc_blocks(raw_dir: Path = RAW) -> list[report_block.Block]:
    """:func:`blocks` and the MiniLM cost block (:func:`minilm_cost`, when ``raw_dir`` holds
    its measurement) as they stand in docs/SEARCH.md, markers included."""
    rendered = {tb: (f"testbed {tb}", block) for tb, block in blocks(raw_dir).items()}
    if (raw_dir / MINILM_COST).is_file():
        cost = minilm_cost(json.loads((raw_dir / MINILM_COST).read_text()))
        rendered["minilm-cost"] = (f"MiniLM cost measurement ({MINILM_COST})", cost)
    out = []
    for tb, (label, block) in rendered.items():
        begin, end = _markers(tb)
        out.append(report_block.Block(label, begin, end, f"{begin}\n{block}\n{end}"))
    return out


def check(doc: Path = DOC, raw_dir: Path = RAW) -> list[str]:
    """Mismatches between ``doc`` and the blocks re-derived from ``raw_dir`` (empty: all match)."""
    return report_block.differences(doc, doc_blocks(raw_dir))


def main(argv=None) -> int:
    """``--write`` / ``--check`` docs/SEARCH.md's blocks, or print them (:func:`bench.report_block.main`)."""
    return report_block.main(argv, DOC, doc_blocks, __doc__.splitlines()[0], "bench/search_report.py")


if __name__ == "__main__":
    sys.exit(main())
