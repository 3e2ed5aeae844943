"""Kubernetes worker backend of ``mergepipe search`` (the driver of a MergeSearch resource).

Each candidate's merge is a child ``ModelMerge`` in the search's namespace, so quota admission and
charging, planning, the merge Job (with its GPU) and the verified ``MergedSnapshot`` all come
from the operator's ModelMerge path:

* name ``<search>-c<NNNN>`` (:func:`candidate_name`, the operator computes the same name to link
  the Pareto set's MergedSnapshots), ownerReference to the MergeSearch (deleted with it; its
  MergedSnapshots are never owned, so they stay), labels naming the search and the candidate;
* spec: the search's base, experts, method, budget, seed and planning options (``sketch``,
  ``blockValue``, ``calibration.uri``), the candidate's settings as ModelMerge
  parameters (a varied parameter is a ``[{filter, value}]`` list per layer block),
  output ``<output prefix>/c<NNNN>/``, and the search's ``resources``/``image``/``s3`` (``template``);
* :meth:`KubernetesMerger.merge` creates it (409: it exists, e.g. a resumed driver) and polls it
  until ``Ready=True`` (reason ``Committed``: returns the MergedSnapshot's URI and manifest hash)
  or a terminal ``Ready=False`` (``InvalidSpec``, ``JobFailed``: the candidate fails, the search
  goes on). ``QuotaExceeded`` is waited out (the operator retries admission).

Each evaluation is a Job too (:class:`KubernetesJobEvaluator`): ``<search>-e<NNNN>`` from the
operator's template (image, GPUs, Secret-only credentials, no ServiceAccount token) running
``mergepipe search-eval`` on the snapshot URI; its metrics come back through object storage.

The API clients are injected (``kubernetes.client`` APIs in a pod; fakes in tests).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mergepipe.errors import InputError
from mergepipe.search.evaluators import EvaluationFailed, Evaluator
from mergepipe.search.runner import CandidateMerger, Merged, SearchConfig

from .names import dns_label, label_value

GROUP = "mergepipe.io"
VERSION = "v1alpha1"
LABEL_SEARCH = f"{GROUP}/merge-search"
LABEL_CANDIDATE = f"{GROUP}/search-candidate"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
#: Ready=False reasons of a ModelMerge that no waiting ends (a spec change would).
FAILED_REASONS = frozenset({"InvalidSpec", "JobFailed"})


#: Headers of a create: kubernetes-client 37 sends the JSON body of a create (or replace) without
#: a Content-Type, which an API server refuses (415 Unsupported Media Type); kmock did not mind.
JSON_BODY = {"Content-Type": "application/json"}


def kube_api() -> Any:
    """A ``CustomObjectsApi`` with the pod's ServiceAccount (in-cluster), else the local kubeconfig.

    Raises:
        mergepipe.errors.InputError: the kubernetes client is not installed.
    """
    try:
        from kubernetes import client, config
    except ImportError:
        raise InputError(
            "--worker-backend kubernetes needs the kubernetes client: pip install 'mergepipe[kube]'."
        ) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()


def kube_batch_api() -> Any:
    """A ``BatchV1Api`` (call after :func:`kube_api`, which loads the configuration)."""
    from kubernetes import client

    return client.BatchV1Api()


class CandidateFailed(RuntimeError):
    """The candidate's ModelMerge ended without a snapshot (its Ready reason and message)."""


def candidate_name(search: str, candidate: int, limit: int = 63, kind: str = "c") -> str:
    """``<search>-c<NNNN>`` (the candidate's ModelMerge; ``kind="e"``: ``<search>-e<NNNN>``, its
    evaluation Job) as a DNS-1123 label (<= 63 chars): a search name that had to be changed or
    shortened is tagged with 8 hex of its SHA-256 (the operator's ``dns_label`` rule, so both
    sides name a candidate alike).

    Raises:
        ValueError: ``candidate`` < 0.
    """
    if candidate < 0:
        raise ValueError(f"candidate must be >= 0, got {candidate}")
    return dns_label(search, f"{kind}{candidate:04d}", limit)


