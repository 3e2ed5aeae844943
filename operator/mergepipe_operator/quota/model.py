"""The MergeQuota resource's models (``mq``): a ResourceQuota-like limit on expert-read bytes
and merges per time window, enforced by ``Clamp`` (lower a merge's budget to what is left) or
``Reject``; its status is the reservation ledger."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from ..k8s.model import ByteQuantity, Duration, K8sModel, NonNegInt, ObservedStatus, Timestamp


class QuotaHard(K8sModel):
    """Hard limits per window; an unset limit is unlimited."""

    expert_read_bytes: ByteQuantity | None = Field(
        default=None, description="Expert bytes all merges of the namespace may read per window."
    )
    merges: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(
        default=None, description="Merges that may be admitted per window."
    )


class MergeQuotaSpec(K8sModel):
    """Limits on the merges of this namespace."""

    hard: QuotaHard
    window: Duration | None = Field(
        default=None,
        description="Rolling window, e.g. 24h, 7d, 1h30m; charges older than this stop counting. Unset: charges never expire.",
    )
    enforcement: Literal["Clamp", "Reject"] = Field(
        default="Reject",
        description="Clamp lowers a merge's budget to what is left; Reject refuses a merge that does not fit.",
    )


class QuotaAmounts(K8sModel):
    """Amounts in bytes and merges."""

    expert_read_bytes: NonNegInt | None = None
    merges: NonNegInt | None = None


class LedgerEntry(K8sModel):
    """One merge's charge against the quota: Reserved at admission, Charged from the realized bytes in
    its manifest (or the reservation, if the Job failed)."""

    key: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    merge: Annotated[str, StringConstraints(max_length=253)]
    bytes: NonNegInt
    state: Literal["Reserved", "Charged"]
    time: Timestamp


class QuotaCarry(K8sModel):
    """Charges folded out of the ledger to keep it small; they count until expires (forever when unset)."""

    expert_read_bytes: NonNegInt | None = None
    merges: NonNegInt | None = None
    expires: Timestamp | None = None


class MergeQuotaStatus(ObservedStatus):
    """Observed state of a MergeQuota: limits as bytes, usage in the current window, the ledger."""

    hard: QuotaAmounts | None = None
    used: QuotaAmounts | None = None
    ledger: list[LedgerEntry] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["key"], "maxItems": 512},
    )
    carry: QuotaCarry | None = None
