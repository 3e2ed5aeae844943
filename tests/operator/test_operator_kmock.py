"""The real operator (kopf.testing.KopfRunner running ``mergepipe_operator.main``) against a fake
Kubernetes API (kmock + RealisticEmulator: uid, resourceVersion, generation, status subresource,
label selectors, finalizers, garbage collection) and a real S3 server (SeaweedFS) holding a tiny
model family. Nothing runs Jobs here, so the tests play them: they run each Job's container
command locally (this checkout's ``mergepipe`` CLI, with the environment its pod would get from
the Job spec and the Secret it references) and then write the Job status the Job controller would.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kopf", reason="kopf (the operator framework) is not installed")
pytest.importorskip("kmock", reason="kmock (fake Kubernetes API) is not installed")

from kubeharness import (  # noqa: E402
    Api,
    KubeServer,
    mark_indexed_job,
    mark_job,
    operator,
    play_job,
    quota_ledger,
    ready,
    record_pod,
    run_job,
    wait_for,
)
from op_testlib import S3Models  # noqa: E402

from mergepipe_operator import (
    controller as ctl,  # noqa: E402
    main,  # noqa: E402,F401  (registers the kopf handlers)
)
from mergepipe_operator.k8s import (
    conditions as cond,  # noqa: E402
    names,  # noqa: E402
)
from mergepipe_operator.modelmerge import (
    decisions as mmd,  # noqa: E402
    planning,  # noqa: E402
)
from mergepipe_operator.snapshot import decisions as snapd  # noqa: E402

pytestmark = pytest.mark.s3

NS = "team-llm"
SECRET = "mergepipe-s3"


@dataclasses.dataclass
class Cluster:
    api: Api
    models: S3Models
    catalog: str
    plans: str
    tmp: Path
    seaweed: Any
    ks: Any = None
    #: s3://bucket/out-<test>-<variant> under which the test's outputs go (the bucket outlives a test: two
    #: tests, or both API variants of one, would otherwise find each other's snapshots and search state,
    #: and the operator reports a merge whose output already holds its plan's snapshot as Committed)
    out: str = ""

    def merge(
        self, name: str, ns: str = NS, *, experts: int = 2, out: str | None = None, **spec: Any
    ) -> dict[str, Any]:
        body = {
            "base": {"uri": self.models.base + "/"},
            "experts": [
                {"name": n, "uri": u + "/", "weight": 0.5, "parameters": {"density": 0.5}}
                for n, u in zip(("code", "math", "chat"), self.models.experts[:experts])
            ],
            "method": "ties",
            "parameters": {"normalize": True},
            "output": {"uri": out or f"{self.out}/snapshots/{ns}/{name}/"},
        }
        body.update(spec)
        return self.api.create(
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "ModelMerge",
                "metadata": {"name": name, "namespace": ns},
                "spec": body,
            }
        )

    def quota(
        self, name: str, ns: str = NS, *, bytes_: Any = None, merges: int | None = None, enforcement: str = "Reject"
    ) -> dict[str, Any]:
        hard = {k: v for k, v in (("expertReadBytes", bytes_), ("merges", merges)) if v is not None}
        return self.api.create(
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "MergeQuota",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"hard": hard, "window": "24h", "enforcement": enforcement},
            }
        )

    def mm(self, name: str, ns: str = NS) -> dict[str, Any] | None:
        return self.api.get("ModelMerge", ns, name)

    def wait_reason(
        self, name: str, reasons: str | tuple[str, ...], ns: str = NS, timeout: float = 60
    ) -> dict[str, Any]:
        reasons = (reasons,) if isinstance(reasons, str) else reasons
        try:
            return wait_for(
                f"ModelMerge {ns}/{name} Ready reason in {reasons}",
                lambda: (o := self.mm(name, ns)) and ready(o).get("reason") in reasons and o,
                timeout,
            )
        except AssertionError as e:
            raise AssertionError(
                f"{e}; its status: {json.dumps((self.mm(name, ns) or {}).get('status'))[:3000]}"
            ) from None

    def jobs(self, ns: str = NS, component: str | None = None) -> list[dict[str, Any]]:
        sel = f"{names.LABEL_MANAGED_BY}={names.MANAGER}" + (
            f",{names.LABEL_COMPONENT}={component}" if component else ""
        )
        return self.api.list("Job", ns, sel)

    def job(self, component: str, ns: str = NS, name: str | None = None) -> dict[str, Any]:
        def one():
            js = [j for j in self.jobs(ns, component) if name is None or j["metadata"]["name"] == name]
            return js[0] if len(js) == 1 else None

        return wait_for(f"one {component} Job in {ns}", one)

    def events(self, name: str, ns: str = NS, kind: str = "ModelMerge") -> list[tuple[str, str, str]]:
        """``(type, reason, message)`` of the Events posted on ``kind`` ``name`` with a condition
        reason (kopf's own handler-log Events left out), oldest first."""
        from mergepipe_operator.search.decisions import SearchReason

        reasons = {v for k, v in vars(cond.Reason).items() if k.isupper()} | {"Analyzed", "Planned"}
        reasons |= {v for k, v in vars(SearchReason).items() if k.isupper()}
        evs = [
            e
            for e in self.api.list("Event", ns)
            if e["involvedObject"].get("name") == name
            and e["involvedObject"].get("kind") == kind
            and e["reason"] in reasons
        ]
        return [(e["type"], e["reason"], e["message"]) for e in sorted(evs, key=lambda e: e["eventTime"])]

    def wait_events(
        self,
        name: str,
        reasons: list[str],
        ns: str = NS,
        kind: str = "ModelMerge",
        timeout: float = 30,
        tail: bool = False,
    ) -> list[tuple[str, str, str]]:
        """Wait until the Events of ``name`` have exactly these reasons, in this order (with
        ``tail``: the last Events have them); returns those Events."""

        def got():
            e = self.events(name, ns, kind)
            e = e[-len(reasons) :] if tail else e
            return [r for _, r, _ in e] == reasons and e

        try:
            return wait_for(f"Events {reasons} on {kind} {ns}/{name}", got, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}; the Events: {self.events(name, ns, kind)}") from None

    def manifest(self, out_uri: str) -> tuple[dict[str, Any], bytes]:
        bucket, key = out_uri[5:].split("/", 1)
        raw = self.models.client.get_object(Bucket=bucket, Key=key.rstrip("/") + "/manifest.json")["Body"].read()
        return json.loads(raw), raw


@pytest.fixture(params=["kmock", pytest.param("apiserver", marks=pytest.mark.apiserver)])
def cluster(tmp_path, monkeypatch, s3_env, s3_models, seaweed, request):
    """A fresh fake API server with namespaces, the S3 Secret, and the operator's environment (as
    the chart's Deployment sets it). The catalog is fully analyzed unless the test is marked
    ``fresh_catalog``. Every test runs twice: all resources in kmock (``kmock``), and the custom
    resources served by a real CRD API server behind a proxy (``apiserver``; realapi.py), where
    no unknown-field warning (a field the server pruned) may occur."""
    import re

    import kubernetes.config.kube_config as kcm

    real = request.getfixturevalue("real_crd_server") if request.param == "apiserver" else None
    tag = re.sub(r"[^a-z0-9]+", "-", request.node.originalname.lower())[:32].strip("-") + "-" + request.param
    fresh = request.node.get_closest_marker("fresh_catalog") is not None
    catalog = f"s3://{s3_models.bucket}/catalog-{tag}/" if fresh else s3_models.catalog + "/"
    plans = f"s3://{s3_models.bucket}/plans-{tag}/"
    with KubeServer(real) as ks:
        monkeypatch.setattr(kcm, "KUBE_CONFIG_DEFAULT_LOCATION", str(ks.kubeconfig(tmp_path / "kubeconfig")))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        monkeypatch.setattr(ctl, "_controller", None)
        monkeypatch.setenv("AWS_REGION", seaweed.region)
        for k, v in {
            "MERGER_IMAGE": "ghcr.io/mergepipe/merger:test",
            "S3_ENDPOINT": seaweed.endpoint_url,
            "S3_REGION": seaweed.region,
            "S3_SECRET_NAME": SECRET,
            "CATALOG_URI": catalog,
            "PLAN_PREFIX": plans,
            "GPU_COUNT": "0",
            "ANALYZE_POLL_SECONDS": "1",
            "QUOTA_RETRY_SECONDS": "300",
        }.items():
            monkeypatch.setenv(f"MERGEPIPE_{k}", v)
        api = Api(ks.url)
        for ns in (NS, "team-b"):
            api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            api.create(
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {"name": SECRET, "namespace": ns},
                    "type": "Opaque",
                    "data": {
                        "AWS_ACCESS_KEY_ID": base64.b64encode(seaweed.access_key.encode()).decode(),
                        "AWS_SECRET_ACCESS_KEY": base64.b64encode(seaweed.secret_key.encode()).decode(),
                    },
                }
            )
        yield Cluster(
            api=api,
            models=s3_models,
            catalog=catalog,
            plans=plans,
            tmp=tmp_path,
            seaweed=seaweed,
            ks=ks,
            out=f"s3://{s3_models.bucket}/out-{tag}",
        )
        if ks.proxy is not None:  # every field the operator wrote is in the schema (none pruned)
            assert [w for w in ks.proxy.warnings if "unknown field" in w[2]] == []


