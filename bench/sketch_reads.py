"""How many ranged reads a saved plan's sketch planes cost, and what bridging gaps would save.

For every work item of the plan (:func:`mergepipe.engine.worklist.build_work_list`) and every
expert with sketched blocks in it, the byte ranges the engine reads
(:func:`mergepipe.engine.reader.sketch_parts`: one per section of each sketched run) are
coalesced as the storage would with gap 0 (what the engine does: realized bytes = planned
bytes), with larger gaps, and with one request per section (every gap inside a plane bridged).
Nothing is read; prints ``name value`` lines: ``calls`` ((work item, expert) reads), ``runs``,
``ranges``, then ``reqs_*``/``bytes_*`` per coalescing rule.

Usage::

    mergepipe plan ... --budget 10% --out plan.json
    python bench/sketch_reads.py plan.json [--gaps 65536,1048576]
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))


def count(plan, gaps: list[int]) -> dict[str, int]:
    """The counters described in the module docstring, for a :class:`~mergepipe.planner.plan.Plan`."""
    from mergepipe.catalog.sketch import level_sections, section_offsets
    from mergepipe.engine.worklist import build_work_list, n_rows
    from mergepipe.storage.base import coalesce

    res: collections.Counter[str] = collections.Counter()
    for it in build_work_list(plan):
        if it.kind not in ("merge", "threshold", "stats"):
            continue
        tp = it.tp
        rpb, rows, row_numel = tp.rows_per_block, n_rows(tp), max(1, math.prod(tp.shape[1:]))
        offs = section_offsets(rows, row_numel, rpb, tp.n_blocks)
        for te in tp.experts:
            rngs: list[tuple[int, int]] = []
            by_sec: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
            runs = 0
            for (b0, b1), k in zip(te.sketch_blocks, te.sketch_levels, strict=True):
                a, z = max(it.r0, b0 * rpb), min(it.r1, b1 * rpb, rows)
                if z <= a:
                    continue
                runs += 1
                lo, hi = a // rpb, -(-z // rpb)
                for s in level_sections(k):
                    r = (te.sketch_start + int(offs[s, lo]), te.sketch_start + int(offs[s, hi]))
                    rngs.append(r)
                    by_sec[s].append(r)
            if not rngs:
                continue
            res["calls"] += 1
            res["runs"] += runs
            res["ranges"] += len(rngs)
            for g in [0, *gaps]:
                q = coalesce(rngs, g)
                res[f"reqs_gap{g}"] += len(q)
                res[f"bytes_gap{g}"] += sum(e - s for s, e in q)
            res["reqs_per_section"] += len(by_sec)
            res["bytes_per_section"] += sum(max(e for _, e in v) - min(s for s, _ in v) for v in by_sec.values())
    return dict(res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path, help="a plan saved by `mergepipe plan --out`")
    ap.add_argument("--gaps", default="65536,1048576", help="comma list of coalescing gaps in bytes")
    a = ap.parse_args(argv)
    from mergepipe.planner.plan import Plan

    plan = Plan.from_json(a.plan.read_text(), source=str(a.plan))
    for k, v in sorted(count(plan, [int(g) for g in a.gaps.split(",") if g]).items()):
        print(k, v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
