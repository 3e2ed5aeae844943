"""Analysis with numpy's BLAS pool pinned to one thread (as ``mergepipe analyze`` does) against
the same analysis with OpenBLAS's default pool (one thread per core), side by side.

A synthetic family (:func:`testkit.synth.make_family`, bf16, ``--hidden``/``--inter``/``--layers``)
is analysed ``--repeats`` times per mode with ``force=True`` (statistics and sign3+r1 sketches
of every block), modes alternating so both see the same machine load. Each analysis reports
wall seconds (``time.perf_counter``) and CPU seconds of the process (``getrusage``: every
thread), with the load average before it. ``pinned`` is
:func:`mergepipe.catalog.catalog.analysis_blas_threads`; ``default`` replaces it with no limit
(the behaviour before it: OpenBLAS's pool as the environment left it).

Run it without ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` in the environment (they would pin
``default`` too)::

    env -u OPENBLAS_NUM_THREADS -u OMP_NUM_THREADS python bench/analyze_blas.py --out /tmp/blas.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="results (JSON) [stdout only]")
    a = ap.parse_args(argv)

    from threadpoolctl import threadpool_info

    import mergepipe.catalog.catalog as cc
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage
    from testkit.synth import llama_like_shapes, make_family

    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    with tempfile.TemporaryDirectory(prefix="analyze-blas-") as td:
        shapes = llama_like_shapes(hidden=a.hidden, inter=a.inter, layers=a.layers, vocab=1024)
        base, experts = make_family(Path(td) / "fam", a.experts, seed=3, shapes=shapes)
        cat = cc.Catalog(Path(td) / "c.sqlite")
        st = LocalStorage(IOCounters())
        b = cat.register(st, str(base))
        es = [cat.register(st, str(e)) for e in experts]
        pinned = cc.analysis_blas_threads
        rows = []
        for rep in range(a.repeats):
            for mode in ("default", "pinned"):
                cc.analysis_blas_threads = pinned if mode == "pinned" else contextlib.nullcontext  # type: ignore[assignment]
                load, c0, t0 = os.getloadavg()[0], _cpu_s(), time.perf_counter()
                cat.analyze(st, b, es, force=True)
                row = {
                    "mode": mode,
                    "rep": rep,
                    "wall_s": round(time.perf_counter() - t0, 2),
                    "cpu_s": round(_cpu_s() - c0, 2),
                    "load1_before": round(load, 2),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        cc.analysis_blas_threads = pinned
    res = {
        "command": ["analyze_blas.py", *(argv if argv is not None else sys.argv[1:])],
        "fixture": {"hidden": a.hidden, "inter": a.inter, "layers": a.layers, "experts": a.experts},
        "blas": [{k: p[k] for k in ("internal_api", "num_threads", "version")} for p in blas],
        "nproc": os.cpu_count(),
        "runs": rows,
    }
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
