"""The operator's Prometheus metrics (no-ops when prometheus-client is not installed)."""

from __future__ import annotations

from typing import Any

try:
    import prometheus_client as _prom

    ADMISSIONS = _prom.Counter("mergepipe_admissions_total", "Quota admissions of merges", ["result"])
    JOBS_CREATED = _prom.Counter("mergepipe_jobs_created_total", "Merge Jobs created")
    ANALYZE_JOBS_CREATED = _prom.Counter("mergepipe_analyze_jobs_created_total", "Analyze Jobs created")
    VERIFICATIONS = _prom.Counter("mergepipe_snapshot_verifications_total", "Snapshot verifications", ["reason"])
    COMMITTED = _prom.Counter(
        "mergepipe_merges_committed_total", "Merges committed and verified (MergedSnapshot created)"
    )
    REALIZED_BYTES = _prom.Counter(
        "mergepipe_realized_bytes_total", "Bytes moved by committed merges, per role, from their manifests", ["role"]
    )
    MERGE_SECONDS = _prom.Histogram(
        "mergepipe_merge_duration_seconds",
        "Wall time of committed merges (manifest)",
        buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200),
    )
    QUOTA_USED = _prom.Gauge(
        "mergepipe_quota_used", "MergeQuota use in its current window (status.used)", ["namespace", "quota", "resource"]
    )
    QUOTA_HARD = _prom.Gauge(
        "mergepipe_quota_hard",
        "MergeQuota limits (status.hard; unset limits have no sample)",
        ["namespace", "quota", "resource"],
    )
except ImportError:  # pragma: no cover - metrics are optional

    class _Noop:
        def labels(self, *a: Any, **k: Any) -> _Noop:
            return self

        def inc(self, *a: Any) -> None:
            pass

        def observe(self, *a: Any) -> None:
            pass

        def set(self, *a: Any) -> None:
            pass

        def remove(self, *a: Any) -> None:
            pass

    ADMISSIONS = JOBS_CREATED = ANALYZE_JOBS_CREATED = VERIFICATIONS = _Noop()  # type: ignore[assignment]
    COMMITTED = REALIZED_BYTES = MERGE_SECONDS = QUOTA_USED = QUOTA_HARD = _Noop()  # type: ignore[assignment]