class KubernetesMerger(CandidateMerger):
    """Merges each candidate as a child ModelMerge (see the module docstring).

    Args:
        api: a ``kubernetes.client.CustomObjectsApi`` (or a fake with the same two methods:
            ``create_namespaced_custom_object`` and ``get_namespaced_custom_object``).
        namespace, search_name, search_uid: the MergeSearch (owner of the candidates).
        output_prefix: ``s3://bucket/prefix`` under which candidate N commits to ``c<NNNN>/``.
        template: ModelMerge spec fields every candidate gets (``resources``, ``image``, ``s3``,
            ``queueName``).
        poll_seconds: seconds between reads of a candidate's ModelMerge.
        timeout_seconds: seconds a candidate may take before it is recorded failed (None: no limit).
        sleep, clock: injected for tests.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        search_name: str,
        search_uid: str,
        output_prefix: str,
        *,
        template: dict | None = None,
        poll_seconds: float = 10.0,
        timeout_seconds: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not output_prefix.startswith("s3://"):
            raise ValueError(f"output prefix {output_prefix!r}: candidates commit to object storage (s3://...)")
        self.api, self.namespace, self.search_name, self.search_uid = api, namespace, search_name, search_uid
        self.output_prefix = output_prefix.rstrip("/")
        self.template = dict(template or {})
        self.poll_seconds, self.timeout_seconds = poll_seconds, timeout_seconds
        self.sleep, self.clock = sleep, clock

    def candidate_body(self, cfg: SearchConfig, cand: dict) -> dict:
        """The child ModelMerge of candidate ``cand`` (pure): ``cand["params"]`` (merge-wide and
        per-expert settings, :data:`mergepipe.search.space.Params`) become ``spec.parameters`` and
        ``spec.experts[i].parameters``."""
        params = cand["params"]
        glob, own = dict(params.get("parameters") or {}), params.get("experts") or {}
        per = [dict(own.get(n) or {}) for n, _ in cfg.experts]
        name = candidate_name(self.search_name, int(cand["id"]))
        spec: dict[str, Any] = {
            "base": {"uri": cfg.base.rstrip("/") + "/"},
            "experts": [
                {"name": n, "uri": u.rstrip("/") + "/", **({"parameters": p} if p else {})}
                for (n, u), p in zip(cfg.experts, per)
            ],
            "method": cfg.method,
            "output": {"uri": f"{self.output_prefix}/c{int(cand['id']):04d}/"},
            "seed": int(cfg.seed),
        }
        if glob:
            spec["parameters"] = dict(glob)
        if cfg.budget is not None:
            spec["budget"] = cfg.budget
        if cfg.planning.sketch is not None:
            spec["sketch"] = cfg.planning.sketch
        if cfg.planning.value is not None:
            spec["blockValue"] = cfg.planning.value
        if cfg.planning.calibration is not None:
            spec["calibration"] = {"uri": cfg.planning.calibration}
        spec.update({k: v for k, v in self.template.items() if k in ("resources", "image", "s3", "queueName")})
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelMerge",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {
                    LABEL_SEARCH: label_value(self.search_name),
                    LABEL_CANDIDATE: str(int(cand["id"])),
                    LABEL_MANAGED_BY: "mergepipe-search",
                },
                "ownerReferences": [
                    {
                        "apiVersion": f"{GROUP}/{VERSION}",
                        "kind": "MergeSearch",
                        "name": self.search_name,
                        "uid": self.search_uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }

    def validation_request(self, cfg: SearchConfig, params: dict):
        """The centre point's request with the ``energy`` block value and no calibration set:
        the candidates' ModelMerges plan with ``spec.blockValue``/``spec.calibration`` in the
        operator, whose analyze Job records the base's Fisher sensitivity (with the search's
        GPU); the driver pod (CPU, the driver's memory) only checks the rest and records the
        experts' statistics. ``SearchConfig.check`` has already refused ``fisher`` without a
        calibration set."""
        return cfg.request(params).with_planning(value="energy", calibration=None)

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
            self.api.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "modelmerges", body, _headers=JSON_BODY
            )
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
                return Merged(
                    snap["spec"]["uri"], snap["spec"]["manifestHash"], int(realized) if realized is not None else None
                )
            if ready and current and ready.get("status") == "False" and ready.get("reason") in FAILED_REASONS:
                raise CandidateFailed(f"ModelMerge {name}: {ready['reason']}: {ready.get('message', '')}")
            if self.timeout_seconds is not None and self.clock() - t0 > self.timeout_seconds:
                why = f"{ready.get('reason')}: {ready.get('message', '')}" if ready else "not reconciled"
                raise CandidateFailed(f"ModelMerge {name}: no snapshot after {self.timeout_seconds:g} s ({why})")
            self.sleep(self.poll_seconds)


class KubernetesJobEvaluator(Evaluator):
    """Evaluates each candidate in its own Job (the search's GPU and image, never the driver's
    pod, so the user's command never runs next to the driver's API token).

    The Job is ``template`` (a batch/v1 Job the operator built with the merge Jobs' security
    settings, credentials and the search's ``spec.resources``) named ``<search>-e<NNNN>``, owned by
    the MergeSearch, running ``mergepipe search-eval --command CMD --checkpoint <snapshot URI>
    --metrics-out <prefix>/evals/c<NNNN>.json``; the driver waits for it and reads that object:
    ``{"metrics": {...}}`` or ``{"error": ...}`` (the candidate fails). A Job that fails or
    exceeds ``timeout`` (seconds) fails the candidate too. 409 on create: a resumed driver finds
    the Job of an earlier attempt and waits for it.

    Args:
        batch: a ``kubernetes.client.BatchV1Api`` (or a fake with ``create_namespaced_job`` and
            ``read_namespaced_job``, returning dicts or client objects).
        storage: a :class:`mergepipe.storage.base.Storage` that reads the metrics object.
    """

    in_process = False

    def __init__(
        self,
        batch: Any,
        namespace: str,
        search_name: str,
        search_uid: str,
        template: dict,
        command: str,
        metrics_prefix: str,
        storage: Any,
        *,
        timeout: float | None = None,
        poll_seconds: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.batch, self.namespace, self.search_name, self.search_uid = batch, namespace, search_name, search_uid
        self.template, self.command, self.storage = template, command, storage
        self.metrics_prefix = metrics_prefix.rstrip("/")
        self.timeout, self.poll_seconds, self.sleep, self.clock = timeout, poll_seconds, sleep, clock

    @staticmethod
    def candidate_of(checkpoint: str) -> int:
        """The candidate number of a snapshot URI ``…/c<NNNN>/``.

        Raises:
            ValueError: the URI does not end with a candidate folder.
        """
        m = re.search(r"/c([0-9]{4,})/?$", str(checkpoint))
        if not m:
            raise ValueError(f"{checkpoint}: not a search candidate's snapshot (…/c<NNNN>/)")
        return int(m.group(1))

    def job_body(self, checkpoint: str) -> tuple[dict, str]:
        """The evaluation Job of ``checkpoint`` and the URI of its metrics object (pure)."""
        cid = self.candidate_of(checkpoint)
        metrics_uri = f"{self.metrics_prefix}/evals/c{cid:04d}.json"
        job = copy.deepcopy(self.template)
        meta = job.setdefault("metadata", {})
        meta["name"] = candidate_name(self.search_name, cid, kind="e")
        meta["namespace"] = self.namespace
        labels = {**(meta.get("labels") or {}), LABEL_SEARCH: label_value(self.search_name), LABEL_CANDIDATE: str(cid)}
        meta["labels"] = labels
        meta["ownerReferences"] = [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "MergeSearch",
                "name": self.search_name,
                "uid": self.search_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        tmpl = job.setdefault("spec", {}).setdefault("template", {})
        tmpl.setdefault("metadata", {})["labels"] = {**(tmpl.get("metadata", {}).get("labels") or {}), **labels}
        (c,) = tmpl["spec"]["containers"]
        args = ["search-eval", "--command", self.command, "--checkpoint", str(checkpoint), "--metrics-out", metrics_uri]
        if self.timeout is not None:
            args += ["--timeout", f"{self.timeout:g}"]
        c["args"] = args
        return job, metrics_uri

    def _outcome(self, name: str) -> tuple[str, str]:
        job = self.batch.read_namespaced_job(name, self.namespace)
        if not isinstance(job, dict):
            job = self.batch.api_client.sanitize_for_serialization(job)
        for c in (job.get("status") or {}).get("conditions") or []:
            if c.get("status") == "True" and c.get("type") in ("Complete", "Failed"):
                return c["type"], f"{c.get('reason') or c['type']}: {c.get('message') or ''}".strip()
        return "Running", ""

    def metrics(self, checkpoint) -> dict[str, float]:
        """Run (or find) the candidate's evaluation Job and return its metrics.

        Raises:
            EvaluationFailed: the command failed (its message), the Job failed, or the timeout passed.
        """
        job, metrics_uri = self.job_body(str(checkpoint))
        name = job["metadata"]["name"]
        try:
            self.batch.create_namespaced_job(self.namespace, job, _headers=JSON_BODY)
        except Exception as e:  # noqa: BLE001 - ApiException without importing kubernetes here
            if getattr(e, "status", None) != 409:
                raise
        t0 = self.clock()
        while True:
            state, why = self._outcome(name)
            if state == "Complete":
                try:
                    doc = json.loads(self.storage.read_object(metrics_uri, role="other"))
                except Exception as e:  # noqa: BLE001 - missing or unreadable object
                    raise EvaluationFailed(
                        f"evaluation Job {name} completed without metrics at {metrics_uri} ({e})"
                    ) from None
                if "error" in doc:
                    raise EvaluationFailed(str(doc["error"]))
                return doc["metrics"]
            if state == "Failed":
                raise EvaluationFailed(f"evaluation Job {name} failed ({why})")
            if self.timeout is not None and self.clock() - t0 > 2 * self.timeout + 600:
                raise EvaluationFailed(f"evaluation Job {name} did not finish in {2 * self.timeout + 600:g} s")
            self.sleep(self.poll_seconds)

    def spec(self) -> dict:
        return {"kind": "command", "command": self.command, "timeout": self.timeout}
