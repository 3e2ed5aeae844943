"""MergedSnapshot decisions: manifest facts and verification."""

from __future__ import annotations

import hashlib
import json

import pytest
from op_testlib import DIGEST

from mergepipe_operator.k8s.conditions import Reason
from mergepipe_operator.snapshot import decisions as snapd

GI = 1024**3

# --- snapshots -----------------------------------------------------------------------------------------


def manifest(**over):
    """A manifest as mergepipe.pipeline writes it (via the core's own helpers)."""
    from mergepipe.commit.manifest import manifest_bytes, snapshot_id

    outputs = {
        "model.safetensors": {"size": 1000, "sha256": "cd" * 32},
        "config.json": {"size": 10, "sha256": "ef" * 32},
    }
    m = {
        "format": "mergepipe.manifest/v1",
        "plan_digest": DIGEST,
        "files_prefix": "runs/0123456789abcdef",
        "outputs": outputs,
        "io": {
            "expert_budget_bytes": 10 * GI,
            "fidelity": None,
            "expert_bytes_total": 20 * GI,
            "estimated": {
                "base_read_bytes": 1000,
                "expert_read_bytes": 4 * GI,
                "output_write_bytes": 1010,
            },
            "realized": {
                "base_read_bytes": 1000,
                "expert_read_bytes": 3 * GI,
                "output_write_bytes": 1010,
                "output_copied_bytes": 0,
                "catalog_read_bytes": 5,
            },
        },
    }
    m.update(over)
    try:
        m.setdefault(
            "snapshot_id",
            snapshot_id(str(m.get("plan_digest") or ""), m.get("outputs") or {}),
        )
    except KeyError:  # an output without size or digest: the core cannot compute an id either
        m.setdefault("snapshot_id", "snap-" + "0" * 16)
    return manifest_bytes(m)


SIZES = {
    "runs/0123456789abcdef/model.safetensors": 1000,
    "runs/0123456789abcdef/config.json": 10,
}


def test_snapshot_ready_accepts_tree_digests_of_copied_shards():
    outputs = {
        "model.safetensors": {"size": 1000, "tree_sha256": "ab" * 32},
        "config.json": {"size": 10, "sha256": "ef" * 32},
    }
    ok, reason, _ = snapd.snapshot_ready(manifest(outputs=outputs), DIGEST, None, object_sizes=SIZES)
    assert (ok, reason) == (True, Reason.VERIFIED)


def test_snapshot_ready_accepts_a_consistent_manifest():
    raw = manifest()
    h = hashlib.sha256(raw).hexdigest()
    ok, reason, msg = snapd.snapshot_ready(raw, DIGEST, h, object_sizes=SIZES)
    assert (ok, reason) == (True, Reason.VERIFIED) and "2 file(s)" in msg and "3Gi expert reads" in msg
    assert snapd.snapshot_ready(raw, DIGEST, "sha256:" + h)[0]
    assert snapd.snapshot_ready(raw, None, None)[0]
    facts = snapd.manifest_facts(json.loads(raw))
    assert facts.total_bytes == 1010 and facts.realized["expertReadBytes"] == 3 * GI and facts.budget_bytes == 10 * GI
    assert snapd.output_path(facts, "config.json") == "runs/0123456789abcdef/config.json"
    doc = json.loads(raw)
    assert snapd.snapshot_ready(doc, DIGEST, h)[0]  # a parsed manifest hashes as the core serializes it
    local = manifest(files_prefix="")
    assert snapd.snapshot_ready(local, DIGEST, None, object_sizes={"model.safetensors": 1000, "config.json": 10})[0]


@pytest.mark.parametrize(
    "uri, prefix, want",
    [
        ("s3://snapshots/llama/", "runs/20261122-abc", "s3://snapshots/llama/runs/20261122-abc/"),
        ("s3://snapshots/llama", "/runs/r1/", "s3://snapshots/llama/runs/r1/"),
        ("s3://snapshots/llama", "", "s3://snapshots/llama/"),  # files beside the manifest (local commits)
    ],
)
def test_storage_uri_is_the_committed_model_folder(uri, prefix, want):
    facts = snapd.ManifestFacts(
        plan_digest=None,
        snapshot_id=None,
        files_prefix=prefix,
        budget_bytes=None,
        outputs={},
        estimated={},
        realized={},
    )
    assert snapd.storage_uri(uri, facts) == want


def test_manifest_hash_matches_the_core():
    from mergepipe.commit.manifest import manifest_hash

    raw = manifest()
    assert snapd.manifest_hash(raw) == manifest_hash(raw)


def _edit(raw, **over):
    doc = json.loads(raw)
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "raw, plan, mhash, sizes, reason",
    [
        (None, DIGEST, None, None, Reason.MANIFEST_MISSING),
        (b"{not json", DIGEST, None, None, Reason.MANIFEST_INVALID),
        (manifest(), DIGEST, "00" * 32, None, Reason.MANIFEST_HASH_MISMATCH),
        (manifest(), "cd" * 32, None, None, Reason.PLAN_DIGEST_MISMATCH),
        (manifest(plan_digest=None), DIGEST, None, None, Reason.PLAN_DIGEST_MISMATCH),
        (
            _edit(manifest(), snapshot_id="snap-0000000000000000"),
            DIGEST,
            None,
            None,
            Reason.MANIFEST_INVALID,
        ),
        (manifest(outputs={}), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (
            manifest(outputs={"a": {"size": 1, "sha256": "zz"}}),
            DIGEST,
            None,
            None,
            Reason.MANIFEST_INVALID,
        ),
        (
            manifest(outputs={"a": {"sha256": "ab" * 32}}),
            DIGEST,
            None,
            None,
            Reason.MANIFEST_INVALID,
        ),
        (
            manifest(outputs={"a": {"size": 5}}),
            DIGEST,
            None,
            None,
            Reason.MANIFEST_INVALID,
        ),
        (
            manifest(files_prefix="../elsewhere"),
            DIGEST,
            None,
            None,
            Reason.MANIFEST_INVALID,
        ),
        (manifest(format="other/v9"), DIGEST, None, None, Reason.MANIFEST_INVALID),
        (
            manifest(
                io={
                    "expert_budget_bytes": 2 * GI,
                    "realized": {"expert_read_bytes": 3 * GI},
                }
            ),
            DIGEST,
            None,
            None,
            Reason.BUDGET_EXCEEDED,
        ),
        (
            manifest(
                io={
                    "estimated": {"expert_read_bytes": GI},
                    "realized": {"expert_read_bytes": 3 * GI},
                }
            ),
            DIGEST,
            None,
            None,
            Reason.BUDGET_EXCEEDED,
        ),
        (
            manifest(),
            DIGEST,
            None,
            {**SIZES, "runs/0123456789abcdef/model.safetensors": 999},
            Reason.OUTPUT_MISMATCH,
        ),
        (
            manifest(),
            DIGEST,
            None,
            {**SIZES, "runs/0123456789abcdef/config.json": None},
            Reason.OUTPUT_MISMATCH,
        ),
        (b"[1, 2]", DIGEST, None, None, Reason.MANIFEST_INVALID),
    ],
)
def test_snapshot_ready_refuses(raw, plan, mhash, sizes, reason):
    ok, got, msg = snapd.snapshot_ready(raw, plan, mhash, object_sizes=sizes)
    assert (ok, got) == (False, reason), msg
    assert msg
