"""The Helm chart: lint and render offline (helm-python-sdk binds Helm v4's Go SDK; there is no
helm binary here), then check every rendered built-in object with kubernetes-validate --strict,
the RBAC for least privilege, and that the Deployment's environment reads back as the Settings
the values describe."""

from __future__ import annotations

import json

import pytest
import yaml
from op_testlib import ROOT, k8s_validate

from mergepipe_operator.settings import Settings

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm v4 Go SDK binding) is not installed")

CHART = ROOT / "helm" / "mergepipe"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "mp", "mergepipe-system"


def values_of(path):
    return yaml.safe_load(path.read_text()) or {}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as c:
        yield c


def render(chart, values):
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objs = []
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            continue
        objs += [o for o in yaml.safe_load_all(text) if o]
    return objs


def test_there_are_at_least_three_values_files():
    assert len(VALUES) >= 3


@pytest.mark.parametrize("vfile", VALUES, ids=lambda p: p.name)
def test_lint(vfile):
    report = helm.lint(str(CHART), values_of(vfile), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("vfile", VALUES, ids=lambda p: p.name)
def test_rendered_objects_are_valid_kubernetes(chart, vfile):
    objs = render(chart, values_of(vfile))
    kinds = sorted(o["kind"] for o in objs)
    assert "Deployment" in kinds
    for o in objs:
        k8s_validate(o)


def deployment(objs):
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    return dep


def operator_env(dep):
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c, {e["name"]: e for e in c["env"]}


@pytest.mark.parametrize("vfile", VALUES, ids=lambda p: p.name)
def test_deployment_is_single_and_locked_down(chart, vfile):
    dep = deployment(render(chart, values_of(vfile)))
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c, env = operator_env(dep)
    sc = c["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"]
        and sc["allowPrivilegeEscalation"] is False
        and sc["capabilities"] == {"drop": ["ALL"]}
    )
    assert c["command"] == ["kopf"] and c["args"][:3] == ["run", "--standalone", "--module=mergepipe_operator.main"]
    for name, e in env.items():
        if name.startswith("AWS_"):
            assert "value" not in e and "secretKeyRef" in e["valueFrom"], e


