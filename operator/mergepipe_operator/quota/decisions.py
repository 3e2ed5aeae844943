"""MergeQuota accounting as pure functions: :func:`admit`, :func:`settle`, :func:`release`,
:func:`closing`/:func:`close` (how every reservation ends), :func:`quota_status` over the quota
object's JSON and an explicit ``now``.

The ledger's invariant (tests/operator/test_operator_ledger.py checks it over random event
sequences): every entry's bytes are an integer >= 0; ``used`` is the sum of the entries that
count plus the carry; once a merge is deleted none of its entries is Reserved; and each run's
final charge is 0 if it never started, its manifest's spent expert bytes if it committed, else
its reservation (the plan's expert bytes, the most one attempt reads)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, cast

from ..k8s.conditions import Reason
from ..quantities import (
    QuantityError,
    human_bytes,
    parse_duration,
    parse_quantity,
    parse_time,
    rfc3339,
)

#: Ledger entries kept before the oldest charges are folded into ``status.carry``.
MAX_LEDGER = 256


@dataclass(frozen=True)
class QuotaLimits:
    expert_read_bytes: int | None
    merges: int | None
    window: timedelta | None
    enforcement: Literal["Clamp", "Reject"]
    window_text: str | None = None


def quota_limits(quota: Mapping[str, Any]) -> QuotaLimits:
    """Parsed ``spec`` of a MergeQuota (raises QuantityError on a bad spec)."""
    spec = quota.get("spec") or {}
    hard = spec.get("hard") or {}
    name = (quota.get("metadata") or {}).get("name", "?")
    b = hard.get("expertReadBytes")
    m = hard.get("merges")
    enforcement = spec.get("enforcement") or "Reject"
    if enforcement not in ("Clamp", "Reject"):
        raise QuantityError(f"MergeQuota {name}: spec.enforcement must be Clamp or Reject, got {enforcement!r}.")
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
        raise QuantityError(f"MergeQuota {name}: spec.hard.merges must be an integer >= 0, got {m!r}.")
    return QuotaLimits(
        expert_read_bytes=None
        if b is None
        else parse_quantity(b, field=f"MergeQuota {name}: spec.hard.expertReadBytes"),
        merges=m,
        window=None
        if not spec.get("window")
        else parse_duration(spec["window"], field=f"MergeQuota {name}: spec.window"),
        enforcement=cast(Literal["Clamp", "Reject"], enforcement),  # checked above
        window_text=spec.get("window") or None,
    )


def _counts(entry: Mapping[str, Any], limits: QuotaLimits, now: datetime) -> bool:
    if entry.get("state") == "Reserved":
        return True  # in flight: counts until settled or released
    if limits.window is None:
        return True
    t = parse_time(entry.get("time"))
    return t is not None and t > now - limits.window


def _usage(status: Mapping[str, Any], limits: QuotaLimits, now: datetime) -> tuple[int, int]:
    b = m = 0
    for e in status.get("ledger") or []:
        if _counts(e, limits, now):
            b += int(e.get("bytes") or 0)
            m += 1
    carry = status.get("carry") or {}
    exp = parse_time(carry.get("expires"))
    if carry and (exp is None or exp > now):
        b += int(carry.get("expertReadBytes") or 0)
        m += int(carry.get("merges") or 0)
    return b, m


def quota_status(quota: Mapping[str, Any], now: datetime, ledger: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The quota's status recomputed at ``now``: hard (echo, in bytes), used, the ledger without
    charges that left the window, the oldest charges folded into ``carry`` past ``MAX_LEDGER``.
    Conditions and other status fields are kept."""
    limits = quota_limits(quota)
    old = dict(quota.get("status") or {})
    entries = [dict(e) for e in (old.get("ledger") or [])] if ledger is None else [dict(e) for e in ledger]
    carry = dict(old.get("carry") or {})
    exp = parse_time(carry.get("expires"))
    if carry and exp is not None and exp <= now:
        carry = {}
    kept = [e for e in entries if e.get("state") == "Reserved" or _counts(e, limits, now)]
    charged = sorted((e for e in kept if e.get("state") == "Charged"), key=lambda e: str(e.get("time")))
    excess = len(kept) - MAX_LEDGER
    fold = charged[: max(0, excess)]
    if fold:
        fold_keys = {e["key"] for e in fold}
        kept = [e for e in kept if e["key"] not in fold_keys]
        carry["expertReadBytes"] = int(carry.get("expertReadBytes") or 0) + sum(int(e["bytes"]) for e in fold)
        carry["merges"] = int(carry.get("merges") or 0) + len(fold)
        if limits.window is None:
            carry.pop("expires", None)
        else:
            last = max(parse_time(e["time"]) for e in fold) + limits.window
            prev = parse_time(carry.get("expires"))
            carry["expires"] = rfc3339(max(last, prev) if prev else last)
    new = dict(old)
    new["ledger"] = kept
    if carry:
        new["carry"] = carry
    else:
        new.pop("carry", None)
    tmp = {"ledger": kept, "carry": carry}
    b, m = _usage(tmp, limits, now)
    new["used"] = {"expertReadBytes": b, "merges": m}
    hard: dict[str, int] = {}
    if limits.expert_read_bytes is not None:
        hard["expertReadBytes"] = limits.expert_read_bytes
    if limits.merges is not None:
        hard["merges"] = limits.merges
    new["hard"] = hard
    gen = (quota.get("metadata") or {}).get("generation")
    if gen is not None:
        new["observedGeneration"] = gen
    return new


