"""Kubernetes worker backend of ``mergepipe search`` (the driver of a MergeSearch resource).

Each candidate's merge is a child ``ModelMerge`` in the search's namespace, so quota admission and
charging, planning, the merge Job (with its GPU) and the verified ``MergedSnapshot`` all come
from the operator's ModelMerge path:

* name ``<search>-c<NNNN>`` (:func:`candidate_name`, the operator computes the same name to link
  the Pareto set's MergedSnapshots), ownerReference to the MergeSearch (deleted with it; its
  MergedSnapshots are never owned, so they stay), labels naming the search and the candidate;
* spec: the search's base, experts, method and budget, the candidate's ``--param`` strings as
  ModelMerge parameters (a varied parameter is a ``[{filter, value}]`` list per layer block),
  output ``<output prefix>/c<NNNN>/``, and the search's ``resources``/``image``/``s3`` (``template``);
* :meth:`KubernetesMerger.merge` creates it (409: it exists, e.g. a resumed driver) and polls it
  until ``Ready=True`` (reason ``Committed``: returns the MergedSnapshot's URI and manifest hash)
  or a terminal ``Ready=False`` (``InvalidSpec``, ``JobFailed``: the candidate fails, the search
  goes on). ``QuotaExceeded`` is waited out (the operator retries admission).

The API client is injected (``kubernetes.client.CustomObjectsApi`` in a pod; a fake in tests).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mergepipe.pipeline import parse_params
from mergepipe.search.runner import CandidateMerger, Merged, SearchConfig

GROUP = "mergepipe.io"
VERSION = "v1alpha1"
LABEL_SEARCH = f"{GROUP}/merge-search"
LABEL_CANDIDATE = f"{GROUP}/search-candidate"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
#: Ready=False reasons of a ModelMerge that no waiting ends (a spec change would).
FAILED_REASONS = frozenset({"InvalidSpec", "JobFailed"})

_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def kube_api() -> Any:
    """A ``CustomObjectsApi`` with the pod's ServiceAccount (in-cluster), else the local kubeconfig.

    Raises:
        mergepipe.errors.InputError: the kubernetes client is not installed.
    """
    try:
        from kubernetes import client, config
    except ImportError:
        from mergepipe.errors import InputError

        raise InputError("--worker-backend kubernetes needs the kubernetes client: pip install 'mergepipe[kube]'.") from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()


class CandidateFailed(RuntimeError):
    """The candidate's ModelMerge ended without a snapshot (its Ready reason and message)."""


def _sanitize(name: str) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", name.lower())
    s = re.sub(r"-{2,}", "-", s).strip("-")
    return s or "merge"


def candidate_name(search: str, candidate: int, limit: int = 63) -> str:
    """``<search>-c<NNNN>`` as a DNS-1123 label (<= 63 chars): a search name that had to be
    changed or shortened is tagged with 8 hex of its SHA-256 (the operator's ``dns_label`` rule,
    so both sides name a candidate alike).

    Raises:
        ValueError: ``candidate`` < 0.
    """
    if candidate < 0:
        raise ValueError(f"candidate must be >= 0, got {candidate}")
    suffix = f"c{candidate:04d}"
    room = limit - len(suffix) - 1
    base = _sanitize(search)
    if base != search or len(base) > room:
        tag = hashlib.sha256(search.encode()).hexdigest()[:8]
        head = base[: room - 9].rstrip("-")
        base = f"{head}-{tag}" if head else tag
    name = f"{base}-{suffix}"
    assert len(name) <= limit and _DNS_LABEL_RE.match(name), name
    return name


