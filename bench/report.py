"""summary.md and plots from a bench/run.py results.json.

Usage::

    python bench/report.py bench/results/<stamp>/results.json   # rewrites summary.md and the PNGs

Byte figures: MB = 10^6 B. "counters" are mergepipe's own storage-layer byte counters (the
``--json`` ``io`` object); "/proc" are ``read_bytes``/``write_bytes`` of ``/proc/<pid>/io`` for the
whole process (block-device traffic: ~0 for reads on a warm cache). mergekit has no role
counters: it reads every input tensor exactly once (mergekit 0.1.5 loads each tensor of each model
through ``LazyTensorLoader.get_tensor``, ``io/lazy_tensor_loader.py``, as one task of its
deduplicated task graph, ``graph.py``), so its base/expert reads are given as the inputs' shard
sizes, marked "(inputs)".
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SYS_ORDER = ("mergekit", "mp-full", "mp-50", "mp-25", "mp-10", "mp-fixed")
COLORS = {
    "mergekit": "#d62728",
    "mp-full": "#1f77b4",
    "mp-50": "#2ca02c",
    "mp-25": "#9467bd",
    "mp-10": "#ff7f0e",
    "mp-fixed": "#8c564b",
}
RSS_TARGET = 1.5e9


def _rss_kib(r: dict) -> int:
    """Peak RSS of a measured run (KiB): the sampled ``VmHWM`` (``peak_rss_kib``); results from
    before it was recorded have only ``ru_maxrss``, which can carry the parent's size."""
    return r.get("peak_rss_kib") or r["maxrss_kib"]


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mmm(xs):
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def _fmt(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def _fmt3(t, nd=2, scale=1.0):
    m, lo, hi = t
    if m is None:
        return "—"
    if lo == hi:
        return f"{m / scale:.{nd}f}"
    return f"{m / scale:.{nd}f} [{lo / scale:.{nd}f}–{hi / scale:.{nd}f}]"


def roles(r: dict) -> dict:
    """Bytes per role of one run: counters for mergepipe, inputs/outputs for mergekit."""
    if r["system"] == "mergekit":
        return {
            "base": r["input_bytes"]["base"],
            "expert": r["input_bytes"]["experts"],
            "output": r["output_bytes"],
            "source": "inputs",
        }
    res = r.get("result") or {}
    io = res.get("io") or {}
    return {
        "base": io.get("base_read_bytes"),
        "expert": io.get("expert_read_bytes"),
        "output": io.get("output_write_bytes"),
        "source": "counters",
    }


def group_runs(results: dict) -> dict:
    g = defaultdict(list)
    for r in results["runs"]:
        if r.get("rc") == 0:
            g[(r["model"], r["cache"], r["k"], r["system"])].append(r)
    return g


def lower_bound(results: dict, model: str, bytes_read: float, bytes_written: float):
    bw = results.get("bandwidth", {}).get(model)
    if not bw or not bw["read"].get("bytes_per_s") or not bw["write"].get("bytes_per_s"):
        return None
    return bytes_read / bw["read"]["bytes_per_s"] + bytes_written / bw["write"]["bytes_per_s"]


def stats(runs: list[dict]) -> dict:
    ro = [roles(r) for r in runs]
    return {
        "n": len(runs),
        "wall": _mmm([r["wall_s"] for r in runs]),
        "wall_sync": _mmm([r["wall_s"] + r.get("sync_after_s", 0) for r in runs]),
        "cpu": _mmm([r["utime_s"] + r["stime_s"] for r in runs]),
        "base": _mmm([x["base"] for x in ro]),
        "expert": _mmm([x["expert"] for x in ro]),
        "output": _mmm([x["output"] for x in ro]),
        "src": ro[0]["source"] if ro else "",
        "rb": _mmm([r["io"].get("read_bytes") for r in runs]),
        "wb": _mmm([r["io"].get("write_bytes") for r in runs]),
        "rss": _mmm([_rss_kib(r) * 1024 for r in runs]),
        "energy": _med([(r.get("result") or {}).get("retained_energy") for r in runs]),
    }


# ------------------------------------------------------------------------------------------
# targets


def targets(results: dict, g: dict) -> list[str]:
    out = []
    eq = results.get("equality") or []

    def speedup(model, cache, k, system):
        a, b = g.get((model, cache, k, "mergekit")), g.get((model, cache, k, system))
        if not a or not b:
            return None
        return _med([r["wall_s"] for r in a]) / _med([r["wall_s"] for r in b])

    def fallback(system):
        """Largest K with both systems, preferring cold, for an indicative figure."""
        best = None
        for m, c, k, s in g:
            if s == system and g.get((m, c, k, "mergekit")):
                key = (c == "cold", k)
                if best is None or key > best[0]:
                    best = (key, (m, c, k))
        return best[1] if best else None

    def row(name, need, value_fn, thresh_fn, indicative_cfg):
        v = value_fn(*need)
        if v is not None:
            ok, txt = thresh_fn(v)
            out.append(f"| {name} | {txt} | **{'met' if ok else 'NOT met'}** |")
        else:
            ind = ""
            if indicative_cfg:
                iv = value_fn(*indicative_cfg)
                if iv is not None:
                    ind = f"; indicative only, {indicative_cfg[0]} K={indicative_cfg[2]} {indicative_cfg[1]}: {thresh_fn(iv)[1]}"
            out.append(f"| {name} | not measured (needs {need[0]}, K={need[2]}, {need[1]}){ind} | not yet measured |")

    out.append("| target | measured | verdict |")
    out.append("|---|---|---|")
    row(
        "TIES unlimited budget, K=8, Qwen3-0.6B shape, cold: ≥ 5× faster than mergekit end to end",
        ("qwen3", "cold", 8),
        lambda m, c, k: speedup(m, c, k, "mp-full"),
        lambda v: (v >= 5, f"{v:.2f}× (mergekit median wall / mp-full median wall)"),
        fallback("mp-full"),
    )
    if eq:
        e = eq[-1]
        t = e.get("total", {})
        txt = (
            f"{e['model']} K={e['k']}: {t.get('differ')} of {t.get('elements')} elements differ, {t.get('over_1ulp')} by > 1 ulp "
            f"(max {t.get('max_ulps')} ulps)"
        )
        at = e.get("attribution")
        if at:
            a = at["total"]
            txt += (
                f"; emulations faithful: {at['emulation_faithful']}; {a['tie_mask_diff']} mask entries differ "
                f"from the canonical tie rule; with canonical ties, mergekit's bf16 arithmetic vs mergepipe: "
                f"{a['arith_over_1ulp']} elements > 1 ulp"
            )
        if e["model"] == "qwen3":
            verdict = f"**{'met' if e.get('identical_within_1ulp') else 'NOT met'}**" + (
                "" if e["k"] == 8 else f" (at K={e['k']})"
            )
        else:
            txt = "indicative only: " + txt
            verdict = "not yet measured (needs the Qwen3 shape)"
        out.append(f"| … and outputs identical within 1 ulp | {txt} | {verdict} |")
    else:
        out.append("| … and outputs identical within 1 ulp | not measured | not yet measured |")
    row(
        "TIES 10% expert budget, K=8, Qwen3 shape, cold: ≥ 10× faster than mergekit",
        ("qwen3", "cold", 8),
        lambda m, c, k: speedup(m, c, k, "mp-10"),
        lambda v: (v >= 10, f"{v:.2f}×"),
        fallback("mp-10"),
    )
    # flatness in K at a fixed byte budget
    for model in sorted({m for (m, _, _, _) in g}):
        for cache in ("cold", "warm"):
            ks = sorted(k for (m, c, k, s) in g if m == model and c == cache and s == "mp-fixed")
            if len(ks) >= 2:
                v = [_med([roles(r)["expert"] for r in g[(model, cache, k, "mp-fixed")]]) for k in ks]
                ref = statistics.median(v)
                dev = max(abs(x - ref) / ref for x in v) if ref else 0.0
                v_txt = f"{'met' if dev <= 0.05 else 'NOT met'}"
                out.append(
                    f"| expert bytes read flat (±5%) in K at a fixed byte budget ({model}, {cache}, mp-fixed) | "
                    f"{'' if model == 'qwen3' else 'indicative only: '}K={ks}: "
                    f"{', '.join(f'{x / 1e6:.2f}' for x in v)} MB; max deviation from the median {dev:.1%} | "
                    + (
                        f"**{v_txt}** |"
                        if model == "qwen3"
                        else f"not yet measured on the Qwen3 shape ({v_txt} on {model}) |"
                    )
                )
                break
    if not any("fixed byte budget" in x for x in out):
        out.append(
            "| expert bytes read flat (±5%) in K at a fixed byte budget | not measured (needs mp-fixed at ≥ 2 K) | not yet measured |"
        )
    # RSS
    mp = [r for r in results["runs"] if r.get("rc") == 0 and r["system"] != "mergekit"]
    if mp:
        worst = max(mp, key=lambda r: _rss_kib(r))
        v = _rss_kib(worst) * 1024
        models = sorted({r["model"] for r in mp})
        verdict = "NOT met" if v > RSS_TARGET else ("met" if "qwen3" in models else "met so far")
        out.append(
            f"| peak RSS ≤ 1.5 GB at every K and model size (mergepipe) | max {v / 1e9:.3f} GB "
            f"({worst['system']} {worst['model']} K={worst['k']} {worst['cache']}) over models {models} | "
            f"**{verdict}**{'' if 'qwen3' in models else ' (Qwen3 shape not yet measured)'} |"
        )
    # lower bound
    lbrows = []
    for (m, c, k, s), runs in sorted(g.items()):
        if s == "mp-full" and c == "cold":
            st = stats(runs)
            lb = lower_bound(results, m, (st["base"][0] or 0) + (st["expert"][0] or 0), st["output"][0] or 0)
            if lb:
                lbrows.append((m, k, st["wall"][0] / lb))
    if lbrows:
        q = [x for x in lbrows if x[0] == "qwen3"]
        txt = ", ".join(f"{m} K={k}: wall {r:.2f}× the bound" for m, k, r in lbrows)
        if q:
            verdict = f"**{'met' if all(x[2] <= 1.5 for x in q) else 'NOT met'}** (Qwen3 shape, every K)"
        else:
            txt = "indicative only: " + txt
            verdict = "not yet measured (needs the Qwen3 shape)"
        out.append(f"| cold full-budget run within 1.5× of the physical lower bound | {txt} | {verdict} |")
    else:
        out.append(
            "| cold full-budget run within 1.5× of the physical lower bound | not measured (needs cold mp-full runs) | not yet measured |"
        )
    hr = results.get("help") or []
    if hr:
        m = _med([r["wall_s"] for r in hr])
        out.append(
            f"| `mergepipe --help` under 0.5 s | median {m:.3f} s of {len(hr)} (min {min(r['wall_s'] for r in hr):.3f}) | "
            f"**{'met' if m < 0.5 else 'NOT met'}** |"
        )
    for p in results.get("plan") or []:
        cli = [r["wall_s"] for r in p["cli"] if r.get("rc") == 0]
        inp = (p.get("inproc") or {}).get("budgets", {})
        ip = [x for b in inp.values() for x in b.get("build_plan_s", [])]
        m_cli, m_ip = _med(cli), _med(ip)
        txt = f"{p['k']} experts, {p['model']} shape: `mergepipe plan --json` process wall median {_fmt(m_cli, 3)} s"
        txt += f"; in-process build_plan median {_fmt(m_ip, 3)} s" if m_ip is not None else ""
        ok = m_cli is not None and m_cli < 1.0
        out.append(
            f"| planning a merge of 16 experts from the catalog under 1 s | {txt} | **{'met' if ok else 'NOT met'}** "
            f"(process wall){'' if p['model'] == 'qwen3' else ' (tiny shape)'} |"
        )
    return out


# ------------------------------------------------------------------------------------------
# summary


def summary_md(results: dict) -> str:
    g = group_runs(results)
    m = results["machine"]
    s = results["settings"]
    L = [f"# mergepipe vs mergekit {s.get('mergekit')}: benchmark results", ""]
    L.append(
        f"Started {results['started']}, finished {results.get('finished', '?')}, {results.get('total_s', 0) / 60:.1f} min; "
        f"git {results['git']}; argv `{' '.join(results['argv'])}`."
    )
    L.append("")
    L.append(
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_total']} RAM, disk `{m['disk']}` "
        f"(rotational={m.get('disk_rotational') or '?'}), kernel {m['kernel']}, Python {m['python']}; "
        f"load average at start {' '.join(m['loadavg_start'])}, at end {' '.join(m.get('loadavg_end', ['?']))}."
    )
    L.append("")
    L.append(
        f"Settings: TIES density {s['density']}, weight {s['weight']}, normalize {s['normalize']}, bf16; "
        f"systems {', '.join(s['systems'])}; K {s['k']}; {s['runs']} run(s) per cell; cache {', '.join(s['cache'])} "
        f"(cold method: {s.get('cold_method') or 'n/a'}). MB = 10^6 B, MiB = 2^20 B. Cells are "
        "median [min–max] over the runs."
    )
    for n in results.get("notes") or []:
        L.append(f"\n> Note: {n}")
    L += ["", "## Inputs", "", "| model | base shards | per-expert shards | source |", "|---|---|---|---|"]
    for model, inp in results.get("inputs", {}).items():
        eb = inp["expert_bytes"]
        L.append(
            f"| {model} | {inp['base_bytes'] / 1e6:.1f} MB | {min(eb) / 1e6:.1f}–{max(eb) / 1e6:.1f} MB × {len(eb)} | {inp['note']} |"
        )
    if results.get("bandwidth"):
        L += ["", "## Disk bandwidth", "", "| model files | cold sequential read | write + fsync |", "|---|---|---|"]
        for model, bw in results["bandwidth"].items():
            L.append(
                f"| {model} | {bw['read']['bytes_per_s'] / 1e6:.0f} MB/s ({bw['read']['bytes'] / 1e6:.0f} MB, "
                f"{bw['read']['files']} files) | {bw['write']['bytes_per_s'] / 1e6:.0f} MB/s ({bw['write']['bytes'] / 1e6:.0f} MB) |"
            )
        L.append("")
        L.append(
            "Physical lower bound of a run = (base + expert bytes read) / read bandwidth + output bytes / write bandwidth."
        )
    if results.get("analysis"):
        L += [
            "",
            "## One-time analysis (`mergepipe analyze`, once per K, before the timed merges)",
            "",
            "| model | K | cache | wall s | base read MB (counters) | expert read MB (counters) | /proc read_bytes MB | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for a in results["analysis"]:
            br = (a.get("result") or {}).get("bytes_read") or {}
            L.append(
                f"| {a['model']} | {a['k']} | {a['cache']} | {a['wall_s']:.2f} | {_fmt((br.get('base') or 0) / 1e6, 1)} | "
                f"{_fmt((br.get('expert') or 0) / 1e6, 1)} | {a['io'].get('read_bytes', 0) / 1e6:.1f} | {_rss_kib(a) / 1024:.0f} |"
            )
    if results.get("startup"):
        L += [
            "",
            "## Start-up alone (interpreter + imports, no merge)",
            "",
            "mergekit: `mergekit-yaml --help`; mergepipe: `python -c 'import torch, mergepipe.cli, mergepipe.pipeline, "
            "mergepipe.engine.executor, ...'`. On a cold cache their /proc read_bytes are library bytes, also "
            "contained in the merges' /proc read_bytes below.",
            "",
            "| model | cache | system | n | wall s | /proc read MB | peak RSS MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        sg = defaultdict(list)
        for r in results["startup"]:
            if r.get("rc") == 0:
                sg[(r["model"], r["cache"], r["system"])].append(r)
        for (model, cache, system), runs in sorted(sg.items()):
            L.append(
                f"| {model} | {cache} | {system} | {len(runs)} | {_fmt3(_mmm([r['wall_s'] for r in runs]))} | "
                f"{_fmt3(_mmm([r['io'].get('read_bytes') for r in runs]), 1, 1e6)} | "
                f"{_fmt3(_mmm([_rss_kib(r) * 1024 for r in runs]), 0, 2**20)} |"
            )
    L += [
        "",
        "## Merges",
        "",
        "wall = process wall time, start to exit, imports included; +sync = plus the `sync` after exit (mergekit does not "
        "fsync its output, mergepipe does); cpu = user + system; base/expert/output = bytes per role "
        "(mergepipe counters; mergekit: input shard sizes and output size on disk); /proc = block-device bytes of the "
        "process; ×mk = mergekit median wall / this system's median wall; LB = physical lower bound of this "
        "system's bytes (cold only), wall/LB its ratio.",
    ]
    for model in results.get("inputs", {}):
        for cache in s["cache"]:
            keys = sorted({k for (mm, c, k, _) in g if mm == model and c == cache})
            if not keys:
                continue
            L += [
                "",
                f"### {model}, {cache} cache",
                "",
                "| K | system | n | wall s | +sync s | cpu s | base MB | expert MB | output MB | /proc read MB | /proc write MB | peak RSS MiB | retained energy | ×mk | wall/LB |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for k in keys:
                mk = g.get((model, cache, k, "mergekit"))
                mkw = _med([r["wall_s"] for r in mk]) if mk else None
                for sysname in SYS_ORDER:
                    runs = g.get((model, cache, k, sysname))
                    if not runs:
                        continue
                    st = stats(runs)
                    sp = f"{mkw / st['wall'][0]:.2f}" if mkw and sysname != "mergekit" else "—"
                    lb = (
                        lower_bound(results, model, (st["base"][0] or 0) + (st["expert"][0] or 0), st["output"][0] or 0)
                        if cache == "cold"
                        else None
                    )
                    src = " (inputs)" if st["src"] == "inputs" else ""
                    L.append(
                        f"| {k} | {sysname} | {st['n']} | {_fmt3(st['wall'])} | {_fmt(st['wall_sync'][0])} | {_fmt(st['cpu'][0])} | "
                        f"{_fmt3(st['base'], 1, 1e6)}{src} | {_fmt3(st['expert'], 1, 1e6)}{src} | {_fmt3(st['output'], 1, 1e6)} | "
                        f"{_fmt3(st['rb'], 1, 1e6)} | {_fmt3(st['wb'], 1, 1e6)} | {_fmt3(st['rss'], 0, 2**20)} | "
                        f"{_fmt(st['energy'], 3)} | {sp} | {_fmt(st['wall'][0] / lb) if lb else '—'} |"
                    )
    failed = [r for r in results["runs"] if r.get("rc") != 0]
    if failed:
        L += [
            "",
            "Failed runs (excluded): "
            + ", ".join(
                f"{r['model']} K={r['k']} {r['cache']} r{r['rep']} {r['system']} (rc {r['rc']})" for r in failed
            ),
        ]
    L += ["", "## Output equality (mergekit vs mp-full)", ""]
    if results.get("equality"):
        for e in results["equality"]:
            if "error" in e:
                L.append(f"- {e['model']} K={e['k']}: comparison failed: {e['error'][-300:]}")
                continue
            t = e["total"]
            L.append(
                f"- {e['model']} K={e['k']}: {t['elements']} elements in {e.get('n_tensors', '?')} "
                f"common tensors; {t['differ']} differ ({t['differ'] / max(t['elements'], 1):.2%}), {t['over_1ulp']} by more "
                f"than 1 bf16 ulp in {e['tensors_over_1ulp']} tensors, max {t['max_ulps']} ulps; bit-identical: "
                f"{e['bit_identical']}; within 1 ulp: {e['identical_within_1ulp']}. Per-tensor detail: "
                f"`equality-{e['model']}-K{e['k']}.json`."
            )
            at = e.get("attribution")
            if at:
                a = at["total"]
                L.append(
                    f"  - Attribution (independent recomputation, `bench/compare_outputs.py --ties`): mergekit emulation "
                    f"reproduces mergekit's output {'exactly' if a['mk_emul_mismatch'] == 0 else 'NOT exactly (' + str(a['mk_emul_mismatch']) + ' elements)'}"
                    f", float32 + canonical-tie emulation reproduces mergepipe's "
                    f"{'exactly' if a['mp_emul_mismatch'] == 0 else 'NOT exactly (' + str(a['mp_emul_mismatch']) + ' elements)'}. "
                    f"{a['tied_entries']} task-vector entries sit exactly at their tensor's TIES threshold; mergekit's "
                    f"argsort kept a different subset of them than the canonical rule in {a['tie_mask_diff']} mask entries. "
                    f"Replaying mergekit's bf16 arithmetic with the canonical masks leaves {a['arith_differ']} elements "
                    f"different from mergepipe ({a['arith_over_1ulp']} by > 1 output ulp, max {a['arith_max_ulps']}): "
                    "bf16 rounding of each intermediate (delta, sum, quotient, base + delta) against one float32 rounding; "
                    "the large ulp counts are outputs near zero, where base + mixed cancels."
                )
        L.append("")
        L.append(
            "TIES ties at the threshold are resolved canonically by mergepipe (all or none of the tied entries; "
            'docs/CONCEPTS.md, "Canonical TIES tie rule"), by argsort order in mergekit.'
        )
    else:
        L.append("Not measured in this run.")
    L += ["", "## CLI start-up and planning", ""]
    hr = results.get("help") or []
    if hr:
        L.append(
            f"- `mergepipe --help`: process wall {_fmt3(_mmm([r['wall_s'] for r in hr]), 3)} s over {len(hr)} runs, "
            f"peak RSS {_med([_rss_kib(r) for r in hr]) / 1024:.0f} MiB."
        )
    for p in results.get("plan") or []:
        for budget in ("unlimited", "10%"):
            cli = [r["wall_s"] for r in p["cli"] if r.get("rc") == 0 and r["budget"] == budget]
            L.append(
                f"- `mergepipe plan` of {p['k']} experts ({p['model']} shape, budget {budget}), from the catalog: "
                f"process wall {_fmt3(_mmm(cli), 3)} s over {len(cli)} runs."
            )
        ip = p.get("inproc") or {}
        if "budgets" in ip:
            for b, v in ip["budgets"].items():
                L.append(
                    f"  - in-process `build_plan(analyze=False)`, budget {b}: {_fmt3(_mmm(v['build_plan_s']), 3)} s, "
                    f"of which catalog (register + load analyses) {_fmt3(_mmm(v['catalog_s']), 3)} s; "
                    f"{v['tensors']} tensors; import of mergepipe.pipeline {ip['import_s']:.3f} s."
                )
        elif ip:
            L.append(f"  - in-process timing failed: {ip.get('error', '')[-300:]}")
        an = p.get("analyze")
        if an:
            L.append(f"  - its one-time analysis of {p['k']} experts: {an['wall_s']:.1f} s.")
    L += ["", "## Targets", ""] + targets(results, g)
    L += ["", "Plots: `expert_io_vs_k.png`, `wall_vs_k.png`, `io_composition.png`.", ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------
# plots


def _kticks(ax, ks) -> None:
    ks = sorted(set(ks))
    if ks:
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks])
        from matplotlib.ticker import NullLocator

        ax.xaxis.set_minor_locator(NullLocator())
        if len(ks) == 1:
            ax.set_xlim(ks[0] / 1.5, ks[0] * 1.5)


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = group_runs(results)
    models = [m for m in results.get("inputs", {}) if any(k[0] == m for k in g)]
    if not models:
        return []
    made = []
    caches = [c for c in ("cold", "warm") if any(k[1] == c for k in g)]

    # 1. expert I/O vs K
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for sysname in SYS_ORDER:
            pts = []
            for k in sorted({k for (m, c, k, s) in g if m == model and s == sysname}):
                runs = [r for c in caches for r in g.get((model, c, k, sysname), [])]
                pts.append((k, _med([roles(r)["expert"] for r in runs])))
            if pts:
                ks, v = zip(*pts)
                lab = sysname + (" (reads every expert byte: input size)" if sysname == "mergekit" else "")
                if sysname == "mergekit":  # drawn wide underneath: it coincides with mp-full
                    ax.plot(
                        ks,
                        [x / 1e6 for x in v],
                        "s--",
                        color=COLORS[sysname],
                        lw=5,
                        ms=10,
                        alpha=0.45,
                        label=lab,
                        zorder=1,
                    )
                else:
                    ax.plot(ks, [x / 1e6 for x in v], "o-", color=COLORS[sysname], label=lab, zorder=2)
        ax.set_xscale("log", base=2)
        _kticks(ax, [k for (m, c, k, s) in g if m == model])
        ax.set_xlabel("K (experts)")
        ax.set_ylabel("expert bytes read (MB)")
        ax.set_title(f"{model}: expert I/O vs K")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "expert_io_vs_k.png", dpi=120)
    plt.close(fig)
    made.append("expert_io_vs_k.png")

    # 2. wall vs K, with the lower bound
    fig, axes = plt.subplots(len(caches), len(models), figsize=(5.5 * len(models), 4.2 * len(caches)), squeeze=False)
    for ci, cache in enumerate(caches):
        for mi, model in enumerate(models):
            ax = axes[ci][mi]
            for sysname in SYS_ORDER:
                ks = sorted({k for (m, c, k, s) in g if m == model and c == cache and s == sysname})
                if not ks:
                    continue
                st = [stats(g[(model, cache, k, sysname)])["wall"] for k in ks]
                med = [x[0] for x in st]
                err = [[x[0] - x[1] for x in st], [x[2] - x[0] for x in st]]
                ax.errorbar(ks, med, yerr=err, fmt="o-", capsize=3, color=COLORS[sysname], label=sysname)
            bw = results.get("bandwidth", {}).get(model)
            for sysname, style in (("mp-full", ":"), ("mergekit", "-.")):
                ks = sorted({k for (m, c, k, s) in g if m == model and c == cache and s == sysname})
                lbs = []
                for k in ks:
                    st = stats(g[(model, cache, k, sysname)])
                    lbs.append(
                        lower_bound(results, model, (st["base"][0] or 0) + (st["expert"][0] or 0), st["output"][0] or 0)
                    )
                if ks and all(lbs):
                    ax.plot(
                        ks,
                        lbs,
                        style,
                        marker="x",
                        color="gray",
                        label=f"lower bound, {sysname} bytes / disk bw" + ("" if cache == "cold" else " (cold)"),
                    )
            if bw:
                ax.text(
                    0.02,
                    0.98,
                    f"disk: read {bw['read']['bytes_per_s'] / 1e6:.0f} MB/s, write+fsync "
                    f"{bw['write']['bytes_per_s'] / 1e6:.0f} MB/s",
                    transform=ax.transAxes,
                    va="top",
                    fontsize=7,
                )
            ax.set_xscale("log", base=2)
            _kticks(ax, [k for (m, c, k, s) in g if m == model])
            ax.set_yscale("log")
            ax.set_xlabel("K (experts)")
            ax.set_ylabel("end-to-end wall time (s)")
            ax.set_title(f"{model}, {cache} cache: wall vs K (median, min–max)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "wall_vs_k.png", dpi=120)
    plt.close(fig)
    made.append("wall_vs_k.png")

    # 3. I/O composition at the largest K
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        kmax = max(k for (m, c, k, s) in g if m == model)
        names, parts, rbs = [], [], []
        for sysname in SYS_ORDER:
            runs = [r for c in caches for r in g.get((model, c, kmax, sysname), [])]
            if not runs:
                continue
            ro = [roles(r) for r in runs]
            names.append(sysname)
            parts.append([_med([x[p] for x in ro]) or 0 for p in ("base", "expert", "output")])
            cold = g.get((model, "cold", kmax, sysname))
            base_rb = (
                _med(
                    [
                        r["io"].get("read_bytes")
                        for r in results.get("startup") or []
                        if r.get("rc") == 0
                        and r["model"] == model
                        and r["cache"] == "cold"
                        and r["system"] == ("mergekit" if sysname == "mergekit" else "mergepipe")
                    ]
                )
                or 0
            )
            rbs.append(max(0, _med([r["io"].get("read_bytes") for r in cold]) - base_rb) if cold else None)
        x = range(len(names))
        bottom = [0.0] * len(names)
        for pi, (lab, col) in enumerate(
            (("base read", "#7f7f7f"), ("expert read", "#1f77b4"), ("output write", "#bcbd22"))
        ):
            vals = [p[pi] / 1e6 for p in parts]
            ax.bar(x, vals, bottom=bottom, color=col, label=lab)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if any(v is not None for v in rbs):
            ax.scatter(
                [i for i, v in enumerate(rbs) if v is not None],
                [v / 1e6 for v in rbs if v is not None],
                marker="_",
                s=400,
                color="red",
                zorder=3,
                label="/proc read_bytes, cold, minus start-up's",
            )
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=20)
        ax.set_ylabel("MB")
        ax.set_title(f"{model}: I/O composition at K={kmax}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "io_composition.png", dpi=120)
    plt.close(fig)
    made.append("io_composition.png")
    return made


def write_all(results: dict, out: Path) -> None:
    out = Path(out)
    (out / "summary.md").write_text(summary_md(results))
    try:
        plots(results, out)
    except ImportError as e:
        print(f"plots skipped: {e} (pip install matplotlib, or mergepipe's [bench] extra)", file=sys.stderr)


if __name__ == "__main__":
    p = Path(sys.argv[1])
    write_all(json.loads(p.read_text()), p.parent)
