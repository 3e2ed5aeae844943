"""Measure the engine's working memory per tensor element, per method and K (the planner's
``chunk_rows`` sizes chunks from these figures: ``mergepipe/planner/planner.py``, ``WORK_FLOATS``).

For each method and K: a bf16 family with one ``ROWS x COLS`` tensor, merged in a fresh process
with a work-memory target large enough that the tensor is one chunk; peak RSS (sampled ``VmHWM``) minus the same merge of a tiny tensor, divided by ``4 * numel``,
is the number of float32-sized arrays alive at the peak (raw bf16 inputs and the output count
as half an array each). Usage::

    python bench/work_floats.py [--k 2,4] [--methods ties,dare_ties,...] [--rows 4096 --cols 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CHILD = """
import json, sys
from mergepipe.catalog.catalog import Catalog
from mergepipe.pipeline import merge, register_and_analyze
from mergepipe.storage.base import IOCounters
from mergepipe.pipeline import open_storage
base, out, cat, method, params = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
experts = [(f"e{i}", p) for i, p in enumerate(sys.argv[6:])]
c = Catalog(cat)
if out == "-":  # analysis only (so the measured run does not include it)
    register_and_analyze(c, open_storage(base, IOCounters()), base, [p for _, p in experts], 128 * 1024,
                         pairs=len(experts) > 1)
    sys.exit(0)
merge(base, experts, method, out, params, catalog=c, work_bytes=4 << 30, prefetch_bytes=4 << 30)
"""

METHODS = {
    "ties": ["density=0.5"],
    "task_arithmetic": [],
    "ties+rescale": ["density=0.5", "rescale=true"],
    "dare_ties": ["density=0.5"],
    "della": ["density=0.5"],
    "model_stock": [],
    "nuslerp": [],
    "slerp": ["t=0.3"],
    "breadcrumbs": ["density=0.5"],
}
K_FIXED = {"nuslerp": 2, "slerp": 1}


def peak_rss(args: list[str], tmp: Path) -> int:
    """Peak RSS (bytes) of the child: its sampled ``VmHWM`` (``bench/measure.py``; ``ru_maxrss``
    would carry this process's size, which holds the synthesized family)."""
    import measure

    r = measure.run_measured(
        [sys.executable, "-c", CHILD, *args],
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
        stderr_path=tmp / "child.err",
        interval=0.005,
    )
    if r["rc"] != 0:
        raise SystemExit((tmp / "child.err").read_text()[-2000:])
    return r["peak_rss_kib"] * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    a = ap.parse_args()
    from testkit.synth import make_family

    out = []
    with tempfile.TemporaryDirectory(dir=HERE / ".work" if (HERE / ".work").is_dir() else None) as tmp:
        tmp = Path(tmp)
        kmax = max(int(k) for k in a.k.split(","))
        name = "model.layers.0.mlp.down_proj.weight"
        big = make_family(tmp / "big", kmax, seed=1, shapes={name: (a.rows, a.cols)}, n_shards=1)
        small = make_family(tmp / "small", kmax, seed=1, shapes={name: (64, 64)}, n_shards=1)
        numel = a.rows * a.cols
        for m in a.methods.split(","):
            method = m.split("+")[0]
            for k in sorted({K_FIXED.get(m, int(k)) for k in a.k.split(",")}):
                rss = {}
                for tag, (b, es) in (("big", big), ("small", small)):
                    cat = str(tmp / f"c-{tag}-{k}.sqlite")
                    args = [str(b), "-", cat, method, json.dumps(METHODS[m]), *map(str, es[:k])]
                    peak_rss(args, tmp)  # analysis, not measured
                    o = tmp / f"o-{tag}-{m}-{k}"
                    args[1] = str(o)
                    rss[tag] = peak_rss(args, tmp)
                floats = (rss["big"] - rss["small"]) / (4 * numel)
                out.append(
                    {
                        "method": m,
                        "k": k,
                        "floats_per_elem": round(floats, 2),
                        "peak_rss_mib": round(rss["big"] / 2**20),
                        "baseline_mib": round(rss["small"] / 2**20),
                    }
                )
                print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