def test_watch_namespaces_and_rbac(chart):
    all_ns = render(chart, {})
    args = deployment(all_ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args
    assert {o["kind"] for o in all_ns if "Role" in o["kind"]} == {"ClusterRole", "ClusterRoleBinding"}
    assert [o["kind"] for o in all_ns if is_driver(o)] == ["ClusterRole"]  # to bind per namespace
    some = render(chart, {"watchNamespaces": ["team-a", "team-b"]})
    args = deployment(some)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    roles = [o for o in some if o["kind"] == "Role" and not is_driver(o)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    (cluster_role,) = [o for o in some if o["kind"] == "ClusterRole"]
    # with fixed namespaces, the only cluster-wide grants are reads kopf needs
    for rule in cluster_role["rules"]:
        assert set(rule["verbs"]) <= {"list", "watch"}
        assert set(rule["resources"]) <= {"customresourcedefinitions", "namespaces"}


#: (apiGroup, resource) -> verbs the operator and kopf use; anything more is a finding.
EXPECTED_GRANTS = {
    ("mergepipe.io", "modelmerges"): {"get", "list", "watch", "patch"},
    ("mergepipe.io", "mergedsnapshots"): {"get", "list", "watch", "patch", "create"},
    ("mergepipe.io", "mergequotas"): {"get", "list", "watch", "patch"},
    ("mergepipe.io", "mergesearches"): {"get", "list", "watch", "patch"},
    ("mergepipe.io", "mergesearches/status"): {"get", "patch"},
    ("mergepipe.io", "modelmerges/status"): {"get", "patch"},
    ("mergepipe.io", "mergedsnapshots/status"): {"get", "patch"},
    ("mergepipe.io", "mergequotas/status"): {"get", "update"},
    ("mergepipe.io", "modelmerges/finalizers"): {"update"},
    ("mergepipe.io", "mergesearches/finalizers"): {"update"},
    ("batch", "jobs"): {"get", "list", "watch", "create", "delete"},
    ("", "pods"): {"get", "list"},
    ("", "events"): {"create"},
    ("events.k8s.io", "events"): {"create"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}


#: What a MergeSearch driver may do in its namespace: its candidates and their evaluation Jobs.
EXPECTED_DRIVER_GRANTS = {
    ("mergepipe.io", "modelmerges"): {"create", "get", "list", "watch"},
    ("mergepipe.io", "mergedsnapshots"): {"get", "list"},
    ("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
    ("mergepipe.io", "mergesearches/finalizers"): {"update"},
}


def is_driver(o) -> bool:
    return o["kind"] in ("Role", "ClusterRole", "RoleBinding") and o["metadata"]["name"].endswith("-search-driver")


def grants(objs, driver: bool = False):
    out: dict[tuple[str, str], set[str]] = {}
    for o in objs:
        if o["kind"] not in ("Role", "ClusterRole") or is_driver(o) != driver:
            continue
        for rule in o["rules"]:
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    out.setdefault((g, r), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster", "namespaced"])
def test_rbac_is_least_privilege(chart, values):
    got = grants(render(chart, values))
    assert got == EXPECTED_GRANTS
    flat = json.dumps([o for o in render(chart, values) if "Role" in o["kind"]])
    assert '"*"' not in flat and "secrets" not in flat and "pods/" not in flat  # pods: get/list only, no logs/exec


#: With the io-budget AdmissionCheck: what its controller reads and writes of Kueue's objects.
EXPECTED_KUEUE_GRANTS = {
    ("kueue.x-k8s.io", "localqueues"): {"get"},
    ("kueue.x-k8s.io", "clusterqueues"): {"get"},
    ("kueue.x-k8s.io", "admissionchecks"): {"get", "list", "watch", "patch"},
    ("kueue.x-k8s.io", "admissionchecks/status"): {"get", "update"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "workloads/status"): {"get", "update"},
}


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster", "namespaced"])
def test_kueue_values_reach_the_operator_and_its_rbac(chart, values):
    off = render(chart, values)
    assert not any(k[0] == "kueue.x-k8s.io" for k in grants(off))
    on = render(chart, dict(values, kueue={"queueName": "llm", "admissionCheck": {"enabled": True}}))
    assert grants(on) == {**EXPECTED_GRANTS, **EXPECTED_KUEUE_GRANTS}
    s = settings_from(deployment(on))
    assert (s.queue_name, s.kueue_admission_check) == ("llm", True)
    s = settings_from(deployment(off))
    assert (s.queue_name, s.kueue_admission_check) == (None, False)
    for o in on:
        k8s_validate(o)


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster", "namespaced"])
def test_search_driver_rbac_is_least_privilege(chart, values):
    objs = render(chart, values)
    assert grants(objs, driver=True) == EXPECTED_DRIVER_GRANTS
    assert not [o for o in objs if o["kind"] == "ClusterRoleBinding" and "search-driver" in o["roleRef"]["name"]]


def test_search_driver_service_account_per_watched_namespace(chart):
    objs = render(chart, {"watchNamespaces": ["team-a", "team-b"]})
    sas = sorted(
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in objs
        if o["kind"] == "ServiceAccount" and o["metadata"].get("namespace") in ("team-a", "team-b")
    )
    assert sas == [("team-a", "mergepipe-search-driver"), ("team-b", "mergepipe-search-driver")]
    for b in (o for o in objs if o["kind"] == "RoleBinding" and is_driver(o)):
        ns = b["metadata"]["namespace"]
        assert b["roleRef"]["kind"] == "Role" and b["roleRef"]["name"].endswith("-search-driver")
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "mergepipe-search-driver", "namespace": ns}]
    s = settings_from(
        deployment(
            render(
                chart,
                {
                    "search": {
                        "driver": {"serviceAccountName": "searcher", "cpu": "1", "memory": "2Gi"},
                        "pollSeconds": 5,
                    }
                },
            )
        )
    )
    assert (s.search_service_account, s.search_driver_cpu, s.search_driver_memory, s.search_poll_seconds) == (
        "searcher",
        "1",
        "2Gi",
        5,
    )


def test_rbac_can_be_disabled(chart):
    objs = render(chart, {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}})
    assert {o["kind"] for o in objs} == {"Deployment", "NetworkPolicy"}  # (not RBAC: networkPolicy.enabled)
    assert deployment(objs)["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def settings_from(dep):
    _, env = operator_env(dep)
    return Settings.from_env({k: e["value"] for k, e in env.items() if "value" in e})


def test_values_reach_the_operator_settings(chart):
    s = settings_from(deployment(render(chart, {})))
    assert (s.merger_image, s.gpu_resource_name, s.gpu_count) == ("ghcr.io/mergepipe/merger:0.1.0", "nvidia.com/gpu", 1)
    assert (s.s3_secret_name, s.catalog_uri, s.plan_prefix, s.default_budget) == (
        "mergepipe-s3",
        "s3://mergepipe/catalog/",
        "s3://mergepipe/plans/",
        None,
    )
    assert (s.backoff_limit, s.active_deadline_seconds, s.ttl_seconds_after_finished) == (2, 21600, 86400)
    assert s.metrics_port == 9090 and s.watch_namespaces == ()
    assert (s.quota_retry_seconds, s.analyze_poll_seconds) == (300, 15)
    assert (s.max_parallelism, s.bytes_per_part) == (8, 100 * 1024**3)
    assert s.sketch is None and s.sketch_by_namespace == {}  # the core's default tiers (DEFAULT_SKETCH)
    assert s.allowed_images == ()  # spec.image refused by default (issue 22)

    custom = settings_from(deployment(render(chart, values_of(CHART / "ci" / "custom-values.yaml"))))
    assert custom.merger_image == "registry.internal/mergepipe/merger:0.1.0-rocm"
    assert (custom.gpu_resource_name, custom.gpu_count, custom.tmp_size_limit) == ("amd.com/gpu", 2, "100Gi")
    assert (custom.s3_endpoint, custom.s3_region, custom.s3_secret_name) == (
        "https://minio.storage.svc:9000",
        "eu-central-1",
        "minio-creds",
    )
    assert (custom.s3_access_key_id_key, custom.s3_secret_access_key_key) == ("accesskey", "secretkey")
    assert custom.job_service_account == "merger-irsa" and custom.node_selector == {"pool": "gpu"}
    assert custom.tolerations == [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert (custom.default_budget, custom.backoff_limit, custom.image_pull_policy) == ("512MiB", 0, "Always")
    assert (custom.max_parallelism, custom.bytes_per_part) == (4, 50 * 1024**3)
    assert custom.sketch == "none"
    assert custom.allowed_images == (
        "registry.internal/mergepipe/*",
        "registry.internal/team-a/merger@sha256:" + "0123456789abcdef" * 4,
    )
    _, env = operator_env(deployment(render(chart, values_of(CHART / "ci" / "custom-values.yaml"))))
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "minio-creds", "key": "accesskey"}

    cpu = settings_from(deployment(render(chart, values_of(CHART / "ci" / "namespaced-cpu-values.yaml"))))
    assert cpu.gpu_count == 0 and cpu.watch_namespaces == ("team-a", "team-b") and cpu.metrics_port is None
    assert (cpu.cpu, cpu.memory, cpu.default_budget, cpu.quota_retry_seconds) == ("8", "64Gi", "10Gi", 120)
    assert cpu.analyze_poll_seconds == 5 and cpu.sketch == "sign1" and cpu.sketch_by_namespace == {"team-b": "none"}


def test_chart_ships_the_generated_crds(chart):
    crds = {c["filename"].removeprefix("mergepipe/"): c["data"] for c in chart.crds}
    assert sorted(crds) == [
        "crds/kopf-peerings.yaml",
        "crds/mergedsnapshots.yaml",
        "crds/mergequotas.yaml",
        "crds/mergesearches.yaml",
        "crds/modelmerges.yaml",
    ]
    peering = crds.pop("crds/kopf-peerings.yaml")
    for name, data in crds.items():
        assert data == (ROOT / name).read_text()
    docs = [d for d in yaml.safe_load_all(peering) if d]
    assert sorted((d["spec"]["names"]["kind"], d["spec"]["scope"], d["spec"]["group"]) for d in docs) == [
        ("ClusterKopfPeering", "Cluster", "kopf.dev"),
        ("KopfPeering", "Namespaced", "kopf.dev"),
    ]


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]], ids=["cluster", "namespaced"])
def test_replicas_run_kopf_peering(chart, watch):
    one = render(chart, {"watchNamespaces": watch})
    assert not [o for o in one if o["apiVersion"] == "kopf.dev/v1"]
    objs = render(chart, {"replicas": 3, "watchNamespaces": watch})
    dep = deployment(objs)
    k8s_validate(dep)
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["strategy"] == {"type": "RollingUpdate"}
    c, env = operator_env(dep)
    assert "--standalone" not in c["args"] and f"--peering={RELEASE}-mergepipe" in c["args"]
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # kopf's peer identity
    peerings = sorted((o["kind"], o["metadata"].get("namespace")) for o in objs if o["apiVersion"] == "kopf.dev/v1")
    got = grants(objs)
    if watch:
        assert peerings == [("KopfPeering", "team-a"), ("KopfPeering", "team-b")]
        assert got[("kopf.dev", "kopfpeerings")] == {"get", "list", "watch", "patch"}
        assert ("kopf.dev", "clusterkopfpeerings") not in got
    else:
        assert peerings == [("ClusterKopfPeering", None)]
        assert got[("kopf.dev", "clusterkopfpeerings")] == {"get", "list", "watch", "patch"}
        assert ("kopf.dev", "kopfpeerings") not in got
    assert {k: v for k, v in got.items() if k[0] != "kopf.dev"} == grants(one)  # nothing else changes


