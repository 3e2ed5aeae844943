"""``mergepipe gc`` (issue 12 item 6): orphan run prefixes and stale multipart uploads on a real S3
server (SeaweedFS), dead writers' staging folders locally; committed snapshots and other
people's objects untouched."""

import json
import os
import time

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit.gc import collect
from mergepipe.commit.manifest import OutputLock, lock_path, staging_path, verify_snapshot
from mergepipe.commit.objectstore import verify_obj
from mergepipe.pipeline import merge
from mergepipe.storage.base import IOCounters
from mergepipe.storage.routing import open_storage
from tests.conftest import run_cli


def _keys(client, bucket, prefix=""):
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _uploads(client, bucket):
    return sorted(u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.s3
def test_gc_on_s3_removes_orphans_and_keeps_snapshots(s3_env, family, tmp_path, monkeypatch, capsys):
    base, experts = family
    c = s3_env.client()
    bucket = s3_env.make_bucket("gc")
    st = open_storage(None, IOCounters())
    snap = f"s3://{bucket}/snaps/a"
    r = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        snap,
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
        storage=st,
    )
    live_run = r.manifest["files_prefix"]
    # debris of killed runs: an orphan run beside the committed one, a run of an --out that never
    # committed, open multipart uploads (one in the committed run: a lost CreateMultipartUpload)
    c.put_object(Bucket=bucket, Key="snaps/a/runs/00000000000000aa/model-00001-of-00002.safetensors", Body=b"x" * 10)
    c.put_object(Bucket=bucket, Key="snaps/b/runs/00000000000000bb/model.safetensors", Body=b"y" * 10)
    # a killed partitioned merge (default run id plan-<16 hex>) and its records
    c.put_object(Bucket=bucket, Key="snaps/a/runs/plan-00000000000000dd/model.safetensors", Body=b"p")
    c.put_object(Bucket=bucket, Key="snaps/a/runs/plan-00000000000000dd.records/part-0-of-2.json", Body=b"{}")
    up1 = c.create_multipart_upload(Bucket=bucket, Key="snaps/a/runs/00000000000000cc/model.safetensors")
    c.upload_part(
        Bucket=bucket,
        Key="snaps/a/runs/00000000000000cc/model.safetensors",
        UploadId=up1["UploadId"],
        PartNumber=1,
        Body=b"z" * 100,
    )
    c.create_multipart_upload(Bucket=bucket, Key=f"snaps/a/{live_run}/model.safetensors")
    # not mergepipe's: other objects and uploads under the same prefix
    c.put_object(Bucket=bucket, Key="snaps/other/data.bin", Body=b"keep")
    c.put_object(Bucket=bucket, Key="snaps/other/runs/notarunid/x", Body=b"keep")
    c.create_multipart_upload(Bucket=bucket, Key="snaps/other/big.bin")

    young = collect(st, f"s3://{bucket}/snaps", grace_s=3600)
    assert young.deleted_runs == [] and young.aborted_uploads == [] and len(young.kept_young) == 6
    assert len(_uploads(c, bucket)) == 3

    code, out, err = run_cli(["gc", f"s3://{bucket}/snaps", "--grace", "0", "--json"], monkeypatch, capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert sorted(rep["deleted_runs"]) == [
        f"s3://{bucket}/snaps/a/runs/00000000000000aa",
        f"s3://{bucket}/snaps/a/runs/plan-00000000000000dd",
        f"s3://{bucket}/snaps/a/runs/plan-00000000000000dd.records",
        f"s3://{bucket}/snaps/b/runs/00000000000000bb",
    ]
    assert len(rep["aborted_uploads"]) == 2
    assert _uploads(c, bucket) == ["snaps/other/big.bin"]
    keys = _keys(c, bucket, "snaps/")
    assert not any("00000000000000" in k for k in keys)
    assert "snaps/other/data.bin" in keys and "snaps/other/runs/notarunid/x" in keys
    assert verify_obj(st, snap)["ok"]
    # idempotent
    code, out, _ = run_cli(["gc", f"s3://{bucket}/snaps", "--grace", "0", "--json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["deleted_runs"] == [] and json.loads(out)["aborted_uploads"] == []


def test_gc_local_reclaims_dead_staging_only(family, tmp_path, monkeypatch, capsys):
    base, experts = family
    root = tmp_path / "snaps"
    done = merge(
        str(base),
        [(e.name, str(e)) for e in experts],
        "ties",
        str(root / "done"),
        ["density=0.5"],
        catalog=Catalog(tmp_path / "c.sqlite"),
    )
    dead = root / "dead"  # a killed writer: staging + free lock
    staging_path(dead).mkdir()
    (staging_path(dead) / "model.safetensors").write_bytes(b"partial")
    lock_path(dead).write_text("gone pid 1\n")
    alive = root / "alive"  # a running writer (this process holds its lock)
    held = OutputLock(alive).acquire()
    staging_path(alive).mkdir()
    old = root / ".legacy.staging-0123456789ab"  # a pre-lock version's staging, a week old
    old.mkdir()
    os.utime(old, (time.time() - 7 * 86400,) * 2)
    fresh = root / ".fresh.staging-0123456789ab"
    fresh.mkdir()
    try:
        dry = collect(open_storage(None, IOCounters()), str(root), grace_s=3600, dry_run=True)
        assert staging_path(dead).exists() and lock_path(dead).exists() and old.exists()
        assert sorted(dry.removed_staging) == sorted([str(staging_path(dead)), str(old)])
        code, out, err = run_cli(["gc", str(root), "--grace", "1h", "--json"], monkeypatch, capsys)
        assert code == 0, err
        rep = json.loads(out)
    finally:
        held.release()
    assert sorted(rep["removed_staging"]) == sorted([str(staging_path(dead)), str(old)])
    assert rep["kept_in_use"] == [str(staging_path(alive))]
    assert not staging_path(dead).exists() and not lock_path(dead).exists() and not old.exists()
    assert staging_path(alive).exists() and fresh.exists()
    assert verify_snapshot(done.out)["ok"]


@pytest.mark.parametrize("grace", ["-1", "1e999", "soon", "nan"])
def test_gc_refuses_bad_grace(tmp_path, monkeypatch, capsys, grace):
    code, out, err = run_cli(["gc", str(tmp_path), "--grace", grace], monkeypatch, capsys)
    assert code == 2 and "--grace" in err and len(err.strip().splitlines()) == 1
