"""Cost of the engine's content checks (issue 22): merges with and without them, side by side.

Builds (once) a bf16 family of ``bench/synthetic.py`` (default the Qwen3-0.6B shape, K = 2),
analyzes it once, then runs the same merge ``--reps`` times with the per-block checks on and
off alternately (off: :func:`mergepipe.engine.checks.check_expert_runs` and
``check_sketch_plane`` replaced by no-ops in this process), warm page cache, and prints the
median wall and CPU times (CPU: less sensitive to a shared machine's load), their ratios and
the bytes hashed, plus the single-thread SHA-256 rate of
this machine on 128 KiB blocks.

Usage::

    python bench/content_checks.py OUT_DIR [--shape qwen3-0.6b|tiny] [--experts 2] [--reps 3]
        [--budget 100%] [--method ties]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path


def sha256_rate(block: int = 128 << 10, total: int = 256 << 20) -> float:
    """Single-thread ``hashlib.sha256`` throughput (bytes/s) on ``block``-byte pieces."""
    data = memoryview(os.urandom(total))
    t0 = time.perf_counter()
    for i in range(0, total, block):
        hashlib.sha256(data[i : i + block]).digest()
    return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", default="100%")
    ap.add_argument("--method", default="ties")
    args = ap.parse_args()

    import mergepipe.engine.reader as reader
    from bench.synthetic import make_family
    from mergepipe.catalog.catalog import Catalog
    from mergepipe.pipeline import merge
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.local import LocalStorage

    root = Path(args.out)
    base, experts = make_family(root / "family", args.experts, shape=args.shape)
    cat = Catalog(root / "catalog.sqlite")
    on = (reader.check_expert_runs, reader.check_sketch_plane)
    off = (lambda *a, **k: None, lambda *a, **k: None)
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    read = {}
    for rep in range(args.reps + 1):  # rep 0 warms the page cache (and analyzes)
        for mode in ("on", "off"):
            reader.check_expert_runs, reader.check_sketch_plane = on if mode == "on" else off
            out = root / f"out-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            st = LocalStorage(IOCounters())
            t0, c0 = time.perf_counter(), time.process_time()
            merge(
                str(base),
                [(e.name, str(e)) for e in experts],
                args.method,
                str(out),
                ["density=0.5"] if args.method in ("ties", "dare_ties") else [],
                budget=args.budget,
                catalog=cat,
                storage=st,
            )
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rep:
                times[mode].append(dt)
                cpu[mode].append(dc)
            read[mode] = st.counters.snapshot()["read"]
    reader.check_expert_runs, reader.check_sketch_plane = on
    med = {m: statistics.median(v) for m, v in times.items()}
    print(
        json.dumps(
            {
                "shape": args.shape,
                "experts": args.experts,
                "method": args.method,
                "budget": args.budget,
                "reps": args.reps,
                "wall_s": times,
                "median_s": med,
                "overhead": med["on"] / med["off"] - 1.0,
                "cpu_s": cpu,
                "cpu_overhead": statistics.median(cpu["on"]) / statistics.median(cpu["off"]) - 1.0,
                "expert_bytes_hashed": read["on"].get("expert", 0),
                "sha256_MBps_1thread": sha256_rate() / 1e6,
                "loadavg": os.getloadavg(),
                "cpus": os.cpu_count(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
