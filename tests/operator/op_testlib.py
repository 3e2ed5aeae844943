"""Shared helpers of the operator tests (no cluster: fakes of the API and of object storage).

Imported as ``op_testlib`` (a unique name: this folder has no __init__.py on purpose, since a
package named ``operator`` would shadow the stdlib; conftest.py puts this folder on sys.path).
"""

from __future__ import annotations

import copy
import itertools
import sys
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "operator") not in sys.path:  # this checkout first, installed or not
    sys.path.insert(0, str(ROOT / "operator"))

from mergepipe_operator.crd import RESOURCES  # noqa: E402
from mergepipe_operator.k8s.api import Conflict  # noqa: E402
from mergepipe_operator.settings import Settings  # noqa: E402

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=timezone.utc)
DIGEST = "ab" * 32
K8S_VERSIONS = ("1.30", "1.37")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def crd_doc(kind: str) -> dict[str, Any]:
    (doc,) = load_docs(ROOT / "crds" / f"{RESOURCES[kind]['plural']}.yaml")
    return doc


def crd_schema(kind: str) -> dict[str, Any]:
    return crd_doc(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _strict(node: Any) -> Any:
    """Emulate the API server's strict field validation: objects with ``properties`` and no
    ``additionalProperties``/preserve-unknown-fields are closed (unknown fields would be pruned,
    and `kubectl apply` warns/fails on them)."""
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def cr_errors(obj: dict[str, Any]) -> list[str]:
    """Schema errors of a custom resource against its CRD (OpenAPI v3.0 ~ JSON Schema draft 4:
    boolean exclusiveMinimum). CEL rules (x-kubernetes-validations) are not evaluated here."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is needed to validate custom resources")
    schema = _strict(crd_schema(obj["kind"]))
    schema["properties"]["metadata"] = {"type": "object"}
    v = jsonschema.Draft4Validator(schema)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(obj))


def k8s_validate(obj: dict[str, Any], versions: tuple[str, ...] = K8S_VERSIONS) -> None:
    """`kubernetes-validate --strict` as a library call, for built-in kinds."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for v in versions:
        try:
            kv.validate(obj, v, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(
                f"{obj['kind']}/{obj['metadata'].get('name')} invalid for Kubernetes {v}: {path}: {e.message}"
            ) from None


class FakeKube:
    """In-memory stand-in for :class:`mergepipe_operator.k8s.api.Kube` with resourceVersion
    conflicts, uid/generation, equality label selectors, and a hook before status writes."""

    def __init__(self) -> None:
        self.objects: dict[tuple, dict[str, Any]] = {}
        self.lock = threading.RLock()
        self.rv = itertools.count(1)
        self.before_replace = None  # callable(obj) run before a replace_status is applied
        self.writes: list[tuple[str, str, str]] = []

    def _k(self, res, ns, name):
        return (res[2], ns, name)

    def put(self, res, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as the API server would after a create."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self.rv))
        with self.lock:
            self.objects[self._k(res, meta.get("namespace"), meta["name"])] = obj
        return copy.deepcopy(obj)

    def get(self, res, ns, name):
        with self.lock:
            o = self.objects.get(self._k(res, ns, name))
            return copy.deepcopy(o) if o is not None else None

    def list(self, res, ns, label_selector=None):
        want = dict(s.split("=", 1) for s in label_selector.split(",")) if label_selector else {}
        with self.lock:
            out = [
                copy.deepcopy(o)
                for (r, n, _), o in self.objects.items()
                if r == res[2]
                and n == ns
                and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in want.items())
            ]
        return sorted(out, key=lambda o: o["metadata"]["name"])

    def create(self, res, ns, body):
        with self.lock:
            if self._k(res, ns, body["metadata"]["name"]) in self.objects:
                raise Conflict("already exists")
            body = copy.deepcopy(body)
            body["metadata"]["namespace"] = ns
            body.pop("status", None)  # status is ignored on create
            self.writes.append(("create", res[2], body["metadata"]["name"]))
            return self.put(res, body)

    def delete(self, res, ns, name):
        with self.lock:
            self.writes.append(("delete", res[2], name))
            return self.objects.pop(self._k(res, ns, name), None) is not None

    def patch_status(self, res, ns, name, status):
        with self.lock:
            o = self.objects[self._k(res, ns, name)]
            st = o.setdefault("status", {})
            for k, v in status.items():  # JSON merge patch at the first level is enough here
                if v is None:
                    st.pop(k, None)
                else:
                    st[k] = copy.deepcopy(v)
            o["metadata"]["resourceVersion"] = str(next(self.rv))
            self.writes.append(("patch_status", res[2], name))

    def replace_status(self, res, obj, status):
        hook, self.before_replace = self.before_replace, None
        if hook is not None:
            hook(obj)
        with self.lock:
            meta = obj["metadata"]
            cur = self.objects.get(self._k(res, meta["namespace"], meta["name"]))
            if cur is None or cur["metadata"]["resourceVersion"] != meta["resourceVersion"]:
                raise Conflict("the object has been modified")
            cur["status"] = copy.deepcopy(status)
            cur["metadata"]["resourceVersion"] = str(next(self.rv))
            self.writes.append(("replace_status", res[2], meta["name"]))
            return copy.deepcopy(cur)

    # cluster-scoped objects (Kueue's ClusterQueues and AdmissionChecks) live under namespace None
    def get_cluster(self, res, name):
        return self.get(res, None, name)

    def list_cluster(self, res):
        with self.lock:
            out = [copy.deepcopy(o) for (r, n, _), o in self.objects.items() if r == res[2] and n is None]
        return sorted(out, key=lambda o: o["metadata"]["name"])

    def replace_cluster_status(self, res, obj, status):
        return self.replace_status(res, dict(obj, metadata=dict(obj["metadata"], namespace=None)), status)


class FakeStore:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def get(self, uri: str) -> bytes | None:
        return self.objects.get(uri)

    def head_size(self, uri: str) -> int | None:
        o = self.objects.get(uri)
        return None if o is None else len(o)

    def put(self, uri: str, data: bytes, content_type: str = "application/json") -> None:
        self.objects[uri] = bytes(data)


def make_merge(name: str = "mm1", namespace: str = "ns1", **spec_overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "base": {"uri": "s3://models/base/"},
        "experts": [
            {"name": "code", "uri": "s3://models/code/", "weight": 0.5, "parameters": {"density": 0.5}},
            {"name": "math", "uri": "s3://models/math/", "weight": 0.5},
        ],
        "method": "ties",
        "parameters": {"normalize": True},
        "budget": "10Gi",
        "output": {"uri": "s3://snapshots/mm1/"},
    }
    spec.update(spec_overrides)
    for k in [k for k, v in spec.items() if v is None]:
        del spec[k]
    return {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "ModelMerge",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": "0f0e0d0c-0000-4000-8000-000000000001",
            "generation": 1,
        },
        "spec": spec,
    }


def make_quota(
    name: str = "q",
    namespace: str = "ns1",
    *,
    bytes_: Any = "100Gi",
    merges: int | None = None,
    window: str | None = "24h",
    enforcement: str = "Reject",
    status: dict | None = None,
) -> dict[str, Any]:
    hard: dict[str, Any] = {}
    if bytes_ is not None:
        hard["expertReadBytes"] = bytes_
    if merges is not None:
        hard["merges"] = merges
    spec: dict[str, Any] = {"hard": hard, "enforcement": enforcement}
    if window:
        spec["window"] = window
    q = {
        "apiVersion": "mergepipe.io/v1alpha1",
        "kind": "MergeQuota",
        "metadata": {"name": name, "namespace": namespace, "generation": 1},
        "spec": spec,
    }
    if status is not None:
        q["status"] = status
    return q


def make_settings() -> Settings:
    return Settings(
        merger_image="ghcr.io/mergepipe/merger:test",
        s3_endpoint="http://seaweedfs:8333",
        s3_region="us-east-1",
        s3_secret_name="mergepipe-s3",
        catalog_uri="s3://mergepipe/catalog/",
        plan_prefix="s3://mergepipe/plans/",
    )


# --- object storage (SeaweedFS) ------------------------------------------------------------------


@dataclass
class S3Models:
    bucket: str
    base: str
    experts: list[str]
    catalog: str
    client: Any = None


def upload_dir(client: Any, bucket: str, folder: Path, prefix: str) -> str:
    """Upload a checkpoint folder; returns its ``s3://`` URI (no trailing slash)."""
    for f in sorted(Path(folder).iterdir()):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.name}")
    return f"s3://{bucket}/{prefix}"


def core_storage(seaweed: Any) -> Any:
    """The core's storage on SeaweedFS with explicit credentials (no environment needed)."""
    from mergepipe.storage.base import IOCounters
    from mergepipe.storage.routing import open_storage

    return open_storage(None, IOCounters(), client=seaweed.client())


def analyze_into(seaweed: Any, catalog_uri: str, base: str, experts: list[str]) -> None:
    """Record the experts' statistics in an object catalog, in-process (what the analyze Job does)."""
    from mergepipe.catalog.objectstore import ObjectCatalog
    from mergepipe.pipeline import register_and_analyze

    st = core_storage(seaweed)
    register_and_analyze(ObjectCatalog(st, catalog_uri), st, base, experts)