def planned_expert_bytes(c: Cluster, **spec: Any) -> int:
    """What the operator's planner will plan for the default two-expert merge (deterministic)."""
    from op_testlib import core_storage

    s = {
        "base": {"uri": c.models.base},
        "method": "ties",
        "parameters": {"normalize": True},
        "experts": [
            {"name": n, "uri": u, "weight": 0.5, "parameters": {"density": 0.5}}
            for n, u in zip(("code", "math"), c.models.experts[:2])
        ],
    }
    s.update(spec)
    return planning.plan_merge(s, c.catalog, storage=core_storage(c.seaweed)).expert_read_bytes


# --- tests ------------------------------------------------------------------------------------------


def test_invalid_spec_names_the_field_then_a_fix_proceeds(cluster):
    c = cluster
    # generation 2 is invalid before the operator starts: had it seen the valid generation 1 first
    # (it does, at times, with the real API server), that generation's Job would exist, and an
    # invalid generation does not retire it
    bad = c.merge("bad", experts=2, budget="10Gi")
    c.api.patch(
        "ModelMerge",
        NS,
        "bad",
        {
            "spec": {
                "experts": [dict(bad["spec"]["experts"][0], parameters={"density": 1.5}), bad["spec"]["experts"][1]]
            }
        },
    )
    with operator():
        o = c.wait_reason("bad", "InvalidSpec")
        r = ready(o)
        assert r["status"] == "False" and "spec.experts[0].parameters.density" in r["message"] and "1.5" in r["message"]
        assert o["status"]["observedGeneration"] == o["metadata"]["generation"] == r["observedGeneration"] == 2
        assert c.jobs() == []
        ev = c.wait_events("bad", ["InvalidSpec"], tail=True)
        assert ev[-1][0] == "Warning" and "spec.experts[0].parameters.density" in ev[-1][2]
        # fixing the spec is a new generation: reconciled again, now planned and running
        c.api.patch(
            "ModelMerge",
            NS,
            "bad",
            {
                "spec": {
                    "experts": [dict(bad["spec"]["experts"][0], parameters={"density": 0.5}), bad["spec"]["experts"][1]]
                }
            },
        )
        o = c.wait_reason("bad", "JobRunning")
        assert o["status"]["observedGeneration"] == 3 and ready(o)["observedGeneration"] == 3
        assert names.FINALIZER in o["metadata"]["finalizers"]
        (job,) = c.jobs(component="merge")
        assert job["metadata"]["name"] == o["status"]["jobName"] == mmd.job_name("bad", o["status"]["plan"]["digest"])
        ev = c.wait_events("bad", ["InvalidSpec", "Analyzed", "Admitted", "Planned", "JobRunning"], tail=True)
        assert {t for t, *_ in ev[1:]} == {"Normal"} and job["metadata"]["name"] in ev[-1][2]


