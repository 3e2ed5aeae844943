"""bench/s3_requests.py --record profiles a real S3 merge (SeaweedFS) and appends the run to the
raw record that bench/benchmarks_report.py renders into docs/BENCHMARKS.md."""

import json
import os
import sys

import pytest

from bench import benchmarks_report as br, s3_requests

pytestmark = pytest.mark.s3


def _upload(client, bucket, folder, prefix):
    for f in sorted(os.listdir(folder)):
        client.upload_file(os.path.join(folder, f), bucket, f"{prefix}/{f}")
    return f"s3://{bucket}/{prefix}"


def test_a_recorded_run_is_rendered_with_its_gets(s3_env, family, tmp_path, monkeypatch, capsys):
    base, experts = family
    c = s3_env.client()
    bucket = s3_env.make_bucket("reqrec")
    b = _upload(c, bucket, base, "models/base")
    es = [_upload(c, bucket, e, f"models/{e.name}") for e in experts]
    from testkit.harness import run_cli

    analyze = ["analyze", "--base", b, *(x for e in es for x in ("--expert", e)), "--catalog", f"s3://{bucket}/catalog"]
    code, _, err = run_cli(analyze, monkeypatch, capsys)  # beforehand: the profile is the merge's GETs alone
    assert code == 0, err
    rec = tmp_path / "s3-requests-x.json"
    merge = ["merge", "--base", b, *(x for e in es for x in ("--expert", e)), "--catalog", f"s3://{bucket}/catalog"]
    merge += ["--method", "ties", "-p", "density=0.3", "--budget", "25%", "--sketch", "sign3"]
    merge += ["--out", f"s3://{bucket}/prof/a", "--json"]
    monkeypatch.setattr(sys, "argv", ["s3_requests.py"])  # the script sets sys.argv for the CLI
    argv = ["--record", str(rec), "--code", "main", "--fixture", "testkit family, 3 experts", "--", *merge]
    assert s3_requests.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)  # the command's --json result is still printed

    d = br.read_s3_requests(rec)
    assert d["fixture"] == "testkit family, 3 experts"
    (run,) = d["runs"]
    assert run["run"] == "25% sign3" and run["code"] == "main" and run["rc"] == 0
    cmd = " ".join(run["command"])
    assert cmd.startswith("s3_requests.py -- merge --base s3://$BUCKET/models/base")
    assert f"s3://{bucket}/" not in cmd and str(rec) not in cmd and "--record" not in cmd
    assert run["engine_wall_s"] == printed["wall_s"] and run["io"] == printed["io"]
    k = run["by_kind"]
    assert k["sketch"]["requests"] > 0 and k["base"]["requests"] > 0
    # the GETs of the expert files and sketch blobs are the merge's realized expert bytes
    got = round(k["expert"]["mb"] + k["sketch"]["mb"], 3) if "expert" in k else k["sketch"]["mb"]
    assert abs(got - printed["io"]["expert_read_bytes"] / 1e6) < 0.002
    assert 0 < run["input_window_s"] <= run["process_wall_s"]

    md = br.render_s3_requests(rec)
    assert (
        f"| 25% `sign3` | main | {run['started'][11:16]}, {run['load1_before']:.1f} | {k['sketch']['requests']:,} |"
        in md
    )

    # a second run appends to the same record
    assert s3_requests.main(argv) == 0
    assert len(br.read_s3_requests(rec)["runs"]) == 2
