"""In-process planning time: plan a TIES merge of the given experts from the catalog.

Usage (after ``mergepipe analyze`` of the same base and experts, same ``MERGEPIPE_HOME``)::

    MERGEPIPE_HOME=... python bench/plan_time.py --base B --expert E1 ... [--repeat 5]

Prints one JSON object: the import time of mergepipe's pipeline module, and per budget
(unlimited, 10%) the seconds of each ``build_plan(..., analyze=False)`` call (shard headers of
unchanged checkpoints are not re-read; statistics come from the catalog; no tensor byte is read)
and of the catalog part alone (register + load the analyses), so make_plan's own share is the
difference.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--expert", action="append", required=True)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
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
