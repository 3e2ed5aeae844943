"""Job templates shared by every worker Job (merge, analyze, search driver, evaluation): the
merger image's ``mergepipe`` CLI with the operator's security settings, its ownerReference, and
the outcome of a Job read from its status (:func:`job_outcome`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..settings import Settings
from .conditions import Reason
from .model import API_VERSION
from .queueing import job_suspended, queue_labels, queue_name, queued_message

#: Where the worker container writes its one-line error (the Kubernetes default path; the kubelet
#: makes it the container's termination message).
TERMINATION_LOG = "/dev/termination-log"


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
    image: str | None = None,
) -> dict[str, Any]:
    """A Job running the merger image's ``mergepipe`` CLI with the operator's security settings
    (shared by the merge and the analyze Job). The container runs ``image`` when given (a tenant's
    image the caller checked against ``settings.allowed_images``, :func:`~.images.image_issue`),
    else the operator's ``settings.merger_image``; ``mm.spec.image`` is never read here. With a Kueue LocalQueue (``spec.queueName`` of
    ``mm``, else ``settings.queue_name``) the Job carries Kueue's queue label: Kueue then holds it
    suspended until it admits it (the operator never unsuspends a Job)."""
    meta = mm.get("metadata") or {}
    spec = mm.get("spec") or {}
    namespace = meta.get("namespace")
    res = spec.get("resources") or {}
    gpu_spec = res.get("gpu") or {}
    gpu_count = (settings.gpu_count if gpu_spec.get("count") is None else int(gpu_spec["count"])) if gpu else 0
    gpu_name = gpu_spec.get("resourceName") or settings.gpu_resource_name
    env = _s3_env(spec.get("s3") or {}, settings)
    env += [
        {"name": "HOME", "value": "/tmp"},
        {"name": "TMPDIR", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    env += [dict(e) for e in env_extra]
    if gpu_count == 0:
        env.append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})
    resources = _resources(res, settings, gpu_count, gpu_name)

    tmp_volume: dict[str, Any] = {"name": "tmp", "emptyDir": {}}
    if settings.tmp_size_limit:
        tmp_volume["emptyDir"]["sizeLimit"] = settings.tmp_size_limit
    env = env + [{"name": "MERGEPIPE_TERMINATION_LOG", "value": TERMINATION_LOG}]
    container = _container(component, image or settings.merger_image, args, env, resources, gpu_count, settings)
    job_meta: dict[str, Any] = {
        "name": name,
        "labels": {**dict(labels), **queue_labels(queue_name(spec, settings.queue_name))},
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
                "spec": _pod_spec(container, tmp_volume, settings),
            },
        },
    }


def _container(
    component: str,
    image: str,
    args: list[str],
    env: list[dict[str, Any]],
    resources: dict[str, Any],
    gpu_count: int,
    settings: Settings,
) -> dict[str, Any]:
    """The worker container: ``mergepipe <args>`` (``--device cuda`` added when it gets GPUs) in
    ``image``, non-root, read-only root filesystem (an emptyDir at /tmp), all capabilities
    dropped, its one-line error in the termination log."""
    container = {
        "name": component,
        "image": image,
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
        # the worker writes its one-line error there (MERGEPIPE_TERMINATION_LOG); a pod that died
        # without writing it (OOM, a crash) gets the tail of its log instead
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return container


def _s3_env(s3: Mapping[str, Any], settings: Settings) -> list[dict[str, Any]]:
    """The worker's S3 environment: credentials only as ``secretKeyRef`` (``s3.credentialsSecretRef``
    of the spec, else the operator's secret; the session token optional), then the endpoint and
    region (the spec's, else the operator's)."""
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
    return env


def _resources(res: Mapping[str, Any], settings: Settings, gpu_count: int, gpu_name: str) -> dict[str, Any]:
    """The container's requests/limits: CPU and memory from ``res`` (``spec.resources``) else
    ``settings`` (memory limit = request; CPU limited only with ``settings.limit_cpu``), and
    ``gpu_count`` of ``gpu_name`` as a limit. Empty sections are left out."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    cpu = res.get("cpu", settings.cpu)
    memory = res.get("memory", settings.memory)
    if cpu is not None:
        requests["cpu"] = str(cpu)
        if settings.limit_cpu:  # chart merger.resources.limitCPU: no bursting beyond the request
            limits["cpu"] = str(cpu)
    if memory is not None:
        requests["memory"] = limits["memory"] = str(memory)
    if gpu_count > 0:
        limits[gpu_name] = str(gpu_count)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return resources


