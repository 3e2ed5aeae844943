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

``--record FILE --code TEXT`` also appends the run to the raw record ``FILE`` (format
``mergepipe.bench.s3_requests/v1``, created with ``--fixture TEXT`` when missing), which
``bench/benchmarks_report.py`` renders into docs/BENCHMARKS.md: the run's label (``--budget``
and ``--sketch`` of the command), ``code`` (what code ran: ``TEXT``), its commit, start time and
load average, the command (``--out``/``--record`` left out, the bucket as ``$BUCKET``), exit
code, process wall, the input window (the first base GET's start to the end of the last base,
expert or sketch GET), the command's ``--json`` figures (``wall_s`` as ``engine_wall_s``,
``analyze_plan_s``, ``total_s``, ``io``) and the per-kind summary.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
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


FORMAT = "mergepipe.bench.s3_requests/v1"
#: the kinds the input window spans
INPUT_KINDS = ("base", "expert", "sketch")


def input_window_s(reqs: list[dict]) -> float | None:
    """Seconds from the first ``base`` GET's start to the end of the last input GET (kinds
    :data:`INPUT_KINDS`) of recorded GETs (``{"kind", "t0", "s"}``); None without a base GET."""
    base = [r["t0"] for r in reqs if r["kind"] == "base"]
    ends = [r["t0"] + r["s"] for r in reqs if r["kind"] in INPUT_KINDS]
    return round(max(ends) - min(base), 3) if base else None


def _opt(args: list[str], *names: str) -> str | None:
    for n in names:
        if n in args[:-1]:
            return args[args.index(n) + 1]
    return None


def record_command(argv: list[str], bucket: str | None) -> list[str]:
    """This script's command line as a record keeps it: its own ``--out``/``--record``/
    ``--code``/``--fixture`` and their values left out (where results went, scratch paths, and
    what the record says elsewhere), the mergepipe command after ``--`` kept whole, the bucket
    as ``$BUCKET``."""
    n = argv.index("--") if "--" in argv else len(argv)
    own, skip = [], False
    for x in argv[:n]:
        if skip:
            skip = False
        elif x in ("--out", "--record", "--code", "--fixture"):
            skip = True
        elif not x.startswith(("--out=", "--record=", "--code=", "--fixture=")):
            own.append(x)
    cmd = ["s3_requests.py", *own, *argv[n:]]
    return [x.replace(f"s3://{bucket}/", "s3://$BUCKET/") for x in cmd] if bucket else cmd


def record_run(
    args: list[str],
    argv: list[str],
    code: str,
    started: str,
    load1: float,
    rc: int,
    wall: float,
    reqs: list[dict],
    res: dict | None,
) -> dict:
    """One run of the raw record (see the module docstring): ``args`` the mergepipe command,
    ``argv`` this script's arguments, ``res`` the command's ``--json`` result (None: none)."""
    from bench.record import git_rev

    base = _opt(args, "--base")
    bucket = base[5:].split("/", 1)[0] if base and base.startswith("s3://") else None
    run: dict = {
        "run": f"{_opt(args, '--budget', '-b') or 'unlimited'} {_opt(args, '--sketch') or 'default'}",
        "code": code,
        "git": git_rev(),
        "started": started,
        "load1_before": round(load1, 2),
        "command": record_command(argv, bucket),
        "rc": rc,
        "process_wall_s": round(wall, 3),
    }
    w = input_window_s(reqs)
    if w is not None:
        run["input_window_s"] = w
    if res:
        for k, key in (("wall_s", "engine_wall_s"), ("analyze_plan_s", "analyze_plan_s"), ("total_s", "total_s")):
            if isinstance(res.get(k), (int, float)):
                run[key] = res[k]
        if isinstance(res.get("io"), dict):
            run["io"] = res["io"]
    run["by_kind"] = summarize(reqs)
    return run


def append_record(path: Path, run: dict, fixture: str) -> None:
    """Append ``run`` to the raw record at ``path`` (created with ``fixture`` when missing).

    Raises:
        ValueError: ``path`` exists but is not a record of :data:`FORMAT`.
    """
    if path.exists():
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("runs"), list):
            raise ValueError(f"{path}: not a {FORMAT} record; give another --record file")
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        d = {"format": FORMAT, "fixture": fixture, "machine": f"{os.cpu_count()} cores / {mem:.0f} GiB", "runs": []}
    d["runs"].append(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="summary and every request (JSON)")
    ap.add_argument("--record", type=Path, default=None, help="append the run to this raw record (see above)")
    ap.add_argument("--code", default=None, help="with --record: what code ran (e.g. 'main', 'main with X')")
    ap.add_argument("--fixture", default="", help="with --record: the fixture, for a new record file")
    ap.add_argument(
        "--sketch-gap",
        type=int,
        default=None,
        help="experiment: read sketch planes coalescing gaps up to this many bytes (the engine reads "
        "with 0); the bridged bytes exceed the plan, so the engine's realized-bytes check is off in "
        "this process and the output is committed anyway (measure only, never a product run)",
    )
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the mergepipe command line")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    if a.record is not None and not a.code:
        print("error: --record needs --code TEXT (what code ran)", file=sys.stderr)
        return 2
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
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load1 = os.getloadavg()[0]
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            cli.main()
    except SystemExit as e:
        rc = int(e.code or 0)
    finally:
        S3Storage._get_range = real  # type: ignore[method-assign]
        sys.stdout.write(stdout.getvalue())
    wall = time.perf_counter() - t_start
    res = {"command": ["mergepipe", *args], "rc": rc, "wall_s": round(wall, 3), "by_kind": summarize(reqs)}
    print(json.dumps(res["by_kind"], indent=1), file=sys.stderr)
    if a.out:
        a.out.write_text(json.dumps(dict(res, requests=reqs), indent=None) + "\n")
    if a.record is not None:
        try:
            result = json.loads(stdout.getvalue())
        except ValueError:
            result = None  # the command printed no --json result (or failed)
        run = record_run(
            args, argv, a.code, started, load1, rc, wall, reqs, result if isinstance(result, dict) else None
        )
        append_record(a.record, run, a.fixture)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