@pytest.mark.slow
@pytest.mark.fresh_catalog
def test_merge_end_to_end_analyze_plan_merge_commit_charge_delete(cluster):
    """ModelMerge -> analyze Job -> plan in status -> merge Job -> real snapshot in S3 ->
    MergedSnapshot Ready -> quota charged from the manifest; an operator restart while the analyze
    Job runs starts no second Job; deleting the merge stops its running Job and keeps the snapshot."""
    from prometheus_client import REGISTRY

    from mergepipe.planner.plan import Plan

    c = cluster
    before = REGISTRY.get_sample_value("mergepipe_merges_committed_total") or 0.0
    c.quota("daily", bytes_="1Gi", merges=10, enforcement="Clamp")
    out = f"{c.out}/snapshots/e2e/"
    with operator():
        mm = c.merge("e2e", out=out, budget="1Mi", seed=7)
        uid = mm["metadata"]["uid"]
        o = c.wait_reason("e2e", "Analyzing")
        an = c.job("analyze")
        assert an["metadata"]["name"] in ready(o)["message"]
        analyzed = {x["type"]: x for x in o["status"]["conditions"]}["Analyzed"]
        assert (analyzed["status"], analyzed["reason"]) == ("False", "Analyzing")
        assert c.jobs(component="merge") == []
    # the operator restarts while the analyze Job runs: it finds the Job instead of starting another
    with operator():
        time.sleep(2.5)  # > 2 analyze polls
        assert [j["metadata"]["name"] for j in c.jobs()] == [an["metadata"]["name"]]
        assert ready(c.mm("e2e"))["reason"] == "Analyzing"
        (ac,) = an["spec"]["template"]["spec"]["containers"]
        assert ac["args"] == [
            "analyze",
            "--base",
            c.models.base,
            "--expert",
            c.models.experts[0],
            "--expert",
            c.models.experts[1],
            "--catalog",
            c.catalog,
            "--json",
        ]
        assert an["metadata"]["ownerReferences"][0]["uid"] == uid
        assert "nvidia.com/gpu" not in ac["resources"].get("limits", {})  # analysis is numpy: no GPU
        r = play_job(c.api, an, c.tmp / "analyze")
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)["experts"]) == 2

        o = c.wait_reason("e2e", "JobRunning")
        st = o["status"]
        assert {x["type"]: x for x in st["conditions"]}["Analyzed"]["status"] == "True"
        assert st["plan"]["uri"] == f"{c.plans}{NS}/e2e/{st['plan']['digest']}.json"
        bucket, key = st["plan"]["uri"][5:].split("/", 1)
        plan = Plan.from_json(c.models.client.get_object(Bucket=bucket, Key=key)["Body"].read().decode())
        assert (
            plan.digest == st["plan"]["digest"] and plan.budget_bytes == st["budgetBytes"] == 1024**2 and plan.seed == 7
        )
        assert st["plan"]["estimated"]["expertReadBytes"] == plan.io.expert_read_bytes <= 1024**2
        assert (st["budget"], st["expertCount"], st["method"]) == ("1Mi", 2, "ties")
        job = c.job("merge")
        (mc,) = job["spec"]["template"]["spec"]["containers"]
        assert job["metadata"]["name"] == st["jobName"] == mmd.job_name("e2e", st["plan"]["digest"])
        assert job["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "ModelMerge",
                "name": "e2e",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert mc["args"] == ["execute", st["plan"]["uri"], "--out", out, "--resume", "--json"]  # GPU count 0: CPU
        env = {e["name"]: e for e in mc["env"]}
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": SECRET,
            "key": "AWS_SECRET_ACCESS_KEY",
        }
        assert env["AWS_ENDPOINT_URL"]["value"] == c.seaweed.endpoint_url
        (entry,) = quota_ledger(c.api, NS, "daily")
        assert (entry["state"], entry["bytes"], entry["merge"]) == ("Reserved", plan.io.expert_read_bytes, "e2e")

        r = play_job(c.api, job, c.tmp / "merge")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        o = c.wait_reason("e2e", "Committed")
        ev = c.wait_events("e2e", ["Analyzing", "Analyzed", "Admitted", "Planned", "JobRunning", "Committed"])
        assert (
            {t for t, *_ in ev} == {"Normal"}
            and an["metadata"]["name"] in ev[0][2]
            and o["status"]["snapshot"] in ev[-1][2]
        )
        c.wait_events(o["status"]["snapshot"], ["Verified"], kind="MergedSnapshot")
        assert (REGISTRY.get_sample_value("mergepipe_merges_committed_total") or 0.0) == before + 1
        assert REGISTRY.get_sample_value("mergepipe_realized_bytes_total", {"role": "expertReadBytes"}) > 0
        assert REGISTRY.get_sample_value("mergepipe_merge_duration_seconds_count") >= 1
        st = o["status"]
        manifest, raw = c.manifest(out)
        assert result["manifest_hash"] == snapd.manifest_hash(raw) and manifest["plan_digest"] == st["plan"]["digest"]
        realized = manifest["io"]["realized"]["expert_read_bytes"]
        assert 0 < realized <= plan.io.expert_read_bytes <= 1024**2
        assert st["realized"]["expertReadBytes"] == realized and ready(o)["status"] == "True"
        snap = wait_for(
            "MergedSnapshot Ready",
            lambda: (s := c.api.get("MergedSnapshot", NS, st["snapshot"])) and ready(s).get("status") == "True" and s,
        )
        assert snap["spec"]["manifestHash"] == snapd.manifest_hash(raw) and snap["spec"]["uri"] == out
        assert ready(snap)["reason"] == "Verified" and snap["status"]["sizes"]["files"] == len(manifest["outputs"])
        # the committed Hugging Face folder, what a model server loads (KServe's storageUri)
        assert snap["status"]["storageUri"] == f"{out}{manifest['files_prefix']}/"
        bucket, key = snap["status"]["storageUri"][5:].split("/", 1)
        files = {o["Key"][len(key) :] for o in c.models.client.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]}
        assert "config.json" in files and set(manifest["outputs"]) <= files, files
        assert "ownerReferences" not in snap["metadata"]
        (entry,) = quota_ledger(c.api, NS, "daily")
        assert (entry["state"], entry["bytes"]) == ("Charged", realized)  # from the manifest, not the plan
        assert c.api.get("MergeQuota", NS, "daily")["status"]["used"] == {"expertReadBytes": realized, "merges": 1}
        gauge = {
            (m, r): REGISTRY.get_sample_value(m, {"namespace": NS, "quota": "daily", "resource": r})
            for m in ("mergepipe_quota_used", "mergepipe_quota_hard")
            for r in ("expertReadBytes", "merges")
        }
        assert gauge == {
            ("mergepipe_quota_used", "expertReadBytes"): realized,
            ("mergepipe_quota_used", "merges"): 1,
            ("mergepipe_quota_hard", "expertReadBytes"): 1024**3,
            ("mergepipe_quota_hard", "merges"): 10,
        }

        # a new generation (new output, lower budget) starts a new merge Job; then the merge is deleted
        out2 = f"{c.out}/snapshots/e2e-2/"
        c.api.patch("ModelMerge", NS, "e2e", {"spec": {"output": {"uri": out2}, "budget": "200Ki"}})
        o = wait_for(
            "generation 2 running",
            lambda: (
                (x := c.mm("e2e"))
                and x["status"].get("observedGeneration") == 2
                and ready(x).get("reason") == "JobRunning"
                and x
            ),
        )
        job2 = c.job("merge", name=o["status"]["jobName"])
        assert job2["metadata"]["name"] != job["metadata"]["name"]
        assert [j["metadata"]["name"] for j in c.jobs(component="merge")] == [
            job2["metadata"]["name"]
        ]  # old one retired
        mark_job(c.api, job2, "Running")
        c.api.delete("ModelMerge", NS, "e2e")
        wait_for("the ModelMerge is gone", lambda: c.mm("e2e") is None)
        assert c.jobs() == []  # the running merge Job (and the analyze Job) deleted
    snap = c.api.get("MergedSnapshot", NS, st["snapshot"])
    assert snap is not None and ready(snap)["status"] == "True"  # not owned: kept
    assert c.manifest(out)[1] == raw  # and so is the committed snapshot
    ledger = {e["key"]: e for e in quota_ledger(c.api, NS, "daily")}
    assert ledger[f"{uid}.1"]["bytes"] == realized and ledger[f"{uid}.2"]["state"] == "Charged"  # settled


@pytest.mark.slow
def test_spec_sketch_none_and_sign3_plan_differently_and_the_manifest_records_the_tiers(cluster):
    """Two merges alike but for spec.sketch under one small budget: none reads or skips blocks,
    sign3 spends part of the budget on block sketches (status.plan.sketchReadBytes, another
    digest, more energy kept); the sign3 merge Job runs the plan object (no extra arguments) and
    its committed manifest records the sketched blocks by level and the sketch bytes; the quota
    is charged the realized expert bytes, sketch reads included."""
    c = cluster
    budget = 20_000
    outs = {kind: f"{c.out}/snapshots/tiers-{kind}/" for kind in ("none", "sign3")}
    c.quota("daily", bytes_="1Gi", merges=10)
    with operator():
        for kind, out in outs.items():
            c.merge(f"tiers-{kind}", out=out, budget=budget, sketch=kind)
        st = {kind: c.wait_reason(f"tiers-{kind}", "JobRunning")["status"] for kind in outs}
        none, tiered = st["none"]["plan"], st["sign3"]["plan"]
        assert (none["sketch"], none["sketchReadBytes"]) == ("none", 0)
        assert tiered["sketch"] == "sign3"
        assert 0 < tiered["sketchReadBytes"] <= tiered["estimated"]["expertReadBytes"] <= budget
        assert none["digest"] != tiered["digest"] and tiered["retainedEnergy"] > none["retainedEnergy"]
        assert "block sketches, sign3" in {x["type"]: x for x in st["sign3"]["conditions"]}["Planned"]["message"]
        job = c.job("merge", name=st["sign3"]["jobName"])
        (mc,) = job["spec"]["template"]["spec"]["containers"]
        assert mc["args"] == ["execute", tiered["uri"], "--out", outs["sign3"], "--resume", "--json"]
        r = play_job(c.api, job, c.tmp / "merge")
        assert r.returncode == 0, r.stderr
        o = c.wait_reason("tiers-sign3", "Committed")
        manifest, _ = c.manifest(outs["sign3"])
        assert manifest["plan_digest"] == tiered["digest"] and manifest["sketch"]["kind"] == "sign3"
        assert sum(manifest["sketch"]["blocks_by_level"].values()) > 0
        assert manifest["io"]["estimated"]["sketch_read_bytes"] == tiered["sketchReadBytes"]
        realized = manifest["io"]["realized"]["expert_read_bytes"]
        assert tiered["sketchReadBytes"] < realized <= tiered["estimated"]["expertReadBytes"] <= budget
        assert o["status"]["realized"]["expertReadBytes"] == realized
        ledger = wait_for(
            "the sign3 merge charged",
            lambda: (
                (led := {e["merge"]: e for e in quota_ledger(c.api, NS, "daily")})
                and led["tiers-sign3"]["state"] == "Charged"
                and led
            ),
        )
        assert ledger["tiers-sign3"]["bytes"] == realized
        assert ledger["tiers-none"]["bytes"] == none["estimated"]["expertReadBytes"]  # reserved: its plan's reads


