"""In-process planning time: plan a TIES merge of the given experts from the catalog.

Usage (after ``mergepipe analyze`` of the same base and experts, same ``MERGEPIPE_HOME``)::

    MERGEPIPE_HOME=... python bench/plan_time.py --base B --expert E1 ... [--repeat 5]

Prints one JSON object: the import time of mergepipe's pipeline module, and per budget
(unlimited, 10%) the seconds of each ``build_plan(..., analyze=False)`` call (shard headers of
unchanged checkpoints are not re-read; statistics come from the catalog; no tensor byte is read)
and of the catalog part alone (register + load the analyses), so make_plan's own share is the
difference.

Synthetic mode, for model sizes this machine cannot analyze (no checkpoint is read or written)::

    python bench/plan_time.py --synthetic llama-7b --experts 4 --sketch none,sign3 \
        --budgets 10%,25%,50% [--method ties] [--repeat 3]

plans from a synthetic catalog of a 7B-shaped family (:mod:`bench.synthetic_catalog`: real
layouts, drawn block statistics and sketches) and prints, per fidelity-tier setting and budget,
the wall and CPU seconds of each ``make_plan`` call, the plan digest, the planned expert and sketch
bytes and the retained energy, with the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import time


def synthetic(a: argparse.Namespace) -> dict:
    """Time ``make_plan`` on a synthetic catalog (see the module docstring)."""
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.synthetic_catalog import family
    from mergepipe.planner.planner import EngineOptions, PlanInputs, SelectionOptions, make_plan
    from mergepipe.request import ExpertRequest, MergeRequest, parse_bytes

    load0 = os.getloadavg()
    t = time.perf_counter()
    base, recs, analyses = family(a.synthetic, a.experts, seed=a.seed)
    total = sum(r.total_bytes for r in recs)
    out: dict = {
        "shape": a.synthetic,
        "experts": a.experts,
        "method": a.method,
        "expert_bytes": total,
        "blocks": sum(st.n_blocks for an in analyses for st in an.tensors.values()),
        "catalog_build_s": round(time.perf_counter() - t, 3),
        "nproc": os.cpu_count(),
        "runs": [],
    }
    params = {"density": 0.5} if a.method in ("ties", "dare_ties", "dare_linear", "breadcrumbs", "della") else {}
    rr = MergeRequest(
        base=base.uri,
        method=a.method,
        parameters=params,
        experts=[ExpertRequest(name=f"expert{i}", uri=r.uri) for i, r in enumerate(recs)],
    ).resolve()
    inputs = PlanInputs(base, recs, analyses)
    for sketch in a.sketch.split(","):
        for budget in a.budgets.split(","):
            sel = SelectionOptions(budget_bytes=parse_bytes(budget, total=total), sketch=sketch)
            wall, cpu = [], []
            for _ in range(a.repeat):
                t, c = time.perf_counter(), time.process_time()
                p = make_plan(rr, inputs, sel, EngineOptions())
                wall.append(round(time.perf_counter() - t, 3))
                cpu.append(round(time.process_time() - c, 3))
            out["runs"].append(
                {
                    "sketch": sketch,
                    "budget": budget,
                    "make_plan_wall_s": wall,
                    "make_plan_cpu_s": cpu,
                    "plan_digest": p.digest,
                    "expert_read_bytes": p.io.expert_read_bytes,
                    "sketch_read_bytes": p.io.sketch_read_bytes,
                    "retained_energy": round(p.retained_energy, 6),
                }
            )
    out["loadavg_before_after"] = [load0, os.getloadavg()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base")
    ap.add_argument("--expert", action="append")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--synthetic", choices=("llama-7b", "llama-110m", "tiny"), help="plan from a synthetic catalog of this shape"
    )
    ap.add_argument("--experts", type=int, default=4, help="(--synthetic) number of experts")
    ap.add_argument("--sketch", default="none,sign3", help="(--synthetic) fidelity tiers, comma-separated")
    ap.add_argument("--budgets", default="10%,25%,50%", help="(--synthetic) expert budgets, comma-separated")
    ap.add_argument("--method", default="ties", help="(--synthetic) merge method (density 0.5 where it has one)")
    ap.add_argument("--seed", type=int, default=0, help="(--synthetic) seed of the drawn statistics")
    a = ap.parse_args()
    if a.synthetic:
        print(json.dumps(synthetic(a)))
        return
    if not a.base or not a.expert:
        ap.error("--base and --expert are required (or --synthetic SHAPE)")
    t = time.perf_counter()
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import build_plan, parse_expert, register_and_analyze
    from mergepipe.request import ExpertRequest, MergeRequest
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    out = {"import_s": time.perf_counter() - t, "experts": len(a.expert), "budgets": {}}
    experts = [parse_expert(e) for e in a.expert]
    for budget in ("unlimited", "10%"):
        runs, cat_s = [], []
        for _ in range(a.repeat):
            cat = Catalog()
            st = LocalStorage(IOCounters())
            t = time.perf_counter()
            register_and_analyze(cat, st, a.base, [u for _, u in experts], analyze=True)
            cat_s.append(time.perf_counter() - t)
            cat = Catalog()
            st = LocalStorage(IOCounters())
            t = time.perf_counter()
            req = MergeRequest(
                base=a.base,
                method="ties",
                parameters={"density": 0.5},
                budget=budget,
                experts=[ExpertRequest(name=n, uri=u) for n, u in experts],
            )
            p = build_plan(cat, st, req, analyze=False)
            runs.append(time.perf_counter() - t)
            reads = st.counters.snapshot()["read"]
        out["budgets"][budget] = {
            "build_plan_s": runs,
            "catalog_s": cat_s,
            "tensors": len(p.tensors),
            "expert_read_bytes_planned": p.io.expert_read_bytes,
            "retained_energy": p.retained_energy,
            "bytes_read_while_planning": reads,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
