"""Tiered decode throughput: GB of expert bytes per second per core, per stage and device.

A benchmark, not a test: run it after touching ``mergepipe/engine/sketchkernel.py`` or
``mergepipe/catalog/sketch.py`` and compare with docs/BENCHMARKS.md. It codes a random bf16-sized
tensor (``--rows`` x ``--cols``, blocks of ``--block-rows``) into 3 sign planes, then times, in
CPU seconds of one thread (``time.process_time``, so the figure is per core and robust to a
shared machine's load) or CUDA-synchronised wall time on a GPU:

- ``numpy``: the reference decoder, ``decode_blocks`` per plane summed in float32 (what the
  engine did before issue 23), plus the engine's ``(b + δ̂) − b``;
- ``prepare``: :class:`~mergepipe.engine.sketchkernel.SketchRun` building its sign codes and
  value tables (once per run);
- ``tiles``: decoding the run tile by tile (64Ki entries, the engine's tile) into ``δ̂`` (the
  task vector the engine merges for a sketched entry since issue 23's table forms);
- ``tiles_trim``: the same with the TIES trim the engine applies (``hardshrink`` at the median
  ``|δ|``: from the value table for sign planes, on the decoded rows for the rank-1 tier);

- ``fused_trim`` (CPU): the same trimmed decode by the fused C kernels the engine runs on a CPU
  (:mod:`mergepipe.methods.kernels_cpu` ``gather_rows`` / ``rank1_rows``);

each for the sign tier (``sign3``: 3 planes, keys ``{dev}_...``) and the rank-1 tier
(``sign3+r1``'s level 4: rank-1 factors + the residual plane, keys ``{dev}_r1_...``); then the
TIES combine of ``--experts`` trimmed task vectors, torch's formulation against the fused kernel
(``cpu_combine_torch_gb_s``, ``cpu_combine_fused_gb_s``; checked bit-identical).

Throughput is the bf16 bytes the decoded entries stand for (2 bytes per entry) per second of one
core: GB of expert bytes per second per core.
Usage::

    python bench/sketch_decode.py [--rows 4096] [--cols 768] [--block-rows 85] [--repeat 3] [--experts 8]

``--out FILE`` appends the run's record (with its commit, time and command: :mod:`bench.record`)
to ``FILE``, e.g. ``docs/benchmarks/sketch-decode-DATE.jsonl``, which ``bench/benchmarks_report.py``
renders into docs/BENCHMARKS.md (run it alternately with ``MERGEPIPE_KERNELS=torch`` and without).
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--block-rows", type=int, default=85)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--experts", type=int, default=8, help="K of the combine stages")
    ap.add_argument(
        "--out", type=Path, default=None, help="append the run's record (one JSON line) to this file [print only]"
    )
    a = ap.parse_args(argv)

    import torch

    from mergepipe.catalog.sketch import PLANES, SECTIONS, decode_blocks, encode_block
    from mergepipe.engine.chunk import TILE_ELEMS
    from mergepipe.engine.sketchkernel import SketchRun
    from mergepipe.methods import kernels_cpu

    def fused_tiles(run: SketchRun, shrink: float) -> None:
        out = np.empty(TILE_ELEMS, dtype=np.float32)
        codes, table, u, v = run.host_arrays(torch.device("cpu"), shrink, 1.0)
        for s in range(0, n, TILE_ELEMS):
            e = min(n, s + TILE_ELEMS)
            if u is None:
                kernels_cpu.gather_rows(out[: e - s], codes, table, s, e, rn)
            else:
                kernels_cpu.rank1_rows(out[: e - s], codes, table, u, v, rpb, s, e, rn, shrink, 1.0)

    torch.set_num_threads(1)
    rows, rn, rpb = a.rows, a.cols, a.block_rows
    n = rows * rn
    rng = np.random.default_rng(0)
    delta = (rng.standard_normal((rows, rn)) * 0.01).astype(np.float32)
    planes: list[list[bytes]] = [[] for _ in range(SECTIONS)]
    for r in range(0, rows, rpb):
        for p, b in enumerate(encode_block(delta[r : r + rpb])[0]):
            planes[p].append(b)
    blobs = [b"".join(p) for p in planes]
    base = (rng.standard_normal(n) * 0.02).astype(np.float32)
    gb = 2 * n / 1e9
    lam = float(np.median(np.abs(delta)))
    report: dict = {
        "entries": n,
        "expert_gb": gb,
        "planes": PLANES,
        "threads": 1,
        "kernels": "fused" if kernels_cpu.available() else "torch",  # (MERGEPIPE_KERNELS=torch: torch)
        "loadavg_start": os.getloadavg()[0],
    }

    def timed(fn, sync=None) -> float:
        best = float("inf")
        for _ in range(a.repeat):
            if sync is None:
                t = time.process_time()
                fn()
                best = min(best, time.process_time() - t)
            else:
                sync()
                t = time.perf_counter()
                fn()
                sync()
                best = min(best, time.perf_counter() - t)
        return best

    def numpy_decode() -> None:
        d = np.zeros(n, dtype=np.float32)
        for p in range(PLANES):
            d += decode_blocks(blobs[p], rows, rn, rpb)
        torch.sub(torch.from_numpy(base + d), torch.from_numpy(base))

    report["numpy_gb_s"] = round(gb / timed(numpy_decode), 3)
    devs = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if len(devs) == 1:
        print("no GPU: torch.cuda.is_available() is False; CPU stages only", flush=True)
    for dev in devs:
        sync = torch.cuda.synchronize if dev == "cuda" else None
        bt = torch.from_numpy(base).to(dev)

        tiers = {"": (list(blobs[:PLANES]), None), "r1_": ([blobs[PLANES + 1]], blobs[PLANES])}
        for tag, (pl, fac) in tiers.items():

            def prepare(dev=dev, pl=pl, fac=fac) -> SketchRun:
                run = SketchRun(rows, rn, rpb, pl, factors=fac)
                run.delta_rows(0, 1, torch.device(dev))
                return run

            run = prepare()

            def tiles(run=run, bt=bt, shrink=None) -> None:
                for s in range(0, n, TILE_ELEMS):
                    e = min(n, s + TILE_ELEMS)
                    run.delta(s, e, bt[s:e], shrink)

            report[f"{dev}_{tag}prepare_gb_s"] = round(gb / timed(prepare, sync), 3)
            report[f"{dev}_{tag}tiles_gb_s"] = round(gb / timed(tiles, sync), 3)
            report[f"{dev}_{tag}tiles_trim_gb_s"] = round(gb / timed(lambda run=run: tiles(run, shrink=lam), sync), 3)
            if dev == "cpu" and kernels_cpu.available():
                report[f"cpu_{tag}fused_trim_gb_s"] = round(gb / timed(lambda run=run: fused_tiles(run, lam)), 3)
    if kernels_cpu.available():
        report.update(combine_stages(torch, n, rng, a.experts, timed))
    else:
        print(f"fused CPU kernels unavailable ({kernels_cpu.unavailable_reason()}): torch stages only", flush=True)
    report["loadavg_end"] = os.getloadavg()[0]
    report.update(record.provenance("bench/sketch_decode.py", sys.argv[1:] if argv is None else argv))
    print(json.dumps(report))
    if a.out is not None:
        record.append_jsonl(a.out, report)


def combine_stages(torch, n: int, rng, k: int, timed) -> dict:
    """The TIES combine of K trimmed task vectors (density 0.3) over the same entries, tile by
    tile: torch's formulation (:func:`mergepipe.methods.kernels.task_arithmetic_combine`) and the
    fused kernel (``combine_sum``), in GB of expert (bf16) bytes per second per core, checked
    bit-identical."""
    from mergepipe.engine.chunk import TILE_ELEMS
    from mergepipe.methods import kernels_cpu
    from mergepipe.methods.kernels import task_arithmetic_combine

    tile = min(n, TILE_ELEMS)
    d = (rng.standard_normal((k, tile)) * 0.01).astype(np.float32)
    d[np.abs(d) < np.quantile(np.abs(d), 0.7)] = 0.0
    base = (rng.standard_normal(tile) * 0.02).astype(np.float32)
    g = {"normalize": True, "lambda": 1.0}
    reps = -(-n // tile)
    gb = 2 * k * tile * reps / 1e9
    out = np.empty(tile, dtype=np.float32)

    def torch_combine() -> torch.Tensor:
        for _ in range(reps):
            r = task_arithmetic_combine(
                torch.from_numpy(base), [torch.from_numpy(x.copy()) for x in d], [1.0] * k, g, "sum"
            )
        return r

    def fused_combine() -> None:
        for _ in range(reps):
            kernels_cpu.combine_sum(out, base, d, k, tile, [1.0] * k, True, 1.0)

    ref = torch_combine()
    fused_combine()
    if not np.array_equal(out.view(np.uint32), ref.numpy().view(np.uint32)):
        raise SystemExit("fused combine differs from torch's: a kernel bug")
    return {
        "combine_experts": k,
        "cpu_combine_torch_gb_s": round(gb / timed(torch_combine), 3),
        "cpu_combine_fused_gb_s": round(gb / timed(fused_combine), 3),
    }


if __name__ == "__main__":
    main()