#: Python run in a merge pod before the CLI: the pod is killed (SIGKILL, as an OOM kill or a lost
#: node would) right after its first output file is durable and recorded.
KILL_AFTER_FIRST_FILE = """
import os, signal
from mergepipe.commit import runs
_record = runs.write_file_record
def _record_then_die(*a, **k):
    _record(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
runs.write_file_record = _record_then_die
"""


@pytest.mark.slow
def test_indexed_merge_job_retries_an_index_and_commits_in_process(cluster):
    """spec.parallelism: 2 runs the merge as an Indexed Job of two pods, each `execute --part
    $(JOB_COMPLETION_INDEX)/2`; the status counts parts done; index 1's first pod is killed after its
    first file and its retry resumes (keeps that file, reads none of its bytes again); when both
    indexes succeeded the operator commits in-process: the snapshot of a single-process execution
    of the same plan, charged to the quota with the parts' summed realized bytes plus what the
    killed attempt had read."""
    from op_testlib import core_storage

    from mergepipe.pipeline import execute_and_commit
    from mergepipe.planner.plan import Plan

    c = cluster
    c.quota("daily", bytes_="1Gi", merges=10)
    out = f"{c.out}/snapshots/indexed/"
    with operator():
        c.merge("par", out=out, parallelism=2)
        o = c.wait_reason("par", "JobRunning")
        st = o["status"]
        job = c.job("merge")
        spec = job["spec"]
        assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["maxFailedIndexes"]) == (
            "Indexed",
            2,
            2,
            0,
        )
        (mc,) = spec["template"]["spec"]["containers"]
        assert mc["args"] == [
            "execute",
            st["plan"]["uri"],
            "--out",
            out,
            "--part",
            "$(JOB_COMPLETION_INDEX)/2",
            "--json",
        ]
        assert st["parts"]["progress"] == "0/2" and st["parts"]["total"] == 2
        assert "Indexed Job of 2 parts" in ready(o)["message"]

        mark_indexed_job(c.api, job, [], active=2)
        r0 = run_job(c.api, job, c.tmp / "pod-0", index=0)
        assert r0.returncode == 0, r0.stderr
        record_pod(c.api, job, r0, c.tmp / "pod-0", index=0)
        mark_indexed_job(c.api, job, [0], active=1)
        o = wait_for(
            "1/2 parts", lambda: (x := c.mm("par")) and (x["status"].get("parts") or {}).get("progress") == "1/2" and x
        )
        assert ready(o)["reason"] == "JobRunning" and "1/2 parts done" in ready(o)["message"]

        # index 1: the first pod dies after its first file; the Job controller starts another
        r1 = run_job(c.api, job, c.tmp / "pod-1a", index=1, prelude=KILL_AFTER_FIRST_FILE)
        assert r1.returncode == -9, r1.stderr
        assert (
            record_pod(c.api, job, r1, c.tmp / "pod-1a", index=1)["status"]["containerStatuses"][0]["state"][
                "terminated"
            ]["exitCode"]
            == 137
        )
        mark_indexed_job(c.api, job, [0], failed_pods=1, active=1)
        o = wait_for("a failed attempt", lambda: (x := c.mm("par")) and "1 failed attempt" in ready(x)["message"] and x)
        assert o["status"]["parts"]["failedPods"] == 1 and ready(o)["reason"] == "JobRunning"
        assert o["status"].get("snapshot") is None
        r1b = run_job(c.api, job, c.tmp / "pod-1b", index=1)
        assert r1b.returncode == 0, r1b.stderr
        part1 = json.loads(r1b.stdout)
        assert part1["part"] == "1/2" and part1["kept"] and set(part1["kept"]) <= set(part1["files"])
        if set(part1["kept"]) == set(part1["files"]):  # everything was done: nothing is read again
            assert part1["realized"]["base_read_bytes"] == part1["realized"]["expert_read_bytes"] == 0
        record_pod(c.api, job, r1b, c.tmp / "pod-1b", index=1)
        mark_indexed_job(c.api, job, [0, 1], failed_pods=1)

        o = c.wait_reason("par", "Committed")
        st = o["status"]
        assert st["parts"]["progress"] == "2/2" and st["parts"]["completedIndexes"] == "0-1"
        manifest, raw = c.manifest(out)
        assert [p["part"] for p in manifest["parts"]] == [0, 1] and manifest["parts"][1]["kept"] == part1["kept"]
        realized = manifest["io"]["realized"]
        assert realized["expert_read_bytes"] == sum(p["realized"]["expert_read_bytes"] for p in manifest["parts"])
        assert 0 < realized["expert_read_bytes"] <= st["plan"]["estimated"]["expertReadBytes"]
        assert st["realized"]["expertReadBytes"] == realized["expert_read_bytes"]
        # the killed attempt of index 1 had read the blocks of the file its retry kept: charged too
        earlier = manifest["io"]["earlier_attempts"]["expert_read_bytes"]
        assert earlier > 0 and manifest["parts"][1]["earlier_attempts"][0]["realized"]["expert_read_bytes"] == earlier
        (entry,) = quota_ledger(c.api, NS, "daily")
        assert (entry["state"], entry["bytes"]) == ("Charged", realized["expert_read_bytes"] + earlier)
        snap = wait_for(
            "MergedSnapshot Ready",
            lambda: (s := c.api.get("MergedSnapshot", NS, st["snapshot"])) and ready(s).get("status") == "True" and s,
        )
        assert snap["spec"]["manifestHash"] == snapd.manifest_hash(raw)
        c.wait_events("par", ["Committed"], tail=True)

    # bit for bit the snapshot one process makes of the same plan
    bucket, key = st["plan"]["uri"][5:].split("/", 1)
    plan = Plan.from_json(c.models.client.get_object(Bucket=bucket, Key=key)["Body"].read().decode())
    one = execute_and_commit(plan, core_storage(c.seaweed), f"{c.out}/snapshots/indexed-one/")
    assert one.manifest["snapshot_id"] == manifest["snapshot_id"] and one.manifest["outputs"] == manifest["outputs"]


