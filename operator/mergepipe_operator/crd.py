"""The operator's custom resources, one table for ``crdgen``: four kinds in
``mergepipe.io/v1alpha1``, each defined as pydantic models by the package that reconciles it:

- ``ModelMerge`` (``mm``): :mod:`mergepipe_operator.modelmerge.model`;
- ``MergedSnapshot`` (``msnap``): :mod:`mergepipe_operator.snapshot.model`;
- ``MergeQuota`` (``mq``): :mod:`mergepipe_operator.quota.model`;
- ``MergeSearch`` (``msearch``): :mod:`mergepipe_operator.search.model`.

``crdgen`` turns the table into the CRD YAML (``crds/*.yaml``, copied into the Helm chart). Field
names are the Kubernetes (camelCase) names; Python attribute names are snake_case. Only the
composition root (``crdgen``, tests) imports this module; the resources import their own models."""

from __future__ import annotations

from typing import Any

from .k8s.model import API_VERSION, GROUP, VERSION
from .modelmerge.model import METHODS, ModelMergeSpec, ModelMergeStatus
from .quota.model import MergeQuotaSpec, MergeQuotaStatus
from .search.model import SEARCH_STRATEGIES, MergeSearchSpec, MergeSearchStatus
from .snapshot.model import MergedSnapshotSpec, MergedSnapshotStatus

__all__ = ["API_VERSION", "GROUP", "METHODS", "PLURALS", "RESOURCES", "SEARCH_STRATEGIES", "VERSION"]

# --- resource table ----------------------------------------------------------------------------

READY_STATUS = '.status.conditions[?(@.type=="Ready")].status'
READY_REASON = '.status.conditions[?(@.type=="Ready")].reason'

#: Everything crdgen needs per kind.
RESOURCES: dict[str, dict[str, Any]] = {
    "ModelMerge": {
        "plural": "modelmerges",
        "singular": "modelmerge",
        "short_names": ["mm"],
        "spec": ModelMergeSpec,
        "status": ModelMergeStatus,
        "description": "A budget-aware merge of expert checkpoints into a base model.",
        "columns": [
            {"name": "Ready", "type": "string", "jsonPath": READY_STATUS},
            {"name": "Reason", "type": "string", "jsonPath": READY_REASON},
            {"name": "Method", "type": "string", "jsonPath": ".spec.method"},
            {"name": "Experts", "type": "integer", "jsonPath": ".status.expertCount"},
            {"name": "Budget", "type": "string", "jsonPath": ".status.budget"},
            {"name": "ExpertRead", "type": "string", "jsonPath": ".status.expertRead"},
            {"name": "Parts", "type": "string", "jsonPath": ".status.parts.progress"},
            {"name": "Retained", "type": "number", "jsonPath": ".status.plan.retainedEnergy", "priority": 1},
            {"name": "Plan", "type": "string", "jsonPath": ".status.plan.digest", "priority": 1},
            {"name": "Snapshot", "type": "string", "jsonPath": ".status.snapshot", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
    "MergedSnapshot": {
        "plural": "mergedsnapshots",
        "singular": "mergedsnapshot",
        "short_names": ["msnap"],
        "spec": MergedSnapshotSpec,
        "status": MergedSnapshotStatus,
        "description": "A committed merged checkpoint, verified against its manifest.",
        "columns": [
            {"name": "Ready", "type": "string", "jsonPath": READY_STATUS},
            {"name": "Reason", "type": "string", "jsonPath": READY_REASON},
            {"name": "Source", "type": "string", "jsonPath": ".spec.source.name"},
            {"name": "Size", "type": "string", "jsonPath": ".status.totalSize"},
            {"name": "ExpertRead", "type": "string", "jsonPath": ".status.expertRead"},
            {"name": "URI", "type": "string", "jsonPath": ".spec.uri", "priority": 1},
            {"name": "StorageURI", "type": "string", "jsonPath": ".status.storageUri", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
    "MergeQuota": {
        "plural": "mergequotas",
        "singular": "mergequota",
        "short_names": ["mq"],
        "spec": MergeQuotaSpec,
        "status": MergeQuotaStatus,
        "description": "Limits on expert-read bytes and merges of a namespace per time window.",
        "columns": [
            {"name": "Enforcement", "type": "string", "jsonPath": ".spec.enforcement"},
            {"name": "Window", "type": "string", "jsonPath": ".spec.window"},
            {"name": "ExpertReadUsed", "type": "integer", "jsonPath": ".status.used.expertReadBytes"},
            {"name": "ExpertReadHard", "type": "string", "jsonPath": ".spec.hard.expertReadBytes"},
            {"name": "MergesUsed", "type": "integer", "jsonPath": ".status.used.merges"},
            {"name": "MergesHard", "type": "integer", "jsonPath": ".spec.hard.merges"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
}

RESOURCES["MergeSearch"] = {
    "plural": "mergesearches",
    "singular": "mergesearch",
    "short_names": ["msearch"],
    "spec": MergeSearchSpec,
    "status": MergeSearchStatus,
    "description": "A layer-wise multi-objective search over merge parameters (a Pareto set of merged snapshots).",
    "columns": [
        {"name": "Ready", "type": "string", "jsonPath": READY_STATUS},
        {"name": "Reason", "type": "string", "jsonPath": READY_REASON},
        {"name": "Strategy", "type": "string", "jsonPath": ".spec.strategy"},
        {"name": "Evaluated", "type": "integer", "jsonPath": ".status.evaluations"},
        {"name": "Pareto", "type": "integer", "jsonPath": ".status.paretoSize"},
        {"name": "Hypervolume", "type": "number", "jsonPath": ".status.hypervolume"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
}

PLURALS = {kind: r["plural"] for kind, r in RESOURCES.items()}