@dataclass(frozen=True)
class Admission:
    """The outcome of :func:`admit`.

    Attributes:
        allowed: the merge may proceed.
        budget: the budget it may use (``requested`` or lower when clamped; ``None`` = unbounded).
        reason: Admitted | Clamped | AlreadyAdmitted | QuotaExceeded.
        message: one line for the ModelMerge's condition.
        new_used: ``{"expertReadBytes", "merges"}`` after the reservation.
        new_status: the quota status to write (with the reservation in its ledger), or ``None``
            when nothing must be written (rejected, idempotent repeat, or no ``key``).
    """

    allowed: bool
    budget: int | None
    reason: str
    message: str
    new_used: dict[str, int]
    new_status: dict[str, Any] | None = None

    @property
    def clamped(self) -> bool:
        return self.reason == Reason.CLAMPED


def _window_text(limits: QuotaLimits) -> str:
    return f"in the last {limits.window_text}" if limits.window else "in total"


def _repeat_admission(
    status: Mapping[str, Any],
    limits: QuotaLimits,
    requested_budget: int | None,
    key: str,
    name: str,
    used: dict[str, int],
) -> Admission | None:
    """The idempotent answer when ``key`` already has a ledger entry (``None`` when it has not):
    allowed again, its budget capped at the reserved bytes when the quota limits bytes."""
    for e in status.get("ledger") or []:
        if e.get("key") == key:
            budget = requested_budget
            if limits.expert_read_bytes is not None:
                budget = (
                    int(e.get("bytes") or 0)
                    if requested_budget is None
                    else min(requested_budget, int(e.get("bytes") or 0))
                )
            return Admission(
                True, budget, Reason.ALREADY_ADMITTED, f"already admitted by MergeQuota {name}", used, None
            )
    return None


