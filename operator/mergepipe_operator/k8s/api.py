"""The few Kubernetes API calls the operator makes, behind one small adapter.

Everything goes through the generic ``CustomObjectsApi`` with plain dicts (it serves any API
group, so batch/v1 Jobs too), which keeps the handlers testable with an in-memory fake of this
class. The RBAC in ``helm/mergepipe/templates/rbac.yaml`` grants exactly these verbs.
"""

from __future__ import annotations

import builtins
import json
from typing import Any

from .model import GROUP, VERSION


class NotFound(Exception):
    pass


class Conflict(Exception):
    """A write lost a race (HTTP 409: stale resourceVersion, or the object already exists)."""


MERGES = (GROUP, VERSION, "modelmerges")
SNAPSHOTS = (GROUP, VERSION, "mergedsnapshots")
QUOTAS = (GROUP, VERSION, "mergequotas")
SEARCHES = (GROUP, VERSION, "mergesearches")
JOBS = ("batch", "v1", "jobs")
PODS = ("", "v1", "pods")

_MERGE_PATCH = "application/merge-patch+json"
_JSON = "application/json"


class Kube:
    """Calls (resource, verb) the operator uses:

    - modelmerges: get; modelmerges/status: patch
    - mergedsnapshots: create; mergedsnapshots/status: patch
    - mergequotas: list, get; mergequotas/status: update (PUT with resourceVersion)
    - jobs (batch): create, get, list, delete
    - pods: list (the failed pod's termination message, for JobFailed)
    - Kueue (with an io-budget AdmissionCheck): localqueues get; clusterqueues, admissionchecks
      get/list; admissionchecks/status update; workloads get/list; workloads/status update
    (kopf itself also lists/watches/patches the watched kinds and creates events.)
    """

    def __init__(self, api: Any = None):
        if api is None:
            from kubernetes import client

            api = client.CustomObjectsApi()
        self.api = api

    @staticmethod
    def load_config() -> None:
        from kubernetes import config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()

    def _call(self, fn, *args, **kw):
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kw)
        except ApiException as e:
            if e.status == 404:
                raise NotFound(str(e.reason)) from None
            if e.status == 409:
                raise Conflict(str(e.reason)) from None
            raise

    # generic ---------------------------------------------------------------------------------

    def get(self, res: tuple[str, str, str], namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(self.api.get_namespaced_custom_object, *res[:2], namespace, res[2], name)
        except NotFound:
            return None

    def list(
        self, res: tuple[str, str, str], namespace: str, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        kw = {"label_selector": label_selector} if label_selector else {}
        if res == PODS:  # the core group: not served by CustomObjectsApi
            from kubernetes import client

            resp = self._call(
                client.CoreV1Api(self.api.api_client).list_namespaced_pod, namespace, _preload_content=False, **kw
            )
            out = json.loads(resp.data)
        else:
            out = self._call(self.api.list_namespaced_custom_object, *res[:2], namespace, res[2], **kw)
        return sorted(out.get("items") or [], key=lambda o: o["metadata"]["name"])

    def create(self, res: tuple[str, str, str], namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create; raises :class:`Conflict` when it already exists."""
        return self._call(
            self.api.create_namespaced_custom_object,
            *res[:2],
            namespace,
            res[2],
            body,
            _headers={"Content-Type": _JSON},
        )  # the client sets none: an API server answers 415

    def delete(self, res: tuple[str, str, str], namespace: str, name: str) -> bool:
        try:
            self._call(
                self.api.delete_namespaced_custom_object,
                *res[:2],
                namespace,
                res[2],
                name,
                propagation_policy="Background",
            )
            return True
        except NotFound:
            return False

    def get_cluster(self, res: tuple[str, str, str], name: str) -> dict[str, Any] | None:
        """A cluster-scoped object (Kueue's ClusterQueues and AdmissionChecks), or ``None``."""
        try:
            return self._call(self.api.get_cluster_custom_object, *res[:2], res[2], name)
        except NotFound:
            return None

    def list_cluster(self, res: tuple[str, str, str]) -> builtins.list[dict[str, Any]]:  # list: the method
        out = self._call(self.api.list_cluster_custom_object, *res[:2], res[2])
        return sorted(out.get("items") or [], key=lambda o: o["metadata"]["name"])

    def replace_cluster_status(
        self, res: tuple[str, str, str], obj: dict[str, Any], status: dict[str, Any]
    ) -> dict[str, Any]:
        """PUT a cluster-scoped object's ``status`` conditioned on its resourceVersion."""
        meta = obj["metadata"]
        body = {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "metadata": {"name": meta["name"], "resourceVersion": meta["resourceVersion"]},
            "spec": obj.get("spec"),
            "status": status,
        }
        return self._call(
            self.api.replace_cluster_custom_object_status,
            *res[:2],
            res[2],
            meta["name"],
            body,
            _headers={"Content-Type": _JSON},
        )

    def patch_status(self, res: tuple[str, str, str], namespace: str, name: str, status: dict[str, Any]) -> None:
        """JSON merge patch of ``status`` (lists are replaced whole)."""
        self._call(
            self.api.patch_namespaced_custom_object_status,
            *res[:2],
            namespace,
            res[2],
            name,
            {"status": status},
            _content_type=_MERGE_PATCH,
        )

    def replace_status(self, res: tuple[str, str, str], obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """PUT ``status`` conditioned on ``obj``'s resourceVersion; :class:`Conflict` when stale."""
        meta = obj["metadata"]
        if not meta.get("resourceVersion"):
            raise ValueError("replace_status needs metadata.resourceVersion")
        body = {
            "apiVersion": obj.get("apiVersion"),
            "kind": obj.get("kind"),
            "metadata": {
                "name": meta["name"],
                "namespace": meta["namespace"],
                "resourceVersion": meta["resourceVersion"],
            },
            "spec": obj.get("spec"),
            "status": status,
        }
        return self._call(
            self.api.replace_namespaced_custom_object_status,
            *res[:2],
            meta["namespace"],
            res[2],
            meta["name"],
            body,
            _headers={"Content-Type": _JSON},  # the client sets none for a replace: an API server answers 415
        )