@pytest.mark.parametrize(
    "bad",
    [
        {"merger": {"gpu": {"count": -1}}},
        {"merger": {"gpu": {"resourceName": "gpu please"}}},
        {"watchNamespaces": ["Team_A"]},
        {"s3": {"endpoint": "ftp://x"}},
        {"merges": {"defaultBudget": "10 GB"}},
        {"merges": {"sketch": "sign4"}},
        {"merges": {"sketch": "None"}},
        {"merges": {"sketchByNamespace": {"team-a": "sign4"}}},
        {"merges": {"sketchByNamespace": {"Team_A": "none"}}},
        {"catalog": {"uri": "/data/catalog"}},
        {"logLevel": "verbose"},
        {"replicas": 0},  # (more than 1 runs kopf peering: test_replicas_run_kopf_peering)
        {"image": {"pullPolicy": "Sometimes"}},
        {"merges": {"allowedImages": ["registry.example/a b"]}},
        {"merges": {"allowedImages": [""]}},
    ],
    ids=str,
)
def test_values_schema_rejects_bad_values(chart, bad):
    with pytest.raises(helm.HelmError):
        chart.validate_schema(bad)


def test_values_schema_accepts_the_ci_values(chart):
    for v in VALUES:
        chart.validate_schema(values_of(v))