def _byte_admission(
    limits: QuotaLimits,
    requested_budget: int | None,
    name: str,
    used: dict[str, int],
) -> tuple[int | None, str, str] | Admission:
    """Apply the byte limit: ``(budget, reason, message)`` when the merge may proceed (as asked,
    or lowered under ``Clamp``), or the rejecting ``Admission``."""
    if limits.expert_read_bytes is None:
        return requested_budget, Reason.ADMITTED, f"admitted by MergeQuota {name}"
    used_b = used["expertReadBytes"]
    hard = limits.expert_read_bytes
    left = max(0, hard - used_b)
    used_text = f"{human_bytes(used_b)} of {human_bytes(hard)} expert reads used {_window_text(limits)}"
    if requested_budget is not None and requested_budget <= left:
        budget = requested_budget
        return (
            budget,
            Reason.ADMITTED,
            f"admitted by MergeQuota {name} ({used_text}, reserving {human_bytes(budget)})",
        )
    if limits.enforcement == "Clamp" and left >= 1:
        asked = "an unbounded read" if requested_budget is None else human_bytes(requested_budget)
        return (
            left,
            Reason.CLAMPED,
            f"budget lowered from {asked} to {human_bytes(left)} by MergeQuota {name} (Clamp; {used_text})",
        )
    if requested_budget is None:
        why = "the merge sets no budget (unbounded expert reads); set spec.budget"
    else:
        why = f"requested {human_bytes(requested_budget)} but only {human_bytes(left)} is left"
    return Admission(
        False,
        None,
        Reason.QUOTA_EXCEEDED,
        f"MergeQuota {name} ({limits.enforcement}): {why}; {used_text}",
        used,
    )


def admit(
    quota: Mapping[str, Any],
    requested_budget: int | None,
    now: datetime,
    *,
    key: str | None = None,
    merge: str = "",
) -> Admission:
    """Admit a merge asking for ``requested_budget`` expert bytes (``None``: unbounded) under
    ``quota`` (a MergeQuota object) at ``now``.

    Usage counts Reserved ledger entries (merges in flight) and Charged entries inside the rolling
    window. ``merges`` must have room for one more. With a byte limit, a request that fits is
    admitted as is; otherwise ``Clamp`` lowers the budget to what is left (refusing when nothing
    is), and ``Reject`` refuses. An admitted merge with a ``key`` gets a Reserved ledger entry in
    ``new_status``; admitting the same key again is an idempotent no-op (kopf retries handlers).

    Race-freedom is the caller's part: write ``new_status`` with the quota's ``resourceVersion``
    (a conflict means someone else changed the quota: re-read and call ``admit`` again).
    """
    limits = quota_limits(quota)
    name = (quota.get("metadata") or {}).get("name", "?")
    status = quota.get("status") or {}
    used_b, used_m = _usage(status, limits, now)
    used = {"expertReadBytes": used_b, "merges": used_m}
    if key is not None:
        repeat = _repeat_admission(status, limits, requested_budget, key, name, used)
        if repeat is not None:
            return repeat
    if limits.merges is not None and used_m + 1 > limits.merges:
        return Admission(
            False,
            None,
            Reason.QUOTA_EXCEEDED,
            f"MergeQuota {name}: {used_m} of {limits.merges} merges used {_window_text(limits)}; wait or raise spec.hard.merges",
            used,
        )
    decided = _byte_admission(limits, requested_budget, name, used)
    if isinstance(decided, Admission):
        return decided
    budget, reason, message = decided
    reserve = budget or 0
    new_used = {"expertReadBytes": used_b + reserve, "merges": used_m + 1}
    new_status = None
    if key is not None:
        ledger = [dict(e) for e in status.get("ledger") or []]
        ledger.append({"key": key, "merge": merge, "bytes": reserve, "state": "Reserved", "time": rfc3339(now)})
        new_status = quota_status(quota, now, ledger)
        new_used = dict(new_status["used"])
    return Admission(True, budget, reason, message, new_used, new_status)