def _label_value(value: str) -> str:
    if len(value) <= 63 and re.match(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$", value):
        return value
    return candidate_name(value, 0)[:-6] + "-" + hashlib.sha256(value.encode()).hexdigest()[:6]


def _typed(value: str) -> Any:
    """A ``--param`` value as the ModelMerge's typed value (JSON: number, boolean, list)."""
    try:
        return json.loads(value)
    except ValueError:
        return value


class KubernetesMerger(CandidateMerger):
    """Merges each candidate as a child ModelMerge (see the module docstring).

    Args:
        api: a ``kubernetes.client.CustomObjectsApi`` (or a fake with the same two methods:
            ``create_namespaced_custom_object`` and ``get_namespaced_custom_object``).
        namespace, search_name, search_uid: the MergeSearch (owner of the candidates).
        output_prefix: ``s3://bucket/prefix`` under which candidate N commits to ``c<NNNN>/``.
        template: ModelMerge spec fields every candidate gets (``resources``, ``image``, ``s3``).
        poll_seconds: seconds between reads of a candidate's ModelMerge.
        timeout_seconds: seconds a candidate may take before it is recorded failed (None: no limit).
        sleep, clock: injected for tests.
    """

    def __init__(self, api: Any, namespace: str, search_name: str, search_uid: str, output_prefix: str, *,
                 template: dict | None = None, poll_seconds: float = 10.0, timeout_seconds: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        if not output_prefix.startswith("s3://"):
            raise ValueError(f"output prefix {output_prefix!r}: candidates commit to object storage (s3://...)")
        self.api, self.namespace, self.search_name, self.search_uid = api, namespace, search_name, search_uid
        self.output_prefix = output_prefix.rstrip("/")
        self.template = dict(template or {})
        self.poll_seconds, self.timeout_seconds = poll_seconds, timeout_seconds
        self.sleep, self.clock = sleep, clock

    def candidate_body(self, cfg: SearchConfig, cand: dict) -> dict:
        """The child ModelMerge of candidate ``cand`` (pure).

        Raises:
            mergepipe.errors.InputError: a ``--param`` string names no expert of the search.
        """
        names = [n for n, _ in cfg.experts]
        glob, per = parse_params(cand["params"], names)
        name = candidate_name(self.search_name, int(cand["id"]))
        spec: dict[str, Any] = {
            "base": {"uri": cfg.base.rstrip("/") + "/"},
            "experts": [{"name": n, "uri": u.rstrip("/") + "/", **({"parameters": {k: _typed(v) for k, v in p.items()}}
                                                                    if p else {})}
                        for (n, u), p in zip(cfg.experts, per)],
            "method": cfg.method,
            "output": {"uri": f"{self.output_prefix}/c{int(cand['id']):04d}/"},
            "seed": int(cfg.seed),
        }
        if glob:
            spec["parameters"] = {k: _typed(v) for k, v in glob.items()}
        if cfg.budget is not None:
            spec["budget"] = cfg.budget
        spec.update({k: v for k, v in self.template.items() if k in ("resources", "image", "s3")})
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelMerge",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {LABEL_SEARCH: _label_value(self.search_name), LABEL_CANDIDATE: str(int(cand["id"])),
                           LABEL_MANAGED_BY: "mergepipe-search"},
                "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "MergeSearch",
                                     "name": self.search_name, "uid": self.search_uid, "controller": True,
                                     "blockOwnerDeletion": True}],
            },
            "spec": spec,
        }

    def _get(self, plural: str, name: str) -> dict:
        return self.api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name)

    def merge(self, cfg: SearchConfig, cand: dict, out: Path, lineage: dict, catalog) -> Merged:
        """Create the candidate's ModelMerge (if absent) and wait for its snapshot.

        Raises:
            CandidateFailed: its Ready condition says InvalidSpec or JobFailed, or the timeout passed.
            kubernetes.client.ApiException: the API refused the create (other than 409) or a read.
        """
        body = self.candidate_body(cfg, cand)
        name = body["metadata"]["name"]
        try:
            self.api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, "modelmerges", body)
        except Exception as e:  # noqa: BLE001 - ApiException without importing kubernetes here
            if getattr(e, "status", None) != 409:
                raise
        t0 = self.clock()
        while True:
            mm = self._get("modelmerges", name)
            st = mm.get("status") or {}
            ready = next((c for c in st.get("conditions") or [] if c.get("type") == "Ready"), None)
            current = st.get("observedGeneration") == mm["metadata"].get("generation")
            if ready and current and ready.get("status") == "True" and st.get("snapshot"):
                snap = self._get("mergedsnapshots", st["snapshot"])
                realized = (st.get("realized") or {}).get("expertReadBytes")
                return Merged(snap["spec"]["uri"], snap["spec"]["manifestHash"],
                              int(realized) if realized is not None else None)
            if ready and current and ready.get("status") == "False" and ready.get("reason") in FAILED_REASONS:
                raise CandidateFailed(f"ModelMerge {name}: {ready['reason']}: {ready.get('message', '')}")
            if self.timeout_seconds is not None and self.clock() - t0 > self.timeout_seconds:
                why = f"{ready.get('reason')}: {ready.get('message', '')}" if ready else "not reconciled"
                raise CandidateFailed(f"ModelMerge {name}: no snapshot after {self.timeout_seconds:g} s ({why})")
            self.sleep(self.poll_seconds)
