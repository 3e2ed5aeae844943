"""MergedSnapshot verification: read the committed manifest, HEAD every output it lists, and set
Ready (Verified, or the reason it cannot be trusted)."""

from __future__ import annotations

import json
from typing import Any

from ..k8s.conditions import Reason, get_condition, set_condition
from ..metrics import VERIFICATIONS
from ..objectstore import join, manifest_uri
from ..quantities import human_bytes, rfc3339
from ..reconcile import Reconciler, RetryWithStatus
from .decisions import manifest_facts, output_path, snapshot_ready, storage_uri


class SnapshotVerifier(Reconciler):
    """Verification of MergedSnapshots (also used by the merge reconciler for a finished Job)."""

    def output_sizes(self, prefix: str | None, raw: bytes | None) -> dict[str, int | None] | None:
        """HEAD every output listed in the manifest: ``{path relative to prefix: size or None}``."""
        if raw is None or prefix is None or self.store is None:
            return None
        try:
            facts = manifest_facts(json.loads(raw))
        except ValueError:
            return None
        paths = [output_path(facts, name) for name in facts.outputs]
        return {p: self.store.head_size(join(prefix, p)) for p in paths}

    def verify_snapshot(self, body: dict[str, Any]) -> dict[str, Any] | None:
        spec, status = body.get("spec") or {}, body.get("status") or {}
        gen = body["metadata"].get("generation")
        ready = get_condition(status.get("conditions"), "Ready")
        if ready and ready.get("status") == "True" and status.get("observedGeneration") == gen:
            return None
        now = self.clock()
        raw = self.store.get(manifest_uri(spec["uri"])) if self.store else None
        ok, reason, message = snapshot_ready(
            raw, spec.get("planDigest"), spec.get("manifestHash"), object_sizes=self.output_sizes(spec["uri"], raw)
        )
        VERIFICATIONS.labels(reason).inc()
        out: dict[str, Any] = {"observedGeneration": gen}
        if ok:
            assert raw is not None  # snapshot_ready found the manifest
            facts = manifest_facts(json.loads(raw))
            out.update(
                verifiedTime=rfc3339(now),
                planDigest=facts.plan_digest,
                sizes={"totalBytes": facts.total_bytes, "files": len(facts.outputs)},
                totalSize=human_bytes(facts.total_bytes),
                estimated=facts.estimated,
                realized=facts.realized,
                expertRead=human_bytes(facts.realized.get("expertReadBytes")),
                storageUri=storage_uri(spec["uri"], facts),
            )
        out["conditions"] = set_condition(status.get("conditions"), "Ready", ok, reason, message, gen, now)
        if reason == Reason.MANIFEST_MISSING:
            raise RetryWithStatus(message, 60, out)
        return out
