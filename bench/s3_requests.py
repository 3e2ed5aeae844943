"""Per-request profile of one ``mergepipe`` command on S3: every ranged GET it issues, by kind.

Runs ``mergepipe <args>`` in this process with :meth:`mergepipe.storage.s3.S3Storage._get_range`
wrapped to record, per GET, the object's kind (``sketch``: a catalog sketch blob; ``catalog``:
another catalog object; ``base``: under the ``--base`` prefix; ``output``: under the
``--out`` prefix (read back by the commit); ``expert``: any other ``.safetensors``; ``other``), its bytes, its seconds (from the call to the last byte read,
retries included) and its start relative to the command's start. Prints and writes (``--out``)
per kind: requests, MB, the sum of request seconds, the median and 90th percentile
milliseconds per request, MB/s per request (bytes / request seconds), and the span from the
kind's first request start to its last end (with the reader threads overlapping requests, the
sum exceeds the span).

Usage (the environment's ``AWS_*`` variables name the endpoint and keys, as for ``mergepipe``)::

    python bench/s3_requests.py --out /tmp/p.json -- merge --base s3://b/models/base \\
        --expert s3://b/models/e0 ... --catalog s3://b/catalog --budget 10% --out s3://b/out/x --json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))


def _kind(uri: str, base: str | None, out: str | None) -> str:
    if uri.endswith(".sketch"):
        return "sketch"
    if "/catalog/" in uri:
        return "catalog"
    if base and uri.startswith(base.rstrip("/") + "/"):
        return "base"
    if out and uri.startswith(out.rstrip("/") + "/"):
        return "output"
    return "expert" if uri.endswith(".safetensors") else "other"


def summarize(reqs: list[dict]) -> dict:
    """``{kind: {requests, mb, request_s, median_ms, p90_ms, mb_per_s_per_request, span_s}}`` of
    recorded GETs (each ``{"kind", "bytes", "t0", "s"}``)."""
    import numpy as np

    out = {}
    for kind in sorted({r["kind"] for r in reqs}):
        rs = [r for r in reqs if r["kind"] == kind]
        s = np.array([r["s"] for r in rs])
        b = np.array([r["bytes"] for r in rs], dtype=np.float64)
        out[kind] = {
            "requests": len(rs),
            "mb": round(float(b.sum()) / 1e6, 3),
            "request_s": round(float(s.sum()), 3),
            "median_ms": round(float(np.median(s)) * 1e3, 2),
            "p90_ms": round(float(np.percentile(s, 90)) * 1e3, 2),
            "median_kb": round(float(np.median(b)) / 1e3, 1),
            "mb_per_s_per_request": round(float(b.sum()) / 1e6 / max(float(s.sum()), 1e-9), 1),
            "span_s": round(max(r["t0"] + r["s"] for r in rs) - min(r["t0"] for r in rs), 3),
        }
    return out


def _bridge_sketch_gaps(gap: int) -> None:
    """``--sketch-gap``: sketch blobs read with coalescing gap ``gap``, realized-bytes check off."""
    import mergepipe.engine.executor as ex
    from mergepipe.storage.base import Storage

    real = Storage.read_ranges

    def read_ranges(self, uri, ranges, role, max_gap=None):
        if uri.endswith(".sketch"):
            max_gap = gap
        return real(self, uri, ranges, role, max_gap=max_gap)

    Storage.read_ranges = read_ranges  # type: ignore[method-assign]
    ex._check_realized = lambda plan, realized: None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="summary and every request (JSON)")
    ap.add_argument(
        "--sketch-gap",
        type=int,
        default=None,
        help="experiment: read sketch planes coalescing gaps up to this many bytes (the engine reads "
        "with 0); the bridged bytes exceed the plan, so the engine's realized-bytes check is off in "
        "this process and the output is committed anyway (measure only, never a product run)",
    )
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the mergepipe command line")
    a = ap.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    base = args[args.index("--base") + 1] if "--base" in args else None
    out = args[args.index("--out") + 1] if "--out" in args else None

    from mergepipe import cli
    from mergepipe.storage.s3 import S3Storage

    reqs: list[dict] = []
    lock = threading.Lock()
    real = S3Storage._get_range
    t_start = time.perf_counter()

    def timed(self, uri, start, end, **kw):
        t0 = time.perf_counter()
        try:
            return real(self, uri, start, end, **kw)
        finally:
            t1 = time.perf_counter()
            with lock:
                reqs.append(
                    {"kind": _kind(uri, base, out), "uri": uri, "bytes": end - start, "t0": t0 - t_start, "s": t1 - t0}
                )

    S3Storage._get_range = timed  # type: ignore[method-assign]
    if a.sketch_gap is not None:
        _bridge_sketch_gaps(a.sketch_gap)
    sys.argv = ["mergepipe", *args]
    rc = 0
    try:
        cli.main()
    except SystemExit as e:
        rc = int(e.code or 0)
    finally:
        S3Storage._get_range = real  # type: ignore[method-assign]
    wall = time.perf_counter() - t_start
    res = {"command": ["mergepipe", *args], "rc": rc, "wall_s": round(wall, 3), "by_kind": summarize(reqs)}
    print(json.dumps(res["by_kind"], indent=1), file=sys.stderr)
    if a.out:
        a.out.write_text(json.dumps(dict(res, requests=reqs), indent=None) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
