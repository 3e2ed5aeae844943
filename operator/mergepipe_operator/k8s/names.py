"""Names, labels and annotations of the objects the operator creates (one naming rule shared with
the search driver: :mod:`mergepipe_kube.names`)."""

from __future__ import annotations

import re

from mergepipe_kube.names import dns_label, label_value

from .model import GROUP

__all__ = ["dns_label", "label_value"]

#: A sha256 digest as 64 lowercase hex characters (plan digests, manifest hashes, analysis ids).
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")

MANAGER = "mergepipe-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MERGE = f"{GROUP}/model-merge"
LABEL_PLAN = f"{GROUP}/plan-digest"
ANN_PLAN_DIGEST = f"{GROUP}/plan-digest"
ANN_PLAN_URI = f"{GROUP}/plan-uri"
ANN_MERGE = f"{GROUP}/model-merge"
ANN_GENERATION = f"{GROUP}/generation"
#: N of a partitioned merge Job (an Indexed Job of N pods; absent: one pod)
ANN_PARTS = f"{GROUP}/parts"
FINALIZER = f"{GROUP}/finalizer"
