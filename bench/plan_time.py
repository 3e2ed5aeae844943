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

Recorded mode, issue 23 item 3's figure (planning from a cached catalog, 110M-shaped Llama, K = 8)::

    python bench/plan_time.py --record docs/benchmarks/planning-110m-k8.json [--repeat 7] \
        [--work bench/.work/plan-110m]

writes the family once (:func:`bench.synthetic_catalog.write_family`: real headers, a catalog of
drawn statistics, nothing analysed), then per repetition, in fresh processes: ``api.plan`` in
process (CPU and wall seconds, and ``make_plan``'s share) for unlimited, 10% ``sign3`` and 10%
``sign3+r1`` TIES plans; the whole ``mergepipe plan`` process at 10% ``sign3``; and the floors:
the bare interpreter, and the interpreter with the imports planning needs. Raw results (every
repetition, load averages, machine, commit); ``bench/plan_report.py`` renders them into
docs/BENCHMARKS.md.
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


#: the in-process measurement (a fresh interpreter per repetition); argv: base, experts...
_INPROC = r"""
import json, sys, time
c0, t0 = time.process_time(), time.perf_counter()
from mergepipe import api
import mergepipe.pipeline as pipeline
from mergepipe.request import ExpertRequest, MergeRequest, PlanningOptions
imports = [time.process_time() - c0, time.perf_counter() - t0]
inner = []
make_plan = pipeline.make_plan
def timed(*a, **k):
    c = time.process_time()
    try:
        return make_plan(*a, **k)
    finally:
        inner.append(time.process_time() - c)
pipeline.make_plan = timed
base, experts = sys.argv[1], sys.argv[2:]
out = {"imports": imports, "cases": {}}
for budget, sketch in (("unlimited", "none"), ("10%", "sign3"), ("10%", "sign3+r1")):
    req = MergeRequest(base=base, method="ties", parameters={"density": 0.3}, budget=budget,
                       planning=PlanningOptions(sketch=sketch),
                       experts=[ExpertRequest(name=f"expert{i}", uri=u) for i, u in enumerate(experts)])
    inner.clear()
    c, t = time.process_time(), time.perf_counter()
    p = api.plan(req)
    out["cases"][f"{budget} {sketch}"] = {"cpu_s": time.process_time() - c, "wall_s": time.perf_counter() - t,
                                         "make_plan_cpu_s": sum(inner), "digest": p.digest,
                                         "expert_read_bytes": p.io.expert_read_bytes}
print(json.dumps(out))
"""


def _child(args: list[str], env: dict, cwd: str) -> tuple[float, float, str]:
    """Run ``args``; (CPU seconds of the child, wall seconds, stdout). Raises on failure."""
    import resource
    import subprocess

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    o = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if o.returncode:
        raise SystemExit(f"plan_time: {' '.join(args[:4])} ... failed ({o.returncode}): {o.stderr.strip()[-500:]}")
    return r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, wall, o.stdout


def record(out: str, repeat: int, work: str, label: str = "") -> dict:
    """Issue 23 item 3's planning figure (see the module docstring): raw results, written to ``out``."""
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    from bench.synthetic_catalog import write_family

    w = Path(work)
    if not (w / "home" / "catalog.sqlite").exists():
        write_family("llama-110m", 8, w)
    base, experts = str(w / "base"), [str(w / f"expert{i}") for i in range(8)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as installed: bytecode cached
    env.update(MERGEPIPE_HOME=str(w / "home"), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])
    cli = [sys.executable, "-m", "mergepipe.cli", "plan", "--base", base, "-m", "ties", "-p", "density=0.3"]
    cli += ["--budget", "10%", "--sketch", "sign3"] + [a for e in experts for a in ("-e", e)]
    floor = [sys.executable, "-c", "import mergepipe.cli, mergepipe.pipeline, mergepipe.planner.planner"]
    _child(cli, env, str(repo))  # warm-up: bytecode written, page cache warm
    # the last commit of the product code measured (bench/ and docs/ commits after it change nothing timed)
    commit = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--", "mergepipe", "operator"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    runs = []
    for _ in range(repeat):
        load = os.getloadavg()
        cpu, wall, so = _child([sys.executable, "-c", _INPROC, base, *experts], env, str(repo))
        inproc = json.loads(so)
        pcpu, pwall, _ = _child(cli, env, str(repo))
        fcpu, fwall, _ = _child(floor, env, str(repo))
        icpu, iwall, _ = _child([sys.executable, "-c", "pass"], env, str(repo))
        runs.append(
            {
                "loadavg_before": list(load),
                "loadavg_after": list(os.getloadavg()),
                "in_process": inproc,
                "process_10pct_sign3": {"cpu_s": pcpu, "wall_s": pwall},
                "floor_imports": {"cpu_s": fcpu, "wall_s": fwall},
                "floor_interpreter": {"cpu_s": icpu, "wall_s": iwall},
            }
        )
    res = {
        "label": label,
        "fixture": "bench/synthetic_catalog.py write_family('llama-110m', 8): 110M-shaped bf16 Llama, K = 8, "
        "catalog of drawn statistics (nothing analysed); TIES density 0.3",
        "command": f"python bench/plan_time.py --record {_rel(out, repo)} --repeat {repeat}"
        + (f" --label {json.dumps(label)}" if label else ""),
        "commit": commit,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": {"nproc": os.cpu_count(), "mem_gib": _mem_gib(), "python": platform.python_version()},
        "runs": runs,
    }
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    return res


def _rel(path: str, repo) -> str:
    """``path`` as the docs cite it: relative to the repository (a raw result written into another
    checkout's docs/benchmarks/ is named by that folder), never this machine's absolute path."""
    import os
    from pathlib import Path

    p = Path(path).resolve()
    r = os.path.relpath(p, repo)
    return r if not r.startswith("..") else f"{p.parent.parent.name}/{p.parent.name}/{p.name}"


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", metavar="OUT_JSON", help="record issue 23 item 3's planning figure (raw results)")
    ap.add_argument("--work", default="bench/.work/plan-110m", help="(--record) where the synthetic family is kept")
    ap.add_argument("--label", default="", help="(--record) what the measured code is, shown with the figure")
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
    if a.record:
        record(a.record, a.repeat, a.work, a.label)
        return
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