def charge_bytes(value: Any, what: str = "charge") -> int:
    """``value`` as a ledger charge: an integer number of bytes >= 0 (not a bool, float or
    string). Every charge read from a manifest or record goes through here before it touches a
    ledger: a negative count would refund other merges' reads.

    Raises:
        ValueError: naming ``what`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: {value!r} is not a byte count (an integer >= 0)")
    if value < 0:
        raise ValueError(f"{what}: {value} bytes is negative; a ledger charge is >= 0")
    return value


def settle(quota: Mapping[str, Any], key: str, expert_read_bytes: int | None, now: datetime) -> dict[str, Any] | None:
    """Turn the reservation ``key`` into a charge of ``expert_read_bytes`` (the realized bytes from
    the manifest; ``None`` keeps the reserved amount, used when a Job failed and read an unknown
    amount). Returns the new status, or ``None`` when there is nothing to change (unknown key,
    or already charged: settling is idempotent).

    Raises:
        ValueError: ``expert_read_bytes`` is not an integer >= 0 (:func:`charge_bytes`).
    """
    if expert_read_bytes is not None:
        charge_bytes(expert_read_bytes, f"settling {key}")
    status = quota.get("status") or {}
    ledger = [dict(e) for e in status.get("ledger") or []]
    for e in ledger:
        if e.get("key") == key:
            if e.get("state") == "Charged":
                return None
            e["state"] = "Charged"
            if expert_read_bytes is not None:
                e["bytes"] = int(expert_read_bytes)
            e["time"] = rfc3339(now)
            return quota_status(quota, now, ledger)
    return None


def release(quota: Mapping[str, Any], key: str, now: datetime) -> dict[str, Any] | None:
    """Drop the reservation ``key`` (the merge never started a Job). ``None``: nothing to change
    (unknown key, or already charged)."""
    status = quota.get("status") or {}
    ledger = [dict(e) for e in status.get("ledger") or []]
    kept = [e for e in ledger if not (e.get("key") == key and e.get("state") == "Reserved")]
    if len(kept) == len(ledger):
        return None
    return quota_status(quota, now, kept)


@dataclass(frozen=True)
class Closing:
    """How a run's reservation ends (:func:`closing`).

    Attributes:
        action: ``release`` (drop it: nothing was read) or ``settle`` (charge it).
        bytes: the charge for ``settle``: the bytes the run read when known, ``None`` to charge
            the reserved amount (the plan's expert bytes: an upper bound of what one attempt reads).
    """

    action: Literal["release", "settle"]
    bytes: int | None = None


def closing(started: bool, known_read: int | None) -> Closing:
    """The one rule that ends every reservation (supersede, invalid spec, deletion, Job failure,
    commit, Kueue eviction): a run that never started a container read nothing and is released;
    a run whose bytes are known (a committed manifest of its plan, validated) is charged exactly
    those; any other run that started is charged its reservation, since it may have read up to its
    plan and the worker reports its reads only when it commits.

    Args:
        started: did a container of the run's Job ever run (:func:`~..k8s.jobs.job_ever_started`;
            a Job that cannot be found counts as started)?
        known_read: expert bytes the run read, from its manifest (``None``: unknown); ignored
            when it never started (the manifest is then an earlier run's).

    Raises:
        ValueError: ``known_read`` is not an integer >= 0.
    """
    if known_read is not None:
        charge_bytes(known_read, "realized expert bytes")
    if not started:  # (a manifest found then is an earlier run's, charged when that run ended)
        return Closing("release")
    return Closing("settle", known_read)


def close(quota: Mapping[str, Any], key: str, how: Closing, now: datetime) -> dict[str, Any] | None:
    """Apply :func:`closing`'s decision to ``quota``'s reservation ``key`` (:func:`release` or
    :func:`settle`); ``None`` when nothing changes (unknown key, already charged)."""
    if how.action == "release":
        return release(quota, key, now)
    return settle(quota, key, how.bytes, now)


def admission_key(uid: str, generation: int | None) -> str:
    """Ledger key of one merge run: one per ModelMerge generation."""
    return f"{uid}.{generation or 0}"


def keys_of(quota: Mapping[str, Any], uid: str, state: str = "Reserved") -> list[str]:
    """The ledger keys of ModelMerge ``uid`` (:func:`admission_key`: ``<uid>.<generation>``) in
    ``state``: a deleted merge leaves none Reserved, even one whose status never recorded it (the
    operator stopped between writing the reservation and the merge's status)."""
    prefix = f"{uid}."
    return [
        str(e["key"])
        for e in (quota.get("status") or {}).get("ledger") or []
        if str(e.get("key", "")).startswith(prefix) and e.get("state") == state
    ]
