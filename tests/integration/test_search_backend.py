"""mergepipe search's worker backend seam: a CandidateMerger other than the in-process one (the
Kubernetes backend of a MergeSearch will be one) merges every candidate, its failures are recorded
per candidate, and results.json follows the running search (what the operator mirrors)."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("botorch")


def test_a_custom_merger_runs_every_candidate_and_results_follow_the_search(family, tmp_path):
    from mergepipe.search.evaluators import CallableEvaluator
    from mergepipe.search.runner import LocalMerger, Merged, SearchConfig, run_search

    base, experts = family
    out = tmp_path / "s"
    calls, seen_results = [], []
    lock = threading.Lock()

    class Recording(LocalMerger):
        def merge(self, cfg, cand, out_, lineage, catalog):
            with lock:
                calls.append((cand["id"], list(cand["params"]), lineage["search"]["candidate"]))
            if cand["id"] == 1:
                raise RuntimeError("quota exceeded for good")
            m = super().merge(cfg, cand, out_, lineage, catalog)
            return Merged(m.snapshot, m.manifest_hash, m.expert_read_bytes)

    def metrics(path):
        r = out / "results.json"
        with lock:
            seen_results.append(
                json.loads(r.read_text())["evaluations"] + json.loads(r.read_text())["failed"] if r.exists() else 0
            )
        return {"a": float(len(str(path))), "b": 1.0 / len(str(path))}

    cfg = SearchConfig(
        base=str(base),
        experts=[[f"e{i}", str(e)] for i, e in enumerate(experts[:2])],
        method="task_arithmetic",
        vary=["weight=0:1"],
        objectives=["a", "b"],
        evaluations=4,
        initial=4,
        workers=1,
        layer_blocks=2,
        strategy="random",
        catalog=str(tmp_path / "cat.sqlite"),
    )
    res = run_search(out, cfg, CallableEvaluator(metrics), merger=Recording())
    assert sorted(c[0] for c in calls) == [0, 1, 2, 3] and all(i == j for i, _, j in calls)
    assert all(p for _, p, _ in calls)  # each candidate's layer-wise parameters reached the merger
    assert (res["evaluations"], res["failed"], res["running"]) == (3, 1, 0)
    assert res["failures"] == [{"id": 1, "error": "merge failed: RuntimeError: quota exceeded for good"}]
    # one worker: when candidate k is evaluated, results.json already counts every earlier finished one
    assert seen_results == [0, 2, 3]
    final = json.loads((out / "results.json").read_text())
    assert final["evaluations"] == 3 and {p["snapshot"] for p in final["pareto"]} <= {
        str(out / "snapshots" / f"c{i:04d}") for i in (0, 2, 3)
    }


@pytest.mark.s3
def test_cli_search_into_s3_resumes_from_the_mirrored_state(family, s3_env, tmp_path, monkeypatch, capsys):
    """`--out s3://…`: the state and results live in object storage too; a driver restarted on a
    fresh machine (local folder gone) with the same command and --resume-existing continues the
    search instead of starting another."""
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    from testkit.harness import run_cli

    base, experts = family
    (tmp_path / "pod-tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "pod-tmp"))  # the driver pod's /tmp
    bucket = s3_env.make_bucket("search")
    out = f"s3://{bucket}/searches/front/g1/"
    script = tmp_path / "ev.py"
    script.write_text("import json, sys\nprint(json.dumps({'a': len(sys.argv[1]) % 7, 'b': 1.0}))\n")
    args = [
        "search",
        "--base",
        str(base),
        "-e",
        f"a={experts[0]}",
        "-e",
        f"b={experts[1]}",
        "--vary",
        "weight=0:1",
        "--layer-blocks",
        "1",
        "--objective",
        "a",
        "--objective",
        "b",
        "--eval-command",
        f"{sys.executable} {script} {{checkpoint}}",
        "--initial",
        "2",
        "--strategy",
        "random",
        "--out",
        out,
        "--catalog",
        str(tmp_path / "c.sqlite"),
        "--resume-existing",
        "--json",
    ]
    code, stdout, err = run_cli(args + ["--evaluations", "2"], monkeypatch, capsys)
    assert code == 0, err
    c = s3_env.client()
    state = json.loads(c.get_object(Bucket=bucket, Key="searches/front/g1/state.json")["Body"].read())
    results = json.loads(c.get_object(Bucket=bucket, Key="searches/front/g1/results.json")["Body"].read())
    assert len(state["candidates"]) == 2 and results["evaluations"] == 2 and results["search_id"] == state["search_id"]
    local = Path(tempfile.gettempdir()) / "mergepipe-search"
    assert local.is_relative_to(tmp_path)
    shutil.rmtree(local)  # the pod is gone with its /tmp
    code, stdout, err = run_cli(args + ["--evaluations", "3"], monkeypatch, capsys)
    assert code == 0, err
    res = json.loads(stdout)
    assert res["evaluations"] == 3 and res["search_id"] == state["search_id"]
    state = json.loads(c.get_object(Bucket=bucket, Key="searches/front/g1/state.json")["Body"].read())
    assert [x["id"] for x in state["candidates"]] == [0, 1, 2] and len(state["sessions"]) == 2
    # the snapshots are committed beside the state, not in the (lost) local folder
    assert [x["snapshot"] for x in state["candidates"]] == [f"{out}snapshots/c{i:04d}" for i in range(3)]
    keys = {o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="searches/front/g1/snapshots/")["Contents"]}
    assert {f"searches/front/g1/snapshots/c{i:04d}/manifest.json" for i in range(3)} <= keys
    manifest = json.loads(
        c.get_object(Bucket=bucket, Key="searches/front/g1/snapshots/c0002/manifest.json")["Body"].read()
    )
    assert manifest["search"]["state"] == f"{out}state.json" and manifest["search"]["candidate"] == 2
