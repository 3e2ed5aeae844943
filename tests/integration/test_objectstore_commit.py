"""The object-store commit protocol (run prefix + conditional manifest), exercised on local
storage (conditional create = O_EXCL); the S3 tests run the same code against SeaweedFS."""

import threading

import pytest

from mergepipe.catalog.catalog import Catalog
from mergepipe.commit.objectstore import read_manifest_obj, verify_obj
from mergepipe.commit.target import PrefixTarget
from mergepipe.errors import CommitConflict, InputError
from mergepipe.pipeline import build_plan, execute_and_commit
from mergepipe.request import request_from_args
from mergepipe.storage.base import IOCounters
from mergepipe.storage.local import LocalStorage


def _commit_obj(plan, out):
    """``execute_and_commit`` with the object-store commit protocol (run prefix + conditional
    manifest create) on a local folder."""
    st = LocalStorage(IOCounters())
    return execute_and_commit(plan, st, str(out), target=PrefixTarget(st, str(out)))


def _plan(family, tmp_path, method="ties", params=("density=0.5",)):
    base, experts = family
    st = LocalStorage(IOCounters())
    return build_plan(
        Catalog(tmp_path / "c.sqlite"),
        st,
        request_from_args(str(base), [(e.name, str(e)) for e in experts], method, list(params), budget="50%"),
    )


def test_concurrent_writers_one_manifest(family, tmp_path):
    plan = _plan(family, tmp_path)
    out = str(tmp_path / "snap")
    results, errors = [], []

    def worker():
        try:
            results.append(_commit_obj(plan, out))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    ids = {r.manifest["snapshot_id"] for r in results}
    assert len(ids) == 1
    assert sum(not r.already_committed for r in results) == 1, "exactly one writer wins"
    m, _ = read_manifest_obj(LocalStorage(), out)
    runs = sorted((tmp_path / "snap" / "runs").iterdir())
    assert [p.name for p in runs] == [m["files_prefix"].split("/")[-1]], "losers' objects are removed"
    assert verify_obj(LocalStorage(), out)["ok"]


def test_different_snapshot_is_refused(family, tmp_path):
    out = str(tmp_path / "snap")
    _commit_obj(_plan(family, tmp_path), out)
    other = _plan(family, tmp_path, params=("density=0.3",))
    with pytest.raises(InputError, match="different plan"):
        _commit_obj(other, out)


def test_lost_race_to_different_snapshot_is_conflict(family, tmp_path, monkeypatch):
    """Both checks pass, then another writer commits a different snapshot first."""
    from mergepipe.commit import objectstore

    out = str(tmp_path / "snap")
    p1, p2 = _plan(family, tmp_path), _plan(family, tmp_path, params=("density=0.3",))
    real_publish = objectstore.publish_obj

    raced = []

    def racing_publish(storage, out_, run, manifest):
        if not raced:
            raced.append(1)
            _commit_obj(p2, out)
        return real_publish(storage, out_, run, manifest)

    monkeypatch.setattr(objectstore, "publish_obj", racing_publish)
    with pytest.raises(CommitConflict, match="another writer"):
        _commit_obj(p1, out)
    m, _ = read_manifest_obj(LocalStorage(), out)
    assert m["plan_digest"] == p2.digest
    assert len(list((tmp_path / "snap" / "runs").iterdir())) == 1


def test_failed_run_leaves_no_objects(family, tmp_path, monkeypatch):
    from mergepipe.storage import local

    plan = _plan(family, tmp_path)
    n = {"i": 0}
    orig = local.LocalWriter.write

    def flaky(self, data):
        n["i"] += 1
        if n["i"] == 3:
            raise ConnectionResetError("upload broke")
        return orig(self, data)

    monkeypatch.setattr(local.LocalWriter, "write", flaky)
    with pytest.raises(ConnectionResetError):
        _commit_obj(plan, tmp_path / "snap")
    assert read_manifest_obj(LocalStorage(), str(tmp_path / "snap")) is None
    runs = tmp_path / "snap" / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []


def test_commit_fails_when_manifest_folder_cannot_be_fsynced(family, tmp_path, monkeypatch):
    """Local object-mode commit: the manifest must be durable before the snapshot is reported
    committed, so a folder fsync refused with EIO fails the commit, and nothing is published."""
    import os

    from testkit.harness import fail_folder_fsync

    plan = _plan(family, tmp_path)
    out = tmp_path / "snap"
    real = os.fsync
    fail_folder_fsync(monkeypatch)
    with pytest.raises(OSError, match="folder fsync refused"):
        _commit_obj(plan, str(out))
    assert read_manifest_obj(LocalStorage(), str(out)) is None
    assert not (out / "runs").exists() or list((out / "runs").iterdir()) == []
    assert sorted(p.name for p in out.iterdir()) in ([], ["runs"])
    monkeypatch.setattr(os, "fsync", real)
    res = _commit_obj(plan, str(out))
    assert not res.already_committed and verify_obj(LocalStorage(), str(out))["ok"]


def test_commit_makes_run_folders_durable_before_the_manifest(family, tmp_path, monkeypatch):
    """Local object-mode commit: the run prefix's folders and their parents up to the snapshot's
    parent are fsync'd before the manifest is created, and the manifest's folder after it."""
    import os
    import stat as stat_

    plan = _plan(family, tmp_path)
    out = tmp_path / "snap"
    real, events = os.fsync, []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if stat_.S_ISDIR(os.fstat(fd).st_mode):
            events.append((path, (out / "manifest.json").exists()))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    res = _commit_obj(plan, str(out))
    run = out / res.manifest["files_prefix"]
    before = {p for p, published in events if not published}
    assert {str(run), str(out / "runs"), str(out), str(tmp_path)} <= before
    assert (str(out), True) in events, "the manifest's folder is fsync'd after the create"