def test_quota_reject_and_clamp(cluster):
    c = cluster
    full = planned_expert_bytes(c)
    c.quota("tight", NS, bytes_=1000, enforcement="Reject")
    c.quota("half", "team-b", bytes_=full // 2, enforcement="Clamp")
    with operator():
        c.merge("rejected", NS, budget="1Mi")
        c.merge("clamped", "team-b")  # no budget: unbounded, lowered to what is left
        o = c.wait_reason("rejected", "QuotaExceeded")
        r = ready(o)
        assert (
            r["status"] == "False"
            and "MergeQuota tight (Reject)" in r["message"]
            and "only 1000B is left" in r["message"]
        )
        assert {x["type"]: x for x in o["status"]["conditions"]}["QuotaAdmitted"]["status"] == "False"
        assert c.jobs(NS) == [] and quota_ledger(c.api, NS, "tight") == []
        ev = c.wait_events("rejected", ["Analyzed", "QuotaExceeded"])
        assert ev[-1][0] == "Warning" and "MergeQuota tight (Reject)" in ev[-1][2]

        o = c.wait_reason("clamped", "JobRunning", ns="team-b")
        st = o["status"]
        assert st["admission"]["clamped"] is True and st["budgetBytes"] == full // 2
        assert {x["type"]: x for x in st["conditions"]}["QuotaAdmitted"]["reason"] == "Clamped"
        assert 0 < st["plan"]["estimated"]["expertReadBytes"] <= full // 2 < full
        (entry,) = quota_ledger(c.api, "team-b", "half")
        assert (entry["state"], entry["bytes"]) == ("Reserved", full // 2)
        assert c.job("merge", "team-b")["metadata"]["name"] == st["jobName"]


def test_kueue_queued_jobs_and_the_io_budget_admission_check(cluster, monkeypatch):
    """Kueue (played: kubeharness.KueuePlayer) holds the merge Jobs of LocalQueue llm suspended;
    its ClusterQueue lists the AdmissionCheck io-budget (controllerName mergepipe.io/io-budget),
    which the operator serves from the MergeQuota ledger. m1 (spec.queueName) and m2 (the
    operator's default queue) are Queued; m1's plan fits the quota: its check is Ready, Kueue
    admits and unsuspends its Job, it commits. m2's plan does not fit what is left: Retry, evicted
    and requeued, its Job stays suspended; once the quota is raised, the requeued check is Ready,
    Kueue admits it, and it commits too. The operator never writes a Job."""
    from kubeharness import KueuePlayer

    from mergepipe_operator.kueue import handlers as kueue_handlers

    c = cluster
    monkeypatch.setenv("MERGEPIPE_KUEUE_ADMISSION_CHECK", "true")
    monkeypatch.setenv("MERGEPIPE_QUEUE_NAME", "llm")  # the chart's kueue.queueName
    monkeypatch.setenv("MERGEPIPE_QUOTA_RETRY_SECONDS", "2")  # Retry's requeueAfterSeconds
    main.serve_kueue_admission_check()  # registered and bound (main does it at import when enabled)
    assert kueue_handlers.workload_event
    full = planned_expert_bytes(c)
    c.quota("budget", bytes_=full * 3 // 2, enforcement="Reject")
    c.api.create(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "AdmissionCheck",
            "metadata": {"name": "io-budget"},
            "spec": {"controllerName": "mergepipe.io/io-budget"},
        }
    )
    c.api.create(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": "gpu"},
            "spec": {
                "namespaceSelector": {},
                "admissionChecksStrategy": {"admissionChecks": [{"name": "io-budget"}]},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu"],
                        "flavors": [{"name": "default", "resources": [{"name": "cpu", "nominalQuota": "64"}]}],
                    }
                ],
            },
        }
    )
    c.api.create(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "llm", "namespace": NS},
            "spec": {"clusterQueue": "gpu"},
        }
    )
    kueue = KueuePlayer(c.api, c.ks, (NS,), capacity=2)
    kueue.paused = True
    kueue.start()
    try:
        with operator(timeout=60):
            c.merge("m1", queueName="llm")
            o = c.wait_reason("m1", "Queued")
            job1 = c.job("merge", name=o["status"]["jobName"])
            assert job1["spec"]["suspend"] is True and job1["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "llm"
            assert f"merge Job {job1['metadata']['name']} is queued in LocalQueue llm" in ready(o)["message"]
            assert o["status"]["admission"]["admissionCheck"] == "io-budget"
            assert quota_ledger(c.api, NS, "budget") == []  # nothing reserved before Kueue asks
            wait_for(
                "AdmissionCheck io-budget Active",
                lambda: (
                    (a := c.api.get("AdmissionCheck", None, "io-budget"))
                    and any(
                        x["type"] == "Active" and x["status"] == "True"
                        for x in (a.get("status") or {}).get("conditions") or []
                    )
                    and a
                ),
            )
            time.sleep(1.0)
            assert c.api.get("Job", NS, job1["metadata"]["name"])["spec"]["suspend"] is True  # nobody else unsuspends
            kueue.paused = False  # Kueue reserves quota: the check decides, Kueue admits
            o = c.wait_reason("m1", "JobRunning", timeout=60)
            (entry,) = quota_ledger(c.api, NS, "budget")
            assert (entry["merge"], entry["state"], entry["bytes"]) == ("m1", "Reserved", full)
            admitted = {x["type"]: x for x in o["status"]["conditions"]}["QuotaAdmitted"]
            assert admitted["status"] == "True" and "io-budget" in admitted["message"]
            assert kueue.unsuspended == [job1["metadata"]["name"]]

            c.merge("m2", out=f"{c.out}/snapshots/{NS}/m2/")  # no queueName: the default queue
            o2 = c.wait_reason("m2", "Queued")
            job2 = c.job("merge", name=o2["status"]["jobName"])
            assert job2["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "llm"
            o2 = wait_for(
                "m2's check to say Retry",
                lambda: (x := c.mm("m2")) and "MergeQuota budget" in ready(x)["message"] and x,
                60,
            )
            assert ready(o2)["reason"] == "Queued" and "io-budget" in ready(o2)["message"]
            assert len(quota_ledger(c.api, NS, "budget")) == 1
            assert c.api.get("Job", NS, job2["metadata"]["name"])["spec"]["suspend"] is True

            r = play_job(c.api, c.api.get("Job", NS, job1["metadata"]["name"]), c.tmp / "m1")
            assert r.returncode == 0, r.stderr
            c.wait_reason("m1", "Committed")
            time.sleep(3)  # a requeue or two: the charged bytes still leave too little for m2
            assert c.api.get("Job", NS, job2["metadata"]["name"])["spec"]["suspend"] is True
            c.api.patch("MergeQuota", NS, "budget", {"spec": {"hard": {"expertReadBytes": full * 3}}})
            o2 = c.wait_reason("m2", "JobRunning", timeout=60)
            r = play_job(c.api, c.api.get("Job", NS, job2["metadata"]["name"]), c.tmp / "m2")
            assert r.returncode == 0, r.stderr
            c.wait_reason("m2", "Committed")
        ledger = {e["merge"]: e for e in quota_ledger(c.api, NS, "budget")}
        assert {m: e["state"] for m, e in ledger.items()} == {"m1": "Charged", "m2": "Charged"}
        assert kueue.unsuspended == [job1["metadata"]["name"], job2["metadata"]["name"]] and kueue.errors == []
        # the operator wrote no Job (only the played Kueue, through urllib, unsuspended them)
        assert [w for w in c.ks.kmock.writes if w[1] == "jobs" and not w[4].startswith("Python-urllib")] == []
    finally:
        kueue.stop()


def test_two_concurrent_merges_against_one_quota(cluster):
    c = cluster
    full = planned_expert_bytes(c)
    c.quota("shared", NS, bytes_=full * 3 // 2, enforcement="Reject")
    c.quota("shared", "team-b", bytes_=full * 3 // 2, enforcement="Clamp")
    with operator():
        for ns in (NS, "team-b"):
            c.merge("m1", ns)
            c.merge("m2", ns)
        # Reject: one is admitted, the other waits
        got = {n: ready(c.wait_reason(n, ("JobRunning", "QuotaExceeded"))).get("reason") for n in ("m1", "m2")}
        assert sorted(got.values()) == ["JobRunning", "QuotaExceeded"], got
        (entry,) = quota_ledger(c.api, NS, "shared")
        assert entry["bytes"] == full and len(c.jobs(NS, "merge")) == 1
        # Clamp: both run, the second with what the first left
        sts = [c.wait_reason(n, "JobRunning", ns="team-b")["status"] for n in ("m1", "m2")]
        assert sorted(s.get("budgetBytes") or s["plan"]["estimated"]["expertReadBytes"] for s in sts) == [
            full * 3 // 2 - full,
            full,
        ]
        ledger = quota_ledger(c.api, "team-b", "shared")
        assert len(ledger) == 2 and sum(e["bytes"] for e in ledger) <= full * 3 // 2
        assert len(c.jobs("team-b", "merge")) == 2


@pytest.mark.slow
def test_failed_merge_job_is_job_failed_then_a_spec_change_retries(cluster):
    c = cluster
    c.quota("q", bytes_="1Gi")
    with operator():
        mm = c.merge("fails", budget="1Mi")
        o = c.wait_reason("fails", "JobRunning")
        job = c.job("merge")
        mark_job(c.api, job, "Failed", "OOMKilled: the pod ran out of memory")
        o = c.wait_reason("fails", "JobFailed")
        r = ready(o)
        assert r["status"] == "False" and "OOMKilled" in r["message"]
        (entry,) = quota_ledger(c.api, NS, "q")
        assert (entry["state"], entry["bytes"]) == ("Charged", o["status"]["plan"]["estimated"]["expertReadBytes"])
        assert c.api.list("MergedSnapshot", NS) == [] and c.api.get("Job", NS, job["metadata"]["name"]) is not None
        ev = c.wait_events("fails", ["Analyzed", "Admitted", "Planned", "JobRunning", "JobFailed"])
        assert ev[-1][0] == "Warning" and "OOMKilled" in ev[-1][2]
        # more memory: a new generation with the same plan runs again, in a Job of its own
        c.api.patch("ModelMerge", NS, "fails", {"spec": {"resources": {"memory": "2Gi"}}})
        o = wait_for(
            "generation 2 running",
            lambda: (
                (x := c.mm("fails"))
                and x["status"].get("observedGeneration") == 2
                and ready(x).get("reason") == "JobRunning"
                and x
            ),
        )
        st = o["status"]
        assert st["plan"]["digest"] == job["metadata"]["annotations"][names.ANN_PLAN_DIGEST]
        assert st["jobName"] == mmd.job_name("fails", st["plan"]["digest"], 2) != job["metadata"]["name"]
        retry = c.job("merge", name=st["jobName"])
        assert retry["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "2Gi"
        r = play_job(c.api, retry, c.tmp / "retry")
        assert r.returncode == 0, r.stderr
        o = c.wait_reason("fails", "Committed")
        ev = c.wait_events(
            "fails",
            [
                "Analyzed",
                "Admitted",
                "Planned",
                "JobRunning",
                "JobFailed",
                "Analyzed",
                "Admitted",
                "Planned",
                "JobRunning",
                "Committed",
            ],
        )
        assert ev[-1][0] == "Normal"
        ledger = {e["key"]: e for e in quota_ledger(c.api, NS, "q")}
        uid = mm["metadata"]["uid"]
        assert ledger[f"{uid}.1"]["state"] == ledger[f"{uid}.2"]["state"] == "Charged"
        assert ledger[f"{uid}.2"]["bytes"] == o["status"]["realized"]["expertReadBytes"]


@pytest.mark.fresh_catalog
def test_failed_analyze_job_is_job_failed(cluster):
    c = cluster
    with operator():
        c.merge("noanalysis")
        c.wait_reason("noanalysis", "Analyzing")
        an = c.job("analyze")
        mark_job(c.api, an, "Failed", "exit code 2: s3://... is not a safetensors checkpoint")
        o = c.wait_reason("noanalysis", "JobFailed")
        assert an["metadata"]["name"] in ready(o)["message"] and "not a safetensors checkpoint" in ready(o)["message"]
        assert c.jobs(component="merge") == []
        ev = c.wait_events("noanalysis", ["Analyzing", "JobFailed"])
        assert ev[-1][0] == "Warning"
        # a spec change retries the analysis in a new Job (the failed one stays for its logs)
        c.api.patch("ModelMerge", NS, "noanalysis", {"spec": {"resources": {"cpu": "3"}}})
        wait_for(
            "generation 2 analyzing",
            lambda: (
                (x := c.mm("noanalysis"))
                and x["status"].get("observedGeneration") == 2
                and ready(x).get("reason") == "Analyzing"
                and x
            ),
        )
        retry = c.job(
            "analyze", name=mmd.analyze_job_name("noanalysis", an["metadata"]["annotations"][mmd.ANN_ANALYSIS], 2)
        )
        (k,) = retry["spec"]["template"]["spec"]["containers"]
        assert k["image"] == "ghcr.io/mergepipe/merger:test" and k["resources"]["requests"]["cpu"] == "3"
        assert sorted(j["metadata"]["name"] for j in c.jobs(component="analyze")) == sorted(
            [an["metadata"]["name"], retry["metadata"]["name"]]
        )


@pytest.mark.slow
def test_two_operator_processes_with_peering_one_acts_no_duplicate_job_no_double_charge(cluster):
    """Chart replicas > 1: two operator processes (kopf --peering, each its own random priority)
    on one API server. Only the higher one acts: one merge Job, one reservation; stopped, it hands
    over at once (kopf removes its keep-alive) and the other finishes the merge: one snapshot,
    one charge."""
    import signal

    from kubeharness import operator_process

    c = cluster
    kubeconfig = c.tmp / "kubeconfig"
    c.api.create({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "mergepipe"}})
    c.quota("q", bytes_="1Gi")
    args = ("--peering=mergepipe", "--all-namespaces")
    with (
        operator_process("op-a", kubeconfig, c.tmp / "op-a.log", *args) as a,
        operator_process("op-b", kubeconfig, c.tmp / "op-b.log", *args) as b,
    ):

        def peers():
            st = (c.api.get("ClusterKopfPeering", None, "mergepipe") or {}).get("status") or {}
            return len(st) == 2 and st

        try:
            st = wait_for("both operators in the peering", peers, timeout=90)
        except AssertionError as err:
            raise AssertionError(
                (c.tmp / "op-a.log").read_text()[-3000:] + (c.tmp / "op-b.log").read_text()[-3000:]
            ) from err
        assert st["op-a"]["priority"] != st["op-b"]["priority"] and min(p["priority"] for p in st.values()) >= 1
        leader, follower = sorted(("op-a", "op-b"), key=lambda n: -st[n]["priority"])
        procs = {"op-a": a, "op-b": b}
        resumed = b"Resuming operations after the pause"  # kopf starts paused until it knows its peers

        def log(n):
            return (c.tmp / f"{n}.log").read_bytes()

        def standing_by(n):  # paused at start and never resumed, or paused again in favour of a higher peer
            text = log(n)
            return text.rfind(resumed) < text.rfind(b"Pausing operations in favour of") or resumed not in text

        wait_for(f"{leader} active", lambda: resumed in log(leader), timeout=60)
        wait_for(f"{follower} standing by", lambda: standing_by(follower), timeout=60)

        c.merge("ha")
        o = c.wait_reason("ha", "JobRunning", timeout=90)
        time.sleep(3)  # let a second actor, if there were one, do its damage
        (job,) = c.jobs(component="merge")
        assert job["metadata"]["name"] == o["status"]["jobName"]
        (entry,) = quota_ledger(c.api, NS, "q")
        assert entry["state"] == "Reserved"
        assert standing_by(follower) and not standing_by(leader)

        # the leader stops cleanly (a rollout, a drained node): the follower takes over
        before = log(follower).count(resumed)
        procs[leader].send_signal(signal.SIGTERM)
        procs[leader].wait(60)
        wait_for(f"{follower} resumed", lambda: log(follower).count(resumed) > before, timeout=60)
        r = play_job(c.api, job, c.tmp / "merge")
        assert r.returncode == 0, r.stderr
        o = c.wait_reason("ha", "Committed", timeout=90)
        assert [j["metadata"]["name"] for j in c.jobs(component="merge")] == [job["metadata"]["name"]]
        (entry,) = quota_ledger(c.api, NS, "q")
        assert (entry["state"], entry["bytes"]) == ("Charged", o["status"]["realized"]["expertReadBytes"])
        assert [s["metadata"]["name"] for s in c.api.list("MergedSnapshot", NS)] == [o["status"]["snapshot"]]
        assert procs[follower].poll() is None


@pytest.mark.fresh_catalog
def test_deleted_shard_job_failed_names_the_shard_and_the_fix(cluster):
    """An expert's shard deleted after planning: the worker's one-line error reaches JobFailed
    through its container's termination message (the Job's own condition only says that the
    backoff limit was reached)."""
    c = cluster
    client, bucket = c.models.client, c.models.bucket
    src = c.models.experts[1][len(f"s3://{bucket}/") :]
    dst = "llama/expert-shard-deleted"
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=src + "/")["Contents"]]
    for k in keys:
        client.copy_object(Bucket=bucket, Key=dst + k[len(src) :], CopySource={"Bucket": bucket, "Key": k})
    expert = f"s3://{bucket}/{dst}/"
    with operator():
        c.api.create(
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "ModelMerge",
                "metadata": {"name": "gone", "namespace": NS},
                "spec": {
                    "base": {"uri": c.models.base + "/"},
                    "method": "ties",
                    "parameters": {"normalize": True},
                    "experts": [
                        {"name": "code", "uri": c.models.experts[0] + "/", "weight": 0.5},
                        {"name": "math", "uri": expert, "weight": 0.5},
                    ],
                    "output": {"uri": f"{c.out}/snapshots/{NS}/gone/"},
                },
            }
        )
        c.wait_reason("gone", "Analyzing")
        r = play_job(c.api, c.job("analyze"), c.tmp / "analyze")
        assert r.returncode == 0, r.stderr
        c.wait_reason("gone", "JobRunning")
        shard = sorted(k for k in keys if k.endswith(".safetensors"))[0]
        client.delete_object(Bucket=bucket, Key=dst + shard[len(src) :])
        job = c.job("merge")
        r = play_job(c.api, job, c.tmp / "merge")
        assert r.returncode == 2
        (pod,) = c.api.list("Pod", NS, f"job-name={job['metadata']['name']}")
        missing = f"s3://{bucket}/{dst}{shard[len(src) :]}"
        (failed,) = [
            x for x in c.api.get("Job", NS, job["metadata"]["name"])["status"]["conditions"] if x["type"] == "Failed"
        ]
        assert missing not in failed["message"]  # the Job controller does not know the cause
        msg = ready(c.wait_reason("gone", "JobFailed"))["message"]
        assert missing in msg and "it was present when the plan was made. Restore it or re-plan." in msg, msg
        assert "backoff limit" in msg  # the Job controller's words stay, after the cause
        assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"].strip() in msg
        ev = c.wait_events("gone", ["Analyzing", "Analyzed", "Admitted", "Planned", "JobRunning", "JobFailed"])
        assert ev[-1][0] == "Warning" and missing in ev[-1][2]


@pytest.mark.slow
def test_operator_restart_mid_merge_creates_no_duplicate_job(cluster):
    c = cluster
    with operator():
        c.merge("restart", budget="1Mi")
        st = c.wait_reason("restart", "JobRunning")["status"]
        job = c.job("merge")
    mark_job(c.api, job, "Running")  # the pod starts while no operator runs
    with operator():
        # the new operator sees the Job (its replayed event updates the condition) ...
        wait_for(
            "the restarted operator to see the running Job",
            lambda: "1 active pod" in ready(c.mm("restart")).get("message", ""),
        )
        time.sleep(1.0)
        # ... and resumes the merge without a second Job or a new plan
        assert [j["metadata"]["name"] for j in c.jobs()] == [job["metadata"]["name"]]
        o = c.mm("restart")
        assert (o["status"]["jobName"], o["status"]["plan"]["digest"]) == (st["jobName"], st["plan"]["digest"])
        r = play_job(c.api, job, c.tmp / "merge")
        assert r.returncode == 0, r.stderr
        o = c.wait_reason("restart", "Committed")
        assert o["status"]["snapshot"] and len(c.jobs()) == 1


def test_search_driver_job_and_status_mirroring(cluster):
    """MergeSearch -> one driver Job (owned by the search, the driver's ServiceAccount, the spec as
    `mergepipe search` options) -> the driver's results in S3 mirrored into the status at the
    Job's events -> Completed when the driver succeeds; an operator restart creates no second
    driver. (The driver itself cannot run here: the core has no Kubernetes worker backend yet.)"""
    from test_operator_search import core_results

    from mergepipe_operator.search import decisions as sd

    c = cluster
    out = f"{c.out}/searches/{NS}/front/"
    spec = {
        "base": {"uri": c.models.base + "/"},
        "experts": [{"name": n, "uri": u + "/"} for n, u in zip(("code", "math"), c.models.experts[:2])],
        "method": "task_arithmetic",
        "vary": [{"name": "weight", "min": 0.0, "max": 1.0}],
        "layerBlocks": 2,
        "objectives": [{"metric": "loss:python"}, {"metric": "loss:arithmetic"}],
        "evaluator": {"command": "python -m evalpkg {checkpoint}"},
        "evaluations": 6,
        "initial": 2,
        "workers": 2,
        "output": {"uri": out},
    }

    def search_obj():
        return c.api.get("MergeSearch", NS, "front")

    def wait_search(pred, what):
        return wait_for(f"MergeSearch front {what}", lambda: (o := search_obj()) and pred(o) and o, 30)

    with operator():
        ms = c.api.create(
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "MergeSearch",
                "metadata": {"name": "front", "namespace": NS},
                "spec": spec,
            }
        )
        job = c.job("search")
        assert job["metadata"]["name"] == "front-search-g1"
        assert job["metadata"]["ownerReferences"][0]["uid"] == ms["metadata"]["uid"]
        assert job["metadata"]["ownerReferences"][0]["kind"] == "MergeSearch"
        pod = job["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "mergepipe-search-driver" and pod["automountServiceAccountToken"]
        args = pod["containers"][0]["args"]
        assert (
            args[:3] == ["search", "--out", out + "g1/"]
            and args[args.index("--search-uid") + 1] == ms["metadata"]["uid"]
        )
        o = wait_search(lambda o: ready(o).get("reason") == "Searching", "Searching")
        assert o["status"]["stateURI"] == out + "g1/state.json" and o["status"]["driverJob"] == "front-search-g1"
        # the driver has finished 3 candidates (1 failed) and rewrites its results; its pod runs
        bucket, key = sd.results_uri(sd.MergeSearchSpec.model_validate(spec), 1)[5:].split("/", 1)
        c.models.client.put_object(Bucket=bucket, Key=key, Body=json.dumps(core_results()).encode())
        mark_job(c.api, job, "Running")
        o = wait_search(lambda o: o["status"].get("evaluations") == 4, "4 evaluations mirrored")
        assert o["status"]["paretoSize"] == 2 and o["status"]["hypervolume"] == pytest.approx(8.0)
        assert [p["candidate"] for p in o["status"]["pareto"]] == [0, 1]
        assert o["status"]["pareto"][0]["snapshot"].startswith("front-c0000-")
        assert ready(o)["status"] == "False" and "4/6 candidates evaluated (1 failed)" in ready(o)["message"]
    with operator():  # restart: the same driver carries on
        time.sleep(1.0)
        assert [j["metadata"]["name"] for j in c.jobs(component="search")] == ["front-search-g1"]
        mark_job(c.api, job, "Succeeded")
        o = wait_search(lambda o: ready(o).get("reason") == "Completed", "Completed")
        assert ready(o)["status"] == "True" and "Pareto set of 2" in ready(o)["message"]
        c.wait_events("front", ["Searching", "Completed"], kind="MergeSearch")


@pytest.mark.slow
def test_search_end_to_end_driver_candidates_as_modelmerges(cluster, monkeypatch):
    """The real thing, played: MergeSearch -> driver Job, whose command (`mergepipe search
    --worker-backend kubernetes`) the test runs locally against the fake API server -> each
    candidate a child ModelMerge (owned by the search) that the operator plans and admits under
    the namespace's quota -> the test plays the merge Jobs -> MergedSnapshots -> an evaluation Job
    per candidate (played: `mergepipe search-eval` runs the command on the snapshot URI) -> results
    in S3 -> status mirrored; Completed when the driver exits 0."""
    import sys
    import threading

    from kubeharness import run_job

    c = cluster
    monkeypatch.setenv("MERGEPIPE_SEARCH_POLL_SECONDS", "1")
    c.quota("daily", merges=10, enforcement="Reject")
    script = c.tmp / "score.py"
    script.write_text(
        "import hashlib, json, sys\nh = hashlib.sha256(sys.argv[1].encode()).digest()\n"
        "print(json.dumps({'a': h[0] / 255, 'b': h[1] / 255}))\n"
    )
    out = f"{c.out}/searches/{NS}/e2e/"
    spec = {
        "base": {"uri": c.models.base + "/"},
        "experts": [{"name": n, "uri": u + "/"} for n, u in zip(("code", "math"), c.models.experts[:2])],
        "method": "task_arithmetic",
        "vary": [{"name": "weight", "min": 0.0, "max": 1.0}],
        "layerBlocks": 1,
        "objectives": [{"metric": "a"}, {"metric": "b"}],
        "evaluator": {"command": f"{sys.executable} {script} {{checkpoint}}"},
        "evaluations": 3,
        "initial": 3,
        "workers": 2,
        "strategy": "random",
        "output": {"uri": out},
        "resources": {"gpu": {"count": 0}},
    }
    played: set[str] = set()
    with operator(timeout=120):
        ms = c.api.create(
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "MergeSearch",
                "metadata": {"name": "e2e", "namespace": NS},
                "spec": spec,
            }
        )
        driver = c.job("search")
        cmd_env: dict[str, Any] = {}
        result: dict[str, Any] = {}

        def run_driver():
            mark_job(c.api, driver, "Running")
            import kubeharness

            orig = kubeharness.job_command

            def with_kubeconfig(api, job, workdir):
                cmd, env = orig(api, job, workdir)
                env["KUBECONFIG"] = str(c.tmp / "kubeconfig")
                cmd_env["env"] = env
                return cmd, env

            monkeypatch.setattr(kubeharness, "job_command", with_kubeconfig)
            result["r"] = run_job(c.api, driver, c.tmp / "driver", timeout=600)

        t = threading.Thread(target=run_driver, daemon=True)
        t.start()
        deadline = time.monotonic() + 600
        while t.is_alive() and time.monotonic() < deadline:
            for job in c.jobs():
                comp = job["metadata"]["labels"].get(names.LABEL_COMPONENT)
                if comp in ("merge", "analyze", "evaluate") and job["metadata"]["name"] not in played:
                    played.add(job["metadata"]["name"])
                    r = play_job(c.api, job, c.tmp / job["metadata"]["name"])
                    assert r.returncode == 0, r.stderr[-2000:]
            time.sleep(0.2)
        t.join(5)
        r = result["r"]
        assert r.returncode == 0, r.stderr[-3000:]
        mark_job(c.api, driver, "Succeeded")
        o = wait_for(
            "MergeSearch e2e Completed",
            lambda: (x := c.api.get("MergeSearch", NS, "e2e")) and ready(x).get("reason") == "Completed" and x,
            60,
        )
    st = o["status"]
    assert st["evaluations"] == 3 and st["failed"] == 0 and st["paretoSize"] == len(st["pareto"]) >= 1
    children = c.api.list("ModelMerge", NS, "mergepipe.io/merge-search=e2e")
    assert sorted(m["metadata"]["name"] for m in children) == ["e2e-c0000", "e2e-c0001", "e2e-c0002"]
    for m in children:
        assert m["metadata"]["ownerReferences"][0]["uid"] == ms["metadata"]["uid"]
        assert ready(m)["reason"] == "Committed"
    for p in st["pareto"]:
        snap = c.api.get("MergedSnapshot", NS, p["snapshot"])
        assert snap is not None and snap["spec"]["uri"] == p["uri"] == f"{out}g1/c{p['candidate']:04d}/"
    evals = c.jobs(component="evaluate")
    assert sorted(j["metadata"]["name"] for j in evals) == ["e2e-e0000", "e2e-e0001", "e2e-e0002"]
    for j in evals:  # the user's command runs here, without a token, owned by the search
        assert j["metadata"]["ownerReferences"][0]["uid"] == ms["metadata"]["uid"]
        assert j["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        assert j["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["search-eval", "--command"]
    ledger = quota_ledger(c.api, NS, "daily")
    assert sorted(e["merge"] for e in ledger) == ["e2e-c0000", "e2e-c0001", "e2e-c0002"]
    assert {e["state"] for e in ledger} == {"Charged"}


def test_tenant_images_refused_and_the_search_driver_image_fixed(cluster, monkeypatch):
    """Issue 22 item 3, end to end: a ModelMerge naming an image the chart's
    merges.allowedImages does not admit is InvalidSpec naming the rule, and no Job is created; a
    MergeSearch naming an admitted image gets a driver Job (the pod holding the driver's token and
    the S3 keys) running the operator's merger image, the tenant's image reaching only the
    evaluation Job template (no token)."""
    c = cluster
    monkeypatch.setenv("MERGEPIPE_ALLOWED_IMAGES", '["registry.example/team-a/*"]')
    with operator():
        c.merge("evil", image="evil.example/steal-keys:1", budget="10Gi")
        o = c.wait_reason("evil", "InvalidSpec")
        msg = ready(o)["message"]
        assert msg.startswith("spec.image: image 'evil.example/steal-keys:1' refused") and "merges.allowedImages" in msg
        ev = c.wait_events("evil", ["InvalidSpec"], tail=True)
        assert ev[-1][0] == "Warning" and "merges.allowedImages" in ev[-1][2]
        spec = {
            "base": {"uri": c.models.base + "/"},
            "experts": [{"name": n, "uri": u + "/"} for n, u in zip(("code", "math"), c.models.experts[:2])],
            "method": "task_arithmetic",
            "vary": [{"name": "weight", "min": 0.0, "max": 1.0}],
            "objectives": [{"metric": "loss:python"}, {"metric": "loss:arithmetic"}],
            "evaluator": {"command": "python -m evalpkg {checkpoint}"},
            "evaluations": 4,
            "initial": 2,
            "image": "registry.example/team-a/evaluator:3",
            "output": {"uri": f"{c.out}/searches/{NS}/img/"},
        }
        c.api.create(
            {
                "apiVersion": "mergepipe.io/v1alpha1",
                "kind": "MergeSearch",
                "metadata": {"name": "img", "namespace": NS},
                "spec": spec,
            }
        )
        job = c.job("search")
        pod = job["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is True
        assert [k["image"] for k in pod["containers"]] == ["ghcr.io/mergepipe/merger:test"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        ev_pod = json.loads(env["MERGEPIPE_EVAL_JOB_TEMPLATE"])["spec"]["template"]["spec"]
        assert ev_pod["containers"][0]["image"] == "registry.example/team-a/evaluator:3"
        assert ev_pod["automountServiceAccountToken"] is False
        # the same search asking for an image outside the allowlist starts nothing
        c.api.patch("MergeSearch", NS, "img", {"spec": {"image": "evil.example/steal-token:1"}})
        o = wait_for(
            "MergeSearch img InvalidSpec",
            lambda: (s := c.api.get("MergeSearch", NS, "img")) and ready(s).get("reason") == "InvalidSpec" and s,
            30,
        )
        assert "spec.image" in ready(o)["message"] and "matches no entry of merges.allowedImages" in ready(o)["message"]
        assert [j["metadata"]["name"] for j in c.jobs(component="search")] == ["img-search-g1"]
        assert [j for j in c.jobs() if j["metadata"]["labels"].get(names.LABEL_COMPONENT) == "merge"] == []
