"""MergeQuota decisions: admission, settling, releasing, the ledger and the status."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from op_testlib import NOW, make_quota

from mergepipe_operator import quantities as qty
from mergepipe_operator.k8s.conditions import Reason
from mergepipe_operator.quota import decisions as qd

GI = 1024**3

# --- quota admission -------------------------------------------------------------------------------


def ledger_entry(key, bytes_, state="Charged", at=NOW, merge="m"):
    return {
        "key": key,
        "merge": merge,
        "bytes": bytes_,
        "state": state,
        "time": qty.rfc3339(at),
    }


def test_admit_without_limits():
    q = make_quota(bytes_=None)
    a = qd.admit(q, 5 * GI, NOW, key="k1", merge="m1")
    assert a.allowed and a.budget == 5 * GI and a.reason == Reason.ADMITTED
    assert a.new_status["ledger"] == [ledger_entry("k1", 5 * GI, "Reserved", merge="m1")]
    assert a.new_status["used"] == {"expertReadBytes": 5 * GI, "merges": 1}
    assert qd.admit(q, None, NOW).budget is None


def test_admit_reject_and_clamp():
    used = {"ledger": [ledger_entry("old", 90 * GI)]}
    rej = make_quota(status=used)
    a = qd.admit(rej, 10 * GI, NOW, key="k")
    assert a.allowed and a.budget == 10 * GI
    a = qd.admit(rej, 11 * GI, NOW, key="k")
    assert not a.allowed and a.reason == Reason.QUOTA_EXCEEDED and a.new_status is None
    assert "requested 11Gi but only 10Gi is left" in a.message and "MergeQuota q (Reject)" in a.message
    clamp = make_quota(enforcement="Clamp", status=used)
    a = qd.admit(clamp, 50 * GI, NOW, key="k")
    assert a.allowed and a.clamped and a.budget == 10 * GI
    assert "lowered from 50Gi to 10Gi" in a.message
    assert a.new_used == {"expertReadBytes": 100 * GI, "merges": 2}
    full = make_quota(enforcement="Clamp", status={"ledger": [ledger_entry("old", 100 * GI)]})
    a = qd.admit(full, 1, NOW, key="k")
    assert not a.allowed and a.reason == Reason.QUOTA_EXCEEDED
    # an unbounded request under a byte limit
    assert qd.admit(clamp, None, NOW, key="k").budget == 10 * GI
    a = qd.admit(rej, None, NOW, key="k")
    assert not a.allowed and "set spec.budget" in a.message


def test_admit_counts_merges():
    q = make_quota(
        bytes_=None,
        merges=2,
        status={"ledger": [ledger_entry("a", 0), ledger_entry("b", 0, "Reserved")]},
    )
    a = qd.admit(q, 1, NOW, key="c")
    assert not a.allowed and "2 of 2 merges used in the last 24h" in a.message
    zero = make_quota(bytes_="1Ti", merges=0, enforcement="Clamp")
    assert not qd.admit(zero, 1, NOW, key="c").allowed


def test_rolling_window():
    old = NOW - timedelta(hours=25)
    st = {
        "ledger": [
            ledger_entry("charged-old", 60 * GI, at=old),
            ledger_entry("reserved-old", 30 * GI, "Reserved", at=old),
            ledger_entry("recent", 5 * GI, at=NOW - timedelta(hours=1)),
        ]
    }
    q = make_quota(status=st)
    a = qd.admit(q, 65 * GI, NOW, key="k")  # 100 - (30 reserved + 5 recent) = 65 left
    assert a.allowed and a.budget == 65 * GI
    assert [e["key"] for e in a.new_status["ledger"]] == [
        "reserved-old",
        "recent",
        "k",
    ]  # the old charge left
    assert not qd.admit(q, 66 * GI, NOW, key="k").allowed
    lifetime = make_quota(window=None, status=st)
    assert not qd.admit(lifetime, 6 * GI, NOW, key="k").allowed  # without a window nothing expires


def test_admission_is_idempotent_per_key():
    q = make_quota(enforcement="Clamp")
    a = qd.admit(q, 150 * GI, NOW, key="k")
    assert a.budget == 100 * GI
    q["status"] = a.new_status
    again = qd.admit(q, 150 * GI, NOW + timedelta(seconds=5), key="k")
    assert again.allowed and again.reason == Reason.ALREADY_ADMITTED and again.budget == 100 * GI
    assert again.new_status is None


def test_settle_and_release():
    q = make_quota()
    q["status"] = qd.admit(q, 10 * GI, NOW, key="k").new_status
    st = qd.settle(q, "k", 3 * GI, NOW + timedelta(minutes=5))
    assert st["ledger"] == [ledger_entry("k", 3 * GI, at=NOW + timedelta(minutes=5), merge="")]
    assert st["used"] == {"expertReadBytes": 3 * GI, "merges": 1}
    q2 = copy.deepcopy(q)
    q2["status"] = st
    assert qd.settle(q2, "k", 1, NOW) is None  # already charged: idempotent
    assert qd.release(q2, "k", NOW) is None  # charged entries are not released
    assert qd.settle(q, "nope", 1, NOW) is None
    kept = qd.settle(q, "k", None, NOW)  # failed Job: charge the reservation
    assert kept["ledger"][0]["bytes"] == 10 * GI and kept["ledger"][0]["state"] == "Charged"
    rel = qd.release(q, "k", NOW)
    assert rel["ledger"] == [] and rel["used"] == {"expertReadBytes": 0, "merges": 0}


def test_ledger_is_bounded_by_folding_into_carry():
    n = qd.MAX_LEDGER + 10
    st = {"ledger": [ledger_entry(f"k{i:04d}", 1, at=NOW - timedelta(minutes=n - i)) for i in range(n)]}
    q = make_quota(bytes_=None, status=st)
    new = qd.quota_status(q, NOW)
    assert len(new["ledger"]) == qd.MAX_LEDGER
    assert new["carry"]["merges"] == 10 and new["carry"]["expertReadBytes"] == 10
    assert new["used"] == {"expertReadBytes": n, "merges": n}
    assert new["ledger"][0]["key"] == "k0010"  # the oldest were folded
    later = copy.deepcopy(q)
    later["status"] = new
    assert qd.quota_status(later, NOW + timedelta(hours=25))["used"] == {
        "expertReadBytes": 0,
        "merges": 0,
    }


def test_quota_status_echoes_hard_limits_and_rejects_bad_specs():
    q = make_quota(bytes_="1Ti", merges=3)
    st = qd.quota_status(q, NOW)
    assert st["hard"] == {"expertReadBytes": 2**40, "merges": 3} and st["observedGeneration"] == 1
    with pytest.raises(qty.QuantityError, match="spec.hard.expertReadBytes"):
        qd.quota_limits(make_quota(bytes_="lots"))
    with pytest.raises(qty.QuantityError, match="spec.window"):
        qd.quota_limits(make_quota(window="forever"))
    with pytest.raises(qty.QuantityError, match="enforcement"):
        qd.quota_limits(make_quota(enforcement="Soft"))