# garbage collection CronJob -------------------------------------------------------------------


def _gc_cronjobs(objs):
    return [o for o in objs if o["kind"] == "CronJob"]


def test_gc_cronjob_is_off_by_default(chart):
    assert _gc_cronjobs(render(chart, {})) == []


def test_gc_cronjob_needs_roots(chart):
    with pytest.raises(Exception, match="gc.roots"):
        render(chart, {"gc": {"enabled": True}})


def test_gc_cronjob_runs_mergepipe_gc_locked_down(chart):
    values = values_of(CHART / "ci" / "custom-values.yaml")
    (cj,) = _gc_cronjobs(render(chart, values))
    k8s_validate(cj)
    assert cj["metadata"]["namespace"] == NAMESPACE and cj["spec"]["concurrencyPolicy"] == "Forbid"
    assert cj["spec"]["schedule"] == values["gc"]["schedule"]
    pod = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == "registry.internal/mergepipe/merger:0.1.0-rocm"
    assert [c["command"][0], *c["args"]] == ["mergepipe", "gc", *values["gc"]["roots"], "--grace", "36h", "--json"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "https://minio.storage.svc:9000"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "minio-creds", "key": "accesskey"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "minio-creds", "key": "secretkey"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]


@pytest.mark.s3
def test_gc_cronjob_command_removes_an_orphan_run_on_s3(chart, s3_env, tmp_path):
    """The rendered container (its args, its env with the Secret's values filled in) run against
    SeaweedFS: the orphan run prefix (with its ownership record) goes; an object merely shaped like
    a run (no record) and other objects stay."""
    import os
    import subprocess
    import sys

    from mergepipe.commit import ownership

    c = s3_env.client()
    bucket = s3_env.make_bucket("gccron")
    rec = ownership.make_record("run-prefix", f"s3://{bucket}/merged/a", "00000000000000aa", "0" * 64)
    c.put_object(Bucket=bucket, Key="merged/a/runs/00000000000000aa.owner.json", Body=rec.model_dump_json())
    c.put_object(Bucket=bucket, Key="merged/a/runs/00000000000000aa/model.safetensors", Body=b"x" * 10)
    c.put_object(Bucket=bucket, Key="merged/b/runs/00000000000000bb/model.safetensors", Body=b"no record")
    c.put_object(Bucket=bucket, Key="merged/other/data.bin", Body=b"keep")
    values = {
        "s3": {"endpoint": s3_env.endpoint_url, "credentialsSecret": {"name": "s3"}},
        "gc": {"enabled": True, "roots": [f"s3://{bucket}/merged/"], "grace": "24h"},
    }
    (cj,) = _gc_cronjobs(render(chart, values))
    (ctr,) = cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    secret = {"AWS_ACCESS_KEY_ID": s3_env.access_key, "AWS_SECRET_ACCESS_KEY": s3_env.secret_key}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path))
    for e in ctr["env"]:
        env[e["name"]] = e["value"] if "value" in e else secret[e["valueFrom"]["secretKeyRef"]["key"]]
    args = list(ctr["args"])
    assert args[args.index("--grace") + 1] == "24h"
    args[args.index("--grace") + 1] = "0"  # the objects were just written (the chart refuses a grace this short)
    cmd = [sys.executable, "-m", "mergepipe.cli", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    rep = json.loads(r.stdout)
    assert rep["deleted_runs"] == [f"s3://{bucket}/merged/a/runs/00000000000000aa"]
    keys = sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", []))
    assert keys == ["merged/b/runs/00000000000000bb/model.safetensors", "merged/other/data.bin"]
    assert len(rep["unproven"]) == 1


# multi-tenant posture (issue 22 item 9) ------------------------------------------------------


def _kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def test_network_policies_deny_ingress_and_restrict_egress_to_the_values(chart):
    """The operator's pod: no ingress but metrics from metricsFrom; worker pods of each watched
    namespace: no ingress at all; with egress restricted, DNS + S3 for every worker, the API
    server only for the operator and the search driver."""
    (op,) = _kind(render(chart, {}), "NetworkPolicy")  # all namespaces: the operator's only
    assert op["spec"]["policyTypes"] == ["Ingress"] and op["spec"]["ingress"] == []
    custom = values_of(CHART / "ci" / "custom-values.yaml")
    (op,) = _kind(render(chart, custom), "NetworkPolicy")
    (rule,) = op["spec"]["ingress"]
    assert (
        rule["ports"] == [{"protocol": "TCP", "port": 9102}] and rule["from"] == custom["networkPolicy"]["metricsFrom"]
    )
    objs = render(chart, values_of(CHART / "ci" / "namespaced-cpu-values.yaml"))
    pols = {(o["metadata"]["namespace"], o["metadata"]["name"]): o["spec"] for o in _kind(objs, "NetworkPolicy")}
    assert sorted(pols) == [
        ("mergepipe-system", "mp-mergepipe"),
        ("team-a", "mergepipe-search-driver"),
        ("team-a", "mergepipe-workers"),
        ("team-b", "mergepipe-search-driver"),
        ("team-b", "mergepipe-workers"),
    ]

    def targets(spec):
        out = set()
        for r in spec.get("egress") or []:
            for peer in r["to"]:
                for port in r["ports"]:
                    out.add((peer.get("ipBlock", {}).get("cidr", "dns"), port["port"]))
        return out

    dns = {("dns", 53)}
    api, s3 = ("10.96.0.1/32", 443), ("10.20.0.0/16", 8333)
    assert targets(pols[("mergepipe-system", "mp-mergepipe")]) == dns | {api, s3}
    workers = pols[("team-a", "mergepipe-workers")]
    assert workers["podSelector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "mergepipe-operator"}}
    assert workers["ingress"] == [] and targets(workers) == dns | {s3}
    driver = pols[("team-a", "mergepipe-search-driver")]
    assert driver["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "search"
    assert targets(driver) == {api}
    # the labels the policies select are the ones the operator puts on its worker pods
    from op_testlib import make_merge, make_settings

    from mergepipe_operator.modelmerge import decisions as mmd

    pod_labels = mmd.build_job(make_merge(), "s3://p/x.json", "ab" * 32, make_settings())["spec"]["template"][
        "metadata"
    ]["labels"]
    assert pod_labels["app.kubernetes.io/managed-by"] == "mergepipe-operator"
    assert _kind(render(chart, {"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []
    with pytest.raises(helm.HelmError):  # restricting egress needs the API server and S3 endpoints
        chart.validate_schema({"networkPolicy": {"egress": {"enabled": True}}})


def test_replicas_get_a_disruption_budget_and_spread_over_nodes(chart):
    one = render(chart, {})
    assert _kind(one, "PodDisruptionBudget") == [] and "affinity" not in deployment(one)["spec"]["template"]["spec"]
    three = render(chart, {"replicas": 3})
    (pdb,) = _kind(three, "PodDisruptionBudget")
    sel = deployment(three)["spec"]["selector"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": sel}
    anti = deployment(three)["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == sel
    hard = deployment(render(chart, {"replicas": 2, "antiAffinity": "hard"}))["spec"]["template"]["spec"]
    assert (
        hard["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"] == sel
    )
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    assert deployment(render(chart, {"replicas": 2, "affinity": mine}))["spec"]["template"]["spec"]["affinity"] == mine
    for o in three:
        if o["kind"] in ("Deployment", "PodDisruptionBudget"):  # (not the kopf peering custom resource)
            k8s_validate(o)


def test_every_chart_container_has_cpu_requests_and_limits(chart):
    objs = render(chart, {"gc": {"enabled": True, "roots": ["s3://models/merged/"]}})
    pods = [deployment(objs)["spec"]["template"]["spec"]]
    pods += [cj["spec"]["jobTemplate"]["spec"]["template"]["spec"] for cj in _kind(objs, "CronJob")]
    assert len(pods) == 2
    for pod in pods:
        for c in pod["containers"]:
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
    # the worker Jobs: CPU limits on request (merger.resources.limitCPU)
    s = settings_from(deployment(render(chart, values_of(CHART / "ci" / "namespaced-cpu-values.yaml"))))
    assert s.limit_cpu is True and settings_from(deployment(render(chart, {}))).limit_cpu is False
    from op_testlib import make_merge

    from mergepipe_operator.modelmerge import decisions as mmd

    res = mmd.build_job(make_merge(), "s3://p/x.json", "ab" * 32, s)["spec"]["template"]["spec"]["containers"][0]
    assert res["resources"]["limits"]["cpu"] == res["resources"]["requests"]["cpu"] == "8"


def test_images_are_pinnable_by_digest(chart):
    d = "sha256:" + "ab" * 32
    objs = render(
        chart,
        {
            "image": {"digest": d},
            "merger": {"image": {"digest": d}},
            "gc": {"enabled": True, "roots": ["s3://models/merged/"]},
        },
    )
    c, env = operator_env(deployment(objs))
    assert c["image"] == f"ghcr.io/mergepipe/operator@{d}"
    assert env["MERGEPIPE_MERGER_IMAGE"]["value"] == f"ghcr.io/mergepipe/merger@{d}"
    (cj,) = _kind(objs, "CronJob")
    assert (
        cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"ghcr.io/mergepipe/merger@{d}"
    )
    with pytest.raises(helm.HelmError):
        chart.validate_schema({"image": {"digest": "sha256:short"}})


def test_the_evaluators_secret_reaches_the_operator(chart):
    assert settings_from(deployment(render(chart, {}))).eval_s3_secret_name is None
    s = settings_from(deployment(render(chart, {"search": {"evaluator": {"credentialsSecret": "search-eval-s3"}}})))
    assert s.eval_s3_secret_name == "search-eval-s3"


def test_metrics_bind_address_reaches_the_operator(chart):
    s = settings_from(deployment(render(chart, {"metrics": {"bindAddress": "127.0.0.1"}})))
    assert (s.metrics_port, s.metrics_bind_address) == (9090, "127.0.0.1")
    assert settings_from(deployment(render(chart, {}))).metrics_bind_address == "0.0.0.0"


@pytest.mark.parametrize(
    ("grace", "deadline", "ok"),
    [
        ("24h", 21600, True),
        ("6h", 21600, False),
        ("21600", 21600, False),
        ("21601", 21600, True),
        ("1.5h", 3600, True),
        ("90m", 7200, False),
        ("7d", 604800, False),
    ],
)
def test_gc_grace_must_exceed_the_merge_jobs_deadline(chart, grace, deadline, ok):
    """JSON Schema (draft 7, what Helm validates values with) cannot compare two values, so the
    chart's gc template fails the render instead, naming both values."""
    values = {
        "gc": {"enabled": True, "roots": ["s3://models/merged/"], "grace": grace},
        "merger": {"activeDeadlineSeconds": deadline},
    }
    chart.validate_schema(values)  # the schema alone admits it
    if ok:
        assert len(_kind(render(chart, values), "CronJob")) == 1
    else:
        with pytest.raises(helm.HelmError, match=r"gc.grace: .* must exceed merger.activeDeadlineSeconds"):
            render(chart, values)


def test_both_images_install_with_the_checked_in_constraints():
    """Both Dockerfiles copy their constraints file and pass it to pip; the files are what this
    environment resolves (constraints/lock.py --check)."""
    import re
    import subprocess
    import sys

    for dockerfile, lock in (("Dockerfile", "operator.txt"), ("merger_image/Dockerfile", "merger.txt")):
        text = (ROOT / dockerfile).read_text()
        assert f"COPY constraints/{lock} ./constraints/{lock}" in text, dockerfile
        installs = [ln for ln in text.splitlines() if re.match(r"RUN pip install", ln)]
        assert installs and all(f"--constraint constraints/{lock}" in ln for ln in installs), installs
        pins = [ln for ln in (ROOT / "constraints" / lock).read_text().splitlines() if ln and not ln.startswith("#")]
        assert pins and all(re.fullmatch(r"[a-z0-9][a-z0-9.-]*==[0-9][^\s]*", p) for p in pins), lock
        assert not any(p.startswith(("torch==", "nvidia-")) for p in pins)  # the merger's torch: its base image's
    r = subprocess.run(
        [sys.executable, str(ROOT / "constraints" / "lock.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_readme_and_ci_install_with_the_dev_lock():
    """The README's set-up command and .ci/run install ``.[all]`` with ``constraints/dev.txt``, so the
    test environment is the locked resolve and the ``--check`` above cannot fail on a fresh machine
    merely because an upstream project released a new version."""
    import re

    for path in ("README.md", ".ci/run"):
        text = (ROOT / path).read_text()
        installs = [ln for ln in text.splitlines() if re.search(r"pip install .*-e \"\.\[all\]\"", ln)]
        assert installs, path
        assert all(re.search(r"(-c|--constraint) constraints/dev\.txt", ln) for ln in installs), installs
    pins = (ROOT / "constraints" / "dev.txt").read_text()
    assert "\nmergekit==" in pins and "\npytest==" in pins and "\ntorch==" not in pins
