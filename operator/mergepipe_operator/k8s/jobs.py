"""Job templates shared by every worker Job (merge, analyze, search driver, evaluation): the
merger image's ``mergepipe`` CLI with the operator's security settings, its ownerReference, and
the outcome of a Job read from its status (:func:`job_outcome`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..crd import API_VERSION
from ..settings import Settings
from .conditions import Reason


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Controller ownerReference to a ModelMerge object (needs metadata.uid)."""
    meta = obj.get("metadata") or {}
    if not meta.get("uid") or not meta.get("name"):
        raise ValueError("the owner needs metadata.name and metadata.uid")
    return {
        "apiVersion": obj.get("apiVersion") or API_VERSION,
        "kind": obj.get("kind") or "ModelMerge",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def worker_job(
    mm: Mapping[str, Any],
    name: str,
    component: Literal["merge", "analyze", "search", "evaluate"],
    args: list[str],
    settings: Settings,
    *,
    gpu: bool,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    env_extra: list[dict[str, Any]],
    owner: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A Job running the merger image's ``mergepipe`` CLI with the operator's security settings
    (shared by the merge and the analyze Job)."""
    meta = mm.get("metadata") or {}
    spec = mm.get("spec") or {}
    namespace = meta.get("namespace")
    res = spec.get("resources") or {}
    gpu_spec = res.get("gpu") or {}
    gpu_count = (settings.gpu_count if gpu_spec.get("count") is None else int(gpu_spec["count"])) if gpu else 0
    gpu_name = gpu_spec.get("resourceName") or settings.gpu_resource_name
    s3 = spec.get("s3") or {}
    secret = s3.get("credentialsSecretRef") or (
        {
            "name": settings.s3_secret_name,
            "accessKeyIdKey": settings.s3_access_key_id_key,
            "secretAccessKeyKey": settings.s3_secret_access_key_key,
        }
        if settings.s3_secret_name
        else None
    )
    endpoint = s3.get("endpoint") or settings.s3_endpoint
    region = s3.get("region") or settings.s3_region

    env: list[dict[str, Any]] = []
    if secret:
        def ref(var: str, key: str, optional: bool = False) -> dict[str, Any]:
            sk = {"name": secret["name"], "key": key}
            if optional:
                sk["optional"] = True
            return {"name": var, "valueFrom": {"secretKeyRef": sk}}

        env.append(ref("AWS_ACCESS_KEY_ID", secret.get("accessKeyIdKey") or "AWS_ACCESS_KEY_ID"))
        env.append(ref("AWS_SECRET_ACCESS_KEY", secret.get("secretAccessKeyKey") or "AWS_SECRET_ACCESS_KEY"))
        if secret.get("sessionTokenKey"):
            env.append(ref("AWS_SESSION_TOKEN", secret["sessionTokenKey"], optional=True))
    if endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": endpoint})
    if region:
        env.append({"name": "AWS_REGION", "value": region})
        env.append({"name": "AWS_DEFAULT_REGION", "value": region})
    env += [
        {"name": "HOME", "value": "/tmp"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    env += [dict(e) for e in env_extra]
    if gpu_count == 0:
        env.append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})

    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    cpu = res.get("cpu", settings.cpu)
    memory = res.get("memory", settings.memory)
    if cpu is not None:
        requests["cpu"] = str(cpu)
    if memory is not None:
        requests["memory"] = limits["memory"] = str(memory)
    if gpu_count > 0:
        limits[gpu_name] = str(gpu_count)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits

    tmp_volume: dict[str, Any] = {"name": "tmp", "emptyDir": {}}
    if settings.tmp_size_limit:
        tmp_volume["emptyDir"]["sizeLimit"] = settings.tmp_size_limit
    container = {
        "name": component,
        "image": spec.get("image") or settings.merger_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["mergepipe"],
        # `mergepipe execute` computes on --device (default cpu): use the GPU the pod gets
        "args": list(args) + (["--device", "cuda"] if gpu_count > 0 else []),
        "env": env,
        "resources": resources,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [tmp_volume],
    }
    if settings.job_service_account:
        pod_spec["serviceAccountName"] = settings.job_service_account
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in settings.tolerations]
    job_meta: dict[str, Any] = {
        "name": name,
        "labels": dict(labels),
        "annotations": dict(annotations),
        "ownerReferences": [dict(owner) if owner is not None else owner_reference(mm)],
    }
    if namespace:
        job_meta["namespace"] = namespace
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": job_meta,
        "spec": {
            "backoffLimit": settings.backoff_limit,
            "activeDeadlineSeconds": settings.active_deadline_seconds,
            "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
            "podFailurePolicy": {
                # evictions/preemptions of a (GPU) pod do not count towards backoffLimit
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
            },
            "template": {
                "metadata": {"labels": dict(labels), "annotations": dict(annotations)},
                "spec": pod_spec,
            },
        },
    }


@dataclass(frozen=True)
class JobOutcome:
    state: Literal["Running", "Succeeded", "Failed"]
    reason: str
    message: str


def job_outcome(job: Mapping[str, Any] | None, what: str = "merge Job") -> JobOutcome:
    """Summarize a Job's status (messages name it ``what``). Only the terminal ``Complete``/``Failed``
    conditions end it (in Kubernetes >= 1.31 ``SuccessCriteriaMet``/``FailureTarget`` come first,
    while pods still stop)."""
    if not job:
        return JobOutcome("Failed", "JobMissing", f"the {what} no longer exists")
    st = job.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("status") != "True":
            continue
        if c.get("type") == "Complete":
            return JobOutcome("Succeeded", "Complete", c.get("message") or f"the {what} completed")
        if c.get("type") == "Failed":
            why = c.get("reason") or "Failed"
            return JobOutcome("Failed", why, c.get("message") or f"the {what} failed ({why})")
    active, failed = int(st.get("active") or 0), int(st.get("failed") or 0)
    msg = f"{what} running ({active} active pod(s)"
    msg += f", {failed} failed attempt(s))" if failed else ")"
    return JobOutcome("Running", Reason.JOB_RUNNING, msg)


