"""The engine's tiled merge of one tensor, torch path against the fused CPU kernels, side by side.

A benchmark, not a test: it builds one bf16 tensor (``--rows`` x ``--cols``, blocks of
``--block-rows``) and ``--experts`` experts whose task vectors are normal draws (σ = 0.01 around a
σ = 0.02 base), each held as ``--mode``: ``exact`` (the bf16 rows), ``sign3`` (3 sign planes) or
``r1`` (the rank-1 tier: factors + residual plane), and merges it with TIES (density 0.3, the
trim at the 70th percentile key, normalize) through
:func:`mergepipe.engine.chunk.merge_chunk`, alternately with ``MERGEPIPE_KERNELS=torch`` (the
torch formulation, the path a CUDA device runs) and with the fused kernels
(:mod:`mergepipe.methods.kernels_cpu`), best of ``--repeat`` each, in CPU seconds of one thread
(``time.process_time``: robust to a shared machine's load). The output bytes of both are
compared (they must be equal). Figures: ns per expert entry (CPU time / (entries · K)).

Usage::

    python bench/merge_tile.py [--mode sign3|r1|exact] [--experts 8] [--rows 3072] [--cols 768]

``--out FILE`` appends the run's record (with its commit, time and command: :mod:`bench.record`)
to ``FILE``, e.g. ``docs/benchmarks/merge-tile-DATE.jsonl``, which ``bench/benchmarks_report.py``
renders into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import record  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["sign3", "r1", "exact"], default="sign3")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=3072)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--block-rows", type=int, default=85)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--out", type=Path, default=None, help="append the run's record (one JSON line) to this file [print only]"
    )
    a = ap.parse_args(argv)

    import torch

    from mergepipe.catalog.sketch import PLANES, encode_block
    from mergepipe.engine.chunk import L1Sums, merge_chunk
    from mergepipe.engine.reader import ChunkInputs
    from mergepipe.engine.sketchkernel import SketchRun
    from mergepipe.engine.worklist import WorkItem
    from mergepipe.methods import kernels_cpu
    from mergepipe.methods.registry import get_method
    from mergepipe.numerics import magnitude_keys
    from mergepipe.planner.plan import TensorExpert, TensorPlan

    torch.set_num_threads(1)
    rows, rn, rpb, k = a.rows, a.cols, a.block_rows, a.experts
    rng = np.random.default_rng(0)
    base = torch.from_numpy((rng.standard_normal((rows, rn)) * 0.02).astype(np.float32)).bfloat16()
    tes, exps = [], []
    for i in range(k):
        x = (base.float() + torch.from_numpy((rng.standard_normal((rows, rn)) * 0.01).astype(np.float32))).bfloat16()
        d = (x.float() - base.float()).numpy()
        mk = int(np.quantile(magnitude_keys(d.ravel()[:200000]), 0.7))
        tes.append(TensorExpert(expert=i, file="x", start=0, density=0.3, min_key=mk, blocks=[], bytes=0,
                                kept_energy=1.0, full_energy=1.0))  # fmt: skip
        if a.mode == "exact":
            exps.append([((0, rows), x.view(torch.uint8).numpy().tobytes())])
            continue
        secs: list[list[bytes]] = [[] for _ in range(PLANES + 2)]
        for r in range(0, rows, rpb):
            for p, b in enumerate(encode_block(d[r : r + rpb])[0]):
                secs[p].append(b)
        blobs = [b"".join(s) for s in secs]
        run = (
            SketchRun(rows, rn, rpb, [blobs[PLANES + 1]], factors=blobs[PLANES])
            if a.mode == "r1"
            else SketchRun(rows, rn, rpb, blobs[:PLANES])
        )
        exps.append([((0, rows), run)])
    tp = TensorPlan(name="t", dtype="BF16", shape=[rows, rn], file="x", start=0, rows_per_block=rpb,
                    n_blocks=-(-rows // rpb), chunk_rows=rows, params={"normalize": True, "lambda": 1.0},
                    weight_sum=float(k), experts=tes)  # fmt: skip
    spec, it, dev = get_method("ties"), WorkItem("merge", tp, 0, rows, 0), torch.device("cpu")
    raw = base.view(torch.uint8).numpy().tobytes()

    def run_once() -> bytes:
        return bytes(merge_chunk(it, ChunkInputs(raw, exps), None, spec, dev, L1Sums()))  # type: ignore[arg-type]

    report: dict = {"mode": a.mode, "experts": k, "entries": rows * rn, "threads": 1}
    report["loadavg_start"] = os.getloadavg()[0]
    best = {"torch": float("inf"), "fused": float("inf")}
    digest = {}
    for _ in range(a.repeat):
        for name in ("torch", "fused"):
            os.environ["MERGEPIPE_KERNELS"] = "torch" if name == "torch" else ""
            if name == "fused" and not kernels_cpu.available():
                raise SystemExit(f"fused CPU kernels unavailable: {kernels_cpu.unavailable_reason()}")
            t = time.process_time()
            out = run_once()
            best[name] = min(best[name], time.process_time() - t)
            digest[name] = hashlib.sha256(out).hexdigest()
    if digest["torch"] != digest["fused"]:
        raise SystemExit("fused kernels' output differs from the torch path's: a kernel bug")
    report["loadavg_end"] = os.getloadavg()[0]
    for name, s in best.items():
        report[f"{name}_ns_per_expert_entry"] = round(s / (rows * rn * k) * 1e9, 2)
    report["speedup"] = round(best["torch"] / best["fused"], 2)
    report["identical"] = True
    report.update(record.provenance("bench/merge_tile.py", sys.argv[1:] if argv is None else argv))
    print(json.dumps(report))
    if a.out is not None:
        record.append_jsonl(a.out, report)


if __name__ == "__main__":
    main()
