"""Conditions per the Kubernetes API conventions (``status.conditions[]`` as a map keyed by
``type``), the reasons of the summary ``Ready`` condition, and the Events for their transitions.

- :func:`set_condition`, :func:`get_condition`, :func:`condition_current`;
- :func:`transition_events`: the Kubernetes Events a status change posts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ..quantities import rfc3339
from .model import CONDITION_REASON_PATTERN

#: A problem with an object's spec: (field path such as ``spec.experts[0].uri``, message).
Issue = tuple[str, str]


class Reason:
    """Reasons of the summary ``Ready`` condition."""

    # ModelMerge
    PLANNING = "Planning"
    ANALYZING = "Analyzing"
    QUOTA_EXCEEDED = "QuotaExceeded"
    JOB_RUNNING = "JobRunning"
    #: the Job exists but Kueue holds it suspended until it admits it (ModelMerge, MergeSearch)
    QUEUED = "Queued"
    JOB_FAILED = "JobFailed"
    INVALID_SPEC = "InvalidSpec"
    COMMITTED = "Committed"
    # MergedSnapshot
    VERIFIED = "Verified"
    VERIFYING = "Verifying"
    MANIFEST_MISSING = "ManifestMissing"
    MANIFEST_INVALID = "ManifestInvalid"
    MANIFEST_HASH_MISMATCH = "ManifestHashMismatch"
    PLAN_DIGEST_MISMATCH = "PlanDigestMismatch"
    OUTPUT_MISMATCH = "OutputMismatch"
    BUDGET_EXCEEDED = "BudgetExceeded"
    # MergeQuota admission
    ADMITTED = "Admitted"
    CLAMPED = "Clamped"
    ALREADY_ADMITTED = "AlreadyAdmitted"
    # MergeSearch (search.decisions.SearchReason; Completed is Ready=True)
    SEARCH_FAILED = "Failed"


_REASON_RE = re.compile(CONDITION_REASON_PATTERN)


def get_condition(conditions: Iterable[Mapping[str, Any]] | None, type: str) -> dict[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == type:
            return dict(c)
    return None


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    type: str,
    status: str | bool,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime,
) -> list[dict[str, Any]]:
    """A new condition list with condition ``type`` set (the input is not modified).

    Per the API conventions ``lastTransitionTime`` changes only when ``status`` flips; reason,
    message and observedGeneration are updated in place. Other conditions are kept in order; a
    new type is appended.
    """
    if isinstance(status, bool):
        status = "True" if status else "False"
    if status not in ("True", "False", "Unknown"):
        raise ValueError(f"condition status must be True, False or Unknown, got {status!r}")
    if not _REASON_RE.match(reason or ""):
        raise ValueError(f"condition reason must be CamelCase ([A-Za-z][A-Za-z0-9_,:]*), got {reason!r}")
    new: dict[str, Any] = {
        "type": type,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": rfc3339(now),
    }
    if generation is not None:
        new["observedGeneration"] = int(generation)
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions or []:
        c = dict(c)
        if c.get("type") == type:
            found = True
            if c.get("status") == status and c.get("lastTransitionTime"):
                new["lastTransitionTime"] = c["lastTransitionTime"]
            c = new
        out.append(c)
    if not found:
        out.append(new)
    return out


#: Reasons whose transition is posted as a Warning Event (the rest are Normal).
WARNING_REASONS = frozenset({Reason.INVALID_SPEC, Reason.JOB_FAILED, Reason.QUOTA_EXCEEDED}) | frozenset(
    {
        Reason.MANIFEST_INVALID,
        Reason.MANIFEST_HASH_MISMATCH,
        Reason.PLAN_DIGEST_MISMATCH,
        Reason.OUTPUT_MISMATCH,
        Reason.BUDGET_EXCEEDED,
        Reason.SEARCH_FAILED,
    }
)


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the object: ``type`` Normal or Warning, a CamelCase
    ``reason`` (the condition's), and the condition's ``message``."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def transition_events(
    old: Iterable[Mapping[str, Any]] | None, new: Iterable[Mapping[str, Any]] | None
) -> list[EventSpec]:
    """The Events for the condition changes from ``old`` to ``new`` (two condition lists).

    A condition *transitions* when it is new or its ``status``, ``reason`` or
    ``observedGeneration`` changed (a message-only update, such as a running Job's pod count, is
    not an Event; a new generation reaching the same reason is). One Event per distinct reason,
    other conditions first and the summary ``Ready`` last (``QuotaAdmitted=False`` and
    ``Ready=False`` both saying ``QuotaExceeded`` give one Event, with Ready's message). Warning
    for ``status=False`` with a reason in :data:`WARNING_REASONS`, else Normal.
    """

    def key(c: Mapping[str, Any]) -> tuple[Any, Any, Any]:
        return c.get("status"), c.get("reason"), c.get("observedGeneration")

    before = {c.get("type"): c for c in old or []}
    changed = [c for c in new or [] if c.get("type") not in before or key(before[c.get("type")]) != key(c)]
    changed.sort(key=lambda c: c.get("type") == "Ready")
    by_reason: dict[str, EventSpec] = {}
    for c in changed:
        reason = str(c.get("reason") or "")
        warn = c.get("status") == "False" and reason in WARNING_REASONS
        by_reason.pop(reason, None)  # Ready (last) wins, and goes last
        by_reason[reason] = EventSpec("Warning" if warn else "Normal", reason, str(c.get("message") or "")[:1024])
    return list(by_reason.values())


def condition_current(cond: Mapping[str, Any] | None, generation: int | None) -> bool:
    """True when ``cond`` exists and was computed for ``generation``."""
    if not cond:
        return False
    og = cond.get("observedGeneration")
    return generation is None or og is None or og >= generation
