"""Harness of the API-level operator tests: a fake API server (kmock + RealisticEmulator) in a
background thread, the real operator under ``kopf.testing.KopfRunner``, and a player that runs a
Job's container command locally the way the pod would.

Everything here is synchronous from the test's point of view: the API server has its own event
loop thread and kopf runs in KopfRunner's thread, so tests may block (``time.sleep`` polling,
the sync kubernetes client, subprocesses) without stalling either.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from kmock._internal import apps
from kmock._internal.references import ResourceInfo
from kmock_realistic import RealisticEmulator
from op_testlib import ROOT

from mergepipe_operator.crd import GROUP, RESOURCES, VERSION

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

#: Kueue's resources (kueue.x-k8s.io/v1beta2): plural -> (kind, namespaced)
KUEUE_RESOURCES = {
    "workloads": ("Workload", True),
    "localqueues": ("LocalQueue", True),
    "clusterqueues": ("ClusterQueue", False),
    "admissionchecks": ("AdmissionCheck", False),
}


class KubeServer:
    """kmock's :class:`RealisticEmulator` on 127.0.0.1 in its own event-loop thread, with the
    bundled built-in resources (namespaces, events, Jobs, Secrets, CRDs, ...) and the mergepipe
    custom resources (namespaced, with a status subresource).

    With ``real`` (a started :class:`realapi.RealCrdServer` with the CRDs installed), the custom
    resources are served by that real API server instead: ``url`` is then a
    :class:`realapi.CompositeProxy` sending ``/apis/mergepipe.io/...`` and
    ``/apis/apiextensions.k8s.io/...`` there and the rest to kmock. The real server's objects are
    removed on entry and exit (it is shared by the session)."""

    def __init__(self, real: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.kmock: RealisticEmulator | None = None
        self.server: apps.Server | None = None
        self.real = real
        self.proxy: Any = None

    def _run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.kmock = RealisticEmulator()
        await self.kmock.__aenter__()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundle with a deprecated importlib call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.kmock.resources.load_bundled()
        for kind, r in RESOURCES.items():
            if self.real is not None:
                break
            self.kmock.resources[f"{GROUP}/{VERSION}/{r['plural']}"] = ResourceInfo(
                kind=kind,
                singular=r["singular"],
                shortnames=set(r["short_names"]),
                namespaced=True,
                subresources={"status"},
                verbs={"list", "watch", "get", "create", "patch", "update", "delete", "deletecollection"},
            )
        # kopf's peering objects (chart replicas > 1): no status subresource, as kopf ships them
        for kind, plural, namespaced in (
            ("ClusterKopfPeering", "clusterkopfpeerings", False),
            ("KopfPeering", "kopfpeerings", True),
        ):
            self.kmock.resources[f"kopf.dev/v1/{plural}"] = ResourceInfo(
                kind=kind,
                singular=plural[:-1],
                namespaced=namespaced,
                verbs={"list", "watch", "get", "create", "patch", "update", "delete"},
            )
        for plural, (kind, namespaced) in KUEUE_RESOURCES.items():  # Kueue's API (its part is played: KueuePlayer)
            self.kmock.resources[f"kueue.x-k8s.io/v1beta2/{plural}"] = ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                subresources={"status"},
                verbs={"list", "watch", "get", "create", "patch", "update", "delete"},
            )
        self.server = apps.Server(self.kmock)
        await self.server.__aenter__()
        if self.real is not None:
            from realapi import CompositeProxy

            self.proxy = CompositeProxy(self.real, str(self.server.url))
            await self.proxy.start()

    async def _stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        if self.server is not None:
            await self.server.__aexit__(None, None, None)
        if self.kmock is not None:
            await self.kmock.__aexit__(None, None, None)

    def _clean_real(self) -> None:
        if self.real is not None:
            self.real.delete_all(GROUP, VERSION, [r["plural"] for r in RESOURCES.values()])

    def __enter__(self) -> KubeServer:
        self._clean_real()
        self.thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._run(self._stop())
            self._clean_real()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    @property
    def url(self) -> str:
        if self.proxy is not None:
            return self.proxy.url
        assert self.server is not None
        return str(self.server.url).rstrip("/")

    def kubeconfig(self, path: Path) -> Path:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
        }
        path.write_text(yaml.safe_dump(cfg))
        return path


class Api:
    """The test's own API client: plain JSON over HTTP to the fake server (like kubectl would),
    independent of the kubernetes client the operator uses."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    @staticmethod
    def _res(kind: str) -> tuple[str, str, str]:
        if kind in RESOURCES:
            return GROUP, VERSION, RESOURCES[kind]["plural"]
        for plural, (k, _) in KUEUE_RESOURCES.items():
            if k == kind:
                return "kueue.x-k8s.io", "v1beta2", plural
        return {
            "Job": ("batch", "v1", "jobs"),
            "Pod": ("", "v1", "pods"),
            "Secret": ("", "v1", "secrets"),
            "ClusterKopfPeering": ("kopf.dev", "v1", "clusterkopfpeerings"),
            "Namespace": ("", "v1", "namespaces"),
            "Event": ("", "v1", "events"),
        }[kind]

    def _path(self, kind: str, ns: str | None, name: str | None = None, sub: str | None = None) -> str:
        g, v, plural = self._res(kind)
        p = f"/api/{v}" if not g else f"/apis/{g}/{v}"
        if ns is not None:
            p += f"/namespaces/{ns}"
        p += f"/{plural}"
        if name:
            p += f"/{name}"
        if sub:
            p += f"/{sub}"
        return p

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code == 404 and method == "GET":
                return None
            raise AssertionError(f"{method} {path}: HTTP {e.code}: {e.read()[:1000]!r}") from None

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", self._path(obj["kind"], obj["metadata"].get("namespace")), obj)

    def get(self, kind: str, ns: str | None, name: str) -> dict[str, Any] | None:
        return self._call("GET", self._path(kind, ns, name))

    def list(self, kind: str, ns: str | None, labels: str | None = None) -> list[dict[str, Any]]:
        import urllib.parse

        q = "?" + urllib.parse.urlencode({"labelSelector": labels}) if labels else ""
        return sorted(self._call("GET", self._path(kind, ns) + q)["items"], key=lambda o: o["metadata"]["name"])

    def patch(self, kind: str, ns: str, name: str, patch: dict[str, Any], sub: str | None = None) -> dict[str, Any]:
        return self._call("PATCH", self._path(kind, ns, name, sub), patch, "application/merge-patch+json")

    def delete(self, kind: str, ns: str, name: str) -> dict[str, Any]:
        return self._call("DELETE", self._path(kind, ns, name), {"propagationPolicy": "Background"})