def _pod_spec(container: dict[str, Any], tmp_volume: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The worker pod's spec: never restarted in place, no service-account token or service
    links, non-root with seccomp RuntimeDefault, and the operator's service account, node
    selector and tolerations when set."""
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
    return pod_spec


@dataclass(frozen=True)
class JobOutcome:
    """A Job's state as the operator sees it: ``Running`` (not finished), ``Succeeded`` or
    ``Failed``; ``reason`` and ``message`` from its terminal condition (or a summary)."""

    state: Literal["Running", "Succeeded", "Failed"]
    reason: str
    message: str


def job_outcome(job: Mapping[str, Any] | None, what: str = "merge Job") -> JobOutcome:
    """Summarize a Job's status (messages name it ``what``). Only the terminal ``Complete``/``Failed``
    conditions end it (in Kubernetes >= 1.31 ``SuccessCriteriaMet``/``FailureTarget`` come first,
    while pods still stop). A suspended Job (Kueue holds it until admitted) is in progress with
    reason ``Queued``."""
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
    if job_suspended(job):  # held by Kueue (or anyone) until unsuspended: still in progress
        return JobOutcome("Running", Reason.QUEUED, queued_message(what, job))
    active, failed = int(st.get("active") or 0), int(st.get("failed") or 0)
    msg = f"{what} running ({active} active pod(s)"
    msg += f", {failed} failed attempt(s))" if failed else ")"
    return JobOutcome("Running", Reason.JOB_RUNNING, msg)


#: Longest pod failure message put into a condition (the kubelet keeps at most 4096 bytes).
MAX_CAUSE_CHARS = 1024


def pod_failure_message(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """Why a Job's pod failed, from the pods' container statuses (the kubelet's record of each
    container's termination; pods are the Job's, e.g. listed by label ``job-name=<job>``).

    Takes the most recently finished container termination with a non-zero exit code (from
    ``state`` or ``lastState``). Its ``message`` is the worker's one-line error (written to
    :data:`TERMINATION_LOG`) or, with ``FallbackToLogsOnError``, the tail of its log, of which the
    last non-empty line is kept (a traceback's exception line). Without a message: the
    termination reason and exit code (e.g. ``OOMKilled (exit code 137)``). At most
    :data:`MAX_CAUSE_CHARS` characters.

    Returns:
        the cause, or ``None`` when no container of these pods failed (or there are no pods).
    """
    best: tuple[str, str] | None = None
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                term = state.get("terminated") or {}
                if not term or int(term.get("exitCode") or 0) == 0:
                    continue
                lines = [ln.strip() for ln in str(term.get("message") or "").splitlines() if ln.strip()]
                if lines:
                    text = lines[-1]
                else:
                    text = f"{term.get('reason') or 'Error'} (exit code {term.get('exitCode')})"
                finished = str(term.get("finishedAt") or "")
                if best is None or finished >= best[0]:
                    best = (finished, text)
    if best is None:
        return None
    text = best[1]
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 1] + "…"


def with_cause(outcome: JobOutcome, cause: str | None) -> JobOutcome:
    """``outcome`` with the pod's failure cause (:func:`pod_failure_message`) in front of its
    message: ``"<cause> (<Job condition message>)"``; unchanged without a cause or unless Failed."""
    if outcome.state != "Failed" or not cause:
        return outcome
    return JobOutcome(outcome.state, outcome.reason, f"{cause} ({outcome.message})")


def job_ever_started(job: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> bool:
    """Did a container of this Job ever run (so it may have read its inputs)?

    True when the Job counts a finished or ready pod (``status.succeeded``, ``failed``, ``ready``)
    or any of ``pods`` (the Job's) is or was running: phase Running/Succeeded/Failed, or a
    container status that is running or terminated now or before a restart. A Job whose pods are
    all still pending (unschedulable, pulling its image, ContainerCreating), or that has no pods
    (suspended, e.g. by Kueue) never started. ``status.active`` and ``startTime`` count pending
    pods too, so they decide nothing.
    """
    st = job.get("status") or {}
    if any(int(st.get(k) or 0) > 0 for k in ("succeeded", "failed", "ready")):
        return True
    for pod in pods:
        ps = pod.get("status") or {}
        if ps.get("phase") in ("Running", "Succeeded", "Failed"):
            return True
        for cs in ps.get("containerStatuses") or []:
            state, last = cs.get("state") or {}, cs.get("lastState") or {}
            if state.get("running") or state.get("terminated") or last.get("terminated"):
                return True
    return False