def ready(obj: dict[str, Any] | None) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c
    return {}


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0, interval: float = 0.1) -> Any:
    """Poll ``fn`` until it returns something truthy; fail with ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}; last: {json.dumps(last, default=str)[:2000]}"
    )


@contextlib.contextmanager
def operator(timeout: float = 30.0) -> Iterator[Any]:
    """The real operator (``kopf run --standalone -A -m mergepipe_operator.main``) in a thread,
    with short watch/batching timeouts; fails the test if it exits with an error."""
    import kopf
    from kopf.testing import KopfRunner

    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 20
    settings.watching.reconnect_backoff = 0.1
    settings.queueing.idle_timeout = 1.0
    settings.queueing.exit_timeout = 1.0
    with KopfRunner(
        ["run", "--standalone", "--all-namespaces", "-m", "mergepipe_operator.main"], settings=settings, timeout=timeout
    ) as runner:
        yield runner
    assert runner.exception is None, runner.output[-5000:]
    assert runner.exit_code == 0, runner.output[-5000:]


@contextlib.contextmanager
def operator_process(name: str, kubeconfig: Path, log: Path, *args: str) -> Iterator[subprocess.Popen]:
    """The real operator as its own OS process (``python -m kopf run ... -m
    mergepipe_operator.main``) with kopf identity ``name`` (``POD_ID``, as the chart sets it) and
    this process's environment; stopped with SIGTERM (kopf's clean shutdown) at the end."""
    env = dict(
        os.environ,
        KUBECONFIG=str(kubeconfig),
        POD_ID=name,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "operator")]),
    )
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with open(log, "wb") as out:
        p = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "--verbose", "-m", "mergepipe_operator.main", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield p
        finally:
            stop_process(p)


def stop_process(p: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# --- Jobs: the test plays the kubelet ---------------------------------------------------------------


def _secret_value(api: Api, ns: str, ref: dict[str, Any]) -> str | None:
    s = api.get("Secret", ns, ref["name"])
    data = (s or {}).get("data") or {}
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise AssertionError(f"Secret {ns}/{ref['name']} has no key {ref['key']!r} (the pod would not start)")
    return base64.b64decode(data[ref["key"]]).decode()


def job_command(
    api: Api, job: dict[str, Any], workdir: Path, index: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """The Job's container command and environment, as its pod would run them: ``mergepipe`` is
    this checkout's CLI, secretKeyRef values come from the Secret in the Job's namespace, and the
    pod's emptyDir /tmp is a fresh folder. ``index``: the pod's completion index in an Indexed
    Job (the Job controller sets ``JOB_COMPLETION_INDEX``; the kubelet expands ``$(VAR)`` in the
    arguments from the container's environment)."""
    ns = job["metadata"]["namespace"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    cmd = list(c["command"]) + list(c.get("args") or [])
    assert cmd[0] == "mergepipe", cmd
    cmd = [sys.executable, "-m", "mergepipe.cli"] + cmd[1:]
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")]),
        # the pod has no AWS config files and no instance metadata
        "AWS_CONFIG_FILE": str(workdir / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(workdir / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            v = _secret_value(api, ns, e["valueFrom"]["secretKeyRef"])
            if v is not None:
                env[e["name"]] = v
    for k in ("HOME", "TMPDIR"):  # /tmp in the pod: the emptyDir
        env[k] = str(tmp)
    env["XDG_CACHE_HOME"] = str(tmp / ".cache")
    if index is not None:
        assert job["spec"].get("completionMode") == "Indexed", "only an Indexed Job's pods have an index"
        env["JOB_COMPLETION_INDEX"] = str(index)
    cmd = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in cmd]
    return cmd, env


def run_job(
    api: Api,
    job: dict[str, Any],
    workdir: Path,
    timeout: float = 300,
    *,
    index: int | None = None,
    prelude: str | None = None,
) -> subprocess.CompletedProcess:
    """Run the Job's command as its container would. The container's ``terminationMessagePath``
    is the local file ``workdir/termination-log`` (the kubelet mounts a file there); environment
    values naming that path point to it. ``index``: an Indexed Job's pod index; ``prelude``:
    Python run in the worker process before the CLI (a test's fault injection)."""
    cmd, env = job_command(api, job, workdir) if index is None else job_command(api, job, workdir, index)
    if prelude is not None:
        assert cmd[1:3] == ["-m", "mergepipe.cli"], cmd
        cmd = [cmd[0], "-c", prelude + "\nfrom mergepipe.cli import main\nmain()\n", *cmd[3:]]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    term = workdir / "termination-log"
    term.unlink(missing_ok=True)
    path = c.get("terminationMessagePath") or "/dev/termination-log"
    for k, v in list(env.items()):
        if v == path:
            env[k] = str(term)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(workdir))


def record_pod(
    api: Api, job: dict[str, Any], r: subprocess.CompletedProcess, workdir: Path, index: int | None = None
) -> dict[str, Any]:
    """Create the Job's pod with the status the kubelet reports after its container exited: the
    container's termination message is the file it wrote at ``terminationMessagePath``, or with
    ``FallbackToLogsOnError`` and a failure, the tail of its log (the last 80 lines, at most 2048
    bytes), as Kubernetes does. A process killed by signal S exits 128 + S. ``index``: an
    Indexed Job's pod index (label ``batch.kubernetes.io/job-completion-index``)."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    term = workdir / "termination-log"
    message = term.read_text()[:4096] if term.exists() else ""
    if not message and r.returncode != 0 and c.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        log = (r.stdout or "") + (r.stderr or "")
        message = "\n".join(log.splitlines()[-80:])[-2048:]
    labels = {
        "job-name": name,
        "batch.kubernetes.io/job-name": name,
        "controller-uid": job["metadata"].get("uid", ""),
        "batch.kubernetes.io/controller-uid": job["metadata"].get("uid", ""),
    }
    if index is not None:
        labels["batch.kubernetes.io/job-completion-index"] = str(index)
    code = r.returncode if r.returncode >= 0 else 128 - r.returncode
    pod_name = f"{name[:57]}-{os.urandom(3).hex()[:5]}"
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ns, "labels": labels},
            "spec": {"restartPolicy": "Never", "containers": [{"name": c["name"], "image": c["image"]}]},
        }
    )
    t = _now()
    terminated = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": t,
        "finishedAt": t,
        "containerID": "containerd://" + os.urandom(8).hex(),
    }
    if message:
        terminated["message"] = message
    return api.patch(
        "Pod",
        ns,
        pod_name,
        {
            "status": {
                "phase": "Succeeded" if code == 0 else "Failed",
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c["image"],
                        "ready": False,
                        "restartCount": 0,
                        "state": {"terminated": terminated},
                    }
                ],
            }
        },
        sub="status",
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def mark_job(api: Api, job: dict[str, Any], state: str, message: str = "") -> None:
    """Write the Job status the Job controller would: Running, Succeeded or Failed."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    t = _now()
    if state == "Running":
        st: dict[str, Any] = {"active": 1, "ready": 1, "startTime": t}
    elif state == "Succeeded":
        st = {
            "active": 0,
            "succeeded": 1,
            "ready": 0,
            "completionTime": t,
            "conditions": [
                {
                    "type": "SuccessCriteriaMet",
                    "status": "True",
                    "reason": "CompletionsReached",
                    "lastTransitionTime": t,
                    "message": "Reached expected number of succeeded pods",
                },
                {
                    "type": "Complete",
                    "status": "True",
                    "reason": "CompletionsReached",
                    "lastTransitionTime": t,
                    "message": "Reached expected number of succeeded pods",
                },
            ],
        }
    else:
        st = {
            "active": 0,
            "failed": 1,
            "ready": 0,
            "conditions": [
                {
                    "type": "FailureTarget",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "lastTransitionTime": t,
                    "message": message or "Job has reached the specified backoff limit",
                },
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "lastTransitionTime": t,
                    "message": message or "Job has reached the specified backoff limit",
                },
            ],
        }
    api.patch("Job", ns, name, {"status": st}, sub="status")


def mark_indexed_job(
    api: Api, job: dict[str, Any], completed: list[int], failed_pods: int = 0, active: int = 0
) -> None:
    """Write the status the Job controller keeps for an Indexed Job: ``completedIndexes`` (ranges,
    e.g. ``0-2,4``), ``succeeded``, ``failed`` pods, ``active`` pods; once every index of
    ``spec.completions`` completed, the ``SuccessCriteriaMet`` and ``Complete`` conditions."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    done = sorted(set(completed))
    ranges: list[str] = []
    for i in done:
        if ranges and int(ranges[-1].split("-")[-1]) == i - 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{i}"
        else:
            ranges.append(str(i))
    t = _now()
    st: dict[str, Any] = {
        "active": active,
        "ready": active,
        "succeeded": len(done),
        "failed": failed_pods,
        "completedIndexes": ",".join(ranges),
        "startTime": t,
    }
    if len(done) == job["spec"]["completions"]:
        st["completionTime"] = t
        st["conditions"] = [
            {"type": c, "status": "True", "reason": "CompletionsReached", "lastTransitionTime": t,
             "message": "Reached expected number of succeeded pods"}
            for c in ("SuccessCriteriaMet", "Complete")
        ]  # fmt: skip
    api.patch("Job", ns, name, {"status": st}, sub="status")


def play_job(api: Api, job: dict[str, Any], workdir: Path) -> subprocess.CompletedProcess:
    """Run the Job's command locally and report its outcome like the kubelet (the pod's status,
    :func:`record_pod`) and the Job controller (the Job's conditions) would."""
    mark_job(api, job, "Running")
    r = run_job(api, job, workdir)
    record_pod(api, job, r, workdir)
    # the Job controller's own words: the cause is only in the pod (as in a cluster)
    mark_job(api, job, "Succeeded" if r.returncode == 0 else "Failed")
    return r


def quota_ledger(api: Api, ns: str, name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(((api.get("MergeQuota", ns, name) or {}).get("status") or {}).get("ledger") or [])


# --- Kueue: the test plays it ------------------------------------------------------------------------


class KueuePlayer:
    """Kueue v0.19's part for Jobs, played against the fake API server (kueue.x-k8s.io/v1beta2):

    - its Job webhook: a Job created with the label ``kueue.x-k8s.io/queue-name`` is stored
      suspended (a kmock admission hook);
    - its job integration: one Workload per such Job, owned by it, in the Job's LocalQueue;
    - its scheduler: a Workload whose LocalQueue leads to a ClusterQueue gets a quota reservation
      (``QuotaReserved=True``, ``status.admission``) while fewer than ``capacity`` Workloads hold
      one, and a ``Pending`` entry per AdmissionCheck the ClusterQueue lists;
    - admission: once every check is ``Ready``, ``Admitted=True`` and the Job is unsuspended (the
      only place a Job is unsuspended); a ``Retry`` evicts the Workload (reservation released) and
      requeues it ``requeueAfterSeconds`` later with its checks ``Pending`` again; ``Rejected``
      deactivates it (``spec.active=false``);
    - a finished Job's Workload releases its reservation (``Finished=True``).

    ``run()`` in a thread steps every 0.1 s until ``stop()``; ``paused`` holds reservations back.
    Writes carry the resourceVersion they were computed from (a 409 is retried next step).
    """

    def __init__(self, api: Api, ks: KubeServer, namespaces: tuple[str, ...], capacity: int = 2) -> None:
        self.api, self.namespaces, self.capacity = api, namespaces, capacity
        self.paused = False
        self.unsuspended: list[str] = []
        self.requeue_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        assert ks.kmock is not None
        ks.kmock.admission_hooks.append(self._webhook)

    @staticmethod
    def _webhook(res: Any, obj: dict[str, Any]) -> None:
        if res.group == "batch" and res.plural == "jobs" and (obj["metadata"].get("labels") or {}).get(QUEUE_LABEL):
            obj.setdefault("spec", {})["suspend"] = True

    def start(self) -> KueuePlayer:
        self._thread = threading.Thread(target=self.run, name="kueue", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except AssertionError as e:
                if "HTTP 409" not in str(e):
                    self.errors.append(str(e))
            self._stop.wait(0.1)

    def _patch_status(self, wl: dict[str, Any], status: dict[str, Any]) -> None:
        self.api.patch(
            "Workload",
            wl["metadata"]["namespace"],
            wl["metadata"]["name"],
            {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]}, "status": status},
            sub="status",
        )

    def step(self) -> None:
        now = time.time()
        for ns in self.namespaces:
            workloads = {
                (w["metadata"].get("ownerReferences") or [{}])[0].get("uid"): w for w in self.api.list("Workload", ns)
            }
            for job in self.api.list("Job", ns):
                queue = (job["metadata"].get("labels") or {}).get(QUEUE_LABEL)
                if not queue:
                    continue
                wl = workloads.get(job["metadata"]["uid"])
                if wl is None:
                    self.api.create(
                        {
                            "apiVersion": "kueue.x-k8s.io/v1beta2",
                            "kind": "Workload",
                            "metadata": {
                                "name": f"job-{job['metadata']['name']}"[:57] + "-" + job["metadata"]["uid"][:5],
                                "namespace": ns,
                                "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]},
                                "ownerReferences": [
                                    {
                                        "apiVersion": "batch/v1",
                                        "kind": "Job",
                                        "name": job["metadata"]["name"],
                                        "uid": job["metadata"]["uid"],
                                        "controller": True,
                                        "blockOwnerDeletion": True,
                                    }
                                ],
                            },
                            "spec": {
                                "queueName": queue,
                                "active": True,
                                "podSets": [{"name": "main", "count": 1, "template": job["spec"]["template"]}],
                            },
                        }
                    )
                    continue
                self._advance(job, wl, now)

    def _reserved(self, ns: str) -> int:
        return sum(
            1
            for w in self.api.list("Workload", ns)
            if _cond(w, "QuotaReserved") == "True" and _cond(w, "Finished") != "True"
        )

    def _advance(self, job: dict[str, Any], wl: dict[str, Any], now: float) -> None:
        ns, name = wl["metadata"]["namespace"], wl["metadata"]["name"]
        st = copy.deepcopy(wl.get("status") or {})
        t = _now()
        finished = any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in (job.get("status") or {}).get("conditions") or []
        )
        if finished:
            if _cond(wl, "Finished") != "True":
                self._patch_status(
                    wl, dict(st, conditions=_set(st, "Finished", "True", "JobFinished", "Job finished", t))
                )
            return
        if not (wl.get("spec") or {}).get("active", True):
            return
        checks = {c["name"]: c for c in st.get("admissionChecks") or []}
        if _cond(wl, "QuotaReserved") != "True":
            if self.paused or now < self.requeue_at.get(name, 0):
                return
            lq = self.api.get("LocalQueue", ns, wl["spec"]["queueName"])
            cq = self.api.get("ClusterQueue", None, lq["spec"]["clusterQueue"]) if lq else None
            if cq is None:
                self._patch_status(
                    wl,
                    dict(
                        st,
                        conditions=_set(
                            st,
                            "QuotaReserved",
                            "False",
                            "Inadmissible",
                            f"LocalQueue {wl['spec']['queueName']} doesn't exist",
                            t,
                        ),
                    ),
                )
                return
            if self._reserved(ns) >= self.capacity:
                msg = "couldn't assign flavors to pod set main: insufficient unused quota for cpu in flavor default"
                if (_cond_msg(wl, "QuotaReserved")) != msg:
                    self._patch_status(wl, dict(st, conditions=_set(st, "QuotaReserved", "False", "Pending", msg, t)))
                return
            names = [r["name"] for r in (cq["spec"].get("admissionChecksStrategy") or {}).get("admissionChecks") or []]
            st["admissionChecks"] = [
                checks[n]
                if n in checks and checks[n].get("state") == "Ready"
                else {"name": n, "state": "Pending", "message": "", "lastTransitionTime": t}
                for n in names
            ]
            st["admission"] = {
                "clusterQueue": cq["metadata"]["name"],
                "podSetAssignments": [{"name": "main", "count": 1, "flavors": {"cpu": "default"}}],
            }
            conds = _set(
                st,
                "QuotaReserved",
                "True",
                "QuotaReserved",
                f"Quota reserved in ClusterQueue {cq['metadata']['name']}",
                t,
            )
            st["conditions"] = _set(
                {"conditions": conds},
                "Admitted",
                "False",
                "UnsatisfiedAdmissionChecks",
                "The workload has not all admission checks",
                t,
            )
            self._patch_status(wl, st)
            return
        states = {c.get("state") for c in checks.values()}
        if "Rejected" in states:
            self.api.patch("Workload", ns, name, {"spec": {"active": False}})
            return
        if "Retry" in states:  # evicted: the reservation goes, requeued after the check's delay
            delay = max([c.get("requeueAfterSeconds") or 0 for c in checks.values() if c.get("state") == "Retry"])
            self.requeue_at[name] = now + delay
            st["admission"] = None
            conds = _set(st, "QuotaReserved", "False", "Pending", "The workload was evicted by an admission check", t)
            conds = _set(
                {"conditions": conds}, "Evicted", "True", "AdmissionCheck", "At least one admission check is false", t
            )
            st["conditions"] = _set(
                {"conditions": conds}, "Admitted", "False", "NoReservation", "The workload has no reservation", t
            )
            st["admissionChecks"] = [
                dict(c, state="Pending") if c.get("state") == "Retry" else c for c in checks.values()
            ]
            # Kueue resets a Retry to Pending when it requeues; the check is decided again then
            self._patch_status(wl, st)
            return
        if states <= {"Ready"} and _cond(wl, "Admitted") != "True":
            st["conditions"] = _set(st, "Admitted", "True", "Admitted", "The workload is admitted", t)
            self._patch_status(wl, st)
            self.api.patch("Job", ns, job["metadata"]["name"], {"spec": {"suspend": False}})
            self.unsuspended.append(job["metadata"]["name"])


def _cond(obj: dict[str, Any], type_: str) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c.get("status")
    return None


def _cond_msg(obj: dict[str, Any], type_: str) -> str | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c.get("message")
    return None


def _set(status: dict[str, Any], type_: str, st: str, reason: str, message: str, t: str) -> list[dict[str, Any]]:
    out = [dict(c) for c in status.get("conditions") or [] if c.get("type") != type_]
    old = next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})
    ltt = old.get("lastTransitionTime") if old.get("status") == st else t
    return out + [{"type": type_, "status": st, "reason": reason, "message": message, "lastTransitionTime": ltt or t}]
